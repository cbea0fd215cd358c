//go:build linux

package seccomp

import "golang.org/x/sys/unix"

// auditArch is the seccomp_data.arch value of a native syscall.
const auditArch = unix.AUDIT_ARCH_AARCH64

// x32Bit is zero: arm64 has no x32-like ABI sharing its AUDIT_ARCH (32-bit
// ARM tasks report AUDIT_ARCH_ARM and are killed by the arch check).
const x32Bit = 0

// deniedArch is empty: arm64 lacks the legacy x86 syscalls.
var deniedArch = []uint32{}
