package gvisor_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
)

// ownersDir is where the level records its owner id; the test process's id
// there is its runs' prefix.
const ownersDir = "/run/moat/owners"

// self returns this process's owner id, the prefix of its runs' ids.
func self(t *testing.T) string {
	t.Helper()
	id, err := owner.Self(ownersDir)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// need skips t when this machine cannot run the level (no root, no runsc,
// no image), except under CI=true, where the level must be tested and t
// fails instead. scripts/setup-gvisor.sh installs what it needs.
func need(t *testing.T, cfg gvisor.Config) {
	t.Helper()
	a := gvisor.Check(context.Background(), cfg)
	if a.Available {
		return
	}
	msg := fmt.Sprintf("the gvisor level cannot run here: %s (%s)", a.Reason, a.Remedy)
	if os.Getenv("CI") == "true" {
		t.Fatal(msg + "; CI must test it: run scripts/setup-gvisor.sh first")
	}
	t.Skip(msg)
}

func newSandbox(t *testing.T, cfg gvisor.Config) *gvisor.Sandbox {
	t.Helper()
	sb, err := gvisor.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// concurrency is how many runs the conformance suite starts at once. Each
// gVisor sandbox is a sentry, a gofer and runsc (about 25 host threads and
// 20 MiB); twenty of them at once on two cores take a few seconds and pass
// here, so the suite's default stands.
const concurrency = 20

func TestConformance(t *testing.T) {
	need(t, gvisor.Config{})
	me := self(t)
	sandboxtest.Run(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		return newSandbox(t, gvisor.Config{Limits: l})
	}, sandboxtest.Options{
		Leftovers: func() []string { return leftovers(gvisor.DefaultStateDir, me) },
		Parallel:  concurrency,
	})
}

// leftovers lists what the runs of the moat process whose owner id is id
// could leave on the host: bundles and runsc state under stateDir, and
// cgroups.
func leftovers(stateDir, id string) []string {
	var out []string
	id += "-"
	dirs := []string{
		filepath.Join(stateDir, "bundles"), filepath.Join(stateDir, "runsc"),
		"/sys/fs/cgroup/moat-gvisor", "/sys/fs/cgroup/memory/moat-gvisor",
		"/sys/fs/cgroup/pids/moat-gvisor", "/sys/fs/cgroup/cpuacct/moat-gvisor",
	}
	for _, dir := range dirs {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), id) || strings.Contains(e.Name(), "-"+id) || strings.Contains(e.Name(), "_"+id) {
				out = append(out, filepath.Join(dir, e.Name()))
			}
		}
	}
	return out
}

func run(t *testing.T, sb moat.Sandbox, code string) *moat.Result {
	t.Helper()
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run(%q): %v", code, err)
	}
	return res
}

// TestIsolation checks what the level promises beyond the conformance
// suite, from inside the sandbox; each expectation differs from what the
// same code sees on the host.
func TestIsolation(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{})
	defer sb.Close()
	cases := []struct {
		name, code, want string
	}{
		{"gVisor's kernel", "import subprocess; print('Starting gVisor' in subprocess.run(['dmesg'], capture_output=True, text=True).stdout)", "True"},
		{"user nobody", "import os; print(os.getuid(), os.getgid(), os.geteuid(), os.getgroups())", "65534 65534 65534 []"},
		{"no capabilities, no_new_privs", `
import ctypes
st = dict(l.split(':', 1) for l in open('/proc/self/status'))
PR_GET_NO_NEW_PRIVS = 39
print(*(st[k].strip() for k in ['CapInh', 'CapPrm', 'CapEff', 'CapBnd']), ctypes.CDLL(None).prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0))`,
			"0000000000000000 0000000000000000 0000000000000000 0000000000000000 1"},
		{"loopback only", "import socket; print(socket.if_nameindex(), sorted(l.split(':')[0].strip() for l in list(open('/proc/net/dev'))[2:]))", "[(1, 'lo')] ['lo']"},
		// /var/tmp is world-writable in the image: only the read-only
		// mount stops the write there.
		{"read-only root", `
import errno
out = []
for p in ['/x', '/etc/x', '/usr/bin/x', '/root/x', '/var/tmp/x']:
    try:
        open(p, 'w')
        out.append(p + ' written')
    except OSError as e:
        out.append(errno.errorcode[e.errno])
print(*out)`, "EACCES EACCES EACCES EACCES EROFS"},
		{"root not writable even by its owner's mode", "import os; print(os.access('/', os.W_OK), os.statvfs('/').f_flag & os.ST_RDONLY != 0)", "False True"},
		{"tmpfs for every writable place", `
mounts = {l.split()[1]: l.split() for l in open('/proc/mounts')}
print(*(mounts[p][2] + ':' + ('noexec' in mounts[p][3]) * 'noexec' for p in ['/work', '/tmp', '/dev/shm']))`, "tmpfs:noexec tmpfs:noexec tmpfs:noexec"},
		{"nothing of the host mounted", `
mounts = [l.split() for l in open('/proc/mounts')]
print(sorted(set(m[2] for m in mounts)), [m[1] for m in mounts if m[2] == '9p'])`, "['9p', 'devpts', 'proc', 'sysfs', 'tmpfs'] ['/']"},
		{"no namespaces, no mounts", `
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(*args):
    r = libc.syscall(*args)
    return errno.errorcode.get(ctypes.get_errno(), '?') if r == -1 else 'ok'
CLONE_NEWUSER, SIGCHLD = 0x10000000, 17
SYS_unshare, SYS_clone, SYS_clone3, SYS_mount, SYS_ptrace = 272, 56, 435, 165, 101
print(call(SYS_unshare, CLONE_NEWUSER), call(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0, 0, 0, 0), call(SYS_clone3, 0, 0),
      call(SYS_mount, b'none', b'/tmp', b'tmpfs', 0, 0), call(SYS_ptrace, 0, 0, 0, 0))`, "EPERM EPERM ENOSYS EPERM EPERM"},
		{"working directory", "import os; print(os.getcwd(), os.environ['HOME'], sorted(os.environ))", "/work /work ['HOME', 'LANG', 'PATH']"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if strings.Contains(c.code, "SYS_unshare") && runtime.GOARCH != "amd64" {
				t.Skip("the probe's system call numbers are amd64's")
			}
			res := run(t, sb, c.code)
			if got := strings.TrimSpace(string(res.Stdout)); got != c.want || res.ExitCode != 0 {
				t.Errorf("got %q (exit %d, stderr %q), want %q", got, res.ExitCode, res.Stderr, c.want)
			}
		})
	}
}

// TestHostLoopbackUnreachable runs a service on the host's loopback and
// checks that the code cannot reach it, while the host can.
func TestHostLoopbackUnreachable(t *testing.T) {
	need(t, gvisor.Config{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("host-secret\n"))
			c.Close()
		}
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	// The probe works: the host reaches the service.
	if c, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second); err != nil {
		t.Fatalf("the host cannot reach its own service: %v", err)
	} else {
		c.Close()
	}
	sb := newSandbox(t, gvisor.Config{})
	defer sb.Close()
	res := run(t, sb, fmt.Sprintf(`
import socket
for host in ['127.0.0.1', '0.0.0.0', '::1']:
    try:
        s = socket.create_connection((host, %d), timeout=2)
        print(host, s.recv(100))
    except OSError as e:
        print(host, 'refused' if isinstance(e, ConnectionRefusedError) else e)
`, port))
	if bytes.Contains(res.Stdout, []byte("host-secret")) {
		t.Errorf("the code reached the host's loopback service:\n%s", res.Stdout)
	}
	if strings.Count(string(res.Stdout), "\n") != 3 {
		t.Errorf("want one line per address, got stdout %q stderr %q", res.Stdout, res.Stderr)
	}
}

// TestForkFloodBounded checks that gVisor's own task limit holds: threads
// and processes inside gVisor are not host tasks, so the host's pids cgroup
// is only a backstop. A flood of 200 processes stops at the limit, with
// reason pids found in the sentry's log, and the sandbox survives to report
// it.
func TestForkFloodBounded(t *testing.T) {
	need(t, gvisor.Config{})
	const limit = 32
	sb := newSandbox(t, gvisor.Config{Limits: moat.Limits{Pids: limit}})
	defer sb.Close()
	for _, c := range []struct{ name, start string }{
		{"processes", "os.fork() == 0 and (time.sleep(30), os._exit(0))"},
		{"threads", "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()"},
	} {
		t.Run(c.name, func(t *testing.T) {
			res := run(t, sb, fmt.Sprintf(`
import os, threading, time
n = 0
try:
    for i in range(200):
        %s
        n += 1
except (OSError, RuntimeError) as e:
    print('refused after', n, type(e).__name__, flush=True)
os._exit(0)
`, c.start))
			var n int
			var kind string
			if _, err := fmt.Sscanf(string(res.Stdout), "refused after %d %s", &n, &kind); err != nil {
				t.Fatalf("200 %s under a limit of %d: none refused: %s / stderr %q, reason %q", c.name, limit, res.Stdout, res.Stderr, res.Reason)
			}
			if n >= limit || n < limit/2 || res.Reason != moat.ReasonPids {
				t.Errorf("200 %s under a limit of %d: %d started, reason %q; want fewer than %d and reason pids", c.name, limit, n, res.Reason, limit)
			}
		})
	}
}

// TestSystrap checks, on the host, that the sandbox runs on the platform
// moat asked for: while the code sleeps, the sentry's command line names
// it (runsc fails rather than choose another).
func TestSystrap(t *testing.T) {
	// No sandbox booted ahead: the one sentry is the run's.
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1}
	need(t, cfg)
	if a := gvisor.Check(context.Background(), cfg); !strings.Contains(strings.Join(a.Details, "\n"), "platform: systrap") {
		t.Errorf("Check details do not name the systrap platform: %q", a.Details)
	}
	sb := newSandbox(t, cfg)
	defer sb.Close()
	if sb.Platform() != gvisor.PlatformSystrap {
		t.Errorf("Platform() = %q, want systrap", sb.Platform())
	}
	sentries := make(chan []string, 1)
	out := &onLine{want: "sleeping", do: func() { sentries <- sentryCmdlines(cfg.StateDir) }}
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("import time; print('sleeping', flush=True); time.sleep(1)"), Stdout: out})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("the run failed: exit %d, stderr %q", res.ExitCode, res.Stderr)
	}
	var cmdlines []string
	select {
	case cmdlines = <-sentries:
	default:
		t.Fatal("the code never said it was sleeping")
	}
	if len(cmdlines) != 1 || !strings.Contains(cmdlines[0], "--platform=systrap") {
		t.Errorf("want one sentry of this sandbox running with --platform=systrap, got %q", cmdlines)
	}
	if !strings.Contains(strings.Join(res.Notes, "\n"), "platform systrap") {
		t.Errorf("the result's notes do not name the platform: %q", res.Notes)
	}
}

// sentryCmdlines returns the command lines of the host's runsc sandbox
// processes whose runsc root is under stateDir.
func sentryCmdlines(stateDir string) []string {
	var out []string
	for _, p := range sentries(stateDir) {
		out = append(out, p.cmdline)
	}
	return out
}

type sentry struct {
	pid     int
	cmdline string
}

// sentries returns the host's runsc sandbox processes whose runsc root is
// under stateDir.
func sentries(stateDir string) []sentry {
	var out []sentry
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) > 0 && args[0] == "runsc-sandbox" && strings.Contains(string(b), "boot") &&
			strings.Contains(string(b), "--root="+stateDir) {
			pid, _ := strconv.Atoi(e.Name())
			out = append(out, sentry{pid, strings.Join(args, " ")})
		}
	}
	return out
}

// onLine is a Request.Stdout that calls do once, when want first appears.
type onLine struct {
	buf  bytes.Buffer
	want string
	do   func()
	done bool
}

func (o *onLine) Write(p []byte) (int, error) {
	o.buf.Write(p)
	if !o.done && strings.Contains(o.buf.String(), o.want) {
		o.done = true
		o.do()
	}
	return len(p), nil
}

// TestRootFSUntouched checks that runs leave the shared root filesystem as
// it was: read-only for the code, and no overlay's file store in it.
func TestRootFSUntouched(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{})
	defer sb.Close()
	var root string
	for _, d := range gvisor.Check(context.Background(), gvisor.Config{}).Details {
		if r, ok := strings.CutPrefix(d, "rootfs: "); ok {
			root, _, _ = strings.Cut(r, " ")
		}
	}
	if root == "" {
		t.Fatal("Check does not name the root filesystem")
	}
	before := snapshot(t, root)
	run(t, sb, "import os\nfor p in ['/tmp/a', '/work/b', '/dev/shm/c']:\n    open(p, 'w').write('x')")
	after := snapshot(t, root)
	if before != after {
		t.Errorf("the root filesystem's top level changed during a run:\nbefore %s\nafter  %s", before, after)
	}
}

// snapshot lists root's top level and the work directory with their
// modification times.
func snapshot(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	for _, dir := range []string{root, filepath.Join(root, "work"), filepath.Join(root, "tmp")} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := os.Stat(dir)
		fmt.Fprintf(&b, "%s@%d:", dir, st.ModTime().UnixNano())
		for _, e := range entries {
			fmt.Fprintf(&b, " %s", e.Name())
		}
		b.WriteString("; ")
	}
	return b.String()
}

// TestCheck checks what `moat doctor` gets: the runsc version and platform
// when available, and a refusal with a remedy for a platform runsc lacks or
// a root filesystem that is not built.
func TestCheck(t *testing.T) {
	need(t, gvisor.Config{})
	a := gvisor.Check(context.Background(), gvisor.Config{})
	details := strings.Join(a.Details, "\n")
	for _, want := range []string{"runsc: ", "version ", "platform: systrap", "rootfs: "} {
		if !strings.Contains(details, want) {
			t.Errorf("Check details lack %q:\n%s", want, details)
		}
	}
	missing := gvisor.Check(context.Background(), gvisor.Config{RootFS: filepath.Join(t.TempDir(), "none")})
	if missing.Available || !strings.Contains(missing.Remedy, "moat image build") {
		t.Errorf("Check with a missing root filesystem = %+v, want unavailable with the remedy 'moat image build'", missing)
	}
	_, err := gvisor.New(gvisor.Config{Platform: "nonsense"})
	if err == nil || !strings.Contains(err.Error(), "unknown platform") {
		t.Errorf("New with platform nonsense: %v, want an invalid-input error", err)
	}
}

// TestReapAfterKill kills a moat process (this test binary, re-executed)
// while its run sleeps, and checks that the next New removes everything that
// run left on the host: bundle, runsc state and cgroups.
func TestReapAfterKill(t *testing.T) {
	if os.Getenv(helperEnv) != "" {
		helperMain()
		return
	}
	stateDir := t.TempDir()
	need(t, gvisor.Config{StateDir: stateDir})
	cmd := exec.Command(os.Args[0], "-test.run=^TestReapAfterKill$")
	cmd.Env = append(os.Environ(), helperEnv+"="+stateDir)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	// The helper prints its owner id, then "sleeping" once its code runs.
	got := make(chan error, 1)
	ownerID := make(chan string, 1)
	go func() {
		buf := make([]byte, 4096)
		var all []byte
		for {
			n, err := stdout.Read(buf)
			all = append(all, buf[:n]...)
			if bytes.Contains(all, []byte("sleeping")) {
				var id string
				fmt.Sscanf(string(all), "owner %s", &id)
				ownerID <- id
				got <- nil
				return
			}
			if err != nil {
				got <- fmt.Errorf("helper output ended: %q: %w", all, err)
				return
			}
		}
	}()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the helper's run never started")
	}
	var helper string
	select {
	case helper = <-ownerID:
	default:
		t.Fatal("the helper did not say its owner id")
	}
	if left := leftovers(stateDir, helper); len(left) == 0 {
		t.Fatal("the helper's run shows nothing on the host to reap; the check would prove nothing")
	}
	cmd.Process.Kill()
	cmd.Wait()

	sb := newSandbox(t, gvisor.Config{StateDir: stateDir})
	defer sb.Close()
	if left := leftovers(stateDir, helper); len(left) > 0 {
		t.Errorf("after the next New, the killed moat's run left:\n\t%s", strings.Join(left, "\n\t"))
	}
	if cmdlines := sentryCmdlines(stateDir); len(cmdlines) > 0 {
		t.Errorf("sandboxes of the killed moat still run: %q", cmdlines)
	}
	// The sandbox works after reaping.
	if res := run(t, sb, "print(6*7)"); string(res.Stdout) != "42\n" {
		t.Errorf("a run after reaping printed %q, stderr %q", res.Stdout, res.Stderr)
	}
}

const helperEnv = "MOAT_GVISOR_TEST_HELPER"

// helperMain is the moat process TestReapAfterKill kills: it starts a run
// that prints "sleeping" and sleeps.
func helperMain() {
	sb, err := gvisor.New(gvisor.Config{StateDir: os.Getenv(helperEnv)})
	if err != nil {
		fmt.Println("helper:", err)
		os.Exit(1)
	}
	id, err := owner.Self(ownersDir)
	if err != nil {
		fmt.Println("helper:", err)
		os.Exit(1)
	}
	fmt.Printf("owner %s\n", id)
	res, err := sb.Run(context.Background(), moat.Request{
		Code:   []byte("import time; print('sleeping', flush=True); time.sleep(60)"),
		Stdout: os.Stdout,
	})
	b, _ := json.Marshal(res)
	fmt.Println("helper: run ended:", string(b), err)
	os.Exit(1)
}

// TestWarm checks the sandboxes booted ahead: they wait after a run, one
// that died while it waited is replaced by a fresh boot, Close kills those
// that wait, and Warm -1 boots none.
func TestWarm(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: 1}
	need(t, cfg)
	sb := newSandbox(t, cfg)
	if res := run(t, sb, "print(1)"); string(res.Stdout) != "1\n" {
		t.Fatalf("first run printed %q, stderr %q", res.Stdout, res.Stderr)
	}
	waiting := eventually(t, func() []sentry { return sentries(cfg.StateDir) }, 1)
	if len(waiting) != 1 {
		t.Fatalf("after a run with Warm 1, %d sandboxes wait, want 1", len(waiting))
	}
	// Killed from outside while it waits (booted by now): once runsc has
	// noticed, the next run must not use it.
	time.Sleep(time.Second)
	if n := len(runscRuns(cfg.StateDir)); n != 1 {
		t.Fatalf("%d runsc processes run for the waiting sandbox, want 1", n)
	}
	if err := syscall.Kill(waiting[0].pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if left := eventually(t, func() []int { return runscRuns(cfg.StateDir) }, 0); len(left) > 0 {
		t.Fatalf("runsc %v still runs after its sandbox was killed", left)
	}
	if res := run(t, sb, "print(2)"); string(res.Stdout) != "2\n" || res.ExitCode != 0 {
		t.Errorf("the run after the waiting sandbox died printed %q, exit %d, stderr %q", res.Stdout, res.ExitCode, res.Stderr)
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if left := sentries(cfg.StateDir); len(left) > 0 {
		t.Errorf("sandboxes still run after Close: %v", left)
	}
	if left := leftovers(cfg.StateDir, self(t)); len(left) > 0 {
		t.Errorf("after Close, left on the host:\n\t%s", strings.Join(left, "\n\t"))
	}

	cold := gvisor.Config{StateDir: t.TempDir(), Warm: -1}
	sb = newSandbox(t, cold)
	defer sb.Close()
	run(t, sb, "print(1)")
	time.Sleep(200 * time.Millisecond)
	if n := len(sentries(cold.StateDir)); n > 0 {
		t.Errorf("with Warm -1, %d sandboxes run after the run ended, want none", n)
	}
}

// runscRuns returns the pids of the host's "runsc run" processes whose
// runsc root is under stateDir.
func runscRuns(stateDir string) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) > 1 && strings.HasSuffix(args[0], "runsc") && slices.Contains(args, "run") && slices.Contains(args, "--root="+filepath.Join(stateDir, "runsc")) {
			out = append(out, pid)
		}
	}
	return out
}

// eventually calls f until it returns want items or a few seconds pass, and
// returns its last answer.
func eventually[T any](t *testing.T, f func() []T, want int) []T {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		got := f()
		if len(got) == want || time.Now().After(deadline) {
			return got
		}
		time.Sleep(20 * time.Millisecond)
	}
}
