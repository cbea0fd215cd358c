//go:build linux && (amd64 || arm64)

package seccomp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The live tests run the test binary itself as the child (the os/exec test
// pattern): with childEnv set, TestMain runs childMain instead of the tests.
// A mode ending in "-plain" skips the filter, as the positive control that
// shows the filter, and not something else, is what refuses.
const childEnv = "MOAT_SECCOMP_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(childMain(mode))
	}
	os.Exit(m.Run())
}

// childMain is the whole life of a child process. It locks itself to one
// thread, as the real helper does, and installs the filter on it unless
// the mode ends in "-plain".
func childMain(mode string) int {
	runtime.LockOSThread()
	base, plain := strings.CutSuffix(mode, "-plain")
	if !plain {
		if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
			fmt.Fprintln(os.Stderr, "no_new_privs:", err)
			return 2
		}
		prog, err := Filter()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
		if err := Install(prog); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 2
		}
	}
	switch base {
	case "probe":
		return probeMain()
	case "python":
		return pythonMain()
	case "int80":
		return int80Main()
	}
	fmt.Fprintln(os.Stderr, "unknown child mode", mode)
	return 2
}

// probeReport is what a probe child prints.
type probeReport struct {
	// Mode is the Seccomp field of /proc/thread-self/status.
	Mode int `json:"mode"`
	// Errno maps each probe to the errno it got, 0 for success.
	Errno map[string]int `json:"errno"`
}

// probe is one raw system call made by the child; it returns the errno,
// 0 for success, and releases whatever it created.
type probe struct {
	name string
	run  func() syscall.Errno
}

// sys makes a raw system call and closes the descriptor it returns, if
// closeFD is set.
func sys(closeFD bool, nr uintptr, args ...uintptr) syscall.Errno {
	var a [6]uintptr
	copy(a[:], args)
	r, _, errno := syscall.RawSyscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5])
	if errno == 0 && closeFD {
		syscall.Close(int(r))
	}
	return errno
}

// rawFork calls clone with flags and no new stack, like fork. The new
// process exits at once with status 0.
//
//go:norace
//go:nosplit
func rawFork(flags uintptr) (pid uintptr, errno syscall.Errno) {
	pid, _, errno = syscall.RawSyscall6(syscall.SYS_CLONE, flags, 0, 0, 0, 0, 0)
	if errno == 0 && pid == 0 {
		syscall.RawSyscall(syscall.SYS_EXIT_GROUP, 0, 0, 0)
	}
	return pid, errno
}

// forkProbe forks with flags and reaps the child, which must exit 0.
func forkProbe(flags uintptr) syscall.Errno {
	pid, errno := rawFork(flags)
	if errno != 0 {
		return errno
	}
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(int(pid), &ws, 0, nil); err != nil {
		return err.(syscall.Errno)
	}
	if !ws.Exited() || ws.ExitStatus() != 0 {
		return syscall.ECHILD // not a real result of clone: makes the test fail
	}
	return 0
}

func str(s string) uintptr {
	p, err := unix.BytePtrFromString(s)
	if err != nil {
		panic(err)
	}
	return uintptr(unsafe.Pointer(p))
}

const high = 1 << 32

func probes() []probe {
	ppid := uintptr(os.Getppid())
	sigchld := uintptr(syscall.SIGCHLD)
	return []probe{
		{"getpid", func() syscall.Errno { return sys(false, unix.SYS_GETPID) }},
		{"socket AF_UNIX", func() syscall.Errno { return sys(true, unix.SYS_SOCKET, unix.AF_UNIX, unix.SOCK_STREAM, 0) }},
		{"socket AF_INET", func() syscall.Errno { return sys(true, unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM, 0) }},
		{"socket AF_INET6", func() syscall.Errno { return sys(true, unix.SYS_SOCKET, unix.AF_INET6, unix.SOCK_DGRAM, 0) }},
		{"socket AF_NETLINK", func() syscall.Errno {
			return sys(true, unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE)
		}},
		// Protocol 0: the packet socket receives nothing.
		{"socket AF_PACKET", func() syscall.Errno { return sys(true, unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_RAW, 0) }},
		// The kernel truncates the family to an int, as the filter assumes.
		{"socket AF_INET, high half set", func() syscall.Errno {
			return sys(true, unix.SYS_SOCKET, high|unix.AF_INET, unix.SOCK_STREAM, 0)
		}},
		{"socket AF_UNIX, high half set", func() syscall.Errno {
			return sys(true, unix.SYS_SOCKET, high|unix.AF_UNIX, unix.SOCK_STREAM, 0)
		}},
		{"socketpair AF_UNIX", func() syscall.Errno {
			var fds [2]int32
			errno := sys(false, unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_STREAM, 0, uintptr(unsafe.Pointer(&fds)))
			if errno == 0 {
				syscall.Close(int(fds[0]))
				syscall.Close(int(fds[1]))
			}
			return errno
		}},
		{"socketpair AF_INET", func() syscall.Errno {
			var fds [2]int32
			return sys(false, unix.SYS_SOCKETPAIR, unix.AF_INET, unix.SOCK_STREAM, 0, uintptr(unsafe.Pointer(&fds)))
		}},
		// Not tracing the parent: ESRCH without the filter.
		{"ptrace", func() syscall.Errno { return sys(false, unix.SYS_PTRACE, unix.PTRACE_PEEKDATA, ppid, 0, 0) }},
		// The target does not exist: ENOENT without the filter.
		{"mount", func() syscall.Errno {
			return sys(false, unix.SYS_MOUNT, str("none"), str("/nonexistent/moat-seccomp-test"), str("tmpfs"), 0, 0)
		}},
		// A multithreaded process may not unshare its user namespace:
		// EINVAL without the filter.
		{"unshare CLONE_NEWUSER", func() syscall.Errno { return sys(false, unix.SYS_UNSHARE, unix.CLONE_NEWUSER) }},
		{"unshare CLONE_NEWNET", func() syscall.Errno { return sys(false, unix.SYS_UNSHARE, unix.CLONE_NEWNET) }},
		{"setns", func() syscall.Errno { return sys(false, unix.SYS_SETNS, ^uintptr(0), 0) }},
		// An unknown operation: EOPNOTSUPP without the filter.
		{"keyctl", func() syscall.Errno { return sys(false, unix.SYS_KEYCTL, 0x7fff, 0, 0, 0, 0) }},
		// An unknown command: EINVAL without the filter.
		{"bpf", func() syscall.Errno { return sys(false, unix.SYS_BPF, 0x7fff, 0, 0) }},
		// No parameters: EFAULT without the filter.
		{"io_uring_setup", func() syscall.Errno { return sys(true, unix.SYS_IO_URING_SETUP, 1, 0) }},
		{"perf_event_open", func() syscall.Errno { return sys(true, unix.SYS_PERF_EVENT_OPEN, 0, 0, ^uintptr(0), ^uintptr(0), 0) }},
		// No arguments: EINVAL without the filter.
		{"clone3", func() syscall.Errno { return sys(false, unix.SYS_CLONE3, 0, 0) }},
		{"clone fork", func() syscall.Errno { return forkProbe(sigchld) }},
		{"clone CLONE_NEWNET", func() syscall.Errno { return forkProbe(sigchld | unix.CLONE_NEWNET) }},
		// The kernel ignores the high half of clone's flags: a plain fork.
		{"clone CLONE_NEWNET in the high half", func() syscall.Errno { return forkProbe(sigchld | unix.CLONE_NEWNET<<32) }},
		// Bad descriptor: EBADF without the filter.
		{"ioctl TIOCSTI", func() syscall.Errno { return sys(false, unix.SYS_IOCTL, ^uintptr(0), unix.TIOCSTI, 0) }},
		{"ioctl TIOCSTI, high half set", func() syscall.Errno {
			return sys(false, unix.SYS_IOCTL, ^uintptr(0), high|unix.TIOCSTI, 0)
		}},
		{"ioctl TIOCLINUX", func() syscall.Errno { return sys(false, unix.SYS_IOCTL, ^uintptr(0), unix.TIOCLINUX, 0) }},
		{"ioctl TIOCGWINSZ", func() syscall.Errno { return sys(false, unix.SYS_IOCTL, ^uintptr(0), unix.TIOCGWINSZ, 0) }},
		{"personality query", func() syscall.Errno { return sys(false, unix.SYS_PERSONALITY, 0xffffffff) }},
		{"personality READ_IMPLIES_EXEC", func() syscall.Errno { return sys(false, unix.SYS_PERSONALITY, 0x0400000) }},
		{"personality PER_LINUX", func() syscall.Errno { return sys(false, unix.SYS_PERSONALITY, 0) }},
	}
}

func probeMain() int {
	rep := probeReport{Mode: -1, Errno: make(map[string]int)}
	for _, p := range probes() {
		rep.Errno[p.name] = int(p.run())
	}
	// The Go runtime keeps working around the filtered thread.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { _ = make([]byte, 1<<20); time.Sleep(time.Millisecond) })
	}
	wg.Wait()
	runtime.GC()
	if status, err := os.ReadFile("/proc/thread-self/status"); err == nil {
		for line := range strings.Lines(string(status)) {
			if v, ok := strings.CutPrefix(line, "Seccomp:"); ok {
				rep.Mode, _ = strconv.Atoi(strings.TrimSpace(v))
			}
		}
	}
	if err := json.NewEncoder(os.Stdout).Encode(rep); err != nil {
		return 2
	}
	return 0
}

// runChild runs the test binary as a child in mode and returns its
// standard output and exit status.
func runChild(t *testing.T, mode string) ([]byte, *os.ProcessState) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, self)
	cmd.Env = []string{childEnv + "=" + mode, "PATH=/usr/bin:/bin"}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	err = cmd.Run()
	var exitErr *exec.ExitError
	if err != nil && !errors.As(err, &exitErr) {
		t.Fatalf("child %s: %v", mode, err)
	}
	if stderr.Len() > 0 {
		t.Logf("child %s stderr:\n%s", mode, stderr.String())
	}
	return stdout.Bytes(), cmd.ProcessState
}

func runProbes(t *testing.T, mode string) probeReport {
	t.Helper()
	out, state := runChild(t, mode)
	if !state.Success() {
		t.Fatalf("child %s: %v", mode, state)
	}
	var rep probeReport
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("child %s printed %q: %v", mode, out, err)
	}
	return rep
}

func checkProbes(t *testing.T, rep probeReport, want map[string]syscall.Errno) {
	t.Helper()
	for _, p := range probes() {
		w, ok := want[p.name]
		if !ok {
			t.Errorf("no expectation for probe %q", p.name)
			continue
		}
		got, ok := rep.Errno[p.name]
		if !ok {
			t.Errorf("%s: not reported", p.name)
			continue
		}
		if syscall.Errno(got) != w {
			t.Errorf("%s: got %s, want %s", p.name, errName(syscall.Errno(got)), errName(w))
		}
	}
}

func errName(e syscall.Errno) string {
	if e == 0 {
		return "success"
	}
	if n := unix.ErrnoName(e); n != "" {
		return n
	}
	return strconv.Itoa(int(e))
}

// TestInstallProbes installs the filter in a child and checks the exact
// errno of each raw system call.
func TestInstallProbes(t *testing.T) {
	t.Parallel()
	rep := runProbes(t, "probe")
	if rep.Mode != 2 {
		t.Errorf("Seccomp mode of the filtered thread is %d, want 2 (filter)", rep.Mode)
	}
	checkProbes(t, rep, map[string]syscall.Errno{
		"getpid":                              0,
		"socket AF_UNIX":                      unix.EPERM,
		"socket AF_INET":                      unix.EAFNOSUPPORT,
		"socket AF_INET6":                     unix.EAFNOSUPPORT,
		"socket AF_NETLINK":                   unix.EAFNOSUPPORT,
		"socket AF_PACKET":                    unix.EAFNOSUPPORT,
		"socket AF_INET, high half set":       unix.EAFNOSUPPORT,
		"socket AF_UNIX, high half set":       unix.EPERM,
		"socketpair AF_UNIX":                  0,
		"socketpair AF_INET":                  unix.EAFNOSUPPORT,
		"ptrace":                              unix.EPERM,
		"mount":                               unix.EPERM,
		"unshare CLONE_NEWUSER":               unix.EPERM,
		"unshare CLONE_NEWNET":                unix.EPERM,
		"setns":                               unix.EPERM,
		"keyctl":                              unix.EPERM,
		"bpf":                                 unix.EPERM,
		"io_uring_setup":                      unix.EPERM,
		"perf_event_open":                     unix.EPERM,
		"clone3":                              unix.ENOSYS,
		"clone fork":                          0,
		"clone CLONE_NEWNET":                  unix.EPERM,
		"clone CLONE_NEWNET in the high half": 0,
		"ioctl TIOCSTI":                       unix.EPERM,
		"ioctl TIOCSTI, high half set":        unix.EPERM,
		"ioctl TIOCLINUX":                     unix.EPERM,
		"ioctl TIOCGWINSZ":                    unix.EBADF,
		"personality query":                   0,
		"personality READ_IMPLIES_EXEC":       unix.EPERM,
		"personality PER_LINUX":               0,
	})
}

// TestInstallProbesPlain is the positive control: the same probes without
// the filter get through, or fail for the kernel's own reasons.
func TestInstallProbesPlain(t *testing.T) {
	t.Parallel()
	rep := runProbes(t, "probe-plain")
	if rep.Mode != 0 {
		t.Errorf("Seccomp mode of the unfiltered thread is %d, want 0", rep.Mode)
	}
	checkProbes(t, rep, map[string]syscall.Errno{
		"getpid":                              0,
		"socket AF_UNIX":                      0,
		"socket AF_INET":                      0,
		"socket AF_INET6":                     0,
		"socket AF_NETLINK":                   0,
		"socket AF_PACKET":                    0,
		"socket AF_INET, high half set":       0,
		"socket AF_UNIX, high half set":       0,
		"socketpair AF_UNIX":                  0,
		"socketpair AF_INET":                  unix.EOPNOTSUPP,
		"ptrace":                              unix.ESRCH,
		"mount":                               unix.ENOENT,
		"unshare CLONE_NEWUSER":               unix.EINVAL,
		"unshare CLONE_NEWNET":                0,
		"setns":                               unix.EBADF,
		"keyctl":                              unix.EOPNOTSUPP,
		"bpf":                                 unix.EINVAL,
		"io_uring_setup":                      unix.EFAULT,
		"perf_event_open":                     unix.EFAULT,
		"clone3":                              unix.EINVAL,
		"clone fork":                          0,
		"clone CLONE_NEWNET":                  0,
		"clone CLONE_NEWNET in the high half": 0,
		"ioctl TIOCSTI":                       unix.EBADF,
		"ioctl TIOCSTI, high half set":        unix.EBADF,
		"ioctl TIOCLINUX":                     unix.EBADF,
		"ioctl TIOCGWINSZ":                    unix.EBADF,
		"personality query":                   0,
		"personality READ_IMPLIES_EXEC":       0,
		"personality PER_LINUX":               0,
	})
}

func TestInstallRejectsEmpty(t *testing.T) {
	if err := Install(nil); err == nil {
		t.Errorf("Install(nil) succeeded")
	}
	if err := Install(make([]unix.SockFilter, unix.BPF_MAXINSNS+1)); err == nil {
		t.Errorf("Install accepted %d instructions", unix.BPF_MAXINSNS+1)
	}
}
