package microvm

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
)

// newSession returns a session of sb, closed when t ends.
func newSession(t *testing.T, sb *Sandbox) moat.Session {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ss, err := sb.NewSession(ctx, moat.SessionOptions{})
	if err != nil {
		t.Fatalf("NewSession: %v", err)
	}
	t.Cleanup(func() { ss.Close() })
	return ss
}

func runIn(t *testing.T, ss moat.Session, code string) *moat.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := ss.Run(ctx, moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	return res
}

func runOK(t *testing.T, ss moat.Session, code string) string {
	t.Helper()
	res := runIn(t, ss, code)
	if res.ExitCode != 0 || res.Reason != moat.ReasonNone {
		t.Fatalf("exit %d, reason %q, stderr %s", res.ExitCode, res.Reason, res.Stderr)
	}
	return string(res.Stdout)
}

func readAll(t *testing.T, ss moat.Session, name string) string {
	t.Helper()
	rc, err := ss.ReadFile(context.Background(), name)
	if err != nil {
		t.Fatalf("ReadFile %s: %v", name, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// vmOf is the session's VM.
func vmOf(t *testing.T, ss moat.Session) *vmSession {
	t.Helper()
	es, ok := ss.(*engine.Session)
	if !ok {
		t.Fatalf("the session is a %T", ss)
	}
	return es.Instance().(*vmSession)
}

// Files written by one run are there for the next and for the file
// operations, and the other way round; the operations do what moat.Files
// says, inside the guest.
func TestSessionFiles(t *testing.T) {
	parallel(t)
	sb := shared(t)
	ss := newSession(t, sb)
	ctx := context.Background()
	if out := runOK(t, ss, "import os\nprint(os.getcwd())\nopen('a.txt', 'w').write('from run 1')\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('deep')\n"); out != "/work\n" {
		t.Errorf("the run's working directory: %q, want /work", out)
	}
	if out := runOK(t, ss, "print(open('a.txt').read())"); out != "from run 1\n" {
		t.Errorf("the second run reads %q, want the first run's file", out)
	}
	if got := readAll(t, ss, "d/e/f"); got != "deep" {
		t.Errorf("ReadFile d/e/f = %q", got)
	}
	big := strings.Repeat("0123456789", 300000) // 3 MB: several chunks each way
	if err := ss.WriteFile(ctx, "in/big.txt", strings.NewReader(big)); err != nil {
		t.Fatal(err)
	}
	if out := runOK(t, ss, "import hashlib, os\nb = open('in/big.txt', 'rb').read()\nprint(len(b), os.stat('in/big.txt').st_uid, os.getuid())\nopen('out.bin', 'wb').write(b[::-1])\n"); !strings.HasPrefix(out, "3000000 ") {
		t.Errorf("the run sees the host's file as %q", out)
	} else if f := strings.Fields(out); f[1] != f[2] {
		t.Errorf("the host's file belongs to uid %s, the run is uid %s", f[1], f[2])
	}
	rev := []byte(big)
	slices.Reverse(rev)
	if got := readAll(t, ss, "out.bin"); got != string(rev) {
		t.Errorf("ReadFile out.bin: %d bytes, not the run's %d", len(got), len(rev))
	}
	if err := ss.Mkdir(ctx, "m/n"); err != nil {
		t.Fatal(err)
	}
	if err := ss.Rename(ctx, "a.txt", "m/n/a.txt"); err != nil {
		t.Fatal(err)
	}
	fi, err := ss.Stat(ctx, "m/n/a.txt")
	if err != nil || fi.Size != int64(len("from run 1")) || fi.IsDir || fi.Name != "m/n/a.txt" {
		t.Errorf("Stat m/n/a.txt = %+v, %v", fi, err)
	}
	if err := ss.RemoveFile(ctx, "d/e/f"); err != nil {
		t.Fatal(err)
	}
	if _, err := ss.Stat(ctx, "d/e/f"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Stat of a removed file: %v, want ErrNotExist", err)
	}
	list, err := ss.ListFiles(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range list {
		names = append(names, f.Name)
	}
	sort.Strings(names)
	want := []string{"d", "d/e", "in", "in/big.txt", "m", "m/n", "m/n/a.txt", "out.bin"}
	if !slices.Equal(names, want) {
		t.Errorf("ListFiles = %q, want %q", names, want)
	}
	if out := runOK(t, ss, "print(open('m/n/a.txt').read(), __import__('os').path.exists('d/e/f'))"); out != "from run 1 False\n" {
		t.Errorf("the run after the file operations sees %q", out)
	}
}

// No file operation follows a link the code planted, to the guest's own
// files or within the directory.
func TestSessionFilesLinks(t *testing.T) {
	parallel(t)
	sb := shared(t)
	ss := newSession(t, sb)
	ctx := context.Background()
	runOK(t, ss, "import os\nos.symlink('/etc', 'etc')\nos.symlink('/etc/passwd', 'passwd')\nos.mkdir('d')\nos.symlink('d', 'dl')\nos.mkfifo('fifo')\n")
	for _, name := range []string{"passwd", "etc/passwd", "dl/x"} {
		if _, err := ss.ReadFile(ctx, name); !errors.Is(err, moat.ErrInvalid) && !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("ReadFile %s through a link: %v, want ErrInvalid", name, err)
		}
	}
	if _, err := ss.ReadFile(ctx, "fifo"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ReadFile of a FIFO: %v, want ErrInvalid", err)
	}
	if err := ss.WriteFile(ctx, "etc/planted", strings.NewReader("x")); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("WriteFile through a link: %v, want ErrInvalid", err)
	}
	if err := ss.WriteFile(ctx, "dl/x", strings.NewReader("x")); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("WriteFile through a link inside: %v, want ErrInvalid", err)
	}
	fi, err := ss.Stat(ctx, "passwd")
	if err != nil || fi.Mode&fs.ModeSymlink == 0 {
		t.Errorf("Stat of a link: %+v, %v; want the link itself", fi, err)
	}
	// Replacing the link writes a file in its place, not through it.
	if err := ss.WriteFile(ctx, "passwd", strings.NewReader("mine")); err != nil {
		t.Fatal(err)
	}
	if out := runOK(t, ss, "import os\nprint(os.path.islink('passwd'), open('passwd').read(), open('/etc/passwd').read().startswith('root:'))"); out != "False mine True\n" {
		t.Errorf("after writing over the link: %q", out)
	}
}

// Each run gets the run limits and a limit ends the run, not the session;
// nothing of a run outlives it; the session's files stay.
func TestSessionRunLimits(t *testing.T) {
	parallel(t)
	sb := open(t, requireVMs(t), moat.Limits{WallTime: moat.Duration(8 * time.Second), Memory: 128 * moat.MiB, Pids: 32})
	ss := newSession(t, sb)
	runOK(t, ss, "open('keep', 'w').write('kept')")

	res := runIn(t, ss, "b = bytearray(400 << 20)\nprint('allocated')")
	if res.Reason != moat.ReasonMemory {
		t.Errorf("a run over the memory limit: reason %q, exit %d, stderr %.300s", res.Reason, res.ExitCode, res.Stderr)
	}
	res = runIn(t, ss, "import os, time\npids = []\nwhile True:\n    pids.append(os.fork())\n    if pids[-1] == 0:\n        time.sleep(60)\n")
	if res.Reason != moat.ReasonPids {
		t.Errorf("a fork flood: reason %q, exit %d, stderr %.300s", res.Reason, res.ExitCode, res.Stderr)
	}
	// A run that leaves a process behind, in a session of its own, and
	// then times out.
	res = runIn(t, ss, "import os, time, subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\nopen('marker', 'w').write(str(os.getpid()))\nwhile True:\n    pass\n")
	if res.Reason != moat.ReasonTimeout || res.Signal != "SIGKILL" {
		t.Errorf("a run past the wall time: reason %q, signal %q", res.Reason, res.Signal)
	}
	out := runOK(t, ss, `import os
mine = os.getpid()
others = []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) != mine:
        try:
            others.append(open('/proc/%s/cmdline' % p).read().replace('\0', ' '))
        except OSError:
            pass
print(open('keep').read(), os.path.exists('marker'), others)
`)
	if out != "kept True []\n" {
		t.Errorf("the run after a timeout sees %q; want the files and no process of an earlier run", out)
	}
}

// Between runs the VM is paused; the next run resumes it.
func TestSessionPausedBetweenRuns(t *testing.T) {
	parallel(t)
	sb := shared(t)
	ss := newSession(t, sb)
	vs := vmOf(t, ss)
	status := func() string {
		st, err := vs.vm.(*qemuVM).mon.status(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	if st := status(); st != "paused" {
		t.Errorf("a new session's VM is %s, want paused", st)
	}
	runOK(t, ss, "print(1)")
	deadline := time.Now().Add(idleGrace + 5*time.Second)
	for status() != "paused" {
		if time.Now().After(deadline) {
			t.Fatalf("the VM is %s after the run, want paused", status())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if out := runOK(t, ss, "print(2)"); out != "2\n" {
		t.Errorf("the run after a pause: %q", out)
	}
	// A file operation between runs resumes the VM and pauses it again.
	if err := ss.WriteFile(context.Background(), "x", strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
}

// Two sessions share no file.
func TestSessionsApart(t *testing.T) {
	parallel(t)
	sb := shared(t)
	a, b := newSession(t, sb), newSession(t, sb)
	runOK(t, a, "open('only-a', 'w').write('a')")
	if err := a.WriteFile(context.Background(), "only-a-too", strings.NewReader("a")); err != nil {
		t.Fatal(err)
	}
	if out := runOK(t, b, "import os\nprint(sorted(os.listdir('.')))"); out != "[]\n" {
		t.Errorf("session b sees %q", out)
	}
	if _, err := b.ReadFile(context.Background(), "only-a"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("session b reads a's file: %v", err)
	}
	if l, err := b.ListFiles(context.Background()); err != nil || len(l) != 0 {
		t.Errorf("session b lists %v, %v", l, err)
	}
}

// Close kills the session's VM; later runs fail with ErrClosed.
func TestSessionClose(t *testing.T) {
	sb := open(t, requireVMs(t), moat.Limits{})
	ss := newSession(t, sb)
	runOK(t, ss, "print(1)")
	pid := vmOf(t, ss).vm.Pid()
	if err := ss.Close(); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Kill(pid, 0); err == nil {
		t.Errorf("the session's QEMU (pid %d) is alive after Close", pid)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Run after Close: %v, want ErrClosed", err)
	}
	if err := ss.Close(); err != nil {
		t.Errorf("a second Close: %v", err)
	}
	sb.Close()
	if left := leftovers(); len(left) > 0 {
		t.Errorf("VMs left after Close: %v", left)
	}
}

// A live interpreter keeps its variables; a process a run starts does not
// outlive the run; a run that ends the interpreter (a timeout, os._exit)
// makes the next run's a fresh one, with the files kept and notes saying so.
func TestSessionInterpreter(t *testing.T) {
	parallel(t)
	sb := open(t, requireVMs(t), moat.Limits{WallTime: moat.Duration(8 * time.Second)})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ss, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	mentions := func(res *moat.Result) bool {
		return slices.ContainsFunc(res.Notes, func(n string) bool { return strings.Contains(n, "interpreter") })
	}
	res := runIn(t, ss, "import os, subprocess\nx = 41\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\nopen('f', 'w').write('kept')\n")
	if res.ExitCode != 0 || mentions(res) {
		t.Fatalf("the first run: exit %d, notes %q, stderr %s", res.ExitCode, res.Notes, res.Stderr)
	}
	out := runOK(t, ss, `import os
def state(p):
    return open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[0]
# A zombie is dead: the interpreter, its parent, reaps it when it likes.
others = [open('/proc/%s/cmdline' % p).read() for p in os.listdir('/proc')
          if p.isdigit() and int(p) != os.getpid() and state(p) != 'Z']
print(x + 1, others)
`)
	if out != "42 []\n" {
		t.Errorf("the second run printed %q, want the variable kept and no process of the first run", out)
	}
	res = runIn(t, ss, "y = 1\nraise ValueError('bad')")
	if res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "ValueError: bad") || mentions(res) {
		t.Errorf("an exception: exit %d, stderr %q, notes %q", res.ExitCode, res.Stderr, res.Notes)
	}
	res = runIn(t, ss, "while True:\n    pass\n")
	if res.Reason != moat.ReasonTimeout || !mentions(res) {
		t.Errorf("a timeout: reason %q, notes %q; want timeout and a note that the interpreter ended", res.Reason, res.Notes)
	}
	res = runIn(t, ss, "print('x' in globals(), open('f').read())")
	if string(res.Stdout) != "False kept\n" || !mentions(res) {
		t.Errorf("after the timeout: %q, notes %q; want a fresh interpreter, the files kept, a note", res.Stdout, res.Notes)
	}
	res = runIn(t, ss, "z = 3\nimport os\nos._exit(4)")
	if res.ExitCode != 4 || !mentions(res) {
		t.Errorf("os._exit(4): exit %d, notes %q", res.ExitCode, res.Notes)
	}
	if out := runOK(t, ss, "print('z' in globals())"); out != "False\n" {
		t.Errorf("after os._exit: %q, want a fresh interpreter", out)
	}
	if res := runIn(t, ss, "w = 1"); mentions(res) {
		t.Errorf("a run of the same interpreter has notes %q", res.Notes)
	}
}

// The session's runs together get SessionCPUTime, counted on the host:
// the run that reaches it ends as a timeout and later runs fail with
// ErrSpent, while the files stay readable.
func TestSessionCPUBudget(t *testing.T) {
	cfg := requireVMs(t)
	cfg.SessionCPUTime = moat.Duration(3 * time.Second)
	sb := open(t, cfg, moat.Limits{CPUTime: moat.Duration(10 * time.Second), WallTime: moat.Duration(30 * time.Second)})
	ss := newSession(t, sb)
	burn := "import time\nopen('f', 'w').write('x')\nend = time.process_time() + 2\nwhile time.process_time() < end:\n    pass\nprint('done')\n"
	var spent *moat.Result
	for i := 0; i < 4 && spent == nil; i++ {
		res := runIn(t, ss, burn)
		if res.Reason == moat.ReasonTimeout {
			spent = res
		}
	}
	if spent == nil {
		t.Fatal("four runs of 2s of CPU each passed a budget of 3s")
	}
	if !slices.ContainsFunc(spent.Notes, func(n string) bool { return strings.Contains(n, "budget") }) {
		t.Errorf("the run that used the budget up has notes %q", spent.Notes)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrSpent) {
		t.Errorf("a run after the budget: %v, want ErrSpent", err)
	}
	if got := readAll(t, ss, "f"); got != "x" {
		t.Errorf("the files of a spent session: %q", got)
	}
}

// A moat killed with SIGKILL leaves no session VM: QEMU dies with it.
func TestSessionVMDiesWithMoat(t *testing.T) {
	requireVMs(t)
	if os.Getenv("MOAT_MICROVM_SESSION_CHILD") == "1" {
		t.Skip("the child's own run")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestSessionChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), "MOAT_MICROVM_SESSION_CHILD=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	sc := bufio.NewScanner(out)
	pid := 0
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "session-vm-pid "); ok {
			pid, _ = strconv.Atoi(p)
			break
		}
	}
	if pid == 0 {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatal("the child made no session")
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("the session's QEMU (pid %d) outlived its moat", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestSessionChild is the moat that TestSessionVMDiesWithMoat kills.
func TestSessionChild(t *testing.T) {
	if os.Getenv("MOAT_MICROVM_SESSION_CHILD") != "1" {
		t.Skip("run by TestSessionVMDiesWithMoat")
	}
	sb := open(t, requireVMs(t), moat.Limits{})
	ss := newSession(t, sb)
	runOK(t, ss, "print(1)")
	fmt.Printf("session-vm-pid %d\n", vmOf(t, ss).vm.Pid())
	time.Sleep(time.Minute)
}

// The figures for the report: a run of print(1) in a session against a
// one-shot run, each the median of five, in one sandbox; and what
// NewSession took, its VM from the pool or not.
func TestSessionLatency(t *testing.T) {
	sb := open(t, requireVMs(t), moat.Limits{})
	made := func(opts moat.SessionOptions) (moat.Session, time.Duration) {
		start := time.Now()
		ss, err := sb.NewSession(context.Background(), opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ss.Close() })
		return ss, time.Since(start)
	}
	ss, plainMade := made(moat.SessionOptions{})
	runOK(t, ss, "print(0)")
	// As a caller between runs: the pool refills after a one-shot run
	// (about a second under TCG), a session's VM pauses once its agent is
	// idle.
	refilled := func() { time.Sleep(time.Second) }
	paused := func(ss moat.Session) func() {
		vs := vmOf(t, ss)
		return func() {
			for deadline := time.Now().Add(idleGrace + 5*time.Second); ; time.Sleep(10 * time.Millisecond) {
				vs.mu.Lock()
				p := vs.paused
				vs.mu.Unlock()
				if p {
					return
				}
				if time.Now().After(deadline) {
					t.Fatal("the session's VM did not pause after its run")
				}
			}
		}
	}
	median := func(settle func(), run func()) time.Duration {
		var d []time.Duration
		for range 5 {
			settle()
			start := time.Now()
			run()
			d = append(d, time.Since(start))
		}
		slices.Sort(d)
		return d[2]
	}
	refilled()
	is, interpMade := made(moat.SessionOptions{Interpreter: true})
	runOK(t, is, "print(0)")
	oneShot := median(refilled, func() { run(t, sb, "print(1)") })
	session := median(paused(ss), func() { runOK(t, ss, "print(1)") })
	interp := median(paused(is), func() { runOK(t, is, "print(1)") })
	t.Logf("accel %s: print(1), median of 5: one-shot %v, session %v, session with an interpreter %v", sb.Accel(), oneShot, session, interp)
	t.Logf("NewSession: plain %v (%s), interpreter %v (%s)", plainMade, vmOf(t, ss).how, interpMade, vmOf(t, is).how)
}
