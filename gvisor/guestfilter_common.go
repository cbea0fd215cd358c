//go:build amd64 || arm64

package gvisor

import "golang.org/x/sys/unix"

// withCommon adds to arch the numbers of deniedSyscalls that every
// supported architecture has.
func withCommon(arch map[string]uint32) map[string]uint32 {
	for name, nr := range map[string]uint32{
		"ptrace": unix.SYS_PTRACE, "process_vm_readv": unix.SYS_PROCESS_VM_READV, "process_vm_writev": unix.SYS_PROCESS_VM_WRITEV,
		"kcmp": unix.SYS_KCMP, "pidfd_getfd": unix.SYS_PIDFD_GETFD, "process_madvise": unix.SYS_PROCESS_MADVISE,
		"move_pages": unix.SYS_MOVE_PAGES, "migrate_pages": unix.SYS_MIGRATE_PAGES,
		"unshare": unix.SYS_UNSHARE, "setns": unix.SYS_SETNS, "mount": unix.SYS_MOUNT, "umount2": unix.SYS_UMOUNT2,
		"pivot_root": unix.SYS_PIVOT_ROOT, "chroot": unix.SYS_CHROOT,
		"fsopen": unix.SYS_FSOPEN, "fsconfig": unix.SYS_FSCONFIG, "fsmount": unix.SYS_FSMOUNT, "fspick": unix.SYS_FSPICK,
		"move_mount": unix.SYS_MOVE_MOUNT, "open_tree": unix.SYS_OPEN_TREE, "mount_setattr": unix.SYS_MOUNT_SETATTR,
		"open_by_handle_at": unix.SYS_OPEN_BY_HANDLE_AT, "name_to_handle_at": unix.SYS_NAME_TO_HANDLE_AT,
		"keyctl": unix.SYS_KEYCTL, "add_key": unix.SYS_ADD_KEY, "request_key": unix.SYS_REQUEST_KEY,
		"bpf": unix.SYS_BPF, "perf_event_open": unix.SYS_PERF_EVENT_OPEN, "userfaultfd": unix.SYS_USERFAULTFD,
		"io_uring_setup": unix.SYS_IO_URING_SETUP, "io_uring_enter": unix.SYS_IO_URING_ENTER, "io_uring_register": unix.SYS_IO_URING_REGISTER,
		"fanotify_init": unix.SYS_FANOTIFY_INIT, "mbind": unix.SYS_MBIND, "set_mempolicy": unix.SYS_SET_MEMPOLICY, "get_mempolicy": unix.SYS_GET_MEMPOLICY,
		"init_module": unix.SYS_INIT_MODULE, "finit_module": unix.SYS_FINIT_MODULE, "delete_module": unix.SYS_DELETE_MODULE,
		"kexec_load": unix.SYS_KEXEC_LOAD, "kexec_file_load": unix.SYS_KEXEC_FILE_LOAD,
		"reboot": unix.SYS_REBOOT, "swapon": unix.SYS_SWAPON, "swapoff": unix.SYS_SWAPOFF, "acct": unix.SYS_ACCT, "quotactl": unix.SYS_QUOTACTL,
	} {
		arch[name] = nr
	}
	return arch
}
