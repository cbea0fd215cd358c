package subprocess_test

import (
	"context"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// The code of the reason-order cases, in pieces.
const (
	atLimit   = "open('big', 'wb').write(b'x' * (64 << 10))\n"
	fillDisk  = "n = 0\ntry:\n    while True:\n        open('fill%d' % n, 'wb').write(b'y' * (60 << 10)); n += 1\nexcept OSError:\n    pass\n"
	pastCap   = "import sys\nsys.stdout.write('z' * 4096); sys.stdout.flush()\nimport time; time.sleep(30)\n"
	forkToCap = "import os, time\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(100); os._exit(0)\nexcept OSError:\n    pass\n"
	spin      = "while True: pass\n"
	sigterm   = "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nimport time; time.sleep(30)\n"
	touch256  = "b = bytearray(256 << 20)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\n"
)

// anyExit marks a case whose exit code is not checked: a run over its CPU
// time ends by SIGXCPU or by the CPU watch's SIGKILL, whichever comes first.
const anyExit = -1

// TestReasonOrderThroughRealRuns: a run that hits two limits gets the reason
// the engine's order puts first (moat.Reason: timeout, memory, pids,
// filesize, disk, output, signal), in a one-shot run, a session's run and a
// live interpreter's run, whose evidence comes from different code. The
// single-limit rows are the positive controls of the pairs: each piece of
// code does trip its limit here. The engine's table test covers the order
// itself; this checks that the level reports every limit it saw.
func TestReasonOrderThroughRealRuns(t *testing.T) {
	requireRoot(t)
	lim := moat.Limits{
		FileSize: 64 * moat.KiB, Disk: moat.MiB, Output: moat.KiB, Memory: 64 * moat.MiB,
		Pids: 16, CPUTime: moat.Duration(time.Second), WallTime: moat.Duration(20 * time.Second),
	}
	sb, err := subprocess.New(subprocess.Config{Limits: lim})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	cases := []struct {
		name   string
		code   string
		reason moat.Reason
		exit   int // anyExit: not checked
	}{
		{"filesize alone", atLimit, moat.ReasonFileSize, 0},
		{"disk alone", fillDisk, moat.ReasonDisk, 0},
		{"pids then signal", forkToCap + sigterm, moat.ReasonPids, 143},
		{"signal alone", sigterm, moat.ReasonSignal, 143},
		{"pids then timeout", forkToCap + spin, moat.ReasonTimeout, anyExit},
		{"filesize then memory", atLimit + touch256, moat.ReasonMemory, 137},
		{"filesize then disk", atLimit + fillDisk, moat.ReasonFileSize, 0},
		{"filesize then output", atLimit + pastCap, moat.ReasonFileSize, 137},
		{"disk then output", fillDisk + pastCap, moat.ReasonDisk, 137},
	}
	modes := []struct {
		name string
		run  func(t *testing.T, code string) *moat.Result
	}{
		{"one-shot", func(t *testing.T, code string) *moat.Result { return run(t, sb, code) }},
		{"session", sessionRunner(sb, moat.SessionOptions{})},
		{"interpreter", sessionRunner(sb, moat.SessionOptions{Interpreter: true})},
	}
	for _, m := range modes {
		for _, c := range cases {
			t.Run(m.name+"/"+c.name, func(t *testing.T) {
				res := m.run(t, c.code)
				if res.Reason != c.reason || (c.exit != anyExit && res.ExitCode != c.exit) {
					t.Errorf("reason %q exit %d signal %q; want reason %q exit %d (stderr %q)", res.Reason, res.ExitCode, res.Signal, c.reason, c.exit, tail(res.Stderr))
				}
			})
		}
	}
}

// sessionRunner runs code in a fresh session of sb with opts.
func sessionRunner(sb *subprocess.Sandbox, opts moat.SessionOptions) func(t *testing.T, code string) *moat.Result {
	return func(t *testing.T, code string) *moat.Result {
		t.Helper()
		s, err := sb.NewSession(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		return srun(t, s, code)
	}
}

func tail(b []byte) []byte {
	if len(b) > 300 {
		return b[len(b)-300:]
	}
	return b
}
