package container_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/sandboxtest"
)

// syscallProbe is Python that tries the calls moat's container profile
// must refuse, and a few it must allow, and prints one JSON object: each
// call's name mapped to "ok" or the name of its errno. The test's own
// statement, kept apart from the level's probe.
func syscallProbe() string {
	return fmt.Sprintf(`import ctypes, errno, json, os, socket, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
bufs = []  # kept alive: the kernel may write into them
def buf(n):
    bufs.append(ctypes.create_string_buffer(n))
    return ctypes.addressof(bufs[-1])
def call(*a):
    if libc.syscall(*[ctypes.c_long(x) for x in a]) < 0:
        raise OSError(ctypes.get_errno(), "")
def in_child(f):
    # A call that changes the process (tracing, namespaces) is made in a
    # child, which only reports its errno: a traced process stops at its
    # next signal, waiting for a tracer that never comes.
    pid = os.fork()
    if pid == 0:
        try:
            f()
            os._exit(0)
        except OSError as e:
            os._exit(e.errno or 255)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code != 0:
        raise OSError(code, "")
r = {}
def probe(name, f):
    try:
        f()
        r[name] = "ok"
    except OSError as e:
        r[name] = errno.errorcode.get(e.errno, str(e.errno))
probe("vsock", lambda: socket.socket(40, socket.SOCK_STREAM).close())
probe("inet", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close())
probe("netlink", lambda: socket.socket(16, socket.SOCK_RAW, 0).close())
probe("socketpair_inet", lambda: call(%[1]d, 2, 1, 0, buf(8)))
probe("io_uring_setup", lambda: call(%[2]d, 1, buf(120)))
probe("memfd_secret", lambda: call(%[3]d, 0))
probe("userfaultfd", lambda: call(%[4]d, 0))
probe("keyctl", lambda: call(%[7]d, 0, 0, 0, 0))
probe("clone3", lambda: call(%[8]d, 0, 0))
probe("personality_8", lambda: call(%[9]d, 8))
probe("tiocsti", lambda: call(%[10]d, 0, 0x5412, buf(1)))
probe("tiocsti_high", lambda: call(%[10]d, 0, 0x5412 | (1 << 32), buf(1)))
probe("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close())
probe("socketpair_unix", lambda: [s.close() for s in socket.socketpair()])
probe("thread", lambda: [t.start() or t.join() for t in [threading.Thread(target=len, args=("",))]])
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 7:
        raise OSError(errno.ECHILD, "")
probe("fork", fork)
probe("unshare_user", lambda: in_child(lambda: call(%[6]d, 0x10000000)))
probe("ptrace_traceme", lambda: in_child(lambda: call(%[5]d, 0, 0, 0, 0)))
print(json.dumps(r))
`, unix.SYS_SOCKETPAIR, unix.SYS_IO_URING_SETUP, unix.SYS_MEMFD_SECRET, unix.SYS_USERFAULTFD, unix.SYS_PTRACE,
		unix.SYS_UNSHARE, unix.SYS_KEYCTL, unix.SYS_CLONE3, unix.SYS_PERSONALITY, unix.SYS_IOCTL)
}

func parseProbe(t *testing.T, where string, out, errOut []byte) map[string]string {
	t.Helper()
	var r map[string]string
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("%s: the probe's report does not parse (%v): stdout %q stderr %q", where, err, out, errOut)
	}
	return r
}

// TestSeccompRefusesFromInside runs the probe in a run of the level: every
// call outside moat's allow-list must fail, ordinary ones must work. The
// positive control runs the same program on the host, where vsock and
// io_uring must get through, or the probe proves nothing.
func TestSeccompRefusesFromInside(t *testing.T) {
	needEngine(t)
	if runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64" {
		t.Skipf("moat has no seccomp profile for %s", runtime.GOARCH)
	}
	code := syscallProbe()

	// The positive control, on the host.
	host := exec.Command("/usr/bin/python3", "-")
	host.WaitDelay = 5 * time.Second
	host.Env = []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}
	host.Stdin = strings.NewReader(code)
	var hostErr strings.Builder
	host.Stderr = &hostErr
	hostOut, err := host.Output()
	if err != nil {
		t.Fatalf("the probe on the host: %v: %s", err, hostErr.String())
	}
	hr := parseProbe(t, "host", hostOut, []byte(hostErr.String()))
	t.Logf("on the host: %v", hr)
	for _, k := range []string{"vsock", "io_uring_setup"} {
		if hr[k] != "ok" {
			t.Fatalf("positive control: %s fails on the host (%s), so the probe cannot show that the sandbox refuses it", k, hr[k])
		}
	}

	forDrivers(t, func(t *testing.T, factory sandboxtest.Factory) { checkSeccompInside(t, factory, code) })
}

func checkSeccompInside(t *testing.T, factory sandboxtest.Factory, code string) {
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatal(err)
	}
	r := parseProbe(t, "container", res.Stdout, res.Stderr)
	t.Logf("in a run: %v", r)
	want := map[string]string{
		"vsock": "EAFNOSUPPORT", "inet": "EAFNOSUPPORT", "netlink": "EAFNOSUPPORT", "socketpair_inet": "EAFNOSUPPORT",
		"io_uring_setup": "EPERM", "memfd_secret": "EPERM", "userfaultfd": "EPERM", "ptrace_traceme": "EPERM",
		"unshare_user": "EPERM", "keyctl": "EPERM", "clone3": "ENOSYS", "personality_8": "EPERM",
		"tiocsti": "EPERM", "tiocsti_high": "EPERM",
		"unix": "ok", "socketpair_unix": "ok", "thread": "ok", "fork": "ok",
	}
	for k, v := range want {
		if r[k] != v {
			t.Errorf("%s in a run: %q, want %q", k, r[k], v)
		}
	}
}

// TestSeccompDockerDefault shows what the level would let through with the
// engine's default profile (the behaviour before moat passed its own), for
// the record: the same hardened flags, through the docker CLI.
func TestSeccompDockerDefault(t *testing.T) {
	needEngine(t)
	docker, err := exec.LookPath("docker")
	if err != nil {
		t.Skip("no docker CLI")
	}
	cmd := exec.Command(docker, "run", "--rm", "-i", "--network=none", "--cap-drop=ALL", "--security-opt=no-new-privileges:true",
		"--user=65534:65534", "--log-driver=none", image.Config{}.Tag(), "/usr/bin/python3", "-")
	cmd.Env = os.Environ()
	cmd.Stdin = strings.NewReader(syscallProbe())
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("docker run: %v: %s", err, stderr.String())
	}
	t.Logf("with the engine's default profile: %v", parseProbe(t, "docker default", out, []byte(stderr.String())))
}

// TestProbeRefusesWeakProfile shows that New's probe fails closed: with a
// profile that allows everything in place of moat's, the probe's calls get
// through in its container, and the level is unavailable.
func TestProbeRefusesWeakProfile(t *testing.T) {
	needEngine(t)
	arch := map[string]string{"amd64": "SCMP_ARCH_X86_64", "arm64": "SCMP_ARCH_AARCH64"}[runtime.GOARCH]
	weak := `{"defaultAction":"SCMP_ACT_ALLOW","architectures":["` + arch + `"],"syscalls":[]}`
	err := moatcontainer.ProbeWithProfile(moatcontainer.Config{}, weak)
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Fatalf("the probe with an allow-all profile: %v, want ErrUnavailable", err)
	}
	for _, name := range []string{"socket(AF_VSOCK)", "io_uring_setup", "memfd_secret", "ptrace(PTRACE_TRACEME)"} {
		if !strings.Contains(err.Error(), name) {
			t.Errorf("the probe's refusal does not name %s: %v", name, err)
		}
	}
	if err := moatcontainer.ProbeWithProfile(moatcontainer.Config{}, ""); err == nil {
		t.Error("the probe passed with an empty seccomp option, which gives the engine's default profile")
	}
	if left := leftovers(); len(left) > 0 {
		t.Errorf("the probes left containers: %v", left)
	}
}

// runAt is a run with the wall-clock window it took, seen from the host.
type runAt struct {
	res        *moat.Result
	err        error
	start, end time.Time
}

// TestPerRunUID runs two runs at once: each must have a uid (and gid) of
// its own, from the level's range, owning its working directory.
func TestPerRunUID(t *testing.T) {
	needEngine(t)
	forDrivers(t, testPerRunUID)
}

func testPerRunUID(t *testing.T, factory sandboxtest.Factory) {
	sb := factory(t, moat.Limits{})
	defer sb.Close()
	code := []byte(`import os, time
st = os.stat('/work')
open('/work/f', 'w').write('x')
print(os.getuid(), os.getgid(), st.st_uid, st.st_gid, flush=True)
time.sleep(2)
`)
	var runs [2]runAt
	var wg sync.WaitGroup
	for i := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runs[i].start = time.Now()
			runs[i].res, runs[i].err = sb.Run(context.Background(), moat.Request{Code: code})
			runs[i].end = time.Now()
		}()
	}
	wg.Wait()
	if runs[0].end.Before(runs[1].start) || runs[1].end.Before(runs[0].start) {
		t.Fatal("inconclusive: the two runs did not overlap")
	}
	var uids [2]int
	for i, r := range runs {
		if r.err != nil || r.res.ExitCode != 0 {
			t.Fatalf("run %d: %v %+v", i, r.err, r.res)
		}
		var uid, gid, owner, group int
		if _, err := fmt.Sscan(string(r.res.Stdout), &uid, &gid, &owner, &group); err != nil {
			t.Fatalf("run %d printed %q: %v", i, r.res.Stdout, err)
		}
		if uid != gid || owner != uid || group != gid {
			t.Errorf("run %d: uid %d gid %d, /work owned by %d:%d; want one number throughout", i, uid, gid, owner, group)
		}
		if uid < moatcontainer.DefaultUIDFirst || uid >= moatcontainer.DefaultUIDFirst+moatcontainer.DefaultUIDCount {
			t.Errorf("run %d: uid %d outside the level's range", i, uid)
		}
		uids[i] = uid
	}
	if uids[0] == uids[1] {
		t.Errorf("two concurrent runs share uid %d", uids[0])
	}
}

// TestInotifyPerUID: a run that holds every inotify instance its uid may
// have (fs.inotify.max_user_instances) must not keep a concurrent run from
// making one. With one uid for all runs, the second gets EMFILE.
func TestInotifyPerUID(t *testing.T) {
	needEngine(t)
	b, err := os.ReadFile("/proc/sys/fs/inotify/max_user_instances")
	if err != nil {
		t.Fatal(err)
	}
	max, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || max <= 0 {
		t.Fatalf("max_user_instances %q", b)
	}
	forDrivers(t, func(t *testing.T, factory sandboxtest.Factory) { checkInotifyPerUID(t, factory, max) })
}

func checkInotifyPerUID(t *testing.T, factory sandboxtest.Factory, max int) {
	sb := factory(t, moat.Limits{OpenFiles: max + 64, WallTime: moat.Duration(90 * time.Second)})
	defer sb.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pr, pw := io.Pipe()
	holder := make(chan runAt, 1)
	go func() {
		res, err := sb.Run(ctx, moat.Request{Stdout: pw, Code: []byte(`import ctypes, time
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while libc.inotify_init1(0) >= 0:
    n += 1
print("held", n, ctypes.get_errno(), flush=True)
time.sleep(80)
`)})
		pw.Close()
		holder <- runAt{res: res, err: err}
	}()
	line, err := bufio.NewReader(pr).ReadString('\n')
	go io.Copy(io.Discard, pr)
	if err != nil {
		r := <-holder
		t.Fatalf("the holder printed nothing: %v (%v %+v)", err, r.err, r.res)
	}
	var n, errno int
	if _, err := fmt.Sscanf(line, "held %d %d", &n, &errno); err != nil {
		t.Fatalf("the holder printed %q", line)
	}
	if n != max || syscall.Errno(errno) != syscall.EMFILE {
		t.Fatalf("inconclusive: the holder made %d inotify instances (errno %d), want all %d of its uid", n, errno, max)
	}

	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(`import ctypes
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0)
print(fd >= 0, ctypes.get_errno())
`)})
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.TrimSpace(string(res.Stdout)); !strings.HasPrefix(got, "True") {
		t.Errorf("while another run holds all its uid's inotify instances, inotify_init1 in a second run: %q (stderr %q); want it to succeed", got, res.Stderr)
	}
	cancel()
	if r := <-holder; r.err != nil && !errors.Is(r.err, context.Canceled) {
		t.Errorf("the holder: %v", r.err)
	}
}

// TestPoolLeases checks that each container prepared ahead of runs (and
// running, its python3 waiting for code) already has a uid of its own,
// leased (its lock held) while it waits, and that Close frees the leases.
func TestPoolLeases(t *testing.T) {
	needEngine(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Warm: 3})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			sb.Close()
		}
	}()
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	ctx := context.Background()
	var users []string
	deadline := time.Now().Add(time.Minute)
	for {
		list, err := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: filters.NewArgs(
			filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(os.Getpid())),
			filters.Arg("status", "running"),
		)})
		if err != nil {
			t.Fatal(err)
		}
		if len(list) >= 3 {
			users = nil
			for _, c := range list {
				ins, err := cli.ContainerInspect(ctx, c.ID)
				if cerrdefs.IsNotFound(err) {
					users = nil // removed meanwhile (another test's): list again
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				users = append(users, ins.Config.User)
			}
			if len(users) > 0 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool has %d prepared containers after a minute, want 3", len(list))
		}
		time.Sleep(50 * time.Millisecond)
	}
	seen := map[string]bool{}
	var uids []int
	for _, u := range users {
		uid, gid, _ := strings.Cut(u, ":")
		n, err := strconv.Atoi(uid)
		if err != nil || uid != gid || n < moatcontainer.DefaultUIDFirst || n >= moatcontainer.DefaultUIDFirst+moatcontainer.DefaultUIDCount {
			t.Errorf("a prepared container's user %q is not a uid:gid of the level's range", u)
		}
		if seen[u] {
			t.Errorf("two prepared containers share user %s", u)
		}
		seen[u] = true
		uids = append(uids, n)
	}
	if os.Geteuid() != 0 {
		return // the lock directory is elsewhere
	}
	locked := func(uid int) bool {
		f, err := os.Open(filepath.Join("/run/moat/uids", strconv.Itoa(uid)))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		return errors.Is(err, syscall.EWOULDBLOCK)
	}
	for _, uid := range uids {
		if !locked(uid) {
			t.Errorf("uid %d of a prepared container is not leased", uid)
		}
	}
	sb.Close()
	closed = true
	for _, uid := range uids {
		if locked(uid) {
			t.Errorf("uid %d is still leased after Close", uid)
		}
	}
}
