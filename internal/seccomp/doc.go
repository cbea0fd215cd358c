//go:build linux

// Package seccomp builds and installs moat's own seccomp-BPF filter for the
// subprocess level: a deny-list written directly in classic BPF (with
// golang.org/x/net/bpf as the assembler), without cgo or libseccomp.
//
// Filter returns the program for the running architecture (amd64 and
// arm64); Install loads a program on the calling thread. A re-executed
// helper stage uses them just before it starts the user's interpreter from
// the same locked thread (syscall.Exec or syscall.ForkExec):
//
//	runtime.LockOSThread()
//	// ... rlimits, setuid, PR_SET_NO_NEW_PRIVS, Landlock ...
//	prog, err := seccomp.Filter()
//	// ...
//	if err := seccomp.Install(prog); err != nil { ... }
//	syscall.Exec("/usr/bin/python3", argv, env)
//
// # Policy
//
// Every syscall is allowed except the following.
//
//   - A syscall made with a foreign calling convention (seccomp_data.arch is
//     not the running architecture's AUDIT_ARCH, for example i386 through
//     int 0x80 on amd64) kills the whole process. On amd64 a syscall number
//     with the x32 bit (0x40000000) set fails with ENOSYS.
//   - socket fails for every family: EPERM for AF_UNIX (a unix socket could
//     connect to any socket file of the host by path, which Landlock before
//     ABI 9 does not govern, or to an abstract socket by name), EAFNOSUPPORT
//     for the rest (IPv4, IPv6, netlink, packet, vsock, ...). socketpair
//     works for AF_UNIX only: a connected pair reaches nothing but itself.
//   - clone fails with EPERM when its flags ask for a new namespace
//     (CLONE_NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWCGROUP,
//     NEWTIME); fork, vfork and pthread_create keep working.
//   - clone3 fails with ENOSYS: its flags live in memory that a seccomp
//     filter cannot read. glibc (2.34 and later) then falls back to clone.
//   - ioctl fails with EPERM for TIOCSTI (typing into the terminal) and
//     TIOCLINUX.
//   - personality fails with EPERM except for the query 0xffffffff and the
//     default persona 0.
//   - A fixed list of syscalls (deniedCommon and deniedArch in the
//     filter_*.go files) fails with EPERM, whatever the arguments: those that escape or inspect other processes
//     (ptrace, process_vm_*, kcmp, pidfd_getfd, process_madvise,
//     move_pages, migrate_pages), make or enter namespaces and mounts
//     (unshare, setns, mount and the new mount API, chroot, pivot_root,
//     file handles), reach the kernel's riskiest surfaces (bpf,
//     perf_event_open, userfaultfd, io_uring, keyrings, fanotify, NUMA
//     memory policy), make files the code writes into code (memfd_create:
//     a memfd lies on no noexec mount, and exec or the loader runs it)
//     or administer the host (modules, kexec, reboot, swap,
//     accounting, quotas, the kernel log, host and domain names, clocks,
//     port I/O). The lists follow Docker's default profile for an
//     unprivileged container, plus io_uring (which can create sockets
//     without calling socket), the new mount API and the mount-tree
//     listing calls.
//
// FilterTCP is the same policy with two exceptions, for a sandbox whose
// own network namespace holds only a loopback with moat's egress proxy
// listening on it: socket() of an IPv4 TCP socket (AF_INET, SOCK_STREAM,
// protocol 0 or IPPROTO_TCP) and connect() are allowed. Every other family
// (AF_VSOCK among them), UDP, raw and ICMP sockets, and bind, listen and
// accept stay refused.
//
// # Arguments
//
// A seccomp filter sees each argument as a 64-bit value, but every argument
// this filter inspects is one the kernel truncates to 32 bits before using
// it: socket and socketpair take an int family, ioctl an unsigned int
// command, personality an unsigned int persona, and clone applies
// lower_32_bits to its flags. The filter therefore compares the low half
// only, which is exactly what the kernel acts on. Comparing all 64 bits
// would be wrong here: ioctl(fd, TIOCSTI|1<<32) would not equal TIOCSTI, yet
// the kernel would perform TIOCSTI.
//
// # Performance
//
// The program is a linear list of comparisons on the syscall number, and
// arguments are loaded only for the five syscalls above. The kernel (5.11
// and later) recognises every other syscall as always allowed and skips the
// filter for it through its per-syscall action cache.
package seccomp
