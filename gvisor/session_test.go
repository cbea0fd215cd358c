package gvisor_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/internal/owner"
)

func newSession(t *testing.T, sb *gvisor.Sandbox) moat.Session {
	t.Helper()
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	return ss
}

func runIn(t *testing.T, ss moat.Session, code string) *moat.Result {
	t.Helper()
	res, err := ss.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run(%q): %v", code, err)
	}
	return res
}

func readFile(t *testing.T, ss moat.Session, name string) string {
	t.Helper()
	rc, err := ss.ReadFile(context.Background(), name)
	if err != nil {
		t.Fatalf("ReadFile(%s): %v", name, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestSessionFiles checks that a session's files persist from run to run
// and through the file operations, and that another session sees none of
// them.
func TestSessionFiles(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ctx := context.Background()
	a, other := newSession(t, sb), newSession(t, sb)
	if err := a.WriteFile(ctx, "in/data.txt", strings.NewReader("from the host")); err != nil {
		t.Fatal(err)
	}
	res := runIn(t, a, "print(open('in/data.txt').read()); open('out.txt', 'w').write('from run 1'); open('/tmp/t', 'w').write('tmp')")
	if got := strings.TrimSpace(string(res.Stdout)); got != "from the host" || res.ExitCode != 0 {
		t.Fatalf("run 1: stdout %q, exit %d, stderr %q", got, res.ExitCode, res.Stderr)
	}
	res = runIn(t, a, "print(open('out.txt').read(), open('/tmp/t').read())")
	if got := strings.TrimSpace(string(res.Stdout)); got != "from run 1 tmp" {
		t.Errorf("run 2 read %q, stderr %q; want the files run 1 wrote", got, res.Stderr)
	}
	if got := readFile(t, a, "out.txt"); got != "from run 1" {
		t.Errorf("ReadFile(out.txt) = %q", got)
	}
	if err := a.Mkdir(ctx, "d/e"); err != nil {
		t.Fatal(err)
	}
	if err := a.Rename(ctx, "out.txt", "d/e/moved.txt"); err != nil {
		t.Fatal(err)
	}
	if fi, err := a.Stat(ctx, "d/e/moved.txt"); err != nil || fi.Size != int64(len("from run 1")) {
		t.Errorf("Stat(d/e/moved.txt) = %+v, %v", fi, err)
	}
	if err := a.RemoveFile(ctx, "in/data.txt"); err != nil {
		t.Fatal(err)
	}
	list, err := a.ListFiles(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range list {
		names = append(names, f.Name)
	}
	sort.Strings(names)
	if want := []string{"d", "d/e", "d/e/moved.txt", "in"}; !slices.Equal(names, want) {
		t.Errorf("ListFiles = %q, want %q", names, want)
	}
	res = runIn(t, a, "import os; print(sorted(os.listdir('.')), os.path.exists('in/data.txt'))")
	if got := strings.TrimSpace(string(res.Stdout)); got != "['d', 'in'] False" {
		t.Errorf("the run sees %q after the file operations", got)
	}
	// The other session: nothing of a's, in its files or in its runs'.
	if _, err := other.ReadFile(ctx, "d/e/moved.txt"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the other session reads a's file: %v", err)
	}
	res = runIn(t, other, "import os; print(os.listdir('.'), os.path.exists('/tmp/t'))")
	if got := strings.TrimSpace(string(res.Stdout)); got != "[] False" {
		t.Errorf("the other session's run sees %q", got)
	}
	// A link the code planted is not followed by the file operations.
	runIn(t, a, "import os; os.symlink('/etc/passwd', 'link')")
	if _, err := a.ReadFile(ctx, "link"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ReadFile of a planted link: %v, want ErrInvalid", err)
	}
}

// TestSessionIsolation checks, from inside a session's run, what each run
// gets: the session's uid with no capability and no_new_privs, the guest
// seccomp filter (which gVisor does not apply to exec'd processes by
// itself), a PID namespace of its own, and the run's rlimits.
func TestSessionIsolation(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the probe's system call numbers are amd64's")
	}
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1, Limits: moat.Limits{Pids: 21, OpenFiles: 77}}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := newSession(t, sb)
	for _, c := range []struct{ name, code, want string }{
		{"user nobody", "import os; print(os.getuid(), os.getgid(), os.geteuid(), os.getgroups())", "65534 65534 65534 []"},
		{"no capabilities, no_new_privs, seccomp", `
import ctypes
st = dict(l.split(':', 1) for l in open('/proc/self/status'))
print(*(st[k].strip() for k in ['CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'Seccomp']), ctypes.CDLL(None).prctl(39, 0, 0, 0, 0))`,
			"0000000000000000 0000000000000000 0000000000000000 0000000000000000 2 1"},
		{"no namespaces, no mounts", `
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    r = libc.syscall(*args)
    return errno.errorcode.get(ctypes.get_errno(), '?') if r == -1 else 'ok'
CLONE_NEWUSER, CLONE_NEWPID, SIGCHLD = 0x10000000, 0x20000000, 17
print(call(272, CLONE_NEWUSER), call(272, CLONE_NEWPID), call(56, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), call(435, 0, 0),
      call(165, b'none', b'/tmp', b'tmpfs', 0, 0), call(101, 0, 0, 0, 0), call(308, 0, 0))`, "EPERM EPERM EPERM ENOSYS EPERM EPERM EPERM"},
		{"a PID namespace of its own", "import os; print(os.getpid(), os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()) != [1])", "1 0 True"},
		// RLIMIT_NPROC one below Pids: gVisor does not count the run's
		// init toward it (made as root, then the session's uid), so
		// its tasks, the init included, number at most Pids
		// (the conformance suite's Limits/Pids, with recycling on).
		{"the run's rlimits", "import resource as r; print(*(r.getrlimit(x)[1] for x in [r.RLIMIT_NPROC, r.RLIMIT_NOFILE, r.RLIMIT_CORE]))", "20 77 0"},
		{"environment and working directory", "import os, sys; print(os.getcwd(), sorted(os.environ), sys.flags.no_user_site)", "/work ['HOME', 'LANG', 'PATH'] 1"},
		{"loopback only", "import socket; print(socket.if_nameindex())", "[(1, 'lo')]"},
	} {
		t.Run(c.name, func(t *testing.T) {
			res := runIn(t, ss, c.code)
			if got := strings.TrimSpace(string(res.Stdout)); got != c.want || res.ExitCode != 0 {
				t.Errorf("got %q (exit %d, stderr %q), want %q", got, res.ExitCode, res.Stderr, c.want)
			}
		})
	}
}

// TestSessionLimits checks that each run gets the run limits, and that a
// run that hits one ends alone: the session, its files and its next run go
// on.
func TestSessionLimits(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1,
		Limits: moat.Limits{WallTime: moat.Duration(2 * time.Second), CPUTime: moat.Duration(time.Second), Pids: 16, FileSize: moat.MiB}}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := newSession(t, sb)
	if err := ss.WriteFile(context.Background(), "keep.txt", strings.NewReader("kept")); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, code string
		reason     moat.Reason
	}{
		{"wall time", "import time; print('sleeping', flush=True); time.sleep(30)", moat.ReasonTimeout},
		{"wall time, with a child in its own session", "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(60)\ntime.sleep(30)", moat.ReasonTimeout},
		{"cpu time", "while True: pass", moat.ReasonTimeout},
		{"processes", "import os, time\nfor i in range(100):\n    if os.fork() == 0:\n        time.sleep(30)\n", moat.ReasonPids},
		{"file size", "open('big', 'wb').write(b'x' * (2 << 20))", moat.ReasonFileSize},
		{"signal", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", moat.ReasonSignal},
	} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			res := runIn(t, ss, c.code)
			if res.Reason != c.reason {
				t.Errorf("reason %q (exit %d, signal %q, stderr %q), want %q", res.Reason, res.ExitCode, res.Signal, clipped(res.Stderr), c.reason)
			}
			if c.reason == moat.ReasonTimeout && time.Since(start) > 15*time.Second {
				t.Errorf("the run took %v to end", time.Since(start))
			}
			// The session goes on: its files, and a run that works.
			next := runIn(t, ss, "print(open('keep.txt').read())")
			if got := strings.TrimSpace(string(next.Stdout)); got != "kept" || next.ExitCode != 0 {
				t.Errorf("the run after it: stdout %q, exit %d, stderr %q", got, next.ExitCode, next.Stderr)
			}
		})
	}
}

// TestSessionLeftovers checks that a process a run leaves behind, in a
// session of its own, dies at its run's end: it does not run between runs,
// nor while a file operation resumes the sandbox, nor during the next run.
func TestSessionLeftovers(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := newSession(t, sb)
	res := runIn(t, ss, `
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            with open('/work/ticks', 'a') as f:
                f.write('x')
            time.sleep(0.02)
    os._exit(0)
while not os.path.exists('/work/ticks'):
    time.sleep(0.01)
time.sleep(0.2)
print('left it ticking')
`)
	if !strings.Contains(string(res.Stdout), "left it ticking") {
		t.Fatalf("run 1: %q, stderr %q", res.Stdout, res.Stderr)
	}
	first := readFile(t, ss, "ticks")
	if len(first) == 0 {
		t.Fatal("the leftover never ticked: the check would prove nothing")
	}
	time.Sleep(500 * time.Millisecond)
	// The file operations resume the sandbox: a living leftover ticks.
	for range 3 {
		readFile(t, ss, "ticks")
		time.Sleep(100 * time.Millisecond)
	}
	if got := readFile(t, ss, "ticks"); got != first {
		t.Errorf("the leftover ticked after its run ended: %d ticks, then %d", len(first), len(got))
	}
	res = runIn(t, ss, "import time; n = len(open('/work/ticks').read()); time.sleep(0.5); print(n, len(open('/work/ticks').read()))")
	if f := strings.Fields(string(res.Stdout)); len(f) != 2 || f[0] != f[1] || f[0] != strconv.Itoa(len(first)) {
		t.Errorf("during the next run the ticks went %q, want %d unchanged", res.Stdout, len(first))
	}
	// And the host's view: no process of the code's uid but the python3
	// waiting for the next run.
	if procs := eventually(t, func() []string { return sessionProcs(t, cfg.StateDir) }, 1); len(procs) != 1 {
		t.Errorf("processes of uid 65534 in the sandbox between runs: %v; want only the next run's python3", procs)
	}
}

// sessionProcs lists the processes of uid 65534 in the one sandbox under
// stateDir, as runsc ps shows them.
func sessionProcs(t *testing.T, stateDir string) []string {
	t.Helper()
	root := filepath.Join(stateDir, "runsc")
	ids := containers(t, stateDir)
	if len(ids) != 1 {
		t.Fatalf("containers under %s: %v, want one", stateDir, ids)
	}
	out, err := exec.Command("runsc", "--root="+root, "ps", ids[0]).CombinedOutput()
	if err != nil {
		t.Fatalf("runsc ps: %v: %s", err, out)
	}
	var procs []string
	for _, l := range strings.Split(string(out), "\n")[1:] {
		if f := strings.Fields(l); len(f) > 0 && f[0] == "65534" {
			procs = append(procs, l)
		}
	}
	return procs
}

// containers lists runsc's containers under stateDir.
func containers(t *testing.T, stateDir string) []string {
	t.Helper()
	out, err := exec.Command("runsc", "--root="+filepath.Join(stateDir, "runsc"), "list", "--format=json").CombinedOutput()
	if err != nil {
		t.Fatalf("runsc list: %v: %s", err, out)
	}
	var list []struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(bytes.TrimSpace(out), &list); err != nil && len(bytes.TrimSpace(out)) > 0 && string(bytes.TrimSpace(out)) != "null" {
		t.Fatalf("runsc list: %v: %s", err, out)
	}
	var ids []string
	for _, c := range list {
		ids = append(ids, c.ID)
	}
	return ids
}

// TestSessionUserSiteNotRead checks that what a run plants in the user
// site directory does not run when the next run's python3 starts, which is
// between runs.
func TestSessionUserSiteNotRead(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := newSession(t, sb)
	runIn(t, ss, `
import os, site
d = site.getusersitepackages()
os.makedirs(d, exist_ok=True)
open(os.path.join(d, 'usercustomize.py'), 'w').write("open('/work/planted-ran', 'a').write('x')\n")
open(os.path.join(d, 'x.pth'), 'w').write("import os; open('/work/pth-ran', 'a').write('x')\n")
print(d)
`)
	res := runIn(t, ss, "import os; print(os.path.exists('/work/planted-ran'), os.path.exists('/work/pth-ran'))")
	if got := strings.TrimSpace(string(res.Stdout)); got != "False False" {
		t.Errorf("planted user-site files ran: %q (stderr %q)", got, res.Stderr)
	}
}

// TestSessionClose checks that Close leaves nothing of the session on the
// host: no runsc container, state, bundle, cgroup or process.
func TestSessionClose(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	runIn(t, ss, "open('f', 'w').write('x')")
	me := self(t)
	if len(containers(t, cfg.StateDir)) != 1 || len(leftovers(cfg.StateDir, me)) == 0 || len(sentries(cfg.StateDir)) == 0 {
		t.Fatal("the open session shows nothing on the host: the check would prove nothing")
	}
	// Close while a run is in progress: the run ends too.
	done := make(chan error, 1)
	go func() {
		_, err := ss.Run(context.Background(), moat.Request{Code: []byte("import time; time.sleep(30)")})
		done <- err
	}()
	time.Sleep(time.Second)
	if err := ss.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the run in progress did not end with Close")
	}
	if ids := containers(t, cfg.StateDir); len(ids) > 0 {
		t.Errorf("runsc still lists %v", ids)
	}
	if left := leftovers(cfg.StateDir, me); len(left) > 0 {
		t.Errorf("after Close, left on the host:\n\t%s", strings.Join(left, "\n\t"))
	}
	if s := sentries(cfg.StateDir); len(s) > 0 {
		t.Errorf("sandbox processes still run: %v", s)
	}
	if n := len(runscExecs(cfg.StateDir)); n > 0 {
		t.Errorf("%d runsc exec processes still run", n)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Run after Close: %v, want ErrClosed", err)
	}
}

// runscExecs returns the pids of the host's runsc exec processes under
// stateDir.
func runscExecs(stateDir string) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if slices.Contains(args, "exec") && slices.Contains(args, "--root="+filepath.Join(stateDir, "runsc")) {
			out = append(out, pid)
		}
	}
	return out
}

// TestSessionCPUBudget checks the session's CPU budget: the run that uses
// it up ends with reason timeout, later runs fail with ErrSpent, and the
// files stay readable.
func TestSessionCPUBudget(t *testing.T) {
	// Run 1 burns 1s of its own CPU, which the cgroup's account shows as
	// 1-3s (the sentry's own work counts, more under load): within its
	// own 10s and the 6s budget. What it leaves of the budget (at most 5s)
	// is below run 2's own 10s, so the budget ends run 2.
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1, SessionCPUTime: moat.Duration(6 * time.Second),
		Limits: moat.Limits{CPUTime: moat.Duration(10 * time.Second), WallTime: moat.Duration(60 * time.Second)}}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	defer sb.Close()
	ss := newSession(t, sb)
	burn := "import time\nt = time.process_time()\nwhile time.process_time() - t < %s: pass\nopen('ran', 'a').write('x')\nprint('done')"
	res := runIn(t, ss, fmt.Sprintf(burn, "1.0"))
	if !strings.Contains(string(res.Stdout), "done") || res.Reason != "" {
		t.Fatalf("run 1: %q, reason %q, stderr %q", res.Stdout, res.Reason, res.Stderr)
	}
	res = runIn(t, ss, fmt.Sprintf(burn, "100"))
	if res.Reason != moat.ReasonTimeout || !strings.Contains(strings.Join(res.Notes, "\n"), "budget") {
		t.Errorf("run 2, past the budget: reason %q, notes %q; want timeout and a note of the budget", res.Reason, res.Notes)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrSpent) {
		t.Errorf("run 3: %v, want ErrSpent", err)
	}
	if got := readFile(t, ss, "ran"); got != "x" {
		t.Errorf("the files after the budget: ran = %q", got)
	}
}

// TestSessionReapAfterKill kills a moat process (this test binary,
// re-executed) while its session runs code, and checks that the next New
// removes everything of the session; with a live interpreter, the
// session's host working directory (a mount) too.
func TestSessionReapAfterKill(t *testing.T) {
	if os.Getenv(sessionHelperEnv) != "" {
		sessionHelperMain()
		return
	}
	for _, interp := range []bool{false, true} {
		t.Run(fmt.Sprintf("Interpreter=%v", interp), func(t *testing.T) { testSessionReapAfterKill(t, interp) })
	}
}

func testSessionReapAfterKill(t *testing.T, interp bool) {
	stateDir := t.TempDir()
	need(t, gvisor.Config{StateDir: stateDir})
	cmd := exec.Command(os.Args[0], "-test.run=^TestSessionReapAfterKill$")
	cmd.Env = append(os.Environ(), sessionHelperEnv+"="+stateDir, fmt.Sprintf("%s=%v", sessionHelperInterpEnv, interp))
	var out syncBuffer
	cmd.Stdout = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	deadline := time.Now().Add(60 * time.Second)
	for !strings.Contains(out.String(), "sleeping") {
		if time.Now().After(deadline) {
			t.Fatalf("the helper's session run never started: %q", out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	var helper string
	fmt.Sscanf(out.String(), "owner %s", &helper)
	if left := leftovers(stateDir, helper); len(left) == 0 || len(sentries(stateDir)) == 0 {
		t.Fatal("the helper's session shows nothing on the host to reap; the check would prove nothing")
	}
	if m := mountsUnder(t, stateDir); interp != (len(m) > 0) {
		t.Fatalf("the helper's session (interpreter %v) has the mounts %q under the state directory", interp, m)
	}
	cmd.Process.Kill()
	cmd.Wait()

	sb := newSandbox(t, gvisor.Config{StateDir: stateDir, Warm: -1})
	defer sb.Close()
	if left := leftovers(stateDir, helper); len(left) > 0 {
		t.Errorf("after the next New, the killed moat's session left:\n\t%s", strings.Join(left, "\n\t"))
	}
	if eventually(t, func() []sentry { return sentries(stateDir) }, 0); len(sentries(stateDir)) > 0 {
		t.Errorf("sandboxes of the killed moat still run: %v", sentries(stateDir))
	}
	if n := len(runscExecs(stateDir)); n > 0 {
		t.Errorf("%d runsc exec processes of the killed moat still run", n)
	}
	if m := mountsUnder(t, stateDir); len(m) > 0 {
		t.Errorf("after the next New, the killed moat's session left the mounts %q", m)
	}
}

// mountsUnder lists the host's mount points under dir.
func mountsUnder(t *testing.T, dir string) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(f[4], dir+"/") {
			out = append(out, f[4])
		}
	}
	return out
}

const (
	sessionHelperEnv       = "MOAT_GVISOR_TEST_SESSION_HELPER"
	sessionHelperInterpEnv = "MOAT_GVISOR_TEST_SESSION_HELPER_INTERPRETER"
)

func sessionHelperMain() {
	sb, err := gvisor.New(gvisor.Config{StateDir: os.Getenv(sessionHelperEnv), Warm: -1})
	if err != nil {
		fmt.Println("helper:", err)
		os.Exit(1)
	}
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: os.Getenv(sessionHelperInterpEnv) == "true"})
	if err != nil {
		fmt.Println("helper:", err)
		os.Exit(1)
	}
	id, _ := ownerID()
	fmt.Printf("owner %s\n", id)
	res, err := ss.Run(context.Background(), moat.Request{Code: []byte("import time; print('sleeping', flush=True); time.sleep(60)"), Stdout: os.Stdout})
	fmt.Println("helper: run ended:", res, err)
	os.Exit(1)
}

func ownerID() (string, error) { return owner.Self(ownersDir) }

// syncBuffer is a bytes.Buffer safe for a writer and a reader at once.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
