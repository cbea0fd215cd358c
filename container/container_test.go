package container_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/attack"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/sandboxtest"
)

// helperEnv makes the test binary a moat process that starts a long run
// and waits to be killed (see TestKillMidRunLeavesNothing).
const helperEnv = "MOAT_CONTAINER_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		os.Exit(helperMain())
	}
	os.Exit(m.Run())
}

// helperMain starts a run that sleeps for a minute, says so on stdout, and
// blocks until it is killed.
func helperMain() int {
	sb, err := moatcontainer.New(moatcontainer.Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	res, err := sb.Run(context.Background(), moat.Request{
		Code:   []byte("import time\nprint('running', flush=True)\ntime.sleep(60)\n"),
		Stdout: os.Stdout,
	})
	fmt.Println("helper: the run ended, which it should not have:", res, err)
	return 1
}

var (
	engineOnce sync.Once
	engineErr  error
)

// needEngine skips t when no Docker engine answers, except in CI (CI=true),
// where the level must be tested and the test fails instead. When the
// engine answers but the image is missing, it builds the image (as root).
func needEngine(t *testing.T) {
	t.Helper()
	engineOnce.Do(func() { engineErr = prepareEngine() })
	if engineErr == nil {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("the container level cannot be tested, and CI must test it: %v", engineErr)
	}
	t.Skipf("skipping the container level: %v (run scripts/setup-docker.sh as root; in CI this fails)", engineErr)
}

func prepareEngine() error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		return err
	}
	defer cli.Close()
	pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
	defer pcancel()
	if _, err := cli.Ping(pctx); err != nil {
		return fmt.Errorf("no Docker engine answers: %w", err)
	}
	if st, err := moatcontainer.InspectImage(ctx, image.Config{}); err != nil || st.Present {
		return err
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("the image %s is not built and building it needs root", image.Config{}.Tag())
	}
	cfg := image.Config{Progress: os.Stderr}
	if _, _, err := image.BuildRootFS(ctx, cfg); err != nil {
		return err
	}
	_, err = moatcontainer.ImportImage(ctx, cfg)
	return err
}

func factory(t *testing.T, l moat.Limits) moat.Sandbox {
	sb, err := moatcontainer.New(moatcontainer.Config{Limits: l})
	if err != nil {
		t.Fatalf("container.New: %v", err)
	}
	return sb
}

func leftovers() []string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ids, err := moatcontainer.Leftovers(ctx)
	if err != nil {
		return []string{err.Error()}
	}
	return ids
}

func TestConformance(t *testing.T) {
	needEngine(t)
	sandboxtest.Run(t, factory, sandboxtest.Options{Leftovers: leftovers})
}

// TestHardeningFromInside runs a program that checks, from inside a run,
// every hardening item it can see.
func TestHardeningFromInside(t *testing.T) {
	needEngine(t)
	lim := moat.Limits{Disk: 8 * moat.MiB, Pids: 32, OpenFiles: 100, FileSize: 2 * moat.MiB}
	sb := factory(t, lim)
	defer sb.Close()
	t.Run("run", func(t *testing.T) { checkHardening(t, lim, sb.Run) })
	// A session's run, an exec in its container, has all of it too.
	ss, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	t.Run("session", func(t *testing.T) { checkHardening(t, lim, ss.Run) })
	si, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer si.Close()
	t.Run("interpreter", func(t *testing.T) { checkHardening(t, lim, si.Run) })
}

func checkHardening(t *testing.T, lim moat.Limits, run func(context.Context, moat.Request) (*moat.Result, error)) {
	res, err := run(context.Background(), moat.Request{Code: []byte(`
import json, os, resource, socket
r = {}
st = dict(l.split(':\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\t' in l)
r['uid'] = os.getuid(); r['gid'] = os.getgid()
r['capeff'] = st['CapEff']; r['capbnd'] = st['CapBnd']
r['nnp'] = st['NoNewPrivs']; r['seccomp'] = st['Seccomp']
r['nets'] = sorted(l.split(':')[0].strip() for l in open('/proc/self/net/dev').read().splitlines()[2:])
try:
    socket.create_connection(('1.1.1.1', 53), timeout=2); r['connect'] = 'ok'
except OSError as e:
    r['connect'] = e.errno
try:
    open('/usr/moat-test', 'w'); r['rootfs'] = 'writable'
except OSError as e:
    r['rootfs'] = e.errno
sizes = {}
for line in open('/proc/self/mounts'):
    dev, mnt, typ, opts = line.split()[:4]
    if mnt in ('/work', '/tmp', '/dev/shm'):
        s = os.statvfs(mnt); sizes[mnt] = [typ, s.f_blocks * s.f_frsize, 'noexec' in opts.split(',')]
r['mounts'] = sizes
r['sock'] = [p for p in ('/var/run/docker.sock', '/run/docker.sock') if os.path.exists(p)]
r['nofile'] = resource.getrlimit(resource.RLIMIT_NOFILE)
r['fsize'] = resource.getrlimit(resource.RLIMIT_FSIZE)
r['cpu'] = resource.getrlimit(resource.RLIMIT_CPU)
r['core'] = resource.getrlimit(resource.RLIMIT_CORE)
r['home'] = os.listdir('/home')
try:
    r['home'] += os.listdir('/root')
except PermissionError:
    pass
print(json.dumps(r))
`)})
	if err != nil {
		t.Fatal(err)
	}
	var r struct {
		UID, GID        int
		CapEff, CapBnd  string
		NNP, Seccomp    string
		Nets            []string
		Connect, Rootfs any
		Mounts          map[string][]any
		Sock            []string
		NoFile, FSize   []int64
		CPU             []int64
		Core            []int64
		Home            []string
	}
	if err := json.Unmarshal(res.Stdout, &r); err != nil {
		t.Fatalf("the probe's report does not parse (%v): stdout %q stderr %q", err, res.Stdout, res.Stderr)
	}
	t.Logf("report: %s", res.Stdout)
	check := func(ok bool, what string, got any) {
		t.Helper()
		if !ok {
			t.Errorf("%s: got %v", what, got)
		}
	}
	check(r.UID != 0 && r.GID != 0, "a non-root user", []int{r.UID, r.GID})
	check(r.CapEff == "0000000000000000" && r.CapBnd == "0000000000000000", "every capability dropped", r.CapEff+" "+r.CapBnd)
	check(r.NNP == "1", "no-new-privileges", r.NNP)
	check(r.Seccomp == "2", "a seccomp filter", r.Seccomp)
	check(len(r.Nets) == 1 && r.Nets[0] == "lo", "no network interface but lo", r.Nets)
	check(r.Connect == float64(syscall.EAFNOSUPPORT), "no AF_INET socket at all (EAFNOSUPPORT)", r.Connect)
	check(r.Rootfs == float64(syscall.EROFS), "a read-only root filesystem", r.Rootfs)
	var total float64
	for _, m := range []string{"/work", "/tmp", "/dev/shm"} {
		v := r.Mounts[m]
		check(len(v) == 3 && v[0] == "tmpfs" && v[2] == true, m+" is a noexec tmpfs", v)
		if len(v) == 3 {
			total += v[1].(float64)
		}
	}
	check(total > 0 && total <= float64(lim.Disk), fmt.Sprintf("the tmpfs sizes add up to at most the disk limit %d", lim.Disk), total)
	check(len(r.Sock) == 0, "no docker socket", r.Sock)
	check(len(r.NoFile) == 2 && r.NoFile[1] == int64(lim.OpenFiles), "nofile", r.NoFile)
	check(len(r.FSize) == 2 && r.FSize[1] == int64(lim.FileSize), "fsize", r.FSize)
	check(len(r.Core) == 2 && r.Core[1] == 0, "no core dumps", r.Core)
	cpu := int64(time.Duration(lim.WithDefaults().CPUTime).Seconds())
	check(len(r.CPU) == 2 && r.CPU[0] == cpu && r.CPU[1] == cpu+1, "the cpu rlimit", r.CPU)
	check(len(r.Home) == 0, "empty /root and /home", r.Home)
}

// TestKillMidRunLeavesNothing kills -9 a moat process in the middle of a
// run and checks that its container, left running, is gone after the next
// New.
func TestKillMidRunLeavesNothing(t *testing.T) {
	needEngine(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	defer func() {
		if !killed {
			cmd.Process.Kill()
		}
		cmd.Wait()
	}()
	// Wait until the run's code says it runs.
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	select {
	case l, ok := <-lines:
		if !ok || l != "running" {
			t.Fatalf("the helper did not start its run: %q", l)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the helper's run did not start within 60s")
	}
	pid := cmd.Process.Pid
	ctx := context.Background()
	// The run's container, and the one prepared ahead of the next run
	// (running too, its python3 waiting for code) once it is ready.
	before := ownedBy(t, ctx, pid)
	if n := running(before); n < 1 || n > 2 {
		t.Fatalf("the helper (pid %d) runs %d containers, want its run's and at most one prepared ahead: %v", pid, n, before)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed = true
	cmd.Wait()
	for range lines {
	}
	// The helper is dead and cannot clean up: its container still runs.
	if left := ownedBy(t, ctx, pid); running(left) < 1 {
		t.Fatalf("after kill -9 of the helper, its containers: %v; want its run's, still running (else this test proves nothing)", left)
	}

	sb, err := moatcontainer.New(moatcontainer.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if left := ownedBy(t, ctx, pid); len(left) != 0 {
		t.Errorf("after the next New, the killed moat's containers remain: %v", left)
	}
}

type summary struct{ ID, State string }

func running(s []summary) int {
	n := 0
	for _, c := range s {
		if c.State == "running" {
			n++
		}
	}
	return n
}

func ownedBy(t *testing.T, ctx context.Context, pid int) []summary {
	t.Helper()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	list, err := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(
		filters.Arg("label", moatcontainer.LabelSandbox+"=1"),
		filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(pid)),
	)})
	if err != nil {
		t.Fatal(err)
	}
	var s []summary
	for _, c := range list {
		s = append(s, summary{c.ID[:12], c.State})
	}
	return s
}

// TestCLIRun runs print(1) through the docker CLI with the level's flags.
func TestCLIRun(t *testing.T) {
	needEngine(t)
	sb := factory(t, moat.Limits{}).(*moatcontainer.Sandbox)
	cliArgs, err := sb.CLIArgs()
	sb.Close()
	if err != nil {
		t.Fatal(err)
	}
	args := strings.Join(cliArgs, " ")
	for _, want := range []string{"--network=none", "--read-only", "--cap-drop=ALL", "no-new-privileges", "--security-opt=seccomp=/", "--pids-limit=", "--log-driver=none", "--runtime="} {
		if !strings.Contains(args, want) {
			t.Errorf("CLIArgs lacks %s: %s", want, args)
		}
	}
	if err := moatcontainer.CLIRun(context.Background(), moatcontainer.Config{}); err != nil {
		t.Fatal(err)
	}
	if left := leftovers(); len(left) > 0 {
		t.Errorf("the CLI run left containers: %v", left)
	}
}

// TestCheck asks the doctor's question of a working engine.
func TestCheck(t *testing.T) {
	needEngine(t)
	a := moatcontainer.Check(context.Background(), moatcontainer.Config{})
	t.Logf("%+v", a)
	if !a.Available || a.Level != moat.LevelContainer {
		t.Errorf("Check on a prepared engine: %+v, want available", a)
	}
	joined := strings.Join(a.Details, "\n")
	for _, want := range []string{"engine: Docker", "runc", "November 2025", "image:", "seccomp profile: moat seccomp profile sha256:", "syscall names",
		"seccomp probe: in a container, socket(AF_VSOCK) EAFNOSUPPORT", "io_uring_setup EPERM", "uids: 2100065536-2100131071"} {
		if !strings.Contains(joined, want) {
			t.Errorf("Check's details lack %q:\n%s", want, joined)
		}
	}
}

// BenchmarkRun times print(1) through the level, for `go test -bench`.
func BenchmarkRun(b *testing.B) {
	if err := prepareEngine(); err != nil {
		b.Skip(err)
	}
	sb, err := moatcontainer.New(moatcontainer.Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	for b.Loop() {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatal(res, err)
		}
	}
}

// BenchmarkCLI times the same run through `docker run --rm -i`.
func BenchmarkCLI(b *testing.B) {
	if err := prepareEngine(); err != nil {
		b.Skip(err)
	}
	for b.Loop() {
		if err := moatcontainer.CLIRun(context.Background(), moatcontainer.Config{}); err != nil {
			b.Fatal(err)
		}
	}
}

// TestAttacks runs the six hostile programs at this level: each must be
// blocked.
func TestAttacks(t *testing.T) {
	needEngine(t)
	ctx := context.Background()
	env, err := attack.Plant(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close()
	forDrivers(t, func(t *testing.T, factory sandboxtest.Factory) {
		sb := factory(t, moat.Limits{WallTime: moat.Duration(5 * time.Second)})
		defer sb.Close()
		var outs []attack.Outcome
		for _, name := range attack.All {
			o := attack.Run(ctx, sb, env, name)
			outs = append(outs, o)
			if !o.Blocked {
				t.Errorf("attack %s: %s (%s): %s", name, o.Verdict, o.How, o.Detail)
			}
		}
		var b strings.Builder
		attack.Scoreboard(&b, outs)
		t.Logf("\n%s", b.String())
	})
}

// A shared object the run drops cannot be loaded (every writable place is
// noexec), and the result's notes say why; a run without it gets no note.
func TestNoexecNote(t *testing.T) {
	needEngine(t)
	forDrivers(t, testNoexecNote)
}

func testNoexecNote(t *testing.T, factory sandboxtest.Factory) {
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	const code = `import ctypes, ctypes.util, os, shutil
name = ctypes.util.find_library("z") or "libz.so.1"
path = next(d + "/" + name for d in ["/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"] if os.path.exists(d + "/" + name))
ctypes.CDLL(path)  # the image's own copy loads
shutil.copy(path, "dropped.so")
ctypes.CDLL("./dropped.so")`
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(res.Stderr), "failed to map segment from shared object") {
		t.Fatalf("the loader did not refuse the dropped .so: exit %d, stderr %q", res.ExitCode, res.Stderr)
	}
	if !strings.Contains(strings.Join(res.Notes, "\n"), "mounted noexec") {
		t.Errorf("notes %q: no note saying why", res.Notes)
	}
	res, err = sb.Run(context.Background(), moat.Request{Code: []byte("import sys; sys.exit('failed otherwise')")})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(strings.Join(res.Notes, "\n"), "mounted noexec") {
		t.Errorf("a run failing otherwise got the note: %q", res.Notes)
	}
}
