//go:build linux

package seccomp

import "golang.org/x/sys/unix"

// dockerArch is the architecture the container profile is for.
const dockerArch = "SCMP_ARCH_X86_64"

// archAllowed adds amd64's own syscalls to mobyAllowed (Moby allows
// modify_ldt too; moat refuses it, see deniedArch).
var archAllowed = []string{"arch_prctl"}

// archNames names the syscalls of deniedArch.
var archNames = map[uint32]string{
	unix.SYS_IOPL:            "iopl",
	unix.SYS_IOPERM:          "ioperm",
	unix.SYS_MODIFY_LDT:      "modify_ldt",
	unix.SYS_USELIB:          "uselib",
	unix.SYS_CREATE_MODULE:   "create_module",
	unix.SYS_GET_KERNEL_SYMS: "get_kernel_syms",
	unix.SYS_QUERY_MODULE:    "query_module",
	unix.SYS__SYSCTL:         "_sysctl",
	unix.SYS_SYSFS:           "sysfs",
	unix.SYS_USTAT:           "ustat",
}
