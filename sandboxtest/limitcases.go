package sandboxtest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// This file holds the checks of the limits. Each uses a small limit and code
// that goes well past it, and judges from what the host sees where it can.

// sleeperPy is Python that replaces the current process with a Python that
// ignores SIGTERM and sleeps, carrying marker in its command line so that the
// host can find it. Before sleeping it prints hello.
func sleeperPy(marker, hello string) string {
	prog := "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(" + split(hello) + ", flush=True); time.sleep(1000)"
	return fmt.Sprintf("os.execvp(sys.executable or 'python3', [sys.executable or 'python3', '-c', %q, %q])", prog, marker)
}

func testWallTime(t *testing.T, s *suite) {
	// Long enough for the tree below to be built at the slowest level (a
	// microvm under TCG starts each python3 in about a second; at 2 s the
	// tree was not there in half the runs), short enough to keep the suite
	// quick.
	wall := 5 * time.Second
	b := s.sandbox(t, moat.Limits{WallTime: moat.Duration(wall)})
	marker := token("moatwall")
	// A tree that a process-group kill misses: a grandchild in a session of
	// its own, a parent that stays, both deaf to SIGTERM and sleeping.
	code := fmt.Sprintf(`
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        %s
    os._exit(0)
os.wait()
%s
`, sleeperPy(marker, "grandchild-ready"), sleeperPy(marker, "parent-ready"))

	// While the run goes on, count the processes the host sees with the
	// marker: not required (gVisor's and VMs' are not host processes), but
	// it tells a reader whether the check after the run could see anything.
	var during atomic.Int64
	during.Store(-1)
	scanned := make(chan struct{})
	var ready atomic.Int32
	watch := func() {
		if ready.Add(1) == 2 {
			go func() {
				defer close(scanned)
				ps, _ := processesWith(procRoot, marker)
				during.Store(int64(len(ps)))
			}()
		}
	}
	out := &stream{on: map[string]func(){"grandchild-ready": watch, "parent-ready": watch}}
	errOut := &stream{}

	start := time.Now()
	res := b.runReq(t, context.Background(), moat.Request{Code: []byte(code), Stdout: out, Stderr: errOut})
	elapsed := time.Since(start)
	if ready.Load() == 2 {
		<-scanned
	}
	t.Logf("the host saw %d processes carrying the marker while the run slept (-1: not scanned)", during.Load())

	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a tree sleeping forever under a %v wall time: got %s\nwant reason timeout", wall, describe(res))
	}
	if bound := 3 * wall; elapsed > bound || res.Duration > bound {
		t.Errorf("a %v wall time: Run took %v (Duration %v), want under %v: the tree or the pipes it held kept Run waiting", wall, elapsed, res.Duration, bound)
	}
	for _, want := range []string{"grandchild-ready", "parent-ready"} {
		if !bytes.Contains(out.bytes(), []byte(want)) && !bytes.Contains(res.Stdout, []byte(want)) {
			t.Errorf("the run never printed %q, so the tree the check needs was not built: %s", want, describe(res))
		}
	}
	if left := remainingWith(marker, settle); len(left) > 0 {
		t.Errorf("processes of the run outlived it by %v (killed now):\n\t%s", settle, strings.Join(left, "\n\t"))
	}
}

func testCPUTime(t *testing.T, s *suite) {
	wall := 10 * time.Second
	b := s.sandbox(t, moat.Limits{CPUTime: moat.Duration(time.Second), WallTime: moat.Duration(wall)})
	start := time.Now()
	res := b.run(t, "while True:\n    pass\n")
	elapsed := time.Since(start)
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a busy loop under a 1s CPU time: got %s\nwant reason timeout", describe(res))
	}
	if elapsed > wall/2 {
		t.Errorf("a busy loop under a 1s CPU time ran %v, want well under the %v wall time", elapsed, wall)
	}
}

func testCPUTimeTree(t *testing.T, s *suite) {
	cpu := time.Second
	b := s.sandbox(t, moat.Limits{CPUTime: moat.Duration(cpu), WallTime: moat.Duration(10 * time.Second)})
	// Eight children one after the other, each burning 0.5s of CPU: under
	// any per-process limit, 4s in all.
	res := b.run(t, `
import os, time
for i in range(8):
    pid = os.fork()
    if pid == 0:
        t = time.process_time()
        while time.process_time() - t < 0.5:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
    print('child', i, flush=True)
print('all' + '-done')
`)
	done := strings.Count(string(res.Stdout), "child ")
	if res.Reason != moat.ReasonTimeout || strings.Contains(string(res.Stdout), "all-done") {
		t.Errorf("children burning 4s of CPU in all under a %v CPU time: got %s\nwant reason timeout before they finish", cpu, describe(res))
	}
	// 1s lets two children finish; allow two more for the accounting's lag.
	if done > 4 {
		t.Errorf("%d children of 0.5s of CPU each finished under a %v CPU time, want at most 4", done, cpu)
	}
}

func testMemory(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{Memory: 64 * moat.MiB, WallTime: moat.Duration(5 * time.Second)})
	res := b.run(t, `
b = bytearray(256 * 1024 * 1024)
for i in range(0, len(b), 4096):
    b[i] = 1
print(`+split("memory-allocated")+`)
`)
	if bytes.Contains(res.Stdout, []byte("memory-allocated")) || res.Reason != moat.ReasonMemory {
		t.Errorf("touching 256MiB under a 64MiB limit: got %s\nwant the allocation to fail and reason memory", describe(res))
	}
}

func testMemoryTree(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{Memory: 64 * moat.MiB, WallTime: moat.Duration(5 * time.Second)})
	// Six children hold 32MiB each at once: small enough for any
	// per-process limit, 192MiB together.
	res := b.run(t, `
import os, time
r, w = os.pipe()
kids = []
for i in range(6):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        b = bytearray(32 * 1024 * 1024)
        for j in range(0, len(b), 4096):
            b[j] = 1
        os.write(w, b'k')
        time.sleep(1.5)
        os._exit(0)
    kids.append(pid)
os.close(w)
held = 0
while True:
    d = os.read(r, 1)
    if not d:
        break
    held += 1
for pid in kids:
    os.waitpid(pid, 0)
print('held', held)
if held == 6:
    print(`+split("memory-allocated")+`)
`)
	if bytes.Contains(res.Stdout, []byte("memory-allocated")) || res.Reason != moat.ReasonMemory {
		t.Errorf("six processes holding 32MiB each under a 64MiB limit: got %s\nwant some to fail and reason memory", describe(res))
	}
}

func testPids(t *testing.T, s *suite) {
	pids := 16
	b := s.sandbox(t, moat.Limits{Pids: pids, WallTime: moat.Duration(5 * time.Second)})
	res := b.run(t, `
import os, signal, time
kids = []
err = 'none'
for i in range(64):
    try:
        pid = os.fork()
    except OSError as e:
        err = str(e.errno)
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
print('forked', len(kids), 'errno', err, flush=True)
for pid in kids:
    os.kill(pid, signal.SIGKILL)
for pid in kids:
    os.waitpid(pid, 0)
`)
	var forked int
	var errno string
	if _, err := fmt.Sscanf(lastLine(res.Stdout), "forked %d errno %s", &forked, &errno); err != nil {
		t.Fatalf("forking 64 children under a limit of %d: no report (%v): %s", pids, err, describe(res))
	}
	if errno == "none" || forked >= pids || forked < 1 || res.Reason != moat.ReasonPids {
		t.Errorf("forking 64 children under a limit of %d: %d forked, fork errno %s; got %s\nwant between 1 and %d forked, a fork refused, reason pids",
			pids, forked, errno, describe(res), pids-1)
	}
}

func testFileSize(t *testing.T, s *suite) {
	limit := 1 * moat.MiB
	b := s.sandbox(t, moat.Limits{FileSize: limit, WallTime: moat.Duration(5 * time.Second)})
	res := b.run(t, `
import os
n = 0
err = 'none'
try:
    with open('big', 'wb', buffering=0) as f:
        for i in range(64):
            n += f.write(b'x' * 65536)
except OSError as e:
    err = str(e.errno)
print('wrote', n, 'size', os.path.getsize('big'), 'errno', err)
`)
	var wrote, size int64
	var errno string
	if _, err := fmt.Sscanf(lastLine(res.Stdout), "wrote %d size %d errno %s", &wrote, &size, &errno); err != nil {
		t.Fatalf("writing 4MiB to one file under a %v limit: no report (%v): %s", limit, err, describe(res))
	}
	if res.Reason != moat.ReasonFileSize || size > int64(limit) || errno == "none" || size == 0 {
		t.Errorf("writing 4MiB to one file under a %v limit: the file has %d bytes, write errno %s; got %s\nwant a write refused, 0 < size <= %d, reason filesize",
			limit, size, errno, describe(res), int64(limit))
	}
}

func testDisk(t *testing.T, s *suite) {
	disk, file := 4*moat.MiB, 1*moat.MiB
	b := s.sandbox(t, moat.Limits{Disk: disk, FileSize: file, WallTime: moat.Duration(5 * time.Second)})
	name := token("moatdisk")
	// Files of half the file limit, so that no file reaches it, in every
	// writable place the code may find; at most 8MiB per place.
	res := b.run(t, fmt.Sprintf(`
import json, os
written = {}
errors = []
for d in [os.getcwd(), '/tmp', '/dev/shm']:
    total = 0
    try:
        for i in range(16):
            with open(os.path.join(d, '%s-%%d' %% i), 'wb', buffering=0) as f:
                while f.tell() < 512 * 1024:
                    n = f.write(b'x' * 65536)
                    total += n
                    if n == 0:
                        raise OSError(0, 'wrote nothing')
    except OSError as e:
        errors.append(d + ': ' + str(e))
    written[d] = total
print(json.dumps({'written': written, 'errors': errors}))
`, name))
	var got struct {
		Written map[string]int64
		Errors  []string
	}
	if err := json.Unmarshal([]byte(lastLine(res.Stdout)), &got); err != nil {
		t.Fatalf("filling the disk: no report (%v): %s", err, describe(res))
	}
	var total int64
	for _, n := range got.Written {
		total += n
	}
	slack := int64(256 * moat.KiB)
	if res.Reason != moat.ReasonDisk || total > int64(disk)+slack || len(got.Errors) == 0 || total == 0 {
		t.Errorf("512KiB files until the disk is full, under a %v disk limit: wrote %d bytes in all %v, errors %q; got %s\nwant writes refused, 0 < total <= %d, reason disk",
			disk, total, got.Written, got.Errors, describe(res), int64(disk)+slack)
	}
	if left := filesLeft(t, s.opts.Dirs, name); len(left) > 0 {
		t.Errorf("files the run wrote remain on the host after Run returned:\n\t%s", strings.Join(left, "\n\t"))
	}
}

func testOutput(t *testing.T, s *suite) {
	limit := 64 * moat.KiB
	b := s.sandbox(t, moat.Limits{Output: limit, WallTime: moat.Duration(5 * time.Second)})

	// Exactly the cap on each stream: all of it kept and passed on, nothing
	// cut, the run not ended.
	out, errOut := &stream{}, &stream{}
	res := b.runReq(t, context.Background(), moat.Request{Stdout: out, Stderr: errOut, Code: []byte(fmt.Sprintf(`
import sys
sys.stdout.write('x' * %d); sys.stdout.flush()
sys.stderr.write('y' * %d); sys.stderr.flush()
`, limit, limit))})
	if res.Truncated || res.Reason != moat.ReasonNone || res.ExitCode != 0 {
		t.Errorf("printing exactly the %v output limit to each stream: got %s\nwant not truncated, no reason, exit 0", limit, describe(res))
	}
	checkStreams(t, res, out, errOut, bytes.Repeat([]byte("x"), int(limit)), bytes.Repeat([]byte("y"), int(limit)))

	// Past the cap on stderr: cut there, on the Result and the writer alike,
	// and the run ended for it; stdout, at its cap, is whole.
	out, errOut = &stream{}, &stream{}
	res = b.runReq(t, context.Background(), moat.Request{Stdout: out, Stderr: errOut, Code: []byte(fmt.Sprintf(`
import sys
sys.stdout.write('x' * %d); sys.stdout.flush()
sys.stderr.write('y' * (1 << 20)); sys.stderr.flush()
`, limit))})
	if !res.Truncated || res.Reason != moat.ReasonOutput || res.ExitCode != 128+int(syscall.SIGKILL) || res.Signal != "SIGKILL" {
		t.Errorf("printing 1MiB to stderr under a %v output limit: got %s\nwant truncated, reason output, exit 137, signal SIGKILL", limit, describe(res))
	}
	checkStreams(t, res, out, errOut, bytes.Repeat([]byte("x"), int(limit)), bytes.Repeat([]byte("y"), int(limit)))
}

// checkStreams fails t unless the Result and the request's writers hold
// exactly the wanted bytes, and no writer was called concurrently.
func checkStreams(t *testing.T, res *moat.Result, out, errOut *stream, wantOut, wantErr []byte) {
	t.Helper()
	for _, c := range []struct {
		name   string
		kept   []byte
		writer *stream
		want   []byte
	}{{"Stdout", res.Stdout, out, wantOut}, {"Stderr", res.Stderr, errOut, wantErr}} {
		if !bytes.Equal(c.kept, c.want) {
			t.Errorf("Result.%s holds %d bytes (%s), want the first %d bytes the code wrote", c.name, len(c.kept), shorten(c.kept), len(c.want))
		}
		if got := c.writer.bytes(); !bytes.Equal(got, c.want) {
			t.Errorf("the Request.%s writer received %d bytes (%s), want exactly the %d the Result kept", c.name, len(got), shorten(got), len(c.want))
		}
		if n := c.writer.overlaps.Load(); n > 0 {
			t.Errorf("the Request.%s writer was called concurrently %d times", c.name, n)
		}
	}
}

// testOutputForever checks that the output cap bounds what moat passes on
// and ends a run that keeps writing, long before its wall time: a capped
// Result over an unbounded stream to the caller is no cap.
func testOutputForever(t *testing.T, s *suite) {
	// A long wall time, so that a slow level (a microvm under TCG on a loaded
	// machine) still ends far below it when the cap works.
	limit, wall := moat.KiB, 30*time.Second
	b := s.sandbox(t, moat.Limits{Output: limit, WallTime: moat.Duration(wall), CPUTime: moat.Duration(wall)})
	out, errOut := &counter{}, &counter{}
	start := time.Now()
	res := b.runReq(t, context.Background(), moat.Request{Stdout: out, Stderr: errOut, Code: []byte(`
while True:
    print('x' * 1000)
`)})
	elapsed := time.Since(start)
	if !res.Truncated || res.Reason != moat.ReasonOutput || res.ExitCode != 128+int(syscall.SIGKILL) || res.Signal != "SIGKILL" {
		t.Errorf("printing forever under a %v output limit: got %s\nwant truncated, reason output, exit 137, signal SIGKILL", limit, describe(res))
	}
	if n := out.n.Load(); n > int64(limit) || !bytes.Equal(out.head(), res.Stdout) {
		t.Errorf("printing forever under a %v output limit: the Request.Stdout writer received %d bytes, want at most %d, the same as Result.Stdout (%d bytes)",
			limit, n, int64(limit), len(res.Stdout))
	}
	if n := errOut.n.Load(); n != int64(len(res.Stderr)) {
		t.Errorf("the Request.Stderr writer received %d bytes, Result.Stderr holds %d", n, len(res.Stderr))
	}
	if ratio := float64(elapsed) / float64(wall); ratio >= 0.5 {
		t.Errorf("printing forever under a %v output limit: Run took %v, %.2f of the %v wall time; want under 0.5: the cap must end the run, not the wall time",
			limit, elapsed, ratio, wall)
	}
}

// counter is a Request writer that counts what it receives and keeps the
// first 64KiB: the suite's record of a stream that could be unbounded.
type counter struct {
	n    atomic.Int64
	mu   sync.Mutex
	kept []byte
}

func (c *counter) Write(p []byte) (int, error) {
	c.n.Add(int64(len(p)))
	c.mu.Lock()
	defer c.mu.Unlock()
	c.kept = append(c.kept, p[:min(len(p), 64<<10-len(c.kept))]...)
	return len(p), nil
}

func (c *counter) head() []byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	return bytes.Clone(c.kept)
}

func testOpenFiles(t *testing.T, s *suite) {
	limit := 32
	b := s.sandbox(t, moat.Limits{OpenFiles: limit, WallTime: moat.Duration(5 * time.Second)})
	res := b.run(t, `
fs = []
err = 'none'
for i in range(100):
    try:
        fs.append(open('f%d' % i, 'w'))
    except OSError as e:
        err = str(e.errno)
        break
print('opened', len(fs), 'errno', err)
`)
	var opened int
	var errno string
	if _, err := fmt.Sscanf(lastLine(res.Stdout), "opened %d errno %s", &opened, &errno); err != nil {
		t.Fatalf("opening 100 files under a limit of %d: no report (%v): %s", limit, err, describe(res))
	}
	if errno != fmt.Sprint(int(syscall.EMFILE)) || opened >= limit {
		t.Errorf("opening 100 files under a limit of %d: opened %d, errno %s; want EMFILE (%d) before %d", limit, opened, errno, int(syscall.EMFILE), limit)
	}
}

func testSignal(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
	if res.Reason != moat.ReasonSignal || res.ExitCode != 128+int(syscall.SIGSEGV) || res.Signal == "" {
		t.Errorf("a process killing itself with SIGSEGV: got %s\nwant reason signal, exit %d, the signal named", describe(res), 128+int(syscall.SIGSEGV))
	}
}

// testSignalXCPUForged: SIGXCPU is how RLIMIT_CPU ends a process, but the
// code can send it to itself (or, where a shell reports the status, exit
// with 152): the CPU time limit is a reason only with the CPU time behind
// it, as the host measured it.
func testSignalXCPUForged(t *testing.T, s *suite) {
	b := s.sandbox(t, moat.Limits{})
	res := b.run(t, "import os, signal; os.kill(os.getpid(), signal.SIGXCPU)")
	// A level whose status passes through a shell may report the death as
	// an exit 152; either way it is not the CPU time limit.
	if res.Reason == moat.ReasonTimeout || res.ExitCode != 128+int(syscall.SIGXCPU) {
		t.Errorf("a process sending itself SIGXCPU at once: got %s\nwant exit %d and any reason but timeout", describe(res), 128+int(syscall.SIGXCPU))
	}
	res = b.run(t, "import os; os._exit(152)")
	if res.Reason == moat.ReasonTimeout {
		t.Errorf("a process exiting with 152 (128+SIGXCPU) at once: got %s\nwant any reason but timeout", describe(res))
	}
	// CPU time spread over processes, none near a per-process limit, the
	// run well under its own; then the signal. The host's measures add up
	// the processes, so they must be held to the run's limit.
	b = s.sandbox(t, moat.Limits{CPUTime: moat.Duration(1900 * time.Millisecond), WallTime: moat.Duration(30 * time.Second)})
	res = b.run(t, `
import os, signal, time
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        burn(0.5)
        os._exit(0)
    kids.append(pid)
for k in kids:
    os.waitpid(k, 0)
os.kill(os.getpid(), signal.SIGXCPU)
`)
	if res.Reason == moat.ReasonTimeout {
		t.Errorf("SIGXCPU sent to itself after 1 s of CPU in two children, under a 1.9 s CPU time: got %s\nwant any reason but timeout", describe(res))
	}
}
