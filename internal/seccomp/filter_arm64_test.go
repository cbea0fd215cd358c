//go:build linux

package seccomp

import "golang.org/x/sys/unix"

var wantDeniedArch = map[string]uint32{}

var archActionTests = []struct {
	name string
	call call
	want uint32
}{
	// arm64 has no x32: large numbers are simply unknown syscalls.
	{"nr 0x40000000", native(0x40000000), actAllow},
	{"amd64 arch on arm64", call{arch: unix.AUDIT_ARCH_X86_64, nr: unix.SYS_GETPID}, actKillProcess},
}
