package container_test

import (
	"context"
	"errors"
	"fmt"
	"os"
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
	"github.com/moatsandbox/moat/internal/engine"
)

// pooled waits until the Sandbox of this process keeps exactly one
// container ahead of runs, running (no run in progress), and returns it.
func pooled(t testing.TB, cli *client.Client) container.InspectResponse {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute)
	for {
		list, err := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(
			filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(os.Getpid())),
			filters.Arg("label", moatcontainer.LabelSandbox+"=1"),
		)})
		if err != nil {
			t.Fatal(err)
		}
		if len(list) == 1 && list[0].State == "running" {
			ins, err := cli.ContainerInspect(ctx, list[0].ID)
			if err == nil && ins.State != nil && ins.State.Pid != 0 {
				return ins
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no container running ahead of runs after a minute: %d of this process", len(list))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitingPython returns the host pid of the python3 that the container
// whose init is pid runs, once it is blocked reading fd 0 (its code).
func waitingPython(t testing.TB, init int) int {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	last := ""
	for time.Now().Before(deadline) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", init, init))
		if err != nil {
			t.Fatalf("the children of the container's init: %v", err)
		}
		kids := strings.Fields(string(b))
		if len(kids) == 1 {
			py, _ := strconv.Atoi(kids[0])
			// /proc/PID/syscall: the number of the syscall it is blocked in,
			// then its arguments. read(2) is 0 on amd64; fd 0 is 0x0.
			sc, err := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", py))
			if err == nil {
				f := strings.Fields(string(sc))
				last = string(sc)
				if len(f) > 1 && f[0] == "0" && f[1] == "0x0" {
					return py
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no python3 of the container blocked reading its stdin within 30s (last syscall %q)", last)
	return 0
}

func procField(t *testing.T, pid int, key string) string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, key+":"); ok {
			return strings.Join(strings.Fields(v), " ")
		}
	}
	t.Fatalf("no %s in /proc/%d/status", key, pid)
	return ""
}

// TestPooledPythonWaits: the container kept ahead of runs already runs its
// python3, under every restriction of a run (its own uid, no capability,
// no-new-privileges, seccomp), blocked reading its code from stdin; a run
// takes that container and nothing more is started for it; and the time
// it waited in the pool, longer than the wall time limit, is not counted
// against the run.
func TestPooledPythonWaits(t *testing.T) {
	needEngine(t)
	if os.Geteuid() != 0 {
		t.Skip("reading another uid's /proc/PID/syscall needs root")
	}
	wall := 2 * time.Second
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: 1, Limits: moat.Limits{WallTime: moat.Duration(wall)}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	cli := dockerClient(t)
	ins := pooled(t, cli)
	py := waitingPython(t, ins.State.Pid)
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", py))
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00"); len(got) != 2 || !strings.HasSuffix(got[0], "python3") || got[1] != "-" {
		t.Errorf("the pooled container's process: %q, want python3 -", got)
	}
	uid, _, _ := strings.Cut(ins.Config.User, ":")
	for key, want := range map[string]string{
		"Uid":        strings.Repeat(uid+" ", 3) + uid,
		"Gid":        strings.Repeat(uid+" ", 3) + uid,
		"CapEff":     "0000000000000000",
		"CapPrm":     "0000000000000000",
		"CapBnd":     "0000000000000000",
		"NoNewPrivs": "1",
		"Seccomp":    "2",
	} {
		if got := procField(t, py, key); got != want {
			t.Errorf("the waiting python3's %s: %q, want %q", key, got, want)
		}
	}
	if ins.HostConfig == nil || !ins.HostConfig.ReadonlyRootfs || ins.HostConfig.NetworkMode != "none" || ins.HostConfig.Memory == 0 ||
		ins.HostConfig.PidsLimit == nil || *ins.HostConfig.PidsLimit == 0 {
		t.Errorf("the pooled container's host config lacks a restriction: %+v", ins.HostConfig)
	}
	// The pool's wait outlasts the wall time limit.
	started, err := time.Parse(time.RFC3339Nano, ins.State.StartedAt)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Until(started.Add(wall + wall/2)))
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
	if err != nil || res.ExitCode != 0 || res.Reason != "" || string(res.Stdout) != "1\n" {
		t.Fatalf("a run from a container that waited past the wall time: %+v, %v; want 1, exit 0, no reason", res, err)
	}
	// The run took the pooled container, which goes with it: its
	// removal finishes after the run returns, by the sandbox's Close.
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.ContainerInspect(context.Background(), ins.ID); err == nil {
		t.Errorf("the pooled container %s is still there after the run that should have taken it", ins.ID[:12])
	}
}

// TestEachRunItsOwnPython: every run has a python3 of its own, so its
// string hash seed and its randomness differ from every other run's.
func TestEachRunItsOwnPython(t *testing.T) {
	needEngine(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	seen := map[string]bool{}
	for i := range 4 {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(
			"import os, random, sys\nprint(sys.flags.hash_randomization, hash('moat'), random.random(), os.urandom(8).hex(), os.getpid())")})
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("run %d: %+v, %v", i, res, err)
		}
		f := strings.Fields(string(res.Stdout))
		if len(f) != 5 || f[0] != "1" {
			t.Fatalf("run %d printed %q, want hash randomization on and four values", i, res.Stdout)
		}
		for j, v := range f[1:4] {
			k := strconv.Itoa(j) + v
			if seen[k] {
				t.Errorf("run %d repeats value %d (%s) of an earlier run: %q", i, j, v, res.Stdout)
			}
			seen[k] = true
		}
	}
}

// TestRunsAsPython3Would: the code runs as `python3 -` runs what it reads
// from stdin, with nothing of moat's in between: its globals, sys.argv and
// sys.path[0], a traceback without frames of moat's, SystemExit, a
// SyntaxError as python3 prints it, and its own stdin at its end.
func TestRunsAsPython3Would(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	for _, tc := range []struct {
		name, code     string
		exit           int
		stdout, stderr string
	}{
		{"main", `import sys; print(sys.argv, repr(sys.path[0]), __name__, sorted(globals()))`, 0,
			"['-'] '' __main__ ['__annotations__', '__builtins__', '__cached__', '__doc__', '__file__', '__loader__', '__name__', '__package__', '__spec__', 'sys']\n", ""},
		{"traceback", "def f():\n    raise ValueError('boom')\nf()\n", 1, "",
			"Traceback (most recent call last):\n  File \"<stdin>\", line 3, in <module>\n  File \"<stdin>\", line 2, in f\nValueError: boom\n"},
		{"exit code", "raise SystemExit(3)", 3, "", ""},
		{"exit text", "raise SystemExit('bye')", 1, "", "bye\n"},
		{"syntax", "x = (", 1, "", "  File \"<stdin>\", line 1\n    x = (\n        ^\nSyntaxError: '(' was never closed\n"},
		{"stdin", "import sys; print(repr(sys.stdin.read()))", 0, "''\n", ""},
	} {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(tc.code)})
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if res.ExitCode != tc.exit || string(res.Stdout) != tc.stdout || string(res.Stderr) != tc.stderr {
			t.Errorf("%s: exit %d, stdout %q, stderr %q; want exit %d, stdout %q, stderr %q",
				tc.name, res.ExitCode, res.Stdout, res.Stderr, tc.exit, tc.stdout, tc.stderr)
		}
	}
}

// TestStalePooledContainer: a container that died while it waited for its
// run (its python3 killed, the container killed) is found at Start, which
// writes no code and fails wrapping engine.ErrStale; Discard removes it;
// and a run whose pooled container died still succeeds, on a fresh one.
func TestStalePooledContainer(t *testing.T) {
	needEngine(t)
	if os.Geteuid() != 0 {
		t.Skip("killing a container's python3 from the host needs root")
	}
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	cli := dockerClient(t)
	ctx := context.Background()
	gone := func(id string) bool {
		ins, err := cli.ContainerInspect(ctx, id)
		return err != nil || ins.State == nil || !ins.State.Running
	}
	for _, how := range []string{"python3 killed", "container killed"} {
		p, err := moatcontainer.Prepare(ctx, sb)
		if err != nil {
			t.Fatal(err)
		}
		ins, err := cli.ContainerInspect(ctx, p.ID())
		if err != nil {
			t.Fatal(err)
		}
		switch how {
		case "python3 killed":
			if err := syscall.Kill(waitingPython(t, ins.State.Pid), syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
		default:
			if err := cli.ContainerKill(ctx, p.ID(), "KILL"); err != nil {
				t.Fatal(err)
			}
		}
		for deadline := time.Now().Add(30 * time.Second); !gone(p.ID()); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the container still runs after 30s", how)
			}
		}
		err = p.Start(ctx, []byte("print(1)"))
		if !errors.Is(err, engine.ErrStale) {
			t.Errorf("%s: Start: %v, want an error wrapping engine.ErrStale", how, err)
		}
		p.Discard()
		if _, err := cli.ContainerInspect(ctx, p.ID()); err == nil {
			t.Errorf("%s: the stale container %s is still there after Discard", how, p.ID()[:12])
		}
	}

	// Through the engine: the pooled container dies, the run retries.
	ins := pooled(t, cli)
	if err := syscall.Kill(waitingPython(t, ins.State.Pid), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); !gone(ins.ID); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the pooled container still runs 30s after its python3 was killed")
		}
	}
	res, err := sb.Run(ctx, moat.Request{Code: []byte("print(1)")})
	if err != nil || res.ExitCode != 0 || res.Signal != "" || string(res.Stdout) != "1\n" {
		t.Errorf("a run whose pooled container had died: %+v, %v; want it run on a fresh one: 1, exit 0", res, err)
	}
	if _, err := cli.ContainerInspect(ctx, ins.ID); err == nil {
		t.Errorf("the dead pooled container %s is still there after the run", ins.ID[:12])
	}
}

// BenchmarkRunWarm times print(1) through the level from a container whose
// python3 waits for its code, the pool's refill left out of the timing
// (BenchmarkRun, back to back, counts the runs that find the pool still
// refilling). It needs root to see that the python3 waits.
func BenchmarkRunWarm(b *testing.B) {
	if err := prepareEngine(); err != nil {
		b.Skip(err)
	}
	if os.Geteuid() != 0 {
		b.Skip("seeing that the pooled python3 waits needs root")
	}
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: 1})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		b.Fatal(err)
	}
	defer cli.Close()
	for b.Loop() {
		b.StopTimer()
		waitingPython(b, pooled(b, cli).State.Pid)
		b.StartTimer()
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatal(res, err)
		}
	}
}

// TestRemovalAfterRun: a run's container is removed after the run has
// returned, but nothing of it runs by then: right after Run, every
// container this process made is exited (the pool is off, so they are the
// runs'), and after Close none is left.
func TestRemovalAfterRun(t *testing.T) {
	needEngine(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := context.Background()
	mine := filters.NewArgs(filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(os.Getpid())))
	for range 3 {
		// The code leaves a process behind: it too is gone with the run.
		res, err := sb.Run(ctx, moat.Request{Code: []byte("import subprocess\nsubprocess.Popen(['sleep', '60'])\nprint(1)")})
		if err != nil || string(res.Stdout) != "1\n" {
			t.Fatalf("%+v %v", res, err)
		}
		list, err := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: mine})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range list {
			if c.State == "running" {
				t.Errorf("container %s is %s after its run returned", c.ID[:12], c.State)
			}
		}
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if left := leftovers(); len(left) > 0 {
		t.Errorf("left after Close: %v", left)
	}
}
