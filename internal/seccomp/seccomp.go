//go:build linux

package seccomp

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// ErrUnsupportedArch is returned by Filter on an architecture this package
// has no policy for.
var ErrUnsupportedArch = errors.New("seccomp: unsupported architecture " + runtime.GOARCH)

// Offsets into struct seccomp_data, the input of a seccomp filter. Every
// load is a native-endian 32-bit word; both supported architectures are
// little-endian, so the low half of args[i] comes first.
const (
	offNr   = 0  // int nr
	offArch = 4  // __u32 arch
	offArgs = 16 // __u64 args[6]
)

// argLow returns the offset of the low 32 bits of syscall argument i.
func argLow(i int) uint32 { return offArgs + 8*uint32(i) }

// The actions the filter returns.
const (
	retAllow = unix.SECCOMP_RET_ALLOW
	retKill  = unix.SECCOMP_RET_KILL_PROCESS
)

// retErrno returns the action that fails a syscall with errno e.
func retErrno(e unix.Errno) uint32 {
	return unix.SECCOMP_RET_ERRNO | uint32(e)&unix.SECCOMP_RET_DATA
}

// Filter returns moat's default filter program for the running
// architecture, ready for Install. It returns ErrUnsupportedArch on an
// architecture other than amd64 and arm64. Each call returns a new slice.
func Filter() ([]unix.SockFilter, error) { return assemble(false) }

// FilterTCP returns Filter's program with two exceptions, for a sandbox
// whose network namespace of its own holds only a loopback with moat's
// egress proxy listening on it, so that a TCP connection reaches that
// listener or nothing: socket() of an IPv4 TCP socket (AF_INET,
// SOCK_STREAM with SOCK_NONBLOCK and SOCK_CLOEXEC allowed, protocol 0 or
// IPPROTO_TCP) and connect() are allowed. Every other family (AF_UNIX,
// AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK, ...), type (UDP, raw, ICMP)
// and protocol stays refused, and so do bind, listen and accept.
func FilterTCP() ([]unix.SockFilter, error) { return assemble(true) }

func assemble(tcp bool) ([]unix.SockFilter, error) {
	prog, err := program(tcp)
	if err != nil {
		return nil, err
	}
	raw, err := bpf.Assemble(prog)
	if err != nil {
		return nil, fmt.Errorf("seccomp: assemble: %w", err)
	}
	out := make([]unix.SockFilter, len(raw))
	for i, r := range raw {
		out[i] = unix.SockFilter{Code: r.Op, Jt: r.Jt, Jf: r.Jf, K: r.K}
	}
	return out, nil
}

// Install loads prog as a seccomp filter on the calling thread only, with
// prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER); it does not synchronise the
// filter to the process's other threads. The filter stays for the life of
// the thread, is inherited by every process and thread it creates, and
// survives execve. It cannot be removed.
//
// Preconditions:
//   - no_new_privs is already set on this thread
//     (prctl(PR_SET_NO_NEW_PRIVS, 1)), or the thread has CAP_SYS_ADMIN;
//     otherwise the kernel refuses with EACCES.
//   - The caller holds runtime.LockOSThread and never unlocks it, and
//     starts the sandboxed program from that same goroutine: syscall.Exec
//     (execve ends every other thread, so the new image runs entirely under
//     the filter) or syscall.ForkExec (the child inherits this thread's
//     filter). The Go runtime's other threads stay unfiltered and keep
//     working. With ForkExec, leave SysProcAttr.UseCgroupFD unset: it makes
//     Go use clone3, which the filter answers with ENOSYS and Go does not
//     retry with clone.
//
// Install makes a single raw system call and does not allocate after it.
func Install(prog []unix.SockFilter) error {
	if len(prog) == 0 || len(prog) > unix.BPF_MAXINSNS {
		return fmt.Errorf("seccomp: program has %d instructions, want 1 to %d", len(prog), unix.BPF_MAXINSNS)
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	_, _, errno := unix.RawSyscall(unix.SYS_PRCTL, unix.PR_SET_SECCOMP, unix.SECCOMP_MODE_FILTER, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(&fprog)
	runtime.KeepAlive(prog)
	if errno != 0 {
		return fmt.Errorf("seccomp: install filter: %w", errno)
	}
	return nil
}
