package gvisor_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
)

// interpSession starts a session with a live interpreter of sb's.
func interpSession(t *testing.T, sb *gvisor.Sandbox) moat.Session {
	t.Helper()
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	return ss
}

// runOK runs code in ss and returns its stdout, failing t unless it exited 0.
func runOK(t *testing.T, ss moat.Session, code string) string {
	t.Helper()
	res := runIn(t, ss, code)
	if res.ExitCode != 0 || res.Reason != moat.ReasonNone {
		t.Fatalf("Run(%q): exit %d, reason %q, stderr %q", code, res.ExitCode, res.Reason, res.Stderr)
	}
	return string(res.Stdout)
}

// suspendOne suspends ss into a new directory of t's and returns it.
func suspendOne(t *testing.T, ss moat.Session) (string, moat.SuspendInfo) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "s")
	info, err := ss.(moat.Suspender).Suspend(context.Background(), dir)
	if err != nil {
		t.Fatalf("Suspend: %v", err)
	}
	if !info.Memory {
		t.Fatalf("Suspend of an interpreter session: %+v, want its memory kept", info)
	}
	return dir, info
}

func resumeOne(t *testing.T, sb *gvisor.Sandbox, dir string) moat.Session {
	t.Helper()
	s, _, err := sb.ResumeSession(context.Background(), dir)
	if err != nil {
		t.Fatalf("ResumeSession: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// A suspended session holds nothing on the host (no sentry, bundle, runsc
// state, cgroup or mount); a resumed one has the host's clock, not the
// clock saved in its state, and forks of one state draw different random
// numbers from the kernel, while both keep the interpreter's variables
// and its working directory's files.
func TestSuspendClockAndForks(t *testing.T) {
	state := t.TempDir()
	cfg := gvisor.Config{StateDir: state, Warm: -1}
	need(t, cfg)
	me := self(t)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := interpSession(t, sb)
	runOK(t, ss, "import os, time\nx = 1\nos.symlink('made.txt', 'link')\nopen('made.txt', 'w').write('kept')")
	dir, _ := suspendOne(t, ss)
	// The checkpoint image is root's alone: its directory 0700, its files
	// 0600.
	filepath.Walk(filepath.Join(dir, "state"), func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			t.Error(err)
			return nil
		}
		want := os.FileMode(0o600)
		if fi.IsDir() {
			want = 0o700
		}
		st := fi.Sys().(*syscall.Stat_t)
		if fi.Mode().Perm() != want || st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s: mode %v, owner %d:%d; want %v, root's", p, fi.Mode().Perm(), st.Uid, st.Gid, want)
		}
		return nil
	})
	if left := leftovers(state, me); len(left) > 0 {
		t.Errorf("a suspended session leaves on the host: %s", strings.Join(left, ", "))
	}
	if m := mountsUnder(t, state); len(m) > 0 {
		t.Errorf("a suspended session leaves mounts: %q", m)
	}
	if n := len(sentryCmdlines(state)); n != 0 {
		t.Errorf("a suspended session leaves %d sentries running", n)
	}
	const away = 4 * time.Second
	time.Sleep(away)
	a, b := resumeOne(t, sb, dir), resumeOne(t, sb, dir)
	before := float64(time.Now().UnixNano()) / 1e9
	out := runOK(t, a, "print(time.time())")
	guest, err := strconv.ParseFloat(strings.TrimSpace(out), 64)
	if err != nil {
		t.Fatalf("time.time() printed %q", out)
	}
	if lag := time.Duration((before - guest) * 1e9); lag > away/2 {
		t.Errorf("right after the resume the sandbox's clock is %v behind the host's: it is the clock of the state", lag)
	}
	rnd := "print(os.urandom(16).hex(), x, open('link').read())"
	ra, rb := runOK(t, a, rnd), runOK(t, b, rnd)
	if ra == rb || !strings.HasSuffix(ra, " 1 kept\n") || !strings.HasSuffix(rb, " 1 kept\n") {
		t.Errorf("two forks of one state: os.urandom, x and the linked file: %q and %q", ra, rb)
	}
	a.Close()
	b.Close()
	if left := leftovers(state, me); len(left) > 0 {
		t.Errorf("closed resumed sessions leave on the host: %s", strings.Join(left, ", "))
	}
	if m := mountsUnder(t, state); len(m) > 0 {
		t.Errorf("closed resumed sessions leave mounts: %q", m)
	}
}

// A resumed sandbox is held to the limits as a fresh one is: the sentry
// still reports a write past the file size limit, a run that times out
// kills the interpreter (its pid, saved with the state, is still the
// one), and the next run starts a fresh interpreter and says so.
func TestSuspendLimitsAfterResume(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1, Limits: moat.Limits{FileSize: moat.MiB, WallTime: moat.Duration(3 * time.Second)}})
	defer sb.Close()
	ss := interpSession(t, sb)
	runOK(t, ss, "x = 7")
	dir, _ := suspendOne(t, ss)
	r := resumeOne(t, sb, dir)
	res := runIn(t, r, "open('big', 'wb').write(b'x' * (2 << 20))")
	if res.Reason != moat.ReasonFileSize {
		t.Errorf("a write past the file size limit after a resume: reason %q, stderr %q", res.Reason, res.Stderr)
	}
	if out := runOK(t, r, "print(x)"); out != "7\n" {
		t.Errorf("x after the refused write: %q", out)
	}
	res = runIn(t, r, "import time\ntime.sleep(60)")
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a sleep past the wall time after a resume: reason %q", res.Reason)
	}
	res = runIn(t, r, "try:\n print(x)\nexcept NameError:\n print('fresh')")
	if string(res.Stdout) != "fresh\n" || !strings.Contains(strings.Join(res.Notes, " "), "fresh interpreter") {
		t.Errorf("the run after the timeout: %q, notes %q; want a fresh interpreter, said", res.Stdout, res.Notes)
	}
}

// A suspend does not give a session its CPU budget back: a session that
// used it up is resumed used up. (The budget counts the sandbox's CPU, the
// sentry's included, which is about twice the code's own here with
// systrap, and more on a loaded machine: a budget spent in part would not
// say reliably whether it was kept.)
func TestSuspendKeepsBudget(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1, SessionCPUTime: moat.Duration(2 * time.Second),
		Limits: moat.Limits{CPUTime: moat.Duration(10 * time.Second), WallTime: moat.Duration(30 * time.Second)}})
	defer sb.Close()
	for _, interp := range []bool{true, false} {
		ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: interp})
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		if res := runIn(t, ss, "while True:\n    pass"); res.Reason != moat.ReasonTimeout {
			t.Fatalf("interpreter %v: a loop in a session of a 2s budget: reason %q", interp, res.Reason)
		}
		dir := filepath.Join(t.TempDir(), "s")
		if _, err := ss.(moat.Suspender).Suspend(context.Background(), dir); err != nil {
			t.Fatal(err)
		}
		r := resumeOne(t, sb, dir)
		res, err := r.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err == nil && res.Reason == moat.ReasonNone {
			t.Errorf("interpreter %v: a run after the resume of a session that used up its budget: %q, want it refused", interp, res.Stdout)
		} else if err != nil && !errors.Is(err, moat.ErrSpent) {
			t.Errorf("interpreter %v: a run after the resume of a session that used up its budget: %v, want an error wrapping ErrSpent", interp, err)
		}
	}
}

// A state is resumed only by a sandbox like the one that saved it: one
// with other limits (and so another spec of its sandbox) refuses it with
// ErrInvalid, and starts nothing.
func TestSuspendOtherSandbox(t *testing.T) {
	state := t.TempDir()
	cfg := gvisor.Config{StateDir: state, Warm: -1}
	need(t, cfg)
	me := self(t)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := interpSession(t, sb)
	runOK(t, ss, "x = 1")
	dir, _ := suspendOne(t, ss)
	other := cfg
	other.Limits = moat.Limits{Memory: 384 * moat.MiB}
	sb2 := newSandbox(t, other)
	defer sb2.Close()
	if r, _, err := sb2.ResumeSession(context.Background(), dir); !errors.Is(err, moat.ErrInvalid) {
		if r != nil {
			r.Close()
		}
		t.Errorf("ResumeSession by a sandbox with other limits = %v, want an error wrapping ErrInvalid", err)
	}
	if left := leftovers(state, me); len(left) > 0 {
		t.Errorf("a refused state started %s", strings.Join(left, ", "))
	}
	// The sandbox that saved it still resumes it.
	if out := runOK(t, resumeOne(t, sb, dir), "print(x)"); out != "1\n" {
		t.Errorf("x resumed by the sandbox that saved it: %q", out)
	}
}

// A session with a network is not checkpointed (its proxy run would not
// match a restored sandbox's): it keeps its files, as before, and its
// interpreter starts fresh on resume, said in the notes; the resumed
// session has a network again.
func TestSuspendNetworkFilesOnly(t *testing.T) {
	p := newProxy(t)
	cfg := gvisor.Config{Egress: p, Warm: -1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	for _, interp := range []bool{false, true} {
		ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: interp})
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		runOK(t, ss, "x = 1\nopen('f', 'w').write('kept')")
		dir := filepath.Join(t.TempDir(), "s")
		info, err := ss.(moat.Suspender).Suspend(context.Background(), dir)
		if err != nil || info.Memory {
			t.Fatalf("interpreter %v: Suspend of a session with a network: %+v, %v; want its files only", interp, info, err)
		}
		r, rinfo, err := sb.ResumeSession(context.Background(), dir)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		out := runOK(t, r, "import os\ntry:\n print(x)\nexcept NameError:\n print('fresh', open('f').read(), 'HTTPS_PROXY' in os.environ)")
		if out != "fresh kept True\n" {
			t.Errorf("interpreter %v: the resumed session: %q", interp, out)
		}
		if interp && !strings.Contains(strings.Join(rinfo.Notes, " "), "fresh") {
			t.Errorf("the resume's notes %q do not say the interpreter starts fresh", rinfo.Notes)
		}
	}
}

// The figures for the README: suspend time and size, resume to the first
// output against a fresh session's first output, for an interpreter
// holding a 100,000-element list:
//
//	go test -count=1 -run TestSuspendFigures -v ./gvisor
func TestSuspendFigures(t *testing.T) {
	state := t.TempDir()
	cfg := gvisor.Config{StateDir: state, Warm: -1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ctx := context.Background()
	opts := moat.SessionOptions{Interpreter: true}
	mib := func(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }
	const rounds = 3
	for i := range rounds {
		start := time.Now()
		fresh, err := sb.NewSession(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		runOK(t, fresh, "print(1)")
		freshFirst := time.Since(start)
		fresh.Close()

		ss := interpSession(t, sb)
		runOK(t, ss, "x = list(range(100000))\nprint(len(x))")
		start = time.Now()
		dir, info := suspendOne(t, ss)
		suspend := time.Since(start)
		sentries := len(sentryCmdlines(state))
		start = time.Now()
		r := resumeOne(t, sb, dir)
		if out := runOK(t, r, "print(len(x))"); out != "100000\n" {
			t.Errorf("the resumed session's x: %q", out)
		}
		resumeFirst := time.Since(start)
		r.Close()
		image := dirSize(t, filepath.Join(dir, "state", "sandbox"))
		t.Logf("round %d: suspend %v, %s on disk (checkpoint image %s); resume to first output %v, a fresh session (NewSession + first run) %v (%.2fx); sentries while suspended: %d",
			i+1, suspend.Round(time.Millisecond), mib(info.Bytes), mib(image), resumeFirst.Round(time.Millisecond),
			freshFirst.Round(time.Millisecond), float64(resumeFirst)/float64(freshFirst), sentries)
	}
}

func dirSize(t *testing.T, dir string) int64 {
	t.Helper()
	var n int64
	filepath.Walk(dir, func(_ string, fi os.FileInfo, err error) error {
		if err == nil && fi.Mode().IsRegular() {
			n += fi.Size()
		}
		return nil
	})
	return n
}

// A session without an interpreter is checkpointed too: what its runs
// left in /tmp and /dev/shm (the sentry's own tmpfs mounts, which the
// files path never kept) comes back with its working directory, the
// primed launcher of its next run is not part of the state (it held host
// files), and the resumed session primes a new one and runs.
func TestSuspendPlainKeepsTmp(t *testing.T) {
	state := t.TempDir()
	cfg := gvisor.Config{StateDir: state, Warm: -1}
	need(t, cfg)
	me := self(t)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := newSession(t, sb)
	runOK(t, ss, "open('/tmp/t', 'w').write('tmp'); open('/dev/shm/s', 'w').write('shm'); open('w', 'w').write('work')")
	dir := filepath.Join(t.TempDir(), "s")
	info, err := ss.(moat.Suspender).Suspend(context.Background(), dir)
	if err != nil || !info.Memory {
		t.Fatalf("Suspend: %+v, %v; want the sandbox kept", info, err)
	}
	if left := leftovers(state, me); len(left) > 0 {
		t.Errorf("a suspended session leaves on the host: %s", strings.Join(left, ", "))
	}
	for i := range 2 {
		r := resumeOne(t, sb, dir)
		if out := runOK(t, r, "print(open('/tmp/t').read(), open('/dev/shm/s').read(), open('w').read())"); out != "tmp shm work\n" {
			t.Errorf("fork %d: %q", i, out)
		}
		if got := readFile(t, r, "w"); got != "work" {
			t.Errorf("fork %d: ReadFile(w) = %q", i, got)
		}
		r.Close()
	}
	if left := leftovers(state, me); len(left) > 0 {
		t.Errorf("closed resumed sessions leave on the host: %s", strings.Join(left, ", "))
	}
}

// The init relays code of any size to the interpreter, and its output
// back, whole, before and after a suspend.
func TestInterpreterRelaysLargeCode(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1, Limits: moat.Limits{Output: 8 * moat.MiB}})
	defer sb.Close()
	ss := interpSession(t, sb)
	code := "s = '" + strings.Repeat("ab", 3<<20) + "'\nimport sys\nsys.stdout.write(s)\nprint(len(s))"
	check := func(when string, s moat.Session) {
		start := time.Now()
		res, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
		if err != nil {
			t.Fatalf("%s: Run: %v", when, err)
		}
		want := strings.Repeat("ab", 3<<20) + strconv.Itoa(6<<20) + "\n"
		if string(res.Stdout) != want || res.ExitCode != 0 {
			t.Errorf("%s: %d bytes of output, want %d; exit %d, reason %q", when, len(res.Stdout), len(want), res.ExitCode, res.Reason)
		}
		t.Logf("%s: 6 MiB of code, 6 MiB of output: %v", when, time.Since(start).Round(time.Millisecond))
	}
	check("fresh", ss)
	dir, _ := suspendOne(t, ss)
	check("resumed", resumeOne(t, sb, dir))
}

// An interpreter that closes every stream it has and goes on running
// ends at the wall time all the same (the init takes its end from its
// status, not from its streams), and the next run has a fresh one.
func TestInterpreterClosesItsStreams(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1, Limits: moat.Limits{WallTime: moat.Duration(3 * time.Second)}})
	defer sb.Close()
	ss := interpSession(t, sb)
	runOK(t, ss, "x = 1")
	res := runIn(t, ss, "import os, time\nos.closerange(0, 4096)\ntime.sleep(60)")
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a run that closed its streams: reason %q, want timeout", res.Reason)
	}
	if out := runOK(t, ss, "try:\n print(x)\nexcept NameError:\n print('fresh')"); out != "fresh\n" {
		t.Errorf("the next run: %q, want a fresh interpreter", out)
	}
}

// What the code makes in its working directory cannot make a suspend
// write more than the directory holds: a file of many names is kept once
// (and comes back with its names), and sparse files adding up to more
// than the directory's size are refused before the checkpoint, the
// session running on.
func TestSuspendWorkAmplified(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1, Limits: moat.Limits{FileSize: 4 * moat.MiB}})
	defer sb.Close()
	ss := interpSession(t, sb)
	runOK(t, ss, "import os\nopen('f', 'wb').write(os.urandom(4 << 20))\nfor i in range(200):\n    os.link('f', 'l%d' % i)")
	dir, _ := suspendOne(t, ss)
	if n := dirSize(t, filepath.Join(dir, "work.tar")); n > 8<<20 {
		t.Errorf("work.tar of a 4 MiB file with 201 names: %d bytes", n)
	}
	r := resumeOne(t, sb, dir)
	if out := runOK(t, r, "import os\nprint(os.stat('l199').st_nlink, os.path.samefile('f', 'l0'))"); out != "201 True\n" {
		t.Errorf("the file's names after the resume: %q", out)
	}

	// Sparse files, 4 MiB each (the file size limit), more than the
	// directory's tmpfs holds in all.
	runOK(t, r, "import os\nst = os.statvfs('.')\nfor i in range(st.f_blocks * st.f_frsize // (4 << 20) + 2):\n    os.truncate(open('s%d' % i, 'wb').name, 4 << 20)")
	dir2 := filepath.Join(t.TempDir(), "s")
	if _, err := r.(moat.Suspender).Suspend(context.Background(), dir2); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("Suspend of sparse files past the directory's size = %v, want an error wrapping ErrInvalid", err)
	}
	if n := dirSize(t, dir2); n > 1<<20 {
		t.Errorf("the refused suspend wrote %d bytes", n)
	}
	if out := runOK(t, r, "import os\nprint(os.stat('l0').st_nlink)"); out != "201\n" {
		t.Errorf("the session after the refused suspend: %q", out)
	}
}

// Records the code writes past its run's end (on the driver's own fd of
// records, which it shares) never block the host's reader of the init's
// frames: the run after a flood of them ends, and once the session is
// closed nothing of the host's end of it is left waiting.
func TestInterpreterRecordFlood(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1, Limits: moat.Limits{WallTime: moat.Duration(10 * time.Second)}})
	defer sb.Close()
	ss := interpSession(t, sb)
	runOK(t, ss, "x = 1")
	// The code ends its run itself, as the driver would (its markers and
	// record, with the nonce it finds in the driver's frame), then goes on
	// writing records while the host has stopped reading them.
	flood := `import os, sys
f = sys._getframe(0)
while 'nonce' not in f.f_locals:
    f = f.f_back
nonce, rec = f.f_locals['nonce'], f.f_locals['rec']
line = b'y' * 100 + b'\n'
def flood():
    while True:
        os.write(rec, line * 40)
import threading, time
threading.Thread(target=flood, daemon=True).start()
time.sleep(0.2)
os.write(1, nonce)
os.write(2, nonce)
os.write(rec, b'\nX' + nonce + b' 0 oe\n')
time.sleep(1)
`
	if res := runIn(t, ss, flood); res.ExitCode != 0 {
		t.Fatalf("the flood: exit %d, reason %q, stderr %q", res.ExitCode, res.Reason, res.Stderr)
	}
	if out := runOK(t, ss, "print(x)"); out != "1\n" {
		t.Errorf("the run after the flood: %q", out)
	}
	runIn(t, ss, flood)
	ss.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		buf := make([]byte, 1<<20)
		stacks := string(buf[:runtime.Stack(buf, true)])
		left := strings.Contains(stacks, "gvisor.(*initConn).read") || strings.Contains(stacks, "gvisor.readRecords")
		if !left {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("10s after Close, the host's end of the init still runs:\n%s", stacks)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A run that keeps its output's end marker from the host (its stdout
// re-aimed at a pipe of its own) ends its interpreter, and the next run
// starts a fresh one: it is never refused because the killed one had not
// yet ended.
func TestInterpreterHidesItsMarker(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Warm: -1})
	defer sb.Close()
	ss := interpSession(t, sb)
	for i := range 3 {
		// Processes of its own make its end take a while.
		res := runIn(t, ss, "import os, subprocess\nfor _ in range(20):\n    subprocess.Popen(['sleep', '100'])\nr, w = os.pipe()\nos.dup2(w, 1)\nprint('hidden')")
		if !strings.Contains(strings.Join(res.Notes, " "), "interpreter ended") {
			t.Errorf("%d: a run that hid its marker: notes %q, want its interpreter ended", i, res.Notes)
		}
		res, err := ss.Run(context.Background(), moat.Request{Code: []byte("print('after')")})
		if err != nil {
			t.Fatalf("%d: the run after one that hid its marker: %v", i, err)
		}
		if string(res.Stdout) != "after\n" || !strings.Contains(strings.Join(res.Notes, " "), "fresh interpreter") {
			t.Errorf("%d: the run after: %q, notes %q", i, res.Stdout, res.Notes)
		}
	}
}
