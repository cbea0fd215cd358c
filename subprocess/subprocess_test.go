package subprocess_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/subprocess"
)

// requireRoot skips only outside CI: strict hardening needs root, and CI
// runs as root, so there the test must run.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root: the strict subprocess level needs it")
		}
		t.Skip("strict hardening needs root (CI runs this as root)")
	}
}

func newStrict(t *testing.T, l moat.Limits) moat.Sandbox {
	t.Helper()
	sb, err := subprocess.New(subprocess.Config{Limits: l})
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

func TestConformance(t *testing.T) {
	requireRoot(t)
	sandboxtest.Run(t, newStrict, sandboxtest.Options{Leftovers: leftovers})
}

// leftovers lists what a finished run could leave on the host: working
// directories and cgroups named after this process's owner id (the one
// every sandbox of this process uses).
func leftovers() []string {
	id, err := owner.Self("/run/moat/owners")
	if err != nil {
		return []string{"no owner id: " + err.Error()}
	}
	var out []string
	prefix := id + "-"
	for _, dir := range []string{"/run/moat/runs", "/sys/fs/cgroup/memory/moat", "/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/cpuacct/moat", "/sys/fs/cgroup/moat"} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), prefix) {
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

// TestStrictIsolation checks the protections the strict profile promises
// beyond the conformance suite, each against what the same code does on the
// host: a dedicated uid, the hidden home, Landlock, seccomp.
func TestStrictIsolation(t *testing.T) {
	requireRoot(t)
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	cases := []struct {
		name, code, want string
	}{
		{"dedicated uid", "import os; print(os.getuid() >= 2100000000, os.getgid() >= 2100000000, os.getgroups())", "True True []"},
		{"no host home", "import os\ntry:\n  os.listdir('/root'); print('read')\nexcept (PermissionError, FileNotFoundError): print('denied')", "denied"},
		{"no /etc/passwd", "try:\n  open('/etc/passwd').read(); print('read')\nexcept (PermissionError, FileNotFoundError): print('denied')", "denied"},
		{"no /tmp", "try:\n  open('/tmp/moat-x','w'); print('wrote')\nexcept (PermissionError, FileNotFoundError): print('denied')", "denied"},
		{"no /dev/shm", "try:\n  open('/dev/shm/moat-x','w'); print('wrote')\nexcept (PermissionError, FileNotFoundError): print('denied')", "denied"},
		{"no /proc", "try:\n  open('/proc/1/environ','rb').read(); print('read')\nexcept (PermissionError, FileNotFoundError): print('denied')", "denied"},
		{"no inet socket", "import socket\ntry:\n  socket.socket(socket.AF_INET); print('socket')\nexcept OSError as e: print(e.errno)", "97"},
		{"no inet6 socket", "import socket\ntry:\n  socket.socket(socket.AF_INET6); print('socket')\nexcept OSError as e: print(e.errno)", "97"},
		{"unix socket allowed", "import socket; s=socket.socketpair(); s[0].send(b'ok'); print(s[1].recv(2).decode())", "ok"},
		{"no ptrace", "import ctypes; libc=ctypes.CDLL(None, use_errno=True); print(libc.ptrace(0,0,0,0), ctypes.get_errno())", "-1 1"},
		{"no memfd_secret", "import ctypes; libc=ctypes.CDLL(None, use_errno=True); print(libc.syscall(447, 0), ctypes.get_errno())", "-1 1"},
		{"no new user namespace", "import ctypes; libc=ctypes.CDLL(None, use_errno=True); print(libc.unshare(0x10000000), ctypes.get_errno())", "-1 1"},
		{"no_new_privs", "import ctypes; libc=ctypes.CDLL(None); print(libc.prctl(39,0,0,0,0))", "1"},
		{"no exec from workdir", "import os, shutil, subprocess\nshutil.copy('/bin/true', 't'); os.chmod('t', 0o755)\ntry:\n  subprocess.run(['./t']); print('ran')\nexcept PermissionError: print('denied')", "denied"},
		{"system binaries run", "import subprocess; print(subprocess.run(['/bin/echo','hi'], capture_output=True).stdout.decode().strip())", "hi"},
		{"environment", "import os; print(sorted(k for k in os.environ if k != 'LC_CTYPE'))", "['HOME', 'LANG', 'PATH']"},
		{"home is workdir", "import os; print(os.environ['HOME'] == os.getcwd())", "True"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			res := run(t, sb, c.code)
			if got := strings.TrimSpace(string(res.Stdout)); got != c.want {
				t.Errorf("got %q, want %q (stderr %q)", got, c.want, res.Stderr)
			}
		})
	}
}

// TestPositiveControl runs probes of TestStrictIsolation on the host, as
// root, without moat: they must get through there, or the probes prove
// nothing.
func TestPositiveControl(t *testing.T) {
	requireRoot(t)
	for _, code := range []string{
		"import os; os.listdir('/root'); print('read')",
		"open('/etc/passwd').read(); print('read')",
		"import socket; socket.socket(socket.AF_INET); print('read')",
	} {
		cmd := exec.Command("/usr/bin/python3", "-c", code)
		cmd.Env = []string{}
		out, err := cmd.CombinedOutput()
		if err != nil || strings.TrimSpace(string(out)) != "read" {
			t.Errorf("on the host, %q gave %q, %v: the probe is broken", code, out, err)
		}
	}
}

func TestTutorialKeepsOnlyRlimits(t *testing.T) {
	sb, err := subprocess.New(subprocess.Config{Hardening: subprocess.HardeningTutorial, Limits: moat.Limits{Memory: 128 * moat.MiB}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	res := run(t, sb, "import os; print(os.getuid() == os.geteuid())\nb = bytearray(512 << 20)")
	if res.Reason != moat.ReasonMemory {
		t.Errorf("512 MiB under a 128 MiB RLIMIT_AS: reason %q, want memory (stderr %q)", res.Reason, res.Stderr)
	}
	if len(res.Notes) == 0 || !strings.Contains(strings.Join(res.Notes, " "), "tutorial") {
		t.Errorf("notes %q do not say the run was weakened", res.Notes)
	}
}

func TestConfigValidate(t *testing.T) {
	bad := []subprocess.Config{
		{Hardening: "paranoid"},
		{Python: "python3"},
		{UIDFirst: 10},
		{Limits: moat.Limits{Memory: 1}},
		{Limits: moat.Limits{Pids: -1}},
		{Warm: -2},
		{Warm: 17},
	}
	for _, c := range bad {
		if err := c.Validate(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("(%+v).Validate() = %v, want ErrInvalid", c, err)
		}
		if _, err := subprocess.New(c); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("New(%+v) = %v, want ErrInvalid", c, err)
		}
	}
}

func TestMissingPythonIsUnavailable(t *testing.T) {
	_, err := subprocess.New(subprocess.Config{Python: "/nonexistent/python3"})
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Fatalf("got %v, want ErrUnavailable", err)
	}
	a := subprocess.Check(context.Background(), subprocess.Config{Python: "/nonexistent/python3"})
	if a.Available || a.Reason == "" || a.Remedy == "" {
		t.Errorf("Check = %+v, want unavailable with a reason and a remedy", a)
	}
}

// TestReapsLeftovers plants what a moat killed mid-run leaves (a working
// directory with a tmpfs, and a cgroup, named after an owner that is gone)
// next to the same things of a live owner (another process holding its
// owner lock, as a moat in another PID namespace would), and checks that New
// removes the first and keeps the second.
func TestReapsLeftovers(t *testing.T) {
	requireRoot(t)
	const dead, live = "00000000deadbeef-run", "00000000a11ce000-run"
	lock := exec.Command("flock", "/run/moat/owners/00000000a11ce000", "sleep", "60")
	if err := os.MkdirAll("/run/moat/owners", 0o700); err != nil {
		t.Fatal(err)
	}
	if err := lock.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		lock.Process.Kill()
		lock.Wait()
		os.Remove("/run/moat/owners/00000000a11ce000")
	}()
	// Wait until flock holds the lock.
	for i := 0; i < 100; i++ {
		if err := exec.Command("flock", "-n", "/run/moat/owners/00000000a11ce000", "true").Run(); err != nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	var planted = map[string][]string{}
	for _, name := range []string{dead, live} {
		dir := filepath.Join("/run/moat/runs", name)
		if err := os.MkdirAll(dir, 0o700); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", dir).CombinedOutput(); err != nil {
			t.Fatalf("mount: %v %s", err, out)
		}
		planted[name] = append(planted[name], dir)
		for _, c := range []string{"/sys/fs/cgroup/memory/moat", "/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/cpuacct/moat", "/sys/fs/cgroup/moat"} {
			if _, err := os.Stat(c); err == nil {
				d := filepath.Join(c, name)
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
				planted[name] = append(planted[name], d)
			}
		}
	}
	defer func() {
		for _, p := range planted[live] {
			exec.Command("umount", p).Run()
			os.Remove(p)
		}
	}()
	sb := newStrict(t, moat.Limits{})
	sb.Close()
	for _, p := range planted[dead] {
		if _, err := os.Stat(p); err == nil {
			t.Errorf("%s of a dead owner survived New", p)
		}
	}
	for _, p := range planted[live] {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("%s of a live owner was reaped: %v", p, err)
		}
	}
}

// TestCancelKillsTree cancels a run whose code double-forks a sleeper and
// checks that the sleeper is gone when Run returns.
func TestCancelKillsTree(t *testing.T) {
	requireRoot(t)
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(500*time.Millisecond, cancel)
	marker := "moat-cancel-" + strconv.Itoa(os.Getpid())
	res, err := sb.Run(ctx, moat.Request{Code: []byte("import os, time\nif os.fork() == 0:\n  os.setsid()\n  if os.fork() == 0:\n    os.execv('/bin/sleep', ['sleep', '1000', '" + marker + "'])\n  os._exit(0)\ntime.sleep(1000)")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonCanceled {
		t.Errorf("reason %q, want canceled", res.Reason)
	}
	if pids := processesWith(marker); len(pids) > 0 {
		t.Errorf("processes %v of the cancelled run are still alive", pids)
	}
}

func processesWith(marker string) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && strings.Contains(string(b), marker) {
			out = append(out, e.Name())
		}
	}
	return out
}

func BenchmarkRun(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("strict hardening needs root")
	}
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	req := moat.Request{Code: []byte("print(1)")}
	for b.Loop() {
		res, err := sb.Run(context.Background(), req)
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatalf("%v %+v", err, res)
		}
	}
}

// BenchmarkWarm times the warm path: a run that finds its instance (a
// python3 started under the run's restrictions) ready.
func BenchmarkWarm(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("strict hardening needs root")
	}
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	sandboxtest.BenchmarkWarm(b, sb)
}

func BenchmarkPython3Direct(b *testing.B) {
	for b.Loop() {
		cmd := exec.Command("/usr/bin/python3", "-c", "print(1)")
		cmd.Env = []string{}
		if out, err := cmd.Output(); err != nil || string(out) != "1\n" {
			b.Fatalf("%v %q", err, out)
		}
	}
}

// TestNoHostUnixSocket: a socket file of the host that every user may
// write to (as /dev/log or D-Bus's system bus are) cannot be reached.
// Landlock at ABI < 9 does not govern connect(2) on a unix socket; the
// seccomp filter refuses socket(AF_UNIX) outright.
func TestNoHostUnixSocket(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("", "moat-sock-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	path := filepath.Join(dir, "s")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	os.Chmod(path, 0o777)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Write([]byte("host-secret"))
			c.Close()
		}
	}()
	code := "import socket\ntry:\n  s = socket.socket(socket.AF_UNIX)\n  s.connect(" + strconv.Quote(path) + ")\n  print(s.recv(64).decode())\nexcept OSError as e: print('denied', e.errno)"
	// Positive control: the probe reaches the socket from the host.
	cmd := exec.Command("/usr/bin/python3", "-c", code)
	cmd.Env = []string{}
	if out, err := cmd.Output(); err != nil || strings.TrimSpace(string(out)) != "host-secret" {
		t.Fatalf("on the host the probe got %q, %v: it is broken", out, err)
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	if got := strings.TrimSpace(string(res.Stdout)); got != "denied 1" {
		t.Errorf("in the sandbox the probe got %q (stderr %q), want denied 1 (EPERM)", got, res.Stderr)
	}
}
