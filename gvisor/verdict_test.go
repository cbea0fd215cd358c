package gvisor

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/engine"
)

// exited is the evidence of a run whose sentry reported the container's
// wait status ws, as a clean run leaves it.
func exited(ws syscall.WaitStatus) evidence {
	return evidence{
		runscExit: exitCode(ws),
		run:       runLog{exited: true, status: ws},
		sent:      sentryFacts{exited: true, status: ws},
	}
}

// TestVerdict checks the level's evidence through the engine's verdict:
// what the sentry reported, what moat and the host limits did, and when the
// run is an error instead.
func TestVerdict(t *testing.T) {
	const (
		exit0   = syscall.WaitStatus(0)
		exit3   = syscall.WaitStatus(3 << 8)
		exit137 = syscall.WaitStatus(137 << 8)
		sigsegv = syscall.WaitStatus(syscall.SIGSEGV)
		sigxcpu = syscall.WaitStatus(syscall.SIGXCPU)
		sigkill = syscall.WaitStatus(syscall.SIGKILL)
		exit2   = syscall.WaitStatus(2 << 8) // the status of a sentry that panicked
	)
	with := func(ev evidence, f func(*evidence)) evidence { f(&ev); return ev }
	// A sentry that panicked: runsc could not wait for the container and
	// reports the sentry's own exit instead.
	panicked := evidence{
		runscExit: 2,
		run:       runLog{exited: true, status: exit2, warnings: []string{"Wait RPC to container failed"}},
		panicLog:  []byte("panic: Signal-induced panic\n\ngoroutine 12 [running]:\n"),
	}
	// A sentry killed by a SIGKILL from outside: no panic, no end of its
	// own, and runsc reports the sentry's death.
	killedOutside := evidence{runscExit: 137, run: runLog{exited: true, status: sigkill}}
	// The engine's own facts: what it killed the run for, and the output
	// cap.
	type engineFacts struct{ wall, canceled, output bool }
	wall := engineFacts{wall: true}
	for _, c := range []struct {
		name string
		ev   evidence
		eng  engineFacts
		want engine.Verdict
		err  string // part of the error, when the run must fail
	}{
		{"exit 0", exited(exit0), engineFacts{}, engine.Verdict{}, ""},
		{"exit 3", exited(exit3), engineFacts{}, engine.Verdict{ExitCode: 3}, ""},
		{"exit 137, not a signal", exited(exit137), engineFacts{}, engine.Verdict{ExitCode: 137}, ""},
		{"SIGSEGV", exited(sigsegv), engineFacts{}, engine.Verdict{ExitCode: 139, Signal: syscall.SIGSEGV, Reason: moat.ReasonSignal}, ""},
		{"SIGXCPU at the CPU rlimit", with(exited(sigxcpu), func(e *evidence) { e.cpuUsed, e.cpuLimit = 2*time.Second, time.Second }), engineFacts{}, engine.Verdict{ExitCode: 128 + int(syscall.SIGXCPU), Signal: syscall.SIGXCPU, Reason: moat.ReasonTimeout}, ""},
		{"SIGXCPU the code sent itself", with(exited(sigxcpu), func(e *evidence) { e.cpuUsed, e.cpuLimit = 50*time.Millisecond, time.Second }), engineFacts{}, engine.Verdict{ExitCode: 128 + int(syscall.SIGXCPU), Signal: syscall.SIGXCPU, Reason: moat.ReasonSignal}, ""},
		{"wall time", with(evidence{runscExit: -1}, func(e *evidence) { e.killed = true }), wall, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonTimeout}, ""},
		{"wall time, the sentry's exit reported meanwhile", with(exited(exit0), func(e *evidence) { e.killed = true }), wall, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonTimeout}, ""},
		{"canceled", with(evidence{runscExit: -1}, func(e *evidence) { e.killed = true }), engineFacts{canceled: true}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonCanceled}, ""},
		{"cpu time", with(exited(exit0), func(e *evidence) { e.cpuOver = true }), engineFacts{}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonTimeout}, ""},
		{"cpu time, sandbox gone", with(evidence{runscExit: -1}, func(e *evidence) { e.cpuOver = true }), engineFacts{}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonTimeout}, ""},
		{"output cap", with(exited(exit0), func(e *evidence) { e.killed = true }), engineFacts{output: true}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonOutput}, ""},
		{"output cap, sandbox gone", with(evidence{runscExit: -1}, func(e *evidence) { e.killed = true }), engineFacts{output: true}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonOutput}, ""},
		{"cgroup oom, sentry killed", with(killedOutside, func(e *evidence) { e.cgroup.OOMKill = true }), engineFacts{}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonMemory}, ""},
		{"cgroup oom, code's exit reported", with(exited(exit3), func(e *evidence) { e.cgroup.OOMKill = true }), engineFacts{}, engine.Verdict{ExitCode: 3, Reason: moat.ReasonMemory}, ""},
		{"host pids limit, sentry panicked", with(panicked, func(e *evidence) { e.cgroup = cgroup.Events{PidsMax: true} }), engineFacts{}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonPids}, ""},
		{"task limit", with(exited(exit0), func(e *evidence) { e.sent.pids = true }), engineFacts{}, engine.Verdict{Reason: moat.ReasonPids}, ""},
		{"file size", with(exited(exit0), func(e *evidence) { e.sent.fileSize = true }), engineFacts{}, engine.Verdict{Reason: moat.ReasonFileSize}, ""},
		{"disk", with(exited(exit0), func(e *evidence) { e.sent.disk = true }), engineFacts{}, engine.Verdict{Reason: moat.ReasonDisk}, ""},
		{"output", exited(exit0), engineFacts{output: true}, engine.Verdict{ExitCode: 137, Signal: syscall.SIGKILL, Reason: moat.ReasonOutput}, ""},
		{"memory before pids", with(exited(exit0), func(e *evidence) { e.cgroup.OOMKill, e.sent.pids = true, true }), engineFacts{}, engine.Verdict{Reason: moat.ReasonMemory}, ""},

		{"sentry panicked", panicked, engineFacts{}, engine.Verdict{}, "the sentry crashed: panic: Signal-induced panic"},
		{"sentry killed from outside", killedOutside, engineFacts{}, engine.Verdict{}, "the sentry ended without reporting"},
		{"runsc failed", evidence{runscExit: 128, run: runLog{fatal: "creating container: cannot create sandbox"}}, engineFacts{}, engine.Verdict{}, "runsc failed, nothing ran"},
		{"runsc killed", evidence{runscExit: -1}, engineFacts{}, engine.Verdict{}, "without the container's status"},
		{"runtime wrote to the panic log", with(exited(exit0), func(e *evidence) { e.panicLog = []byte("fatal error: x") }), engineFacts{}, engine.Verdict{}, "the sentry crashed"},
		{"runsc's exit code disagrees", with(exited(exit0), func(e *evidence) { e.runscExit = 1 }), engineFacts{}, engine.Verdict{}, "disagree"},
		{"the sentry's status disagrees", with(exited(exit0), func(e *evidence) { e.sent.status = exit3 }), engineFacts{}, engine.Verdict{}, "disagree"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ev, err := c.ev.judge()
			if c.err != "" {
				if !errors.Is(err, moat.ErrUnavailable) || !strings.Contains(err.Error(), c.err) {
					t.Errorf("judge = %+v, %v; want an error wrapping ErrUnavailable with %q", ev, err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("judge: %v", err)
			}
			ev.WallTime, ev.Canceled, ev.Output = c.eng.wall, c.eng.canceled, c.eng.output
			if got := engine.Judge(ev); got != c.want {
				t.Errorf("verdict of %+v = %+v, want %+v", ev, got, c.want)
			}
		})
	}
}

// TestReadPanicLog checks that the sentry's own log lines in its panic log
// (a raw socket refused under --network=none writes one) are not taken for
// a crash, and that everything else there still is.
func TestReadPanicLog(t *testing.T) {
	const notice = "I1201 15:41:36.879382   26964 rate_limited.go:36] A process tried to create a raw socket without CAP_NET_RAW. Should the container config enable CAP_NET_RAW?\n"
	const warning = "W1201 15:41:37.000001       7 provider.go:120] something\n"
	const crash = "panic: Signal-induced panic\n\ngoroutine 12 [running]:\n"
	for _, c := range []struct {
		name, text, want string
	}{
		{"empty", "", ""},
		{"notices only", notice + warning + notice + "\n", ""},
		{"crash after notices", notice + crash, crash},
		{"crash", crash, crash},
		{"fatal error", "fatal error: x\n", "fatal error: x\n"},
		{"error level", "E1201 15:41:36.879382   26964 x.go:1] bad\n", "E1201 15:41:36.879382   26964 x.go:1] bad\n"},
		{"notice-like without its form", "I1201 something] x\n", "I1201 something] x\n"},
		{"notice with a crash on its line", "panic: " + notice, "panic: " + notice},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "log-panic")
			if err := os.WriteFile(p, []byte(c.text), 0o600); err != nil {
				t.Fatal(err)
			}
			if got := string(readPanicLog(p)); got != c.want {
				t.Errorf("readPanicLog(%q) = %q, want %q", c.text, got, c.want)
			}
		})
	}
	// A log too long to read whole counts as it is.
	p := filepath.Join(t.TempDir(), "log-panic")
	if err := os.WriteFile(p, []byte(strings.Repeat(notice, maxPanicRead/len(notice)+1)), 0o600); err != nil {
		t.Fatal(err)
	}
	if got := readPanicLog(p); len(got) != maxPanicLog {
		t.Errorf("a panic log past %d bytes gave %d bytes, want the first %d", maxPanicRead, len(got), maxPanicLog)
	}
}
