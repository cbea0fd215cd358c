package container

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/seccomp"
)

// profile is moat's own seccomp profile for containers (see
// seccomp.Docker): an allow-list, passed to the engine with every
// container, in place of the engine's default.
type profile struct {
	json    string // what HostConfig.SecurityOpt carries after "seccomp="
	digest  string // "sha256:" and the hex digest of json
	allowed int    // syscalls allowed, with or without argument checks
}

// newProfile builds the profile for the running architecture. With inet
// (a Sandbox with an egress proxy), socket also allows AF_INET and
// AF_INET6 (see allowInet); without it, AF_UNIX only.
func newProfile(inet bool) (*profile, error) {
	p, err := seccomp.Docker()
	if err != nil {
		return nil, unavailable("moat has no seccomp profile for this architecture", "run moat on amd64 or arm64", err)
	}
	if inet {
		if err := allowInet(p); err != nil {
			return nil, err
		}
	}
	b, err := p.JSON()
	if err != nil {
		return nil, fmt.Errorf("container: %w", err)
	}
	sum := sha256.Sum256(b)
	return &profile{json: string(b), digest: "sha256:" + hex.EncodeToString(sum[:]), allowed: len(p.Allowed())}, nil
}

// The socket families a container with an egress proxy may create, and
// what socket answers for every other: AF_VSOCK above all must stay closed,
// since its ports are not namespaced and reach the host.
const (
	afUnix  = unix.AF_UNIX  // 1
	afInet  = unix.AF_INET  // 2
	afInet6 = unix.AF_INET6 // 10
)

// allowInet changes p's socket rules from AF_UNIX only to AF_UNIX, AF_INET
// and AF_INET6, for a container whose network namespace holds only its
// loopback and moat's proxy listener on it. socketpair stays AF_UNIX only.
// Every other family (AF_VSOCK, AF_NETLINK, AF_PACKET, ...) and any value
// with bits above the low 32 (the kernel takes the family as an int, so
// 1<<32|AF_INET would be AF_INET to it) fail with EAFNOSUPPORT: the rules
// compare all 64 bits, and the refusals cover exactly the values the
// allowances do not (0, 3, 4-7, 8-9, and above 10), so that no two rules
// of socket overlap (libseccomp does not order overlapping rules of one
// syscall).
func allowInet(p *seccomp.DockerProfile) error {
	const (
		allow    = "SCMP_ACT_ALLOW"
		errnoAct = "SCMP_ACT_ERRNO"
		eq       = "SCMP_CMP_EQ"
		gt       = "SCMP_CMP_GT"
		maskedEq = "SCMP_CMP_MASKED_EQ"
	)
	if afUnix != 1 || afInet != 2 || afInet6 != 10 {
		return fmt.Errorf("container: socket families are not numbered as the inet profile assumes")
	}
	found := 0
	var rules []seccomp.DockerSyscall
	for _, r := range p.Syscalls {
		if !slices.Equal(r.Names, []string{"socket", "socketpair"}) {
			rules = append(rules, r)
			continue
		}
		found++
		// socketpair keeps its rule; socket gets the ones below.
		r.Names = []string{"socketpair"}
		rules = append(rules, r)
	}
	if found != 2 {
		return fmt.Errorf("container: moat's seccomp profile has %d socket rules, want 2 (allow AF_UNIX, refuse the rest)", found)
	}
	refuse := uint(unix.EAFNOSUPPORT)
	arg := func(op string, v, v2 uint64) []seccomp.DockerArg {
		return []seccomp.DockerArg{{Index: 0, Value: v, ValueTwo: v2, Op: op}}
	}
	for _, f := range []uint64{afUnix, afInet, afInet6} {
		rules = append(rules, seccomp.DockerSyscall{Names: []string{"socket"}, Action: allow, Args: arg(eq, f, 0),
			Comment: "unix and inet sockets: the network namespace holds only its loopback, where moat's egress proxy listens"})
	}
	for _, a := range [][]seccomp.DockerArg{
		arg(eq, 0, 0),                // AF_UNSPEC
		arg(eq, 3, 0),                // AF_AX25
		arg(maskedEq, ^uint64(3), 4), // 4-7
		arg(maskedEq, ^uint64(1), 8), // 8-9
		arg(gt, afInet6, 0),          // 11 and up: AF_NETLINK, AF_PACKET, AF_VSOCK, high bits
	} {
		rules = append(rules, seccomp.DockerSyscall{Names: []string{"socket"}, Action: errnoAct, ErrnoRet: &refuse, Args: a})
	}
	p.Syscalls = rules
	return nil
}

func (p *profile) String() string {
	return fmt.Sprintf("moat seccomp profile %s: an allow-list of %d syscall names (those this architecture lacks are skipped)", p.digest[:19], p.allowed)
}

// file writes the profile to a file of this user's own and returns its
// path, for the docker CLI, which takes a profile by path.
func (p *profile) file() (string, error) {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("moat-%d", os.Geteuid()))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	// The directory must be this user's and writable by no one else, or
	// another user could swap the profile the CLI reads.
	st, err := os.Lstat(dir)
	if err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	if !st.IsDir() || !ok || int(sys.Uid) != os.Geteuid() || st.Mode().Perm()&0o022 != 0 {
		return "", fmt.Errorf("container: %s is not a directory of this user's that others cannot write", dir)
	}
	path := filepath.Join(dir, "seccomp-"+p.digest[len("sha256:"):][:16]+".json")
	tmp, err := os.CreateTemp(dir, ".seccomp-*")
	if err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(p.json); err != nil {
		tmp.Close()
		return "", fmt.Errorf("container: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", fmt.Errorf("container: %w", err)
	}
	return path, nil
}

// seccompWait bounds how long a run's init may take, after the container
// started, to install its seccomp filter (runc does it just before it
// executes the command, with no-new-privileges).
const seccompWait = 10 * time.Second

// initSeccomp waits until process pid runs under a seccomp filter (mode 2
// in /proc/PID/status) and returns its Seccomp_filters count. It fails
// when the process executed its command without a filter, or is gone.
// Judged from the host: the code has not run yet and cannot write there.
func initSeccomp(pid int) (int, error) {
	deadline := time.Now().Add(seccompWait)
	pause := 50 * time.Microsecond
	for {
		st, err := procStatus(pid)
		if err != nil {
			return 0, fmt.Errorf("container: the run's init (pid %d): %w", pid, err)
		}
		if st["Seccomp"] == "2" {
			n, err := strconv.Atoi(st["Seccomp_filters"])
			if err != nil || n < 1 {
				return 0, fmt.Errorf("container: the run's init (pid %d) is in seccomp mode 2 with filters %q", pid, st["Seccomp_filters"])
			}
			return n, nil
		}
		// runc's init installs the filter and then executes the command:
		// a process that is no longer runc's init has no filter to come.
		if !strings.HasPrefix(st["Name"], "runc:") {
			return 0, fmt.Errorf("container: the run's init (pid %d, %s) runs without a seccomp filter (Seccomp: %s)", pid, st["Name"], st["Seccomp"])
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("container: the run's init (pid %d) installed no seccomp filter within %s", pid, seccompWait)
		}
		time.Sleep(pause)
		pause = min(2*pause, 5*time.Millisecond)
	}
}

// procStatus returns the fields of /proc/PID/status.
func procStatus(pid int) (map[string]string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			m[k] = strings.TrimSpace(v)
		}
	}
	return m, nil
}

// The probe: what must fail inside every container of moat, tried once by
// New and by Check in a container made like every run's. Each entry is
// Python that raises OSError when refused; the names are what Check and
// the errors say.
// A call "got through" when it succeeded, or failed with reached: an
// errno only the kernel's own code past seccomp gives (ioctl on the probe's
// stdin, a pipe, answers ENOTTY). A call marked inet is one that the
// profile of a Sandbox with an egress proxy allows: there it must succeed
// (the profile is the inet one), elsewhere be refused.
var probeCalls = []struct {
	name, code string
	nr         int // the syscall number the code takes, if any
	reached    string
	inet       bool
}{
	{name: "socket(AF_VSOCK)", code: "socket.socket(40, socket.SOCK_STREAM).close()"},
	{name: "socket(AF_INET)", code: "socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()", inet: true},
	{name: "socket(AF_NETLINK)", code: "socket.socket(16, socket.SOCK_RAW, 0).close()"},
	{name: "socket(1<<32|AF_INET)", code: "os.close(call(%d, (1<<32)|2, 1, 0))", nr: unix.SYS_SOCKET},
	{name: "socketpair(AF_INET)", code: "call(%d, 2, 1, 0, buf(8))", nr: unix.SYS_SOCKETPAIR},
	{name: "io_uring_setup", code: "call(%d, 1, buf(120))", nr: unix.SYS_IO_URING_SETUP},
	{name: "memfd_secret", code: "call(%d, 0)", nr: unix.SYS_MEMFD_SECRET},
	{name: "userfaultfd", code: "call(%d, 0)", nr: unix.SYS_USERFAULTFD},
	{name: "ptrace(PTRACE_TRACEME)", code: "in_child(lambda: call(%d, 0, 0, 0, 0))", nr: unix.SYS_PTRACE},
	{name: "unshare(CLONE_NEWUSER)", code: "in_child(lambda: call(%d, 0x10000000))", nr: unix.SYS_UNSHARE},
	{name: "keyctl", code: "call(%d, 0, 0, 0, 0)", nr: unix.SYS_KEYCTL},
	{name: "ioctl(TIOCSTI)", code: "call(%d, 0, 0x5412, buf(1))", nr: unix.SYS_IOCTL, reached: "ENOTTY"},
}

// probeCode is the probe's program: it prints one JSON object, each call's
// name mapped to "ok" or the errno's name.
func probeCode() string {
	var b strings.Builder
	b.WriteString(`import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
bufs = []  # kept alive: the kernel may write into them
def buf(n):
    bufs.append(ctypes.create_string_buffer(n))
    return ctypes.addressof(bufs[-1])
def call(*a):
    r = libc.syscall(*[ctypes.c_long(x) for x in a])
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, "")
    return r
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
`)
	for _, c := range probeCalls {
		code := c.code
		if c.nr != 0 {
			code = fmt.Sprintf(code, c.nr)
		}
		fmt.Fprintf(&b, "probe(%q, lambda: %s)\n", c.name, code)
	}
	b.WriteString("print(json.dumps(r))\n")
	return b.String()
}

// probeResult is what the probe found: each call's errno name, and the
// number of seccomp filters the container's init ran under.
type probeResult struct {
	calls   map[string]string
	filters int
}

func (r *probeResult) String() string {
	parts := make([]string, 0, len(probeCalls))
	for _, c := range probeCalls {
		parts = append(parts, c.name+" "+r.calls[c.name])
	}
	return strings.Join(parts, ", ")
}

// probeSeccomp runs the probe in a container prepared like every run's,
// through the engine's one lifecycle (a run of its own, no pool), and
// fails, with an unavailable error, unless every call was refused: an
// engine that ignores or loosens moat's profile leaves the level
// unavailable. b.filters must still be zero.
func (b *backend) probeSeccomp(ctx context.Context) (*probeResult, error) {
	eng, err := engine.New(engine.Config{Level: moat.LevelContainer, Limits: b.spec.limits, Warm: -1}, probeBackend{b})
	if err != nil {
		return nil, err
	}
	defer eng.Close()
	res, err := eng.Run(ctx, moat.Request{Code: []byte(probeCode())})
	if err != nil {
		return nil, unavailable("moat's seccomp probe could not run in a container", "check dockerd's log", err)
	}
	r := &probeResult{filters: int(b.lastFilters.Load())}
	if res.ExitCode != 0 || json.Unmarshal(res.Stdout, &r.calls) != nil {
		return nil, unavailable(fmt.Sprintf("moat's seccomp probe failed in a container (exit %d): %q", res.ExitCode, res.Stderr),
			"check that the image runs python3 with ctypes", nil)
	}
	var through, refused []string
	for _, c := range probeCalls {
		v, ok := r.calls[c.name]
		got := v == "ok" || v == c.reached
		switch {
		case !ok:
			return nil, unavailable("moat's seccomp probe did not report "+c.name, "check the image", nil)
		case c.inet && b.spec.egress:
			if v != "ok" {
				refused = append(refused, c.name+" "+v)
			}
		case got:
			through = append(through, c.name)
		}
	}
	if len(through) > 0 {
		return nil, unavailable(fmt.Sprintf("the Docker engine does not enforce moat's seccomp profile: %s succeeded in a container", strings.Join(through, ", ")),
			"use a dockerd and runc built with seccomp that honour HostConfig.SecurityOpt seccomp=<profile>", nil)
	}
	if len(refused) > 0 {
		return nil, unavailable(fmt.Sprintf("moat's seccomp profile for egress is not the one in force: %s failed in a container", strings.Join(refused, ", ")),
			"check dockerd and the runtime", nil)
	}
	return r, nil
}

// probeBackend is the backend for the probe's engine, which must not
// close the client of the backend it borrows.
type probeBackend struct{ *backend }

func (probeBackend) Close() error { return nil }

// probed caches each probe's result per engine, runtime, image and
// profile, so that a process creating many Sandboxes probes once; every
// run still checks its own init's filter (initSeccomp).
var probed sync.Map // string -> *probeResult

func probeKey(e *daemon, image string, p *profile) string {
	return strings.Join([]string{e.host, e.version, e.runtime, e.runtimePath, image, p.digest}, "\x00")
}
