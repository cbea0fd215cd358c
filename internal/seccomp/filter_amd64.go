//go:build linux

package seccomp

import "golang.org/x/sys/unix"

// auditArch is the seccomp_data.arch value of a native syscall.
const auditArch = unix.AUDIT_ARCH_X86_64

// x32Bit is set in the number of every x32-ABI syscall (__X32_SYSCALL_BIT).
// x32 shares AUDIT_ARCH_X86_64, so only the number tells it apart.
const x32Bit = 0x40000000

// deniedArch adds the amd64-only syscalls to deniedCommon.
var deniedArch = []uint32{
	unix.SYS_IOPL,       // port I/O
	unix.SYS_IOPERM,     // port I/O
	unix.SYS_MODIFY_LDT, // segment descriptors: old, rarely used, bug-prone
	unix.SYS_USELIB,
	unix.SYS_CREATE_MODULE,
	unix.SYS_GET_KERNEL_SYMS,
	unix.SYS_QUERY_MODULE,
	unix.SYS__SYSCTL,
	unix.SYS_SYSFS,
	unix.SYS_USTAT,
}
