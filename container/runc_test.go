package container_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/sandboxtest"
)

// needRunc skips t when the runc driver cannot be tested here (not root,
// or no image), except in CI, where the test fails instead.
func needRunc(t testing.TB) {
	t.Helper()
	engineOnce.Do(func() { engineErr = prepareEngine() })
	var why string
	switch {
	case os.Geteuid() != 0:
		why = "the runc driver needs root"
	case engineErr != nil:
		why = engineErr.Error()
	}
	if why == "" {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("the runc driver cannot be tested, and CI must test it: %s", why)
	}
	t.Skipf("skipping the runc driver: %s", why)
}

func runcFactory(t *testing.T, l moat.Limits) moat.Sandbox {
	sb, err := moatcontainer.New(moatcontainer.Config{Limits: l, Driver: moatcontainer.DriverRunc})
	if err != nil {
		t.Fatalf("container.New with the runc driver: %v", err)
	}
	return sb
}

func runcLeftovers() []string {
	return append(leftovers(), moatcontainer.RuncLeftovers()...)
}

// forDrivers runs a driver-neutral test of the level once per driver, each
// with its factory.
func forDrivers(t *testing.T, f func(t *testing.T, factory sandboxtest.Factory)) {
	t.Run("docker", func(t *testing.T) { f(t, factory) })
	t.Run("runc", func(t *testing.T) {
		needRunc(t)
		f(t, runcFactory)
	})
}

// TestRuncConformance runs the shared run suite with the runc driver.
func TestRuncConformance(t *testing.T) {
	needRunc(t)
	sandboxtest.Run(t, runcFactory, sandboxtest.Options{Leftovers: runcLeftovers})
}

// TestRuncHardeningFromInside checks every hardening item a run can see,
// with the runc driver; a session of the same Sandbox (through Docker) has
// them too.
func TestRuncHardeningFromInside(t *testing.T) {
	needRunc(t)
	lim := moat.Limits{Disk: 8 * moat.MiB, Pids: 32, OpenFiles: 100, FileSize: 2 * moat.MiB}
	sb := runcFactory(t, lim)
	defer sb.Close()
	if d := sb.(moat.Describer).Describe(); !strings.Contains(d, "driver runc (runc-moat ") {
		t.Errorf("Describe %q does not name the driver", d)
	}
	t.Run("run", func(t *testing.T) { checkHardening(t, lim, sb.Run) })
	t.Run("more", func(t *testing.T) {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(`
import json, os
r = {}
r['sys'] = os.path.exists('/sys/kernel')
r['dev'] = sorted(os.listdir('/dev'))
for p in ('/proc/kcore', '/proc/keys', '/proc/timer_list', '/proc/sched_debug'):
    try:
        r[p] = len(open(p, 'rb').read(64))
    except OSError as e:
        r[p] = e.errno
try:
    open('/proc/sysrq-trigger', 'w').write('h'); r['sysrq'] = 'written'
except OSError as e:
    r['sysrq'] = e.errno
st = dict(l.split(':\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\t' in l)
r['groups'] = st['Groups'].strip()
r['oom'] = open('/proc/self/oom_score_adj').read().strip()
r['env'] = sorted(os.environ)
r['host'] = os.uname().nodename
r['fds'] = sorted(int(f) for f in os.listdir('/proc/self/fd'))
r['lo'] = open('/sys/class/net/lo/operstate').read() if os.path.exists('/sys/class/net/lo') else [l.split()[0] for l in open('/proc/self/net/dev').read().splitlines()[2:]]
print(json.dumps(r))
`)})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("report: %s", res.Stdout)
		// A masked file reads as empty; one this kernel does not have is
		// missing inside too.
		wants := []string{`"sys": false`, `"groups": ""`, `"oom": "1000"`, `"env": ["HOME", "LANG", "PATH", "PWD"]`, `"host": "sandbox"`,
			`"fds": [0, 1, 2, 3]`, // its stdio and listdir's own: none of runc's or moat's
			`"dev": ["fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty", "urandom", "zero"]`}
		for _, p := range []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug"} {
			if _, err := os.Stat(p); err == nil {
				wants = append(wants, fmt.Sprintf("%q: 0", p))
			} else {
				wants = append(wants, fmt.Sprintf("%q: %d", p, syscall.ENOENT))
			}
		}
		if _, err := os.Stat("/proc/sysrq-trigger"); err == nil {
			wants = append(wants, fmt.Sprintf(`"sysrq": %d`, syscall.EROFS))
		}
		for _, want := range wants {
			if !strings.Contains(string(res.Stdout), want) {
				t.Errorf("the run's report lacks %s: %s (stderr %q)", want, res.Stdout, res.Stderr)
			}
		}
	})
	ss, err := sb.(moat.Sessioner).NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	t.Run("session", func(t *testing.T) { checkHardening(t, lim, ss.Run) })
}

// TestRuncSeccompFromHost checks a prepared container's init from the
// host, as the Docker path's check does: it runs under a seccomp filter
// (Seccomp: 2), with no capability and no_new_privs, as its own uid,
// before any code is written.
func TestRuncSeccompFromHost(t *testing.T) {
	needRunc(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	p, err := moatcontainer.PrepareRunc(context.Background(), sb)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Discard()
	st := procStatusOf(t, p.Pid())
	t.Logf("init %d: %s, Seccomp %s (%s filters), CapBnd %s, NoNewPrivs %s, Uid %s", p.Pid(), st["Name"], st["Seccomp"], st["Seccomp_filters"], st["CapBnd"], st["NoNewPrivs"], st["Uid"])
	if st["Seccomp"] != "2" || st["Seccomp_filters"] == "0" {
		t.Errorf("the init runs with Seccomp %q, filters %q; want a filter", st["Seccomp"], st["Seccomp_filters"])
	}
	for _, k := range []string{"CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"} {
		if st[k] != "0000000000000000" {
			t.Errorf("%s %s, want none", k, st[k])
		}
	}
	if f := strings.Fields(st["Uid"]); len(f) != 4 || f[0] != strconv.Itoa(p.UID()) {
		t.Errorf("Uid %q, want %d", st["Uid"], p.UID())
	}
	for _, ns := range []string{"pid", "net", "mnt", "ipc", "uts", "cgroup"} {
		mine, _ := os.Readlink("/proc/self/ns/" + ns)
		its, _ := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", p.Pid(), ns))
		if its == "" || its == mine {
			t.Errorf("namespace %s: the init's %q, moat's %q", ns, its, mine)
		}
	}
}

func procStatusOf(t *testing.T, pid int) map[string]string {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m
}

// TestRuncProbeRefusesWeakFilter shows that the runc driver's probe fails
// closed: with an allow-all filter in place of moat's, the probe's calls
// get through, and the level is unavailable.
func TestRuncProbeRefusesWeakFilter(t *testing.T) {
	needRunc(t)
	arch := map[string]string{"amd64": "SCMP_ARCH_X86_64", "arm64": "SCMP_ARCH_AARCH64"}[runtime.GOARCH]
	err := moatcontainer.RuncProbeWithSeccomp(moatcontainer.Config{Driver: moatcontainer.DriverRunc},
		`{"defaultAction":"SCMP_ACT_ALLOW","architectures":["`+arch+`"],"syscalls":[{"names":["kcmp"],"action":"SCMP_ACT_ERRNO"}]}`)
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Fatalf("the probe with an allow-all filter: %v, want ErrUnavailable", err)
	}
	for _, name := range []string{"socket(AF_VSOCK)", "io_uring_setup", "memfd_secret"} {
		if !strings.Contains(err.Error(), name) {
			t.Errorf("the probe's refusal does not name %s: %v", name, err)
		}
	}
	if left := moatcontainer.RuncLeftovers(); len(left) > 0 {
		t.Errorf("the probe left %v", left)
	}
}

// TestRuncWithoutDocker: with no Docker engine reachable, the runc driver
// still runs one-shot runs, and NewSession fails with ErrUnavailable.
func TestRuncWithoutDocker(t *testing.T) {
	needRunc(t)
	t.Setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
	if _, err := moatcontainer.New(moatcontainer.Config{}); !errors.Is(err, moat.ErrUnavailable) {
		t.Fatalf("the docker driver without an engine: %v, want ErrUnavailable", err)
	}
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(6*7)")})
	if err != nil || strings.TrimSpace(string(res.Stdout)) != "42" {
		t.Fatalf("a run without Docker: %v %+v", err, res)
	}
	_, err = sb.NewSession(context.Background(), moat.SessionOptions{})
	if !errors.Is(err, moat.ErrUnavailable) || !strings.Contains(err.Error(), "Docker") {
		t.Fatalf("NewSession without Docker: %v, want ErrUnavailable naming Docker", err)
	}
	if d := sb.Describe(); !strings.Contains(d, "no sessions") {
		t.Errorf("Describe %q does not say sessions are unavailable", d)
	}
}

// TestRuncRefuses: what the driver cannot give, it refuses.
func TestRuncRefuses(t *testing.T) {
	needRunc(t)
	for name, cfg := range map[string]moatcontainer.Config{
		"another image": {Driver: moatcontainer.DriverRunc, Image: "debian:12"},
		"egress":        {Driver: moatcontainer.DriverRunc, Egress: new(egress.Proxy)},
	} {
		if _, err := moatcontainer.New(cfg); !errors.Is(err, moat.ErrUnavailable) {
			t.Errorf("%s: %v, want ErrUnavailable", name, err)
		}
	}
	if _, err := moatcontainer.New(moatcontainer.Config{Driver: "lxc"}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("driver lxc: %v, want ErrInvalid", err)
	}
}

// uidProcs lists the host processes running as uid.
func uidProcs(uid int) []string {
	var out []string
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat(filepath.Join("/proc", e.Name()), &st) == nil && int(st.Uid) == uid {
			comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
			out = append(out, fmt.Sprintf("%d (%s)", pid, strings.TrimSpace(string(comm))))
		}
	}
	return out
}

// TestRuncNothingOutlivesRun: a run that leaves a daemon of its own
// (setsid, double fork) and a busy child, and is killed at the wall time,
// leaves no process of its uid once Run has returned, and nothing (runc
// state, bundle, cgroup) once the Sandbox is closed.
func TestRuncNothingOutlivesRun(t *testing.T) {
	needRunc(t)
	sb := runcFactory(t, moat.Limits{WallTime: moat.Duration(3 * time.Second)})
	closed := false
	defer func() {
		if !closed {
			sb.Close()
		}
	}()
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(`import os, time
print(os.getuid(), flush=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
if os.fork() == 0:
    while True:
        pass
time.sleep(600)
`)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("reason %q, want timeout", res.Reason)
	}
	uid, err := strconv.Atoi(strings.TrimSpace(string(res.Stdout)))
	if err != nil {
		t.Fatalf("the run printed %q: %v", res.Stdout, err)
	}
	if left := uidProcs(uid); len(left) > 0 {
		t.Errorf("after Run, processes of the run's uid %d still run: %v", uid, left)
	}
	sb.Close()
	closed = true
	if left := moatcontainer.RuncLeftovers(); len(left) > 0 {
		t.Errorf("after Close: %v", left)
	}
}

// TestRuncEvidence checks each reason the runc driver reports from the
// host side: the init's status, the memory cgroup's OOM kills, the pids
// controller's refusals, the CPU time of the whole tree.
func TestRuncEvidence(t *testing.T) {
	needRunc(t)
	sb := runcFactory(t, moat.Limits{Memory: 64 * moat.MiB, Pids: 16, CPUTime: moat.Duration(2 * time.Second), WallTime: moat.Duration(20 * time.Second)})
	defer sb.Close()
	for _, c := range []struct {
		name, code string
		exit       int
		signal     string
		reason     moat.Reason
	}{
		{"exit", "import sys; sys.exit(3)", 3, "", ""},
		{"signal", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", 128 + 11, "SIGSEGV", moat.ReasonSignal},
		{"memory", "x = bytearray(512 << 20)", 137, "SIGKILL", moat.ReasonMemory},
		{"pids", "import os\nfor i in range(64):\n    try:\n        os.fork() or __import__('time').sleep(5)\n    except OSError:\n        break\n", -1, "", moat.ReasonPids},
		{"cpu", "import os\nos.fork()\nwhile True: pass", -1, "", moat.ReasonTimeout},
	} {
		t.Run(c.name, func(t *testing.T) {
			res, err := sb.Run(context.Background(), moat.Request{Code: []byte(c.code)})
			if err != nil {
				t.Fatal(err)
			}
			if (c.exit >= 0 && (res.ExitCode != c.exit || res.Signal != c.signal)) || res.Reason != c.reason {
				t.Errorf("exit %d signal %q reason %q, want %d %q %q (stderr %q)", res.ExitCode, res.Signal, res.Reason, c.exit, c.signal, c.reason, res.Stderr)
			}
		})
	}
}

// runcHelperEnv makes the test binary a moat process that starts a long
// run with the runc driver, says its owner id, and waits to be killed.
const runcHelperEnv = "MOAT_CONTAINER_TEST_RUNC_HELPER"

func init() {
	if os.Getenv(runcHelperEnv) == "1" {
		os.Exit(runcHelperMain())
	}
}

func runcHelperMain() int {
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("owner", moatcontainer.RuncOwner(sb))
	res, err := sb.Run(context.Background(), moat.Request{
		Code:   []byte("import time\nprint('running', flush=True)\ntime.sleep(60)\n"),
		Stdout: os.Stdout,
	})
	fmt.Println("helper: the run ended, which it should not have:", res, err)
	return 1
}

// TestRuncReaper kills -9 a moat process in the middle of a runc-driven
// run: its container (still running), bundle, state and cgroups are left,
// and the next New removes them all, but not what a live moat holds (this
// process's prepared container).
func TestRuncReaper(t *testing.T) {
	needRunc(t)
	live, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer live.Close()
	mine, err := moatcontainer.PrepareRunc(context.Background(), live)
	if err != nil {
		t.Fatal(err)
	}
	defer mine.Discard()

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), runcHelperEnv+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	r := bufio.NewReader(out)
	var owner string
	for owner == "" || !strings.Contains(owner, "running") {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("the helper ended: %v (%q)", err, owner)
		}
		owner += line
	}
	id := strings.Fields(strings.TrimPrefix(owner, "owner "))[0]
	cmd.Process.Kill()
	cmd.Wait()
	left := moatcontainer.RuncLeftoversOf(id)
	t.Logf("the killed moat %s left: %v", id, left)
	if len(left) == 0 {
		t.Fatal("inconclusive: the killed moat left nothing to reap")
	}
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if left := moatcontainer.RuncLeftoversOf(id); len(left) > 0 {
		t.Errorf("after New, the dead moat's leftovers remain: %v", left)
	}
	if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", mine.Pid())); err != nil || !strings.Contains(string(st), "python3") && !strings.Contains(string(st), "sh") {
		t.Errorf("the live moat's prepared container was reaped: %v", err)
	}
}

// BenchmarkRuncRun times print(1) through the runc driver's warm path: each
// run takes a container the pool prepared while the benchmark waited for
// it (the timer stopped), as a run that finds one ready does. It also
// reports the CPU time per run of everything the runs cost (moat, and
// runc, its init, the shell and python3, counted as the test's children
// once each run's runc has exited, so the preparation of each run's
// container counts too), and a bare python3 start's, for comparison.
func BenchmarkRuncRun(b *testing.B) {
	needRunc(b)
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	c0 := cpuTime()
	for b.Loop() {
		b.StopTimer()
		waitReady(b, sb)
		b.StartTimer()
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatal(res, err)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64((cpuTime()-c0).Microseconds())/1000/float64(b.N), "cpu-ms/run")
	c0 = cpuTime()
	for range 10 {
		exec.Command("/usr/bin/python3", "-c", "print(1)").Run()
	}
	b.ReportMetric(float64((cpuTime()-c0).Microseconds())/1000/10, "python3-cpu-ms/run")
}

// waitReady waits until sb's pool has a container ready.
func waitReady(b *testing.B, sb *moatcontainer.Sandbox) {
	for deadline := time.Now().Add(time.Minute); sb.PoolStats().Ready == 0; {
		if time.Now().After(deadline) {
			b.Fatal("the pool prepared no container within a minute")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// cpuTime is the CPU time of this process and its waited-for children.
func cpuTime() time.Duration {
	var self, kids syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &self)
	syscall.Getrusage(syscall.RUSAGE_CHILDREN, &kids)
	return time.Duration(self.Utime.Nano() + self.Stime.Nano() + kids.Utime.Nano() + kids.Stime.Nano())
}
