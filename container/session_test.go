package container_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
)

// sessionHelperEnv makes the test binary a moat process that makes a
// session, runs once in it, says so and waits to be killed (see
// TestSessionOfAKilledMoatIsReaped).
const sessionHelperEnv = "MOAT_CONTAINER_SESSION_HELPER"

// With "interp", the session keeps an interpreter, which the helper leaves
// frozen in its own cgroup, as a moat killed during a file operation
// between runs would.
func init() {
	mode := os.Getenv(sessionHelperEnv)
	if mode == "" {
		return
	}
	fail := func(err error) {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: -1})
	if err != nil {
		fail(err)
	}
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: mode == "interp"})
	if err != nil {
		fail(err)
	}
	res, err := ss.Run(context.Background(), moat.Request{Code: []byte("open('kept', 'w').write('x')\nprint('ready')")})
	if err != nil {
		fail(err)
	}
	if mode == "interp" {
		cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
		if err != nil {
			fail(err)
		}
		list, err := cli.ContainerList(context.Background(), container.ListOptions{All: true, Filters: filters.NewArgs(
			filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(os.Getpid())))})
		if err != nil || len(list) != 1 {
			fail(fmt.Errorf("the session's container: %v %v", list, err))
		}
		id := list[0].ID
		err = os.WriteFile("/sys/fs/cgroup/freezer/docker/"+id+"/moat-interp/freezer.state", []byte("FROZEN"), 0)
		for _, d := range []string{"/sys/fs/cgroup/docker/" + id, "/sys/fs/cgroup/system.slice/docker-" + id + ".scope"} {
			if err != nil {
				err = os.WriteFile(d+"/moat-interp/cgroup.freeze", []byte("1"), 0)
			}
		}
		if err != nil {
			fail(err)
		}
	}
	os.Stdout.Write(res.Stdout)
	time.Sleep(time.Minute)
	os.Exit(1)
}

func dockerClient(t *testing.T) *client.Client {
	t.Helper()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// sessionContainers lists the session containers of moat process pid.
func sessionContainers(t *testing.T, cli *client.Client, pid int) []container.Summary {
	t.Helper()
	list, err := cli.ContainerList(context.Background(), container.ListOptions{All: true, Filters: filters.NewArgs(
		filters.Arg("label", moatcontainer.LabelSession+"=1"),
		filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(pid)),
	)})
	if err != nil {
		t.Fatal(err)
	}
	return list
}

// frozen reports whether the cgroup of container id is frozen, as the host
// sees it (v1 freezer.state, or v2 cgroup.events).
func frozen(t *testing.T, id string) bool {
	t.Helper()
	if b, err := os.ReadFile("/sys/fs/cgroup/freezer/docker/" + id + "/freezer.state"); err == nil {
		return strings.TrimSpace(string(b)) == "FROZEN"
	}
	for _, d := range []string{"/sys/fs/cgroup/docker/" + id, "/sys/fs/cgroup/system.slice/docker-" + id + ".scope"} {
		if b, err := os.ReadFile(d + "/cgroup.events"); err == nil {
			return strings.Contains(string(b), "frozen 1")
		}
	}
	t.Fatalf("no freezer cgroup for container %s", id)
	return false
}

func newSession(t *testing.T, sb moat.Sandbox) moat.Session {
	t.Helper()
	ss, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	return ss
}

func run(t *testing.T, ss moat.Session, code string) *moat.Result {
	t.Helper()
	res, err := ss.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("run %q: %v", code, err)
	}
	return res
}

// TestSessionRunLimits: each run of a session gets the run limits, and a
// run that hits one (CPU time, wall time, memory, processes, output) ends
// with its reason while the session goes on, its files kept.
func TestSessionRunLimits(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{CPUTime: moat.Duration(time.Second), WallTime: moat.Duration(4 * time.Second),
		Memory: 128 * moat.MiB, Pids: 32, Output: 64 * moat.KiB})
	defer sb.Close()
	ss := newSession(t, sb)
	run(t, ss, "open('kept', 'w').write('still here')")
	for _, c := range []struct {
		name, code string
		reason     moat.Reason
	}{
		{"cpu", "while True: pass", moat.ReasonTimeout},
		{"wall", "import time\ntime.sleep(60)", moat.ReasonTimeout},
		{"memory", "b = []\nwhile True: b.append(bytearray(16 << 20))", moat.ReasonMemory},
		{"pids", "import os, time\nfor _ in range(64):\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)", moat.ReasonPids},
		{"output", "while True: print('x' * 1000)", moat.ReasonOutput},
		{"signal", "import os\nos.kill(os.getpid(), 11)", moat.ReasonSignal},
	} {
		res := run(t, ss, c.code)
		if res.Reason != c.reason {
			t.Errorf("%s: reason %q (exit %d, stderr %q), want %q", c.name, res.Reason, res.ExitCode, res.Stderr, c.reason)
		}
		// The session goes on, with its files, and the next run has the
		// whole of each limit again: it forks as many processes as a
		// fresh run may.
		after := run(t, ss, `import os
pids = []
for _ in range(20):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    pids.append(pid)
for p in pids:
    os.waitpid(p, 0)
print(open('kept').read(), len(pids))`)
		if got := strings.TrimSpace(string(after.Stdout)); got != "still here 20" || after.Reason != "" {
			t.Errorf("after %s: %q %q (reason %q), want the file and 20 forks", c.name, got, after.Stderr, after.Reason)
		}
	}
}

// TestSessionLeftoversDoNotRun: a process a run leaves behind (detached in
// a session of its own, writing the time to a file) is killed at its run's
// end: between runs the container is paused and holds nothing but its
// init, and the next run finds no tick written after the previous run
// returned, and no process but its own and the init.
func TestSessionLeftoversDoNotRun(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	ss := newSession(t, sb)
	cli := dockerClient(t)
	list := sessionContainers(t, cli, os.Getpid())
	if len(list) != 1 {
		t.Fatalf("%d session containers of this process, want 1", len(list))
	}
	id := list[0].ID
	res := run(t, ss, `import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            with open('tick', 'w') as f:
                f.write(repr(time.time()))
            time.sleep(0.01)
    os._exit(0)
time.sleep(0.3)
print(open('tick').read())`)
	ended := float64(time.Now().UnixNano()) / 1e9
	if res.ExitCode != 0 || len(res.Stdout) == 0 {
		t.Fatalf("inconclusive: the writer did not start: %+v", res)
	}
	if !frozen(t, id) {
		t.Error("between runs the session's container is not frozen")
	}
	top, err := cli.ContainerTop(context.Background(), id, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(top.Processes) != 1 {
		t.Errorf("between runs the session's container holds %d processes, want its init alone: %v", len(top.Processes), top.Processes)
	}
	time.Sleep(500 * time.Millisecond)
	res = run(t, ss, `import os
print(open('tick').read())
print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid())`)
	lines := strings.Split(strings.TrimSpace(string(res.Stdout)), "\n")
	if len(lines) != 2 {
		t.Fatalf("the second run printed %q (stderr %q)", res.Stdout, res.Stderr)
	}
	last, err := strconv.ParseFloat(lines[0], 64)
	if err != nil {
		t.Fatal(err)
	}
	if last > ended {
		t.Errorf("the leftover wrote at %.3f, after its run returned at %.3f", last, ended)
	}
	var pid int
	procs := strings.TrimSpace(lines[1])
	fmt.Sscanf(procs[strings.LastIndexByte(procs, ' ')+1:], "%d", &pid)
	if want := fmt.Sprintf("[1, %d] %d", pid, pid); procs != want {
		t.Errorf("the second run sees the processes %s, want the init's and its own (%s)", procs, want)
	}
}

// TestSessionsAreApart: two sessions of one sandbox have uids of their own
// and do not see each other's files.
func TestSessionsAreApart(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	a, b := newSession(t, sb), newSession(t, sb)
	run(t, a, "open('secret', 'w').write('a')")
	ra := run(t, a, "import os\nprint(os.getuid(), os.listdir('.'))")
	rb := run(t, b, "import os\nprint(os.getuid(), os.listdir('.'), [p for p in os.listdir('/proc') if p.isdigit()])")
	ua, _, _ := strings.Cut(string(ra.Stdout), " ")
	ub, rest, _ := strings.Cut(string(rb.Stdout), " ")
	if ua == ub {
		t.Errorf("two sessions share uid %s", ua)
	}
	if !strings.Contains(string(ra.Stdout), "'secret'") {
		t.Fatalf("inconclusive: session a does not see its own file: %q", ra.Stdout)
	}
	if strings.Contains(rest, "secret") {
		t.Errorf("session b sees a's file: %q", rb.Stdout)
	}
	if _, err := b.ReadFile(context.Background(), "secret"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("session b's ReadFile of a's file: %v, want ErrNotExist", err)
	}
	if err := b.WriteFile(context.Background(), "only-b", strings.NewReader("b")); err != nil {
		t.Fatal(err)
	}
	if list, err := a.ListFiles(context.Background()); err != nil || len(list) != 1 || list[0].Name != "secret" {
		t.Errorf("session a's files: %+v, %v; want its own alone", list, err)
	}
}

// TestSessionFiles: the file operations act in the session's working
// directory, between runs and from one run to the next, never through a
// link the code planted, and leave the container paused.
func TestSessionFiles(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{FileSize: moat.MiB})
	defer sb.Close()
	ss := newSession(t, sb)
	ctx := context.Background()
	if err := ss.WriteFile(ctx, "in/data.txt", strings.NewReader("from the host")); err != nil {
		t.Fatal(err)
	}
	res := run(t, ss, `import os
print(open('in/data.txt').read())
os.mkdir('out')
open('out/result', 'w').write('from the code')
os.symlink('/etc/passwd', 'link')`)
	if got := strings.TrimSpace(string(res.Stdout)); got != "from the host" {
		t.Errorf("the run read %q (stderr %q)", got, res.Stderr)
	}
	read := func(name string) (string, error) {
		rc, err := ss.ReadFile(ctx, name)
		if err != nil {
			return "", err
		}
		defer rc.Close()
		b, err := io.ReadAll(rc)
		return string(b), err
	}
	if got, err := read("out/result"); err != nil || got != "from the code" {
		t.Errorf("ReadFile of the run's file: %q, %v", got, err)
	}
	if _, err := read("link"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ReadFile through a planted link: %v, want ErrInvalid", err)
	}
	if err := ss.Mkdir(ctx, "made/deep"); err != nil {
		t.Error(err)
	}
	if err := ss.Rename(ctx, "out/result", "made/deep/moved"); err != nil {
		t.Error(err)
	}
	if fi, err := ss.Stat(ctx, "made/deep/moved"); err != nil || fi.Size != int64(len("from the code")) || fi.IsDir {
		t.Errorf("Stat of the moved file: %+v, %v", fi, err)
	}
	if err := ss.RemoveFile(ctx, "link"); err != nil {
		t.Error(err)
	}
	if err := ss.WriteFile(ctx, "big", strings.NewReader(strings.Repeat("x", int(moat.MiB)+1))); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("WriteFile past the file size limit: %v, want ErrInvalid", err)
	}
	list, err := ss.ListFiles(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range list {
		names = append(names, f.Name)
	}
	slices.Sort(names)
	if want := []string{"in", "in/data.txt", "made", "made/deep", "made/deep/moved", "out"}; !slices.Equal(names, want) {
		t.Errorf("ListFiles: %v, want %v", names, want)
	}
	res = run(t, ss, "print(open('made/deep/moved').read())")
	if got := strings.TrimSpace(string(res.Stdout)); got != "from the code" {
		t.Errorf("the next run reads %q", got)
	}
	cli := dockerClient(t)
	list2 := sessionContainers(t, cli, os.Getpid())
	if len(list2) != 1 {
		t.Fatalf("%d session containers, want 1", len(list2))
	}
	if _, err := read("in/data.txt"); err != nil {
		t.Fatal(err)
	}
	if !frozen(t, list2[0].ID) {
		t.Error("after a file operation between runs the container is not frozen")
	}
}

// TestSessionCloseLeavesNothing: Close removes the session's container,
// as the engine sees it, and a run after Close fails with ErrClosed.
func TestSessionCloseLeavesNothing(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	cli := dockerClient(t)
	ss, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	run(t, ss, "print(1)")
	if n := len(sessionContainers(t, cli, os.Getpid())); n != 1 {
		t.Fatalf("inconclusive: %d session containers while the session is open, want 1", n)
	}
	if err := ss.Close(); err != nil {
		t.Fatal(err)
	}
	if left := sessionContainers(t, cli, os.Getpid()); len(left) != 0 {
		t.Errorf("after Close, session containers remain: %v", left)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Run after Close: %v, want ErrClosed", err)
	}
}

// TestSessionCloseDuringARun: Close while a run goes on ends the run and
// removes the container.
func TestSessionCloseDuringARun(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{WallTime: moat.Duration(time.Minute)})
	defer sb.Close()
	ss, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		_, err := ss.Run(context.Background(), moat.Request{Stdout: pw, Code: []byte("import time\nprint('running', flush=True)\ntime.sleep(60)")})
		pw.Close()
		done <- err
	}()
	if line, err := bufio.NewReader(pr).ReadString('\n'); line != "running\n" {
		t.Fatalf("the run did not start: %q %v", line, err)
	}
	go io.Copy(io.Discard, pr)
	t0 := time.Now()
	if err := ss.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the run did not end within 30s of Close")
	}
	t.Logf("the run ended %v after Close began", time.Since(t0))
	if left := sessionContainers(t, dockerClient(t), os.Getpid()); len(left) != 0 {
		t.Errorf("after Close, session containers remain: %v", left)
	}
}

// TestSessionOutlivesItsSandbox: a session belongs to its caller; closing
// the sandbox that made it neither closes it nor breaks it.
func TestSessionOutlivesItsSandbox(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	ss := newSession(t, sb)
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if res := run(t, ss, "print(2)"); strings.TrimSpace(string(res.Stdout)) != "2" {
		t.Errorf("a run after the sandbox closed: %+v", res)
	}
	if err := ss.Close(); err != nil {
		t.Errorf("Close after the sandbox closed: %v", err)
	}
	if left := sessionContainers(t, dockerClient(t), os.Getpid()); len(left) != 0 {
		t.Errorf("after Close, session containers remain: %v", left)
	}
}

// TestSessionOfAKilledMoatIsReaped: a moat killed -9 with a session open
// leaves its container behind, paused; the next New removes it, also when
// the session's interpreter was left frozen in its own cgroup (which the
// engine's kill cannot end).
func TestSessionOfAKilledMoatIsReaped(t *testing.T) {
	needEngine(t)
	for _, mode := range []string{"plain", "interp"} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), sessionHelperEnv+"="+mode)
			out, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer func() {
				cmd.Process.Kill()
				cmd.Wait()
			}()
			line, err := bufio.NewReader(out).ReadString('\n')
			if strings.TrimSpace(line) != "ready" {
				t.Fatalf("the helper: %q, %v", line, err)
			}
			cli := dockerClient(t)
			pid := cmd.Process.Pid
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			cmd.Wait()
			left := sessionContainers(t, cli, pid)
			if len(left) != 1 || !frozen(t, left[0].ID) {
				t.Fatalf("after kill -9 of the helper, its session containers: %+v; want one, frozen (else this test proves nothing)", left)
			}
			sb, err := moatcontainer.New(moatcontainer.Config{Warm: -1})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Close()
			if left := sessionContainers(t, cli, pid); len(left) != 0 {
				t.Errorf("after the next New, the killed moat's session container remains: %+v", left)
			}
		})
	}
}

// TestSessionCPUBudget: the session's container may use SessionCPUTime
// over its life; the run that reaches it ends with a timeout, and later
// runs fail with ErrSpent.
func TestSessionCPUBudget(t *testing.T) {
	needEngine(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: -1, SessionCPUTime: moat.Duration(1500 * time.Millisecond),
		Limits: moat.Limits{CPUTime: moat.Duration(time.Second), WallTime: moat.Duration(10 * time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	ss := newSession(t, sb)
	var reasons []moat.Reason
	for range 3 {
		res, err := ss.Run(context.Background(), moat.Request{Code: []byte("while True: pass")})
		if errors.Is(err, moat.ErrSpent) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		reasons = append(reasons, res.Reason)
	}
	if want := []moat.Reason{moat.ReasonTimeout, moat.ReasonTimeout}; !slices.Equal(reasons, want) {
		t.Errorf("busy runs until the budget is spent ended with %v, want %v and then ErrSpent", reasons, want)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("print(1)")}); !errors.Is(err, moat.ErrSpent) {
		t.Errorf("a run after the budget is spent: %v, want ErrSpent", err)
	}
}

func newInterpreter(t *testing.T, sb moat.Sandbox) moat.Session {
	t.Helper()
	ss, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	return ss
}

func hasNote(res *moat.Result, prefix string) bool {
	return slices.ContainsFunc(res.Notes, func(n string) bool { return strings.HasPrefix(n, prefix) })
}

// TestSessionInterpreter: with Interpreter, variables survive from one run
// to the next; an exit status, an exception and output without a final
// newline are the run's own and keep the interpreter; a process a run
// started is killed at its end while the interpreter lives on.
func TestSessionInterpreter(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	ss := newInterpreter(t, sb)
	run(t, ss, "import os\nx = 41\nfirst = os.getpid()")
	res := run(t, ss, "import os\nprint(x + 1, os.getpid() == first)")
	if got := strings.TrimSpace(string(res.Stdout)); got != "42 True" {
		t.Fatalf("the second run printed %q (stderr %q), want the first's variables: 42 True", got, res.Stderr)
	}
	res = run(t, ss, "import sys\nsys.stdout.write('no newline')\nsys.stderr.write('err')\nsys.exit(3)")
	if string(res.Stdout) != "no newline" || string(res.Stderr) != "err" || res.ExitCode != 3 || len(res.Notes) != 0 {
		t.Errorf("sys.exit(3): %q %q exit %d notes %v", res.Stdout, res.Stderr, res.ExitCode, res.Notes)
	}
	res = run(t, ss, "raise ValueError('boom')")
	if res.ExitCode != 1 || !strings.Contains(string(res.Stderr), "ValueError: boom") {
		t.Errorf("an exception: exit %d stderr %q", res.ExitCode, res.Stderr)
	}
	run(t, ss, "import subprocess\np = subprocess.Popen(['sleep', '100'])\nprint(p.pid)")
	// The killed child stays a zombie until the interpreter reaps it.
	res = run(t, ss, `import os
def live(p):
    try:
        return open('/proc/%s/stat' % p).read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False
print(x, sorted(int(p) for p in os.listdir('/proc') if p.isdigit() and live(p)) == sorted([1, os.getpid()]))`)
	if got := strings.TrimSpace(string(res.Stdout)); got != "41 True" {
		t.Errorf("after a run that left a child: %q (stderr %q), want the variables kept and no live process but the init and the interpreter", got, res.Stderr)
	}
}

// TestSessionInterpreterRestarts: a run that times out, or ends the
// interpreter itself, ends the interpreter and says so; the next run gets
// a fresh one, says so, and finds the files but not the variables.
func TestSessionInterpreterRestarts(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{WallTime: moat.Duration(2 * time.Second)})
	defer sb.Close()
	ss := newInterpreter(t, sb)
	for _, c := range []struct{ name, code string }{
		{"wall time", "import time\ntime.sleep(60)"},
		{"os._exit", "import os\nos._exit(5)"},
		{"cpu", "while True: pass"},
	} {
		run(t, ss, "x = 1\nopen('kept', 'w').write('k')")
		res := run(t, ss, c.code)
		if !hasNote(res, "interpreter ended by") {
			t.Errorf("%s: the run that ended the interpreter says %v", c.name, res.Notes)
		}
		if c.name == "os._exit" && res.ExitCode != 5 {
			t.Errorf("os._exit(5): exit %d", res.ExitCode)
		}
		res = run(t, ss, "print(open('kept').read())\nprint(x)")
		if !hasNote(res, "interpreter restarted") || !strings.Contains(string(res.Stderr), "NameError") || strings.TrimSpace(string(res.Stdout)) != "k" {
			t.Errorf("%s: the next run: %q %q notes %v; want the file, a NameError and the restart noted", c.name, res.Stdout, res.Stderr, res.Notes)
		}
	}
}

// TestSessionInterpreterFrozenBetweenRuns: a thread a run leaves in the
// interpreter does not run between runs, not even while a file operation
// has the container unpaused.
func TestSessionInterpreterFrozenBetweenRuns(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	ss := newInterpreter(t, sb)
	// Each tick replaces the file whole: a read never sees it empty,
	// between a truncation and a write.
	run(t, ss, `import os, threading, time
def tick():
    n = 0
    while True:
        n += 1
        with open('ticks.tmp', 'w') as f:
            f.write(str(n))
        os.replace('ticks.tmp', 'ticks')
        time.sleep(0.005)
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.2)`)
	ctx := context.Background()
	read := func() string {
		rc, err := ss.ReadFile(ctx, "ticks")
		if err != nil {
			t.Fatal(err)
		}
		defer rc.Close()
		b, _ := io.ReadAll(rc)
		return string(b)
	}
	first := read()
	for range 5 {
		if err := ss.WriteFile(ctx, "other", strings.NewReader("x")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if again := read(); again != first {
		t.Errorf("the thread ticked between runs: %s then %s", first, again)
	}
	res := run(t, ss, "import time\ntime.sleep(0.2)\nprint(open('ticks').read())")
	if n, _ := strconv.Atoi(strings.TrimSpace(string(res.Stdout))); n <= 0 || strconv.Itoa(n) == first {
		t.Errorf("inconclusive: the thread did not tick during the next run (%q, first %s)", res.Stdout, first)
	}
}

// BenchmarkSessionVsOneShot times print(1) as a one-shot run, as a
// session's run and as a run of a session's live interpreter, ten of each,
// interleaved, and reports the medians.
func BenchmarkSessionVsOneShot(b *testing.B) {
	if err := prepareEngine(); err != nil {
		b.Skip(err)
	}
	sb, err := moatcontainer.New(moatcontainer.Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	ctx := context.Background()
	ss, err := sb.NewSession(ctx, moat.SessionOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer ss.Close()
	si, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
	if err != nil {
		b.Fatal(err)
	}
	defer si.Close()
	req := moat.Request{Code: []byte("print(1)")}
	runs := []func(context.Context, moat.Request) (*moat.Result, error){sb.Run, ss.Run, si.Run}
	names := []string{"oneshot", "session", "interp"}
	for b.Loop() {
		times := make([][]time.Duration, len(runs))
		for range 10 {
			for i, run := range runs {
				t0 := time.Now()
				res, err := run(ctx, req)
				d := time.Since(t0)
				if err != nil || string(res.Stdout) != "1\n" {
					b.Fatal(res, err)
				}
				times[i] = append(times[i], d)
			}
		}
		for i, ts := range times {
			slices.Sort(ts)
			b.ReportMetric(float64((ts[4]+ts[5]).Microseconds())/2000, names[i]+"-median-ms")
		}
	}
}

// slowReader yields n chunks of size bytes, pausing between them.
type slowReader struct {
	n, size int
	pause   time.Duration
}

func (r *slowReader) Read(p []byte) (int, error) {
	if r.n == 0 {
		return 0, io.EOF
	}
	time.Sleep(r.pause)
	r.n--
	return copy(p, bytes.Repeat([]byte("x"), min(r.size, len(p)))), nil
}

// TestSessionFileOpOutlivesARunsEnd: a file operation in flight when a run
// ends is not killed with the run's processes (the end-of-run kill spares
// it), while what the run left running is.
func TestSessionFileOpOutlivesARunsEnd(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	ss := newSession(t, sb)
	ctx := context.Background()
	done := make(chan error, 1)
	go func() {
		done <- ss.WriteFile(ctx, "slow.bin", &slowReader{n: 30, size: 1000, pause: 50 * time.Millisecond})
	}()
	time.Sleep(300 * time.Millisecond) // the write's process is up
	for i := 0; i < 3; i++ {
		res := run(t, ss, `import subprocess; subprocess.Popen(["sleep", "60"]); print("ran")`)
		if strings.TrimSpace(string(res.Stdout)) != "ran" {
			t.Fatalf("run %d: %q %q", i, res.Stdout, res.Stderr)
		}
	}
	if err := <-done; err != nil {
		t.Fatalf("the write in flight across the runs' ends failed: %v", err)
	}
	res := run(t, ss, `import glob, os
print(os.path.getsize("slow.bin"))
n = 0
for f in glob.glob("/proc/[0-9]*/comm"):
    try:
        n += open(f).read().strip() == "sleep"
    except OSError:
        pass
print(n)`)
	got := strings.Fields(string(res.Stdout))
	if len(got) != 2 || got[0] != "30000" {
		t.Fatalf("after the write: %q %q", res.Stdout, res.Stderr)
	}
	if got[1] != "0" {
		t.Errorf("%s sleeps the runs started are still running", got[1])
	}
}
