package gvisor

import "golang.org/x/sys/unix"

// The guest filter's architecture: its audit value, the first x32 number,
// and the numbers of the system calls it names.
const (
	guestArch = unix.AUDIT_ARCH_X86_64
	guestX32  = 0x40000000
	sysClone  = unix.SYS_CLONE
	sysClone3 = unix.SYS_CLONE3
)

var guestSyscalls = withCommon(map[string]uint32{
	"iopl":       unix.SYS_IOPL,
	"ioperm":     unix.SYS_IOPERM,
	"modify_ldt": unix.SYS_MODIFY_LDT,
})
