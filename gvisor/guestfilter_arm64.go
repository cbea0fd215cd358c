package gvisor

import "golang.org/x/sys/unix"

// The guest filter's architecture: its audit value, no x32 numbers, and
// the numbers of the system calls it names (arm64 has no iopl, ioperm or
// modify_ldt).
const (
	guestArch = unix.AUDIT_ARCH_AARCH64
	guestX32  = 0
	sysClone  = unix.SYS_CLONE
	sysClone3 = unix.SYS_CLONE3
)

var guestSyscalls = withCommon(map[string]uint32{})
