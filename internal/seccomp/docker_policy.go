//go:build linux && (amd64 || arm64)

package seccomp

import (
	"fmt"
	"slices"

	"golang.org/x/sys/unix"
)

// mobyAllowed is the list of syscalls that Moby's default profile
// (moby/profiles, seccomp/default.json, 2025) allows every container
// without condition, for every architecture (libseccomp skips a name the
// architecture lacks), io_uring already left out as Moby 25 does. The
// profile moat passes starts from it and takes away what moat's own filter
// refuses (deniedCommon, deniedArch) and dockerDenied. A syscall not named
// here is refused: a new dangerous syscall is denied until someone adds it.
var mobyAllowed = []string{
	"accept", "accept4", "access", "adjtimex", "alarm", "bind", "brk",
	"cachestat", "capget", "capset", "chdir", "chmod", "chown", "chown32",
	"clock_adjtime", "clock_adjtime64", "clock_getres", "clock_getres_time64",
	"clock_gettime", "clock_gettime64", "clock_nanosleep",
	"clock_nanosleep_time64", "close", "close_range", "connect",
	"copy_file_range", "creat", "dup", "dup2", "dup3", "epoll_create",
	"epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait",
	"epoll_pwait2", "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2",
	"execve", "execveat", "exit", "exit_group", "faccessat", "faccessat2",
	"fadvise64", "fadvise64_64", "fallocate", "fanotify_mark", "fchdir",
	"fchmod", "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat",
	"fcntl", "fcntl64", "fdatasync", "fgetxattr", "flistxattr", "flock",
	"fork", "fremovexattr", "fsetxattr", "fstat", "fstat64", "fstatat64",
	"fstatfs", "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futex",
	"futex_requeue", "futex_time64", "futex_wait", "futex_waitv",
	"futex_wake", "futimesat", "getcpu", "getcwd", "getdents", "getdents64",
	"getegid", "getegid32", "geteuid", "geteuid32", "getgid", "getgid32",
	"getgroups", "getgroups32", "getitimer", "getpeername", "getpgid",
	"getpgrp", "getpid", "getppid", "getpriority", "getrandom", "getresgid",
	"getresgid32", "getresuid", "getresuid32", "getrlimit", "get_robust_list",
	"getrusage", "getsid", "getsockname", "getsockopt", "get_thread_area",
	"gettid", "gettimeofday", "getuid", "getuid32", "getxattr", "getxattrat",
	"inotify_add_watch", "inotify_init", "inotify_init1", "inotify_rm_watch",
	"io_cancel", "ioctl", "io_destroy", "io_getevents", "io_pgetevents",
	"io_pgetevents_time64", "ioprio_get", "ioprio_set", "io_setup",
	"io_submit", "ipc", "kill", "landlock_add_rule", "landlock_create_ruleset",
	"landlock_restrict_self", "lchown", "lchown32", "lgetxattr", "link",
	"linkat", "listen", "listmount", "listxattr", "listxattrat", "llistxattr",
	"_llseek", "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64",
	"madvise", "map_shadow_stack", "membarrier", "memfd_create",
	"memfd_secret", "mincore", "mkdir", "mkdirat", "mknod", "mknodat",
	"mlock", "mlock2", "mlockall", "mmap", "mmap2", "mprotect",
	"mq_getsetattr", "mq_notify", "mq_open", "mq_timedreceive",
	"mq_timedreceive_time64", "mq_timedsend", "mq_timedsend_time64",
	"mq_unlink", "mremap", "mseal", "msgctl", "msgget", "msgrcv", "msgsnd",
	"msync", "munlock", "munlockall", "munmap", "name_to_handle_at",
	"nanosleep", "newfstatat", "_newselect", "open", "openat", "openat2",
	"pause", "pidfd_open", "pidfd_send_signal", "pipe", "pipe2", "pkey_alloc",
	"pkey_free", "pkey_mprotect", "poll", "ppoll", "ppoll_time64", "prctl",
	"pread64", "preadv", "preadv2", "prlimit64", "process_mrelease",
	"pselect6", "pselect6_time64", "pwrite64", "pwritev", "pwritev2", "read",
	"readahead", "readlink", "readlinkat", "readv", "recv", "recvfrom",
	"recvmmsg", "recvmmsg_time64", "recvmsg", "remap_file_pages",
	"removexattr", "removexattrat", "rename", "renameat", "renameat2",
	"restart_syscall", "rmdir", "rseq", "rt_sigaction", "rt_sigpending",
	"rt_sigprocmask", "rt_sigqueueinfo", "rt_sigreturn", "rt_sigsuspend",
	"rt_sigtimedwait", "rt_sigtimedwait_time64", "rt_tgsigqueueinfo",
	"sched_getaffinity", "sched_getattr", "sched_getparam",
	"sched_get_priority_max", "sched_get_priority_min", "sched_getscheduler",
	"sched_rr_get_interval", "sched_rr_get_interval_time64",
	"sched_setaffinity", "sched_setattr", "sched_setparam",
	"sched_setscheduler", "sched_yield", "seccomp", "select", "semctl",
	"semget", "semop", "semtimedop", "semtimedop_time64", "send", "sendfile",
	"sendfile64", "sendmmsg", "sendmsg", "sendto", "setfsgid", "setfsgid32",
	"setfsuid", "setfsuid32", "setgid", "setgid32", "setgroups",
	"setgroups32", "setitimer", "setpgid", "setpriority", "setregid",
	"setregid32", "setresgid", "setresgid32", "setresuid", "setresuid32",
	"setreuid", "setreuid32", "setrlimit", "set_robust_list", "setsid",
	"setsockopt", "set_thread_area", "set_tid_address", "setuid", "setuid32",
	"setxattr", "setxattrat", "shmat", "shmctl", "shmdt", "shmget",
	"shutdown", "sigaltstack", "signalfd", "signalfd4", "sigprocmask",
	"sigreturn", "socketcall", "socketpair", "splice", "stat", "stat64",
	"statfs", "statfs64", "statmount", "statx", "symlink", "symlinkat",
	"sync", "sync_file_range", "syncfs", "sysinfo", "tee", "tgkill", "time",
	"timer_create", "timer_delete", "timer_getoverrun", "timer_gettime",
	"timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create",
	"timerfd_gettime", "timerfd_gettime64", "timerfd_settime",
	"timerfd_settime64", "times", "tkill", "truncate", "truncate64",
	"ugetrlimit", "umask", "uname", "unlink", "unlinkat", "uretprobe",
	"utime", "utimensat", "utimensat_time64", "utimes", "vfork", "vmsplice",
	"wait4", "waitid", "waitpid", "write", "writev",
}

// dockerDenied are refused in a container although moat's subprocess
// filter lets them through, each for a reason of the container level's.
var dockerDenied = []string{
	// Memory the kernel itself cannot read: nothing a sandboxed program
	// needs, and an unusual kernel path.
	"memfd_secret",
	// fanotify_init is refused (deniedCommon); without it, fanotify_mark
	// has nothing to act on.
	"fanotify_mark",
	// The 32-bit multiplexers would reach socket() and the System V calls
	// past the rules below on an architecture that has them.
	"socketcall", "ipc",
	// Rules with arguments follow; the unconditional entries go.
	"socket", "socketpair", "ioctl", "personality", "clone", "clone3",
}

// commonNames names the syscalls of deniedCommon, so that the profile,
// which names syscalls, refuses the same ones as the filter, which numbers
// them. Every number in deniedCommon must be here (Docker fails otherwise).
var commonNames = map[uint32]string{
	unix.SYS_PTRACE:                  "ptrace",
	unix.SYS_PROCESS_VM_READV:        "process_vm_readv",
	unix.SYS_PROCESS_VM_WRITEV:       "process_vm_writev",
	unix.SYS_KCMP:                    "kcmp",
	unix.SYS_PIDFD_GETFD:             "pidfd_getfd",
	unix.SYS_PROCESS_MADVISE:         "process_madvise",
	unix.SYS_MOVE_PAGES:              "move_pages",
	unix.SYS_MIGRATE_PAGES:           "migrate_pages",
	unix.SYS_UNSHARE:                 "unshare",
	unix.SYS_SETNS:                   "setns",
	unix.SYS_MOUNT:                   "mount",
	unix.SYS_UMOUNT2:                 "umount2",
	unix.SYS_PIVOT_ROOT:              "pivot_root",
	unix.SYS_CHROOT:                  "chroot",
	unix.SYS_FSOPEN:                  "fsopen",
	unix.SYS_FSCONFIG:                "fsconfig",
	unix.SYS_FSMOUNT:                 "fsmount",
	unix.SYS_FSPICK:                  "fspick",
	unix.SYS_MOVE_MOUNT:              "move_mount",
	unix.SYS_OPEN_TREE:               "open_tree",
	unix.SYS_OPEN_TREE_ATTR:          "open_tree_attr",
	unix.SYS_MOUNT_SETATTR:           "mount_setattr",
	unix.SYS_STATMOUNT:               "statmount",
	unix.SYS_LISTMOUNT:               "listmount",
	unix.SYS_OPEN_BY_HANDLE_AT:       "open_by_handle_at",
	unix.SYS_NAME_TO_HANDLE_AT:       "name_to_handle_at",
	unix.SYS_KEYCTL:                  "keyctl",
	unix.SYS_ADD_KEY:                 "add_key",
	unix.SYS_REQUEST_KEY:             "request_key",
	unix.SYS_BPF:                     "bpf",
	unix.SYS_PERF_EVENT_OPEN:         "perf_event_open",
	unix.SYS_USERFAULTFD:             "userfaultfd",
	unix.SYS_MEMFD_SECRET:            "memfd_secret",
	unix.SYS_MEMFD_CREATE:            "memfd_create",
	unix.SYS_IO_URING_SETUP:          "io_uring_setup",
	unix.SYS_IO_URING_ENTER:          "io_uring_enter",
	unix.SYS_IO_URING_REGISTER:       "io_uring_register",
	unix.SYS_FANOTIFY_INIT:           "fanotify_init",
	unix.SYS_MBIND:                   "mbind",
	unix.SYS_SET_MEMPOLICY:           "set_mempolicy",
	unix.SYS_GET_MEMPOLICY:           "get_mempolicy",
	unix.SYS_SET_MEMPOLICY_HOME_NODE: "set_mempolicy_home_node",
	unix.SYS_INIT_MODULE:             "init_module",
	unix.SYS_FINIT_MODULE:            "finit_module",
	unix.SYS_DELETE_MODULE:           "delete_module",
	unix.SYS_KEXEC_LOAD:              "kexec_load",
	unix.SYS_KEXEC_FILE_LOAD:         "kexec_file_load",
	unix.SYS_REBOOT:                  "reboot",
	unix.SYS_SWAPON:                  "swapon",
	unix.SYS_SWAPOFF:                 "swapoff",
	unix.SYS_ACCT:                    "acct",
	unix.SYS_QUOTACTL:                "quotactl",
	unix.SYS_QUOTACTL_FD:             "quotactl_fd",
	unix.SYS_SYSLOG:                  "syslog",
	unix.SYS_SETHOSTNAME:             "sethostname",
	unix.SYS_SETDOMAINNAME:           "setdomainname",
	unix.SYS_VHANGUP:                 "vhangup",
	unix.SYS_LOOKUP_DCOOKIE:          "lookup_dcookie",
	unix.SYS_NFSSERVCTL:              "nfsservctl",
	unix.SYS_SETTIMEOFDAY:            "settimeofday",
	unix.SYS_CLOCK_SETTIME:           "clock_settime",
	unix.SYS_CLOCK_ADJTIME:           "clock_adjtime",
	unix.SYS_ADJTIMEX:                "adjtimex",
}

// deniedAliases are the other names under which libseccomp knows a denied
// syscall on some architecture (the 32-bit time64 variants), refused with
// it.
var deniedAliases = map[string][]string{
	"clock_adjtime": {"clock_adjtime64"},
	"clock_settime": {"clock_settime64"},
	"umount2":       {"umount"},
}

// Docker returns moat's container profile for the running
// architecture: an allow-list (every syscall not named fails with EPERM)
// with the same refusals as Filter where a container allows less, namely:
//
//   - only the native architecture: a syscall made with another calling
//     convention (i386's int 0x80 on amd64, x32) is refused by the
//     runtime's bad-architecture action;
//   - Moby's default allow-list less deniedCommon, deniedArch and
//     dockerDenied (io_uring, ptrace in all its forms, userfaultfd,
//     memfd_secret, keyrings, bpf, perf_event_open, fanotify, file
//     handles, the mount family, namespaces, modules, kexec, clocks...);
//   - socket and socketpair for AF_UNIX only (EAFNOSUPPORT for every other
//     family: AF_VSOCK above all, whose ports are not namespaced);
//   - clone without namespace flags (nsFlags), clone3 with ENOSYS so that
//     glibc falls back to clone;
//   - personality only for the query 0xffffffff and the default persona 0;
//   - ioctl except TIOCSTI and TIOCLINUX (compared on the low 32 bits,
//     which is what the kernel acts on).
//
// It returns ErrUnsupportedArch where Filter does.
func Docker() (*DockerProfile, error) {
	denied := map[string]bool{}
	for _, list := range [][]uint32{deniedCommon, deniedArch} {
		for _, nr := range list {
			name, ok := commonNames[nr]
			if !ok {
				name, ok = archNames[nr]
			}
			if !ok {
				return nil, fmt.Errorf("seccomp: syscall %d is denied by the filter but has no name for the docker profile", nr)
			}
			denied[name] = true
			for _, a := range deniedAliases[name] {
				denied[a] = true
			}
		}
	}
	for _, name := range dockerDenied {
		denied[name] = true
	}
	var allowed []string
	for _, name := range slices.Concat(mobyAllowed, archAllowed) {
		if !denied[name] {
			allowed = append(allowed, name)
		}
	}
	slices.Sort(allowed)
	allowed = slices.Compact(allowed)

	errno := func(e unix.Errno) *uint { v := uint(e); return &v }
	eq := func(i uint, v uint64) DockerArg { return DockerArg{Index: i, Value: v, Op: scmpEq} }
	rules := []DockerSyscall{
		{Names: allowed, Action: scmpAllow},
		{Names: []string{"socket", "socketpair"}, Action: scmpAllow, Args: []DockerArg{eq(0, unix.AF_UNIX)},
			Comment: "unix sockets only: the container has no network, and AF_VSOCK would reach the host"},
		{Names: []string{"socket", "socketpair"}, Action: scmpErrno, ErrnoRet: errno(unix.EAFNOSUPPORT),
			Args: []DockerArg{{Index: 0, Value: unix.AF_UNIX, Op: scmpNe}}},
		{Names: []string{"clone"}, Action: scmpAllow,
			Args:    []DockerArg{{Index: 0, Value: nsFlags, ValueTwo: 0, Op: scmpMaskedEq}},
			Comment: "no namespace flags"},
		{Names: []string{"clone3"}, Action: scmpErrno, ErrnoRet: errno(unix.ENOSYS),
			Comment: "its flags are in memory a filter cannot read; glibc falls back to clone"},
		{Names: []string{"personality"}, Action: scmpAllow, Args: []DockerArg{eq(0, 0)}},
		{Names: []string{"personality"}, Action: scmpAllow, Args: []DockerArg{eq(0, 0xffffffff)}},
	}
	// libseccomp lets an unconditional rule win over conditional ones of
	// the same syscall (checked here: an ALLOW for ioctl and an ERRNO for
	// TIOCSTI let TIOCSTI through), so ioctl is allowed by the prefixes of
	// every command but those two instead.
	for _, a := range allowAllBut32(1, []uint32{unix.TIOCSTI, unix.TIOCLINUX}) {
		rules = append(rules, DockerSyscall{Names: []string{"ioctl"}, Action: scmpAllow, Args: []DockerArg{a}})
	}
	return &DockerProfile{
		DefaultAction:   scmpErrno,
		DefaultErrnoRet: errno(unix.EPERM),
		Architectures:   []string{dockerArch},
		Syscalls:        rules,
	}, nil
}

// allowAllBut32 returns comparisons of argument index, one per rule, that
// together match every value whose low 32 bits are none of except, and
// nothing else. Each is a SCMP_CMP_MASKED_EQ on a prefix (from bit 31 down)
// that no excepted value has, so the high 32 bits never matter: the kernel
// truncates such an argument (ioctl's command) to 32 bits, and a value
// with high bits set must not slip past the exception. At most 32 rules
// per excepted value.
func allowAllBut32(index uint, except []uint32) []DockerArg {
	var out []DockerArg
	// walk covers the values under the prefix p of length n bits (the top
	// n bits) whose continuations in set are excepted.
	var walk func(p uint32, n int, set []uint32)
	walk = func(p uint32, n int, set []uint32) {
		if n == 32 {
			return // p itself is excepted
		}
		bit := uint32(1) << (31 - n)
		var zero, one []uint32
		for _, v := range set {
			if v&bit == 0 {
				zero = append(zero, v)
			} else {
				one = append(one, v)
			}
		}
		mask := ^uint32(0) << (31 - n) // the top n+1 bits
		for _, branch := range []struct {
			p   uint32
			set []uint32
		}{{p, zero}, {p | bit, one}} {
			if len(branch.set) == 0 {
				out = append(out, DockerArg{Index: index, Value: uint64(mask), ValueTwo: uint64(branch.p), Op: scmpMaskedEq})
			} else {
				walk(branch.p, n+1, branch.set)
			}
		}
	}
	walk(0, 0, slices.Compact(slices.Sorted(slices.Values(except))))
	return out
}
