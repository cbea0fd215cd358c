package subprocess_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

func newSession(t *testing.T, l moat.Limits, opts moat.SessionOptions) (*subprocess.Sandbox, *subprocess.Session) {
	t.Helper()
	requireRoot(t)
	// No pool: its prepared one-shot runs (a cgroup, a uid, a python3
	// each) are no session's, and the tests count what is left of these.
	sb, err := subprocess.New(subprocess.Config{Limits: l, Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	s, err := sb.NewSession(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	ss := s.(*subprocess.Session)
	t.Cleanup(func() {
		ss.Close()
		if _, err := os.Stat(ss.Dir()); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("session directory %s still there after Close: %v", ss.Dir(), err)
		}
	})
	return sb, ss
}

func srun(t *testing.T, s moat.Session, code string) *moat.Result {
	t.Helper()
	res, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run(%q): %v", code, err)
	}
	return res
}

func out(res *moat.Result) string { return strings.TrimSpace(string(res.Stdout)) }

func writeString(t *testing.T, s moat.Session, name, data string) {
	t.Helper()
	if err := s.WriteFile(context.Background(), name, strings.NewReader(data)); err != nil {
		t.Fatalf("WriteFile(%q): %v", name, err)
	}
}

func readString(s moat.Session, name string) (string, error) {
	rc, err := s.ReadFile(context.Background(), name)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	return string(b), err
}

func TestSessionFilesPersist(t *testing.T) {
	for _, interp := range []bool{false, true} {
		t.Run("interpreter="+strconv.FormatBool(interp), func(t *testing.T) {
			_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: interp})
			if !sessionDirName.MatchString(filepath.Base(s.Dir())) {
				t.Errorf("session dir %s is not named <owner id>-s<id>, which the reaper recognizes", s.Dir())
			}
			res := srun(t, s, "open('a.txt','w').write('from run 1')\nimport os; os.makedirs('d/e'); open('d/e/f','w').write('deep')")
			if res.ExitCode != 0 {
				t.Fatalf("run 1: %+v %s", res, res.Stderr)
			}
			res = srun(t, s, "import os; print(open('a.txt').read(), os.getcwd() == os.environ['HOME'])")
			if got := out(res); got != "from run 1 True" {
				t.Errorf("run 2 saw %q (stderr %s)", got, res.Stderr)
			}
			if got, err := readString(s, "d/e/f"); err != nil || got != "deep" {
				t.Errorf("ReadFile(d/e/f) = %q, %v", got, err)
			}
			writeString(t, s, "up/load.txt", "from host")
			res = srun(t, s, "import os; print(open('up/load.txt').read()); open('up/load.txt','a').write('+code'); print(os.stat('up').st_uid == os.getuid())")
			if got := out(res); got != "from host\nTrue" {
				t.Errorf("the code saw the upload as %q (stderr %s)", got, res.Stderr)
			}
			if got, _ := readString(s, "up/load.txt"); got != "from host+code" {
				t.Errorf("after the code appended: %q", got)
			}
			files, err := s.ListFiles(context.Background())
			if err != nil {
				t.Fatal(err)
			}
			names := map[string]bool{}
			for _, f := range files {
				names[f.Name] = true
				if strings.HasPrefix(path(f.Name), ".moat-") {
					t.Errorf("moat's own file %s listed", f.Name)
				}
			}
			for _, want := range []string{"a.txt", "d", "d/e", "d/e/f", "up", "up/load.txt"} {
				if !names[want] {
					t.Errorf("ListFiles lacks %s: %v", want, files)
				}
			}
			if err := s.RemoveFile(context.Background(), "a.txt"); err != nil {
				t.Fatal(err)
			}
			if _, err := readString(s, "a.txt"); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("after RemoveFile, ReadFile = %v, want not exist", err)
			}
			if err := s.RemoveFile(context.Background(), "d"); err == nil {
				t.Error("RemoveFile removed a directory that is not empty")
			}
		})
	}
}

func path(name string) string { return filepath.Base(name) }

var sessionDirName = regexp.MustCompile(`^[0-9a-f]{16}-s[0-9a-f]+$`)

// TestSessionTraversal checks that names and links cannot lead the host side
// outside the session, whatever the code planted.
func TestSessionTraversal(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{})
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	if err := os.WriteFile(secret, []byte("host secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	// The code runs under Landlock and cannot see outside, but it can
	// still plant links that point there; and a FIFO.
	res := srun(t, s, "import os\n"+
		"os.symlink("+strconv.Quote(outside)+", 'out')\n"+
		"os.symlink("+strconv.Quote(secret)+", 'sec')\n"+
		"os.symlink('/etc', 'etc')\n"+
		"os.symlink('../../..', 'up')\n"+
		"os.mkfifo('fifo')\n"+
		"os.mkdir('in'); open('in/ok','w').write('ok'); os.symlink('in/ok', 'inlink')\n")
	if res.ExitCode != 0 {
		t.Fatalf("planting: %s", res.Stderr)
	}
	ctx := context.Background()
	bad := []string{"", ".", "..", "../x", "/etc/passwd", "a/../../x", "a//b", "./a", "out/secret", "sec", "etc/passwd", "up/etc/passwd", "fifo", "in", "x\x00y"}
	for _, name := range bad {
		if _, err := s.ReadFile(ctx, name); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("ReadFile(%q) = %v, want ErrInvalid", name, err)
		}
	}
	for _, name := range []string{"", "..", "../x", "/tmp/x", "out/new", "out/secret", "etc/moat-evil", "up/tmp/moat-evil"} {
		if err := s.WriteFile(ctx, name, strings.NewReader("evil")); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("WriteFile(%q) = %v, want ErrInvalid", name, err)
		}
	}
	for _, name := range []string{"..", "/etc/passwd", "out/secret"} {
		if err := s.RemoveFile(ctx, name); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("RemoveFile(%q) = %v, want ErrInvalid", name, err)
		}
	}
	if b, err := os.ReadFile(secret); err != nil || string(b) != "host secret" {
		t.Errorf("the host's file changed: %q, %v", b, err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 1 {
		t.Errorf("something was written outside the session: %v", entries)
	}
	for _, p := range []string{"/etc/moat-evil", "/tmp/moat-evil"} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s was created", p)
			os.Remove(p)
		}
	}
	// A link inside the session is fine; replacing a link replaces the
	// link, never its target.
	if got, err := readString(s, "inlink"); err != nil || got != "ok" {
		t.Errorf("ReadFile(inlink) = %q, %v", got, err)
	}
	writeString(t, s, "sec", "replaced")
	if b, _ := os.ReadFile(secret); string(b) != "host secret" {
		t.Errorf("writing over a planted link wrote its target: %q", b)
	}
	if err := s.RemoveFile(ctx, "etc"); err != nil {
		t.Errorf("removing the planted link: %v", err)
	}
	if _, err := os.Stat("/etc/passwd"); err != nil {
		t.Errorf("/etc/passwd: %v", err)
	}
}

func TestSessionDiskLimit(t *testing.T) {
	_, s := newSession(t, moat.Limits{Disk: 2 * moat.MiB, FileSize: moat.MiB}, moat.SessionOptions{})
	ctx := context.Background()
	big := bytes.Repeat([]byte("x"), int(moat.MiB)+1)
	if err := s.WriteFile(ctx, "big", bytes.NewReader(big)); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("a file over the file size limit: %v, want ErrInvalid", err)
	}
	chunk := bytes.Repeat([]byte("y"), int(moat.MiB)-64*1024)
	var err error
	n := 0
	for ; n < 4 && err == nil; n++ {
		err = s.WriteFile(ctx, "f"+strconv.Itoa(n), bytes.NewReader(chunk))
	}
	if !errors.Is(err, moat.ErrInvalid) || n < 2 {
		t.Fatalf("after %d files: %v, want ErrInvalid from the disk limit", n, err)
	}
	files, _ := s.ListFiles(ctx)
	for _, f := range files {
		if f.Name == "big" || f.Name == "f"+strconv.Itoa(n-1) || strings.HasPrefix(f.Name, ".moat") {
			t.Errorf("a refused write left %s", f.Name)
		}
	}
	// The code sees the same limit.
	res := srun(t, s, "open('more','wb').write(b'z'*(1<<20))")
	if res.Reason != moat.ReasonDisk && res.Reason != moat.ReasonFileSize {
		t.Errorf("writing past the disk limit: reason %q, stderr %s", res.Reason, res.Stderr)
	}
}

func TestSessionsAreSeparate(t *testing.T) {
	sb, a := newSession(t, moat.Limits{}, moat.SessionOptions{})
	b, err := sb.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	writeString(t, a, "mine", "a's")
	res := srun(t, b, "import os\ntry:\n  print(os.listdir("+strconv.Quote(a.Dir())+"))\nexcept OSError as e: print('denied')\nprint(os.path.exists('mine'))")
	if got := out(res); got != "denied\nFalse" {
		t.Errorf("session b saw a's files: %q %s", got, res.Stderr)
	}
}

func TestInterpreterKeepsState(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "x = 41\ndef f(): return x + 1\nimport json")
	if res := srun(t, s, "print(f(), json.dumps([x]))"); out(res) != "42 [41]" {
		t.Errorf("state lost: %q %s", res.Stdout, res.Stderr)
	}
	res := srun(t, s, "y = 1\nraise ValueError('bad')")
	if res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "ValueError: bad") || !strings.Contains(string(res.Stderr), "raise ValueError") {
		t.Errorf("exception: exit %d stderr %q", res.ExitCode, res.Stderr)
	}
	if strings.Contains(string(res.Stderr), "_moat_driver") {
		t.Errorf("the traceback shows the driver: %s", res.Stderr)
	}
	if res := srun(t, s, "import sys; print(y); sys.exit(3)"); res.ExitCode != 3 || out(res) != "1" {
		t.Errorf("sys.exit(3): exit %d out %q", res.ExitCode, res.Stdout)
	}
	if res := srun(t, s, "print(x"); res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "SyntaxError") {
		t.Errorf("syntax error: exit %d stderr %q", res.ExitCode, res.Stderr)
	}
	// Output written below Python's streams, by children too, is the run's.
	res = srun(t, s, "import os, sys; os.write(1, b'fd1\\n'); os.system('echo child; echo err >&2'); sys.stderr.write('py2\\n')")
	if out(res) != "fd1\nchild" || !strings.Contains(string(res.Stderr), "err") || !strings.Contains(string(res.Stderr), "py2") {
		t.Errorf("fd-level output: stdout %q stderr %q", res.Stdout, res.Stderr)
	}
	if res := srun(t, s, "print(x)"); out(res) != "41" {
		t.Errorf("state lost after a system() call: %q %s", res.Stdout, res.Stderr)
	}
	// The driver's control channel is not the code's stdin.
	if res := srun(t, s, "import sys; print(repr(sys.stdin.read()))"); out(res) != "''" {
		t.Errorf("stdin: %q %s", res.Stdout, res.Stderr)
	}
}

// The notes say so: of the run that ended the interpreter, that it did and
// why; of the next run, that it started a fresh one and why, so that a
// NameError there is explained. Runs that keep the interpreter say nothing.
func TestInterpreterTimeoutStartsAfresh(t *testing.T) {
	_, s := newSession(t, moat.Limits{WallTime: moat.Duration(3 * time.Second)}, moat.SessionOptions{Interpreter: true})
	res := srun(t, s, "x = 1\nopen('kept','w').write('yes')")
	wantNotes(t, "the first run", res)
	res = srun(t, s, "import subprocess; subprocess.Popen(['sleep','100']); print('looping', flush=True)\nwhile True: pass")
	if res.Reason != moat.ReasonTimeout || out(res) != "looping" {
		t.Errorf("loop: reason %q out %q", res.Reason, res.Stdout)
	}
	wantNotes(t, "the run that timed out", res, "interpreter ended by this run's timeout: the next run starts a fresh one")
	res = srun(t, s, "print('x' in globals(), open('kept').read())")
	if out(res) != "False yes" {
		t.Errorf("after the timeout: %q %s (want a fresh interpreter with the files kept)", res.Stdout, res.Stderr)
	}
	wantNotes(t, "the run after the timeout", res, "interpreter restarted: the previous one was ended by its run's timeout; variables from earlier runs are gone")
	res = srun(t, s, "y = 1")
	wantNotes(t, "the second run of the fresh interpreter", res)
	// os._exit ends the interpreter too: its status is the run's.
	res = srun(t, s, "import os; os._exit(7)")
	if res.ExitCode != 7 {
		t.Errorf("os._exit(7): exit %d", res.ExitCode)
	}
	wantNotes(t, "os._exit(7)", res, "interpreter ended by this run's code exiting it (status 7)")
	res = srun(t, s, "print(2)")
	if out(res) != "2" {
		t.Errorf("after os._exit: %q %s", res.Stdout, res.Stderr)
	}
	wantNotes(t, "the run after os._exit(7)", res, "interpreter restarted: the previous one was ended by its run's code exiting it (status 7)")
}

// wantNotes checks that res's notes about the interpreter are as many as
// want, each starting with its want, in order.
func wantNotes(t *testing.T, what string, res *moat.Result, want ...string) {
	t.Helper()
	var got []string
	for _, n := range res.Notes {
		if strings.HasPrefix(n, "interpreter ") {
			got = append(got, n)
		}
	}
	ok := len(got) == len(want)
	for i := 0; ok && i < len(want); i++ {
		ok = strings.HasPrefix(got[i], want[i])
	}
	if !ok {
		t.Errorf("%s: notes %q; want %d starting %q", what, got, len(want), want)
	}
}

// wakeAndSpinCode arms, in the interpreter and in a child it forks, a POSIX
// timer that sends the process SIGCONT every 10ms (what wakes a process
// stopped with SIGSTOP), and leaves a thread (in the child, its main
// thread) spinning; then it returns, with a variable set.
const wakeAndSpinCode = `import ctypes, os, signal, threading
libc = ctypes.CDLL(None, use_errno=True)
class sigevent(ctypes.Structure):
    _fields_ = [('value', ctypes.c_void_p), ('signo', ctypes.c_int), ('notify', ctypes.c_int), ('pad', ctypes.c_int * 12)]
class timespec(ctypes.Structure):
    _fields_ = [('sec', ctypes.c_long), ('nsec', ctypes.c_long)]
class itimerspec(ctypes.Structure):
    _fields_ = [('interval', timespec), ('value', timespec)]
def arm():
    # With SIGCONT ignored (its default), the kernel parks the timer after
    # its first expiry; a handler keeps it firing.
    signal.signal(signal.SIGCONT, lambda *a: None)
    sev = sigevent(None, signal.SIGCONT, 0)  # SIGEV_SIGNAL
    tid = ctypes.c_void_p()
    if libc.timer_create(1, ctypes.byref(sev), ctypes.byref(tid)) != 0:  # CLOCK_MONOTONIC
        raise OSError(ctypes.get_errno(), 'timer_create')
    its = itimerspec(timespec(0, 10000000), timespec(0, 10000000))
    if libc.timer_settime(tid, 0, ctypes.byref(its), None) != 0:
        raise OSError(ctypes.get_errno(), 'timer_settime')
def spin():
    while True:
        pass
if os.fork() == 0:
    arm()
    spin()
arm()
threading.Thread(target=spin, daemon=True).start()
x = 41
print(os.getuid())
`

// TestSessionInterpreterFrozenBetweenRuns checks that nothing the code
// leaves behind runs between runs, not even processes that arm a timer to
// send themselves SIGCONT: the CPU the interpreter's cgroup uses in a gap
// between runs, read on the host, is next to none. The variables survive.
func TestSessionInterpreterFrozenBetweenRuns(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: true})
	res := srun(t, s, wakeAndSpinCode)
	uid, err := strconv.Atoi(out(res))
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("arming: exit %d %q %s", res.ExitCode, res.Stdout, res.Stderr)
	}
	if procs := processesOf(uid); len(procs) < 3 {
		t.Fatalf("want the interpreter's threads and the forked child, found %v", procs)
	}
	if frozen, err := s.InterpreterFrozen(); err != nil || !frozen {
		t.Errorf("between runs the interpreter's cgroup is not frozen: %v, %v", frozen, err)
	}
	const gap = 2 * time.Second
	before := interpreterCPU(t, s)
	time.Sleep(gap)
	used := interpreterCPU(t, s) - before
	t.Logf("CPU used in a %v gap between runs: %v", gap, used)
	if used*20 > gap {
		t.Errorf("the interpreter used %v of CPU in a %v gap between runs (want under 5%%)", used, gap)
	}

	// Positive control: during a run the spinners do run.
	before = interpreterCPU(t, s)
	res = srun(t, s, "import time; time.sleep(0.5); print(x)")
	during := interpreterCPU(t, s) - before
	if out(res) != "41" {
		t.Errorf("after the gap: %q %s (want the variable kept)", res.Stdout, res.Stderr)
	}
	if during*4 < res.Duration {
		t.Errorf("positive control: the spinners used only %v of CPU in a %v run", during, res.Duration)
	}
	s.Close()
	if procs := processesOf(uid); len(procs) != 0 {
		t.Errorf("processes left after Close: %v", procs)
	}
	// The interpreter's groups, the freezer's included, are gone.
	owner, _, _ := strings.Cut(filepath.Base(s.Dir()), "-s")
	if left, _ := filepath.Glob("/sys/fs/cgroup/*/moat/" + owner + "-*"); len(left) != 0 {
		t.Errorf("cgroups left after Close: %v", left)
	}
}

func interpreterCPU(t *testing.T, s *subprocess.Session) time.Duration {
	t.Helper()
	used, ok, err := s.InterpreterCPU()
	if err != nil || !ok {
		t.Fatalf("the interpreter's CPU account: %v, %v", ok, err)
	}
	return used
}

// TestSessionInterpreterNeedsFreezer: without a cgroup freezer, a session
// with a live interpreter is refused rather than held with SIGSTOP; one
// without is still made.
func TestSessionInterpreterNeedsFreezer(t *testing.T) {
	requireRoot(t)
	// No pool: WithoutFreezer changes the sandbox's cgroup manager, which
	// the pool's preparations use from a goroutine of their own.
	sb, err := subprocess.New(subprocess.Config{Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	sb.WithoutFreezer()
	if s, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true}); !errors.Is(err, moat.ErrUnavailable) || !strings.Contains(fmt.Sprint(err), "freezer") {
		t.Errorf("NewSession(Interpreter) without a freezer: %v, want ErrUnavailable naming the freezer", err)
		if s != nil {
			s.Close()
		}
	}
	s, err := sb.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatalf("a session without an interpreter needs no freezer: %v", err)
	}
	defer s.Close()
	if res := srun(t, s, "print(1)"); out(res) != "1" {
		t.Errorf("run: %q %s", res.Stdout, res.Stderr)
	}
}

// TestSessionCPUBudget: the session's interpreters together, a fresh one
// after os._exit included, are bounded by SessionCPUTime; the run that
// reaches it ends with a timeout well before its own CPU limit, and the
// session then runs nothing more while its files stay readable.
func TestSessionCPUBudget(t *testing.T) {
	requireRoot(t)
	if err := (subprocess.Config{SessionCPUTime: -1}).Validate(); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("a negative session cpu time: %v, want ErrInvalid", err)
	}
	const budget = 2 * time.Second
	lim := moat.Limits{CPUTime: moat.Duration(20 * time.Second), WallTime: moat.Duration(40 * time.Second)}
	sb, err := subprocess.New(subprocess.Config{Limits: lim, SessionCPUTime: moat.Duration(budget)})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	s, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	burn := "import time, os\nt = time.process_time()\nwhile time.process_time() - t < 1.2: pass\nopen('kept', 'w').write('yes')\nos._exit(0)"
	if res := srun(t, s, burn); res.ExitCode != 0 || res.Reason != "" {
		t.Fatalf("a run within the budget: exit %d reason %q %s", res.ExitCode, res.Reason, res.Stderr)
	}
	// A fresh interpreter: its CPU adds to the first one's.
	res := srun(t, s, "while True: pass")
	t.Logf("the run past the budget: %v, reason %q", res.Duration, res.Reason)
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a run past the session's budget: reason %q, want timeout", res.Reason)
	}
	wantNotes(t, "the run past the budget", res,
		"interpreter restarted: the previous one was ended by its run's code exiting it (status 0)",
		"interpreter ended by this run's CPU time limit: the session's CPU budget is spent")
	if res.Duration > time.Duration(lim.CPUTime)/2 {
		t.Errorf("a run past a %v budget of which 1.2s was used ran %v, as if bounded by the %v per-run limit only", budget, res.Duration, time.Duration(lim.CPUTime))
	}
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrSpent) {
		t.Errorf("a run after the budget is spent: %v, want ErrSpent", err)
	}
	if got, err := readString(s, "kept"); err != nil || got != "yes" {
		t.Errorf("the files after the budget is spent: %q, %v", got, err)
	}
}

// forgeEndCode finds the driver's nonce and control socket from the code's
// own frames and /proc, writes a forged end-of-run record and the output
// markers, then goes on and ends with status 7, which the driver reports
// late. It adapts to the control socket's protocol (a stream of
// length-prefixed frames, or one record per message).
const forgeEndCode = `import os, socket, stat, sys, time
nonce = None
f = sys._getframe()
while f is not None:
    for v in list(f.f_locals.values()):
        if isinstance(v, bytes) and len(v) == 32:
            try:
                int(v, 16)
                nonce = v
            except ValueError:
                pass
    f = f.f_back
ctl = None
for fd in range(3, 256):
    try:
        if stat.S_ISSOCK(os.fstat(fd).st_mode):
            ctl = fd
            break
    except OSError:
        pass
if nonce is None or ctl is None:
    print('nothing found', nonce, ctl, file=sys.stderr)
    sys.exit(99)
s = socket.socket(fileno=os.dup(ctl))
if s.type == socket.SOCK_SEQPACKET:
    os.write(ctl, b'X' + nonce + b'0 oe')
else:
    os.write(ctl, b'X' + (4).to_bytes(4, 'big') + b'0 oe')
os.write(1, nonce)
os.write(2, nonce)
time.sleep(1)
raise SystemExit(7)
`

// TestSessionInterpreterForgedEnd: code that reads the driver's nonce and
// writes a forged end of its run (which the host cannot tell from the real
// one) must not shift the next run's exit status or output: the real, late
// end of the forging run is not taken as the next run's.
func TestSessionInterpreterForgedEnd(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: true})
	res := srun(t, s, forgeEndCode)
	// Positive control: the forgery reached the host (status 0, not 7 or
	// 99).
	if res.ExitCode != 0 {
		t.Fatalf("positive control: the forging run ended with %d, not with its forged 0: %s", res.ExitCode, res.Stderr)
	}
	res = srun(t, s, "y = 5\nprint('two')\nraise SystemExit(3)")
	if res.ExitCode != 3 || string(res.Stdout) != "two\n" || len(res.Stderr) != 0 {
		t.Errorf("the run after a forged end: exit %d stdout %q stderr %q; want its own 3, \"two\\n\", nothing", res.ExitCode, res.Stdout, res.Stderr)
	}
	res = srun(t, s, "print(y)")
	if res.ExitCode != 0 || out(res) != "5" {
		t.Errorf("the run after: exit %d stdout %q stderr %q", res.ExitCode, res.Stdout, res.Stderr)
	}
}

// processesOf returns the state of every thread of every process of uid.
func processesOf(uid int) map[string]string {
	out := map[string]string{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		tasks, _ := os.ReadDir("/proc/" + e.Name() + "/task")
		for _, task := range tasks {
			status, err := os.ReadFile("/proc/" + e.Name() + "/task/" + task.Name() + "/status")
			if err != nil {
				continue
			}
			var state string
			owner := -1
			for _, line := range strings.Split(string(status), "\n") {
				if f := strings.Fields(line); len(f) >= 2 {
					switch f[0] {
					case "State:":
						state = f[1]
					case "Uid:":
						owner, _ = strconv.Atoi(f[1])
					}
				}
			}
			if owner == uid && state != "Z" {
				out[e.Name()+"/"+task.Name()] = state
			}
		}
	}
	return out
}

func TestInterpreterStreamsAndCancels(t *testing.T) {
	_, s := newSession(t, moat.Limits{WallTime: moat.Duration(20 * time.Second)}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "v = 'kept'")
	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var res *moat.Result
	var err error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		res, err = s.Run(ctx, moat.Request{Code: []byte("import time\nprint('first', flush=True)\ntime.sleep(60)"), Stdout: pw})
		pw.Close()
	}()
	buf := make([]byte, 6)
	if _, rerr := io.ReadFull(pr, buf); rerr != nil || string(buf) != "first\n" {
		t.Fatalf("streamed %q, %v", buf, rerr)
	}
	cancel()
	go io.Copy(io.Discard, pr)
	wg.Wait()
	if err != nil || res.Reason != moat.ReasonCanceled {
		t.Fatalf("cancelled run: %+v, %v", res, err)
	}
	if res := srun(t, s, "print('v' in globals())"); out(res) != "False" {
		t.Errorf("after a cancelled run: %q", res.Stdout)
	}
}

func TestSessionClose(t *testing.T) {
	sb, s := newSession(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)}, moat.SessionOptions{})
	done := make(chan error, 1)
	go func() {
		_, err := s.Run(context.Background(), moat.Request{Code: []byte("import time; time.sleep(60)")})
		done <- err
	}()
	time.Sleep(300 * time.Millisecond)
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not end the run")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Run after Close: %v", err)
	}
	if err := s.WriteFile(context.Background(), "x", strings.NewReader("")); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("WriteFile after Close: %v", err)
	}
	if _, err := os.Stat(s.Dir()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("session directory left behind: %v", err)
	}
	_ = sb
}

// TestSessionFileAtLimitIsOnlyItsRunsReason: a file that reached the size
// limit in one run is that run's reason, not every later run's, in a session
// with and without a live interpreter, whether the run wrote the file to
// exactly the limit or tried to write past it. The first run's write comes
// within a millisecond of its start, well inside one tick of the coarse clock
// that stamps the file: the verdict must not hang on the host's clock.
func TestSessionFileAtLimitIsOnlyItsRunsReason(t *testing.T) {
	for _, interp := range []bool{false, true} {
		for _, tc := range []struct{ name, code string }{
			{"exactly", "open('big','wb').write(b'x' * (1 << 20))"},
			{"past", "try:\n  open('big','wb').write(b'x' * (2 << 20))\nexcept OSError as e: print(e.errno)"},
		} {
			t.Run(fmt.Sprintf("interpreter=%v/%s", interp, tc.name), func(t *testing.T) {
				_, s := newSession(t, moat.Limits{FileSize: moat.MiB}, moat.SessionOptions{Interpreter: interp})
				for i := range 3 {
					// Every time: a later run rewriting the file at the
					// limit has reached it again.
					if res := srun(t, s, tc.code); res.Reason != moat.ReasonFileSize {
						t.Fatalf("run %d writing the file: reason %q, want filesize (stderr %s)", 2*i+1, res.Reason, res.Stderr)
					}
					res := srun(t, s, "import os; print('hi', os.path.getsize('big'))")
					if res.Reason != "" || out(res) != "hi 1048576" {
						t.Errorf("run %d: reason %q, stdout %q; want no reason and the 1 MiB file still there", 2*i+2, res.Reason, out(res))
					}
				}
			})
		}
	}
}

// TestSessionInterpreterControlGarbage: what the code writes on the control
// socket (a partial frame, an empty record, one longer than any of the
// driver's) neither ends its run nor shifts the framing of later records.
func TestSessionInterpreterControlGarbage(t *testing.T) {
	_, s := newSession(t, moat.Limits{}, moat.SessionOptions{Interpreter: true})
	res := srun(t, s, `import os, stat
ctl = next(fd for fd in range(3, 256) if os.path.exists('/proc/self/fd/%d' % fd) and stat.S_ISSOCK(os.fstat(fd).st_mode))
os.write(ctl, b'X\x00\x00')
os.write(ctl, b'')
os.write(ctl, b'Z' * 10000)
z = 1
print('one')`)
	if res.ExitCode != 0 || out(res) != "one" {
		t.Errorf("the run writing on the control socket: exit %d stdout %q stderr %s", res.ExitCode, res.Stdout, res.Stderr)
	}
	res = srun(t, s, "print('two', z)")
	if res.ExitCode != 0 || out(res) != "two 1" {
		t.Errorf("the next run: exit %d stdout %q stderr %s", res.ExitCode, res.Stdout, res.Stderr)
	}
}

// countingWriter counts what a Request writer receives.
type countingWriter struct {
	mu sync.Mutex
	n  int
}

func (w *countingWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.n += len(p)
	return len(p), nil
}

// TestInterpreterOutputCapEndsTheRun checks that a live interpreter's run is
// held to the output cap like a one-shot run: the writer gets at most the cap,
// the run ends for it long before its wall time, and the next run starts a
// fresh interpreter, with the files still there.
func TestInterpreterOutputCapEndsTheRun(t *testing.T) {
	limit, wall := moat.KiB, 10*time.Second
	_, s := newSession(t, moat.Limits{Output: limit, WallTime: moat.Duration(wall)}, moat.SessionOptions{Interpreter: true})
	srun(t, s, "x = 1\nopen('kept','w').write('yes')")
	for _, code := range []string{
		"while True: print('x' * 1000)",
		// Past the cap, then the code ends by itself: the run is still
		// ended for its output, and the interpreter with it.
		"import sys\nsys.stdout.write('y' * 4096)",
	} {
		w := &countingWriter{}
		start := time.Now()
		res, err := s.Run(context.Background(), moat.Request{Code: []byte(code), Stdout: w})
		elapsed := time.Since(start)
		if err != nil {
			t.Fatalf("Run(%q): %v", code, err)
		}
		if res.Reason != moat.ReasonOutput || !res.Truncated || res.ExitCode != 137 || res.Signal != "SIGKILL" {
			t.Errorf("%q under a %v output limit: reason %q truncated %v exit %d signal %q; want output, true, 137, SIGKILL",
				code, limit, res.Reason, res.Truncated, res.ExitCode, res.Signal)
		}
		w.mu.Lock()
		n := w.n
		w.mu.Unlock()
		if n > int(limit) || n != len(res.Stdout) {
			t.Errorf("%q: the writer received %d bytes, Result.Stdout %d; want the same, at most %d", code, n, len(res.Stdout), int64(limit))
		}
		if ratio := float64(elapsed) / float64(wall); ratio >= 0.5 {
			t.Errorf("%q: Run took %v, %.2f of the %v wall time; want under 0.5", code, elapsed, ratio, wall)
		}
		wantNotes(t, code, res, "interpreter ended by this run's output cap")
		res = srun(t, s, "print('x' in globals(), open('kept').read())")
		if out(res) != "False yes" || res.Reason != "" {
			t.Errorf("after %q: %q %s reason %q (want a fresh interpreter with the files kept)", code, res.Stdout, res.Stderr, res.Reason)
		}
		wantNotes(t, "after "+code, res, "interpreter restarted: the previous one was ended by its run's output cap")
		srun(t, s, "x = 1")
	}
}

// TestSessionCodeFileIsNotAFileAtLimit: the file moat writes the code in is not the
// run's: code as large as the file size limit is no reason filesize, in a
// one-shot run and in a session's.
func TestSessionCodeFileIsNotAFileAtLimit(t *testing.T) {
	code := "print('hi')\n#" + strings.Repeat("x", int(moat.MiB)) + "\n"
	sb, s := newSession(t, moat.Limits{FileSize: moat.MiB}, moat.SessionOptions{})
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != "" || out(res) != "hi" {
		t.Errorf("one-shot run of %d bytes of code: reason %q stdout %q stderr %s; want no reason", len(code), res.Reason, res.Stdout, res.Stderr)
	}
	if res := srun(t, s, code); res.Reason != "" || out(res) != "hi" {
		t.Errorf("session run of %d bytes of code: reason %q stdout %q stderr %s; want no reason", len(code), res.Reason, res.Stdout, res.Stderr)
	}
}

// TestSessionListBounded: a tree the code built past the listing caps is
// refused, not held in moat's memory; under them it is listed.
func TestSessionListBounded(t *testing.T) {
	_, ss := newSession(t, moat.Limits{}, moat.SessionOptions{})
	ctx := context.Background()
	res, err := ss.Run(ctx, moat.Request{Code: []byte("import os\np = ''\nfor i in range(15):\n    p = os.path.join(p, 'd' * 200)\n    os.mkdir(p)\n")})
	if err != nil || res.ExitCode != 0 {
		t.Fatalf("building the tree: %+v %v", res, err)
	}
	if files, err := ss.ListFiles(ctx); err != nil || len(files) != 15 {
		t.Fatalf("under the caps: %d files, %v", len(files), err)
	}
	restore := subprocess.SetListCaps(100000, 16<<10)
	defer restore()
	if _, err := ss.ListFiles(ctx); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("a listing past the bytes cap: %v, want ErrInvalid", err)
	}
	restore()
	defer subprocess.SetListCaps(10, 64<<20)()
	if _, err := ss.ListFiles(ctx); !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("a listing past the entries cap: %v, want ErrInvalid", err)
	}
}
