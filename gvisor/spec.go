package gvisor

import (
	"fmt"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/oci"
)

// The OCI spec types of package oci, under the names this package uses;
// runsc reads nothing else from a bundle's config.json.
type (
	ociSpec         = oci.Spec
	ociProcess      = oci.Process
	ociUser         = oci.User
	ociCapabilities = oci.Capabilities
	ociRlimit       = oci.Rlimit
	ociRoot         = oci.Root
	ociMount        = oci.Mount
	ociLinux        = oci.Linux
	ociSeccomp      = oci.Seccomp
	ociSyscallRule  = oci.SyscallRule
	ociSeccompArg   = oci.SeccompArg
	ociNamespace    = oci.Namespace
)

// The sandbox user: nobody, as in the container level. It is alone in its
// kernel, so RLIMIT_NPROC counts this run's tasks and nothing else.
const (
	sandboxUID = 65534
	sandboxGID = 65534
)

// The writable places of a run and their share of Limits.Disk, as in the
// container level: the working directory, /tmp and /dev/shm are separate
// tmpfs mounts inside the sandbox's kernel whose sizes add up to the disk
// limit. A session's files are its working directory's, so there it gets
// almost all of the disk.
const (
	tmpShare = 4  // /tmp gets Disk/4
	shmShare = 16 // /dev/shm gets Disk/16; the working directory the rest

	sessionTmpShare = 16 // in a session, /tmp gets Disk/16
	sessionShmShare = 64 // and /dev/shm Disk/64
)

// tmpfsMount is one size-limited tmpfs of a run.
type tmpfsMount struct {
	path string
	size int64
	mode string
}

// writable returns the run's tmpfs mounts for the disk limit.
func writable(disk moat.Bytes) []tmpfsMount { return writableShares(disk, tmpShare, shmShare) }

// writableShares returns the tmpfs mounts with /tmp and /dev/shm given
// Disk/tmpShare and Disk/shmShare, and the working directory the rest.
func writableShares(disk moat.Bytes, tmpShare, shmShare int64) []tmpfsMount {
	d := int64(disk)
	shm := pageRound(d / shmShare)
	tmp := pageRound(d / tmpShare)
	work := pageRound(d - shm - tmp)
	return []tmpfsMount{
		{image.WorkDir, work, "0700"},
		{"/tmp", tmp, "1777"},
		{"/dev/shm", shm, "1777"},
	}
}

func pageRound(n int64) int64 {
	const page = 4096
	if n < page {
		return page
	}
	return n / page * page
}

// newSpec returns the OCI spec of one run: python3 reading the code from
// stdin, as nobody, with no capability and no_new_privs, over the read-only
// root filesystem, with a tmpfs for every writable place, the rlimits that
// gVisor's kernel enforces, and namespaces of its own. The network is
// runsc's business (--network=none: loopback only), or, with an egress
// proxy, moat's (withEgress drops the network namespace: network.go).
//
// Python is the container's init (PID 1). Unlike Linux, gVisor does not
// shield its init from the signals it sends itself, so a crash by signal
// shows as one, and when it exits gVisor kills every other task of the
// container.
func newSpec(rootfs, python string, l moat.Limits) *ociSpec {
	return specWith(rootfs, python, l, writable(l.Disk))
}

// specWith is newSpec with the given writable places.
func specWith(rootfs, python string, l moat.Limits, places []tmpfsMount) *ociSpec {
	cpu := uint64(engine.RlimitCPU(time.Duration(l.CPUTime)) / time.Second)
	rl := func(typ string, soft, hard uint64) ociRlimit { return ociRlimit{Type: typ, Soft: soft, Hard: hard} }
	mounts := []ociMount{
		{Destination: "/proc", Type: "proc", Source: "proc"},
		{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"mode=0755"}},
	}
	for _, m := range places {
		mounts = append(mounts, ociMount{
			Destination: m.path, Type: "tmpfs", Source: "tmpfs",
			Options: []string{"rw", "noexec", fmt.Sprintf("size=%d", m.size), "mode=" + m.mode,
				fmt.Sprintf("uid=%d", sandboxUID), fmt.Sprintf("gid=%d", sandboxGID)},
		})
	}
	none := []string{}
	return &ociSpec{
		Version: "1.0.2",
		Process: ociProcess{
			User: ociUser{UID: sandboxUID, GID: sandboxGID, AdditionalGids: []uint32{}},
			Args: []string{python, "-"},
			Env:  []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + image.WorkDir, "LANG=C.UTF-8"},
			Cwd:  image.WorkDir,
			Capabilities: ociCapabilities{
				Bounding: none, Effective: none, Inheritable: none, Permitted: none, Ambient: none,
			},
			Rlimits: []ociRlimit{
				// SIGXCPU at the limit, SIGKILL a second later; the host
				// watches the whole sandbox's CPU time too.
				rl("RLIMIT_CPU", cpu, cpu+1),
				rl("RLIMIT_FSIZE", uint64(l.FileSize), uint64(l.FileSize)),
				rl("RLIMIT_NOFILE", uint64(l.OpenFiles), uint64(l.OpenFiles)),
				// Processes and threads of the sandbox user, who is alone
				// in this kernel: the run's task limit.
				rl("RLIMIT_NPROC", uint64(l.Pids), uint64(l.Pids)),
				rl("RLIMIT_CORE", 0, 0),
			},
			NoNewPrivileges: true,
			// The sandbox is the first to go when the host runs out of
			// memory.
			OOMScoreAdj: 1000,
		},
		Root:     ociRoot{Path: rootfs, Readonly: true},
		Hostname: "sandbox",
		Mounts:   mounts,
		Linux: ociLinux{
			Namespaces: []ociNamespace{{Type: "pid"}, {Type: "network"}, {Type: "ipc"}, {Type: "uts"}, {Type: "mount"}},
			Seccomp:    guestSeccomp(),
		},
	}
}

// deniedSyscalls are the system calls the code may not make, even to
// gVisor's kernel: they reach parts of the sentry that running Python needs
// none of (namespaces and mounts, other processes' memory, keyrings, BPF,
// io_uring, modules), the same list as the subprocess level's filter. Those
// gVisor does not implement fail anyway; runsc skips the names it does not
// know.
var deniedSyscalls = []string{
	"ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "process_madvise",
	"move_pages", "migrate_pages",
	"unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
	"fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
	"open_by_handle_at", "name_to_handle_at",
	"keyctl", "add_key", "request_key",
	"bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
	"fanotify_init", "mbind", "set_mempolicy", "get_mempolicy",
	"init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
	"reboot", "swapon", "swapoff", "acct", "quotactl", "iopl", "ioperm", "modify_ldt",
}

// namespaceFlags are clone's flags that make a namespace.
var namespaceFlags = []uint64{
	0x00020000, // CLONE_NEWNS
	0x02000000, // CLONE_NEWCGROUP
	0x04000000, // CLONE_NEWUTS
	0x08000000, // CLONE_NEWIPC
	0x10000000, // CLONE_NEWUSER
	0x20000000, // CLONE_NEWPID
	0x40000000, // CLONE_NEWNET
}

// guestSeccomp is the seccomp filter gVisor's kernel applies to the code
// (runsc --oci-seccomp): deniedSyscalls fail with EPERM, and so does clone
// with any namespace flag. Without namespaces of its own, the code cannot
// mount a filesystem past the disk limit or gain capabilities in a user
// namespace. clone3, whose flags a filter cannot read, fails with ENOSYS so
// that the C library falls back to clone: that is SCMP_ACT_TRACE with no
// tracer (ptrace is denied, so there is none), because the runsc of Debian
// 13 ignores errnoRet and would return EPERM, which the C library does not
// fall back from.
func guestSeccomp() *ociSeccomp {
	rules := []ociSyscallRule{
		{Names: deniedSyscalls, Action: "SCMP_ACT_ERRNO"},
		{Names: []string{"clone3"}, Action: "SCMP_ACT_TRACE"},
	}
	for _, f := range namespaceFlags {
		rules = append(rules, ociSyscallRule{
			Names:  []string{"clone"},
			Action: "SCMP_ACT_ERRNO",
			Args:   []ociSeccompArg{{Index: 0, Value: f, ValueTwo: f, Op: "SCMP_CMP_MASKED_EQ"}},
		})
	}
	return &ociSeccomp{DefaultAction: "SCMP_ACT_ALLOW", Architectures: []string{"SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64"}, Syscalls: rules}
}
