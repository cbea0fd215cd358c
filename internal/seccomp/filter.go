//go:build linux && (amd64 || arm64)

package seccomp

import (
	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// deniedCommon lists the syscalls that fail with EPERM whatever their
// arguments, on every supported architecture. deniedArch (in the
// architecture's own file) adds the ones only that architecture has.
var deniedCommon = []uint32{
	// Reading or steering other processes.
	unix.SYS_PTRACE,
	unix.SYS_PROCESS_VM_READV,
	unix.SYS_PROCESS_VM_WRITEV,
	unix.SYS_KCMP,
	unix.SYS_PIDFD_GETFD,
	unix.SYS_PROCESS_MADVISE,
	unix.SYS_MOVE_PAGES,
	unix.SYS_MIGRATE_PAGES,

	// Namespaces, mounts and the root directory. clone's namespace flags
	// are checked separately.
	unix.SYS_UNSHARE,
	unix.SYS_SETNS,
	unix.SYS_MOUNT,
	unix.SYS_UMOUNT2,
	unix.SYS_PIVOT_ROOT,
	unix.SYS_CHROOT,
	unix.SYS_FSOPEN,
	unix.SYS_FSCONFIG,
	unix.SYS_FSMOUNT,
	unix.SYS_FSPICK,
	unix.SYS_MOVE_MOUNT,
	unix.SYS_OPEN_TREE,
	unix.SYS_OPEN_TREE_ATTR,
	unix.SYS_MOUNT_SETATTR,
	unix.SYS_STATMOUNT,
	unix.SYS_LISTMOUNT,

	// File handles open any inode of a filesystem, past path-based
	// checks (the "shocker" escape).
	unix.SYS_OPEN_BY_HANDLE_AT,
	unix.SYS_NAME_TO_HANDLE_AT,

	// Kernel keyrings: shared state, and a place for secrets.
	unix.SYS_KEYCTL,
	unix.SYS_ADD_KEY,
	unix.SYS_REQUEST_KEY,

	// The kernel's riskiest surfaces. io_uring also creates sockets
	// without calling socket().
	unix.SYS_BPF,
	unix.SYS_PERF_EVENT_OPEN,
	unix.SYS_USERFAULTFD,
	unix.SYS_MEMFD_SECRET, // memory even the kernel does not map: hides what the code holds
	// A memfd is a file the code writes on no mount moat can make noexec:
	// exec runs it, and the loader maps it executable without exec.
	unix.SYS_MEMFD_CREATE,
	unix.SYS_IO_URING_SETUP,
	unix.SYS_IO_URING_ENTER,
	unix.SYS_IO_URING_REGISTER,
	unix.SYS_FANOTIFY_INIT,
	unix.SYS_MBIND,
	unix.SYS_SET_MEMPOLICY,
	unix.SYS_GET_MEMPOLICY,
	unix.SYS_SET_MEMPOLICY_HOME_NODE,

	// Kernel modules and kexec.
	unix.SYS_INIT_MODULE,
	unix.SYS_FINIT_MODULE,
	unix.SYS_DELETE_MODULE,
	unix.SYS_KEXEC_LOAD,
	unix.SYS_KEXEC_FILE_LOAD,

	// Administering the host.
	unix.SYS_REBOOT,
	unix.SYS_SWAPON,
	unix.SYS_SWAPOFF,
	unix.SYS_ACCT,
	unix.SYS_QUOTACTL,
	unix.SYS_QUOTACTL_FD,
	unix.SYS_SYSLOG,
	unix.SYS_SETHOSTNAME,
	unix.SYS_SETDOMAINNAME,
	unix.SYS_VHANGUP,
	unix.SYS_LOOKUP_DCOOKIE,
	unix.SYS_NFSSERVCTL,

	// Clocks.
	unix.SYS_SETTIMEOFDAY,
	unix.SYS_CLOCK_SETTIME,
	unix.SYS_CLOCK_ADJTIME,
	unix.SYS_ADJTIMEX,
}

// deniedSocket lists the calls that give a socket an address. socket() is
// refused, so the only sockets a sandbox has are socketpair ends, connected
// to each other from the start: bind and connect could only re-aim one at
// an address outside (a host socket file, an abstract name) or squat a
// name. The run's own mount and network namespaces already hide those
// addresses; this refuses the re-aiming itself.
var deniedSocket = []uint32{
	unix.SYS_CONNECT,
	unix.SYS_BIND,
	unix.SYS_LISTEN,
	unix.SYS_ACCEPT,
	unix.SYS_ACCEPT4,
}

// nsFlags are the clone flags that create namespaces. CLONE_NEWTIME (0x80)
// lies inside clone's exit-signal byte, so for clone it only refuses exit
// signals of 128 and above, which are not signals; it is listed so that
// the mask matches unshare's.
const nsFlags = unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC |
	unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET |
	unix.CLONE_NEWCGROUP | unix.CLONE_NEWTIME

// Labels of the program's shared tails.
const (
	lblSocket      label = "socket"
	lblSocketpair  label = "socketpair"
	lblClone       label = "clone"
	lblIoctl       label = "ioctl"
	lblPersonality label = "personality"
	lblAllow       label = "allow"
	lblEPERM       label = "eperm"
	lblEAFNOSUP    label = "eafnosupport"
	lblENOSYS      label = "enosys"
	lblKill        label = "kill"
)

// Labels of the TCP variant's socket checks (programTCP).
const (
	lblSocketINet label = "socket-inet"
	lblSocketType label = "socket-type"
)

// program builds the filter for the running architecture. With tcp (the
// filter FilterTCP returns), socket() of an IPv4 TCP socket and connect()
// are allowed; everything else is the same.
func program(tcp bool) ([]bpf.Instruction, error) {
	var b builder

	// Foreign calling conventions: kill.
	b.emit(bpf.LoadAbsolute{Off: offArch, Size: 4})
	b.jumpIf(bpf.JumpEqual, auditArch, next, lblKill)

	b.emit(bpf.LoadAbsolute{Off: offNr, Size: 4})
	if x32Bit != 0 {
		// Unsigned comparison: also catches nr == -1, which has no
		// syscall behind it anyway.
		b.jumpIf(bpf.JumpGreaterOrEqual, x32Bit, lblENOSYS, next)
	}

	// Syscalls whose arguments matter.
	b.jumpIf(bpf.JumpEqual, unix.SYS_SOCKET, lblSocket, next)
	b.jumpIf(bpf.JumpEqual, unix.SYS_SOCKETPAIR, lblSocketpair, next)
	b.jumpIf(bpf.JumpEqual, unix.SYS_CLONE, lblClone, next)
	b.jumpIf(bpf.JumpEqual, unix.SYS_IOCTL, lblIoctl, next)
	b.jumpIf(bpf.JumpEqual, unix.SYS_PERSONALITY, lblPersonality, next)
	b.jumpIf(bpf.JumpEqual, unix.SYS_CLONE3, lblENOSYS, next)

	// Syscalls denied outright.
	for _, nr := range deniedCommon {
		b.jumpIf(bpf.JumpEqual, nr, lblEPERM, next)
	}
	for _, nr := range deniedSocket {
		if tcp && nr == unix.SYS_CONNECT {
			continue
		}
		b.jumpIf(bpf.JumpEqual, nr, lblEPERM, next)
	}
	for _, nr := range deniedArch {
		b.jumpIf(bpf.JumpEqual, nr, lblEPERM, next)
	}
	b.emit(bpf.RetConstant{Val: retAllow})

	// socket(int family, ...): no socket of any family. A unix socket
	// would reach any socket file on the host by path (Landlock before ABI
	// 9 does not govern connect), and abstract ones by name (before ABI 6):
	// EPERM for AF_UNIX, EAFNOSUPPORT for the rest.
	b.mark(lblSocket)
	b.emit(bpf.LoadAbsolute{Off: argLow(0), Size: 4})
	if !tcp {
		b.jumpIf(bpf.JumpEqual, unix.AF_UNIX, lblEPERM, lblEAFNOSUP)
	} else {
		// With tcp: socket(AF_INET, SOCK_STREAM[|SOCK_NONBLOCK|SOCK_CLOEXEC],
		// 0 or IPPROTO_TCP) only. Every other family, type (UDP, raw,
		// ICMP) and protocol (MPTCP, SCTP) stays refused.
		b.jumpIf(bpf.JumpEqual, unix.AF_UNIX, lblEPERM, next)
		b.jumpIf(bpf.JumpEqual, unix.AF_INET, lblSocketINet, lblEAFNOSUP)
		b.mark(lblSocketINet)
		b.emit(bpf.LoadAbsolute{Off: argLow(1), Size: 4})
		for _, flags := range []uint32{0, unix.SOCK_NONBLOCK, unix.SOCK_CLOEXEC, unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC} {
			b.jumpIf(bpf.JumpEqual, unix.SOCK_STREAM|flags, lblSocketType, next)
		}
		b.emit(bpf.RetConstant{Val: retErrno(unix.EAFNOSUPPORT)})
		b.mark(lblSocketType)
		b.emit(bpf.LoadAbsolute{Off: argLow(2), Size: 4})
		b.jumpIf(bpf.JumpEqual, 0, lblAllow, next)
		b.jumpIf(bpf.JumpEqual, unix.IPPROTO_TCP, lblAllow, lblEAFNOSUP)
	}

	// socketpair(int family, int type, ...): a connected stream or
	// seqpacket pair reaches nothing but itself, so AF_UNIX pairs of those
	// types stay (asyncio, multiprocessing use them). A datagram end takes
	// a destination with every sendto and sendmsg (msg_name, which the
	// filter cannot see), so datagram pairs are refused.
	b.mark(lblSocketpair)
	b.emit(bpf.LoadAbsolute{Off: argLow(0), Size: 4})
	b.jumpIf(bpf.JumpEqual, unix.AF_UNIX, next, lblEAFNOSUP)
	b.emit(bpf.LoadAbsolute{Off: argLow(1), Size: 4})
	for _, typ := range []uint32{unix.SOCK_STREAM, unix.SOCK_SEQPACKET} {
		for _, flags := range []uint32{0, unix.SOCK_NONBLOCK, unix.SOCK_CLOEXEC, unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC} {
			b.jumpIf(bpf.JumpEqual, typ|flags, lblAllow, next)
		}
	}
	b.emit(bpf.RetConstant{Val: retErrno(unix.EPERM)})

	// clone(unsigned long flags, ...): the kernel uses lower_32_bits(flags).
	// The flags are the first argument on both supported architectures.
	b.mark(lblClone)
	b.emit(bpf.LoadAbsolute{Off: argLow(0), Size: 4})
	b.jumpIf(bpf.JumpBitsSet, nsFlags, lblEPERM, lblAllow)

	// ioctl(unsigned int fd, unsigned int cmd, unsigned long arg).
	b.mark(lblIoctl)
	b.emit(bpf.LoadAbsolute{Off: argLow(1), Size: 4})
	b.jumpIf(bpf.JumpEqual, unix.TIOCSTI, lblEPERM, next)
	b.jumpIf(bpf.JumpEqual, unix.TIOCLINUX, lblEPERM, lblAllow)

	// personality(unsigned int persona).
	b.mark(lblPersonality)
	b.emit(bpf.LoadAbsolute{Off: argLow(0), Size: 4})
	b.jumpIf(bpf.JumpEqual, 0xffffffff, lblAllow, next)
	b.jumpIf(bpf.JumpEqual, 0, lblAllow, lblEPERM)

	b.mark(lblAllow)
	b.emit(bpf.RetConstant{Val: retAllow})
	b.mark(lblEPERM)
	b.emit(bpf.RetConstant{Val: retErrno(unix.EPERM)})
	b.mark(lblEAFNOSUP)
	b.emit(bpf.RetConstant{Val: retErrno(unix.EAFNOSUPPORT)})
	b.mark(lblENOSYS)
	b.emit(bpf.RetConstant{Val: retErrno(unix.ENOSYS)})
	b.mark(lblKill)
	b.emit(bpf.RetConstant{Val: retKill})

	return b.assemble()
}
