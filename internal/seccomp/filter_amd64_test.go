//go:build linux

package seccomp

import "golang.org/x/sys/unix"

var wantDeniedArch = map[string]uint32{
	"iopl":            unix.SYS_IOPL,
	"ioperm":          unix.SYS_IOPERM,
	"modify_ldt":      unix.SYS_MODIFY_LDT,
	"uselib":          unix.SYS_USELIB,
	"create_module":   unix.SYS_CREATE_MODULE,
	"get_kernel_syms": unix.SYS_GET_KERNEL_SYMS,
	"query_module":    unix.SYS_QUERY_MODULE,
	"_sysctl":         unix.SYS__SYSCTL,
	"sysfs":           unix.SYS_SYSFS,
	"ustat":           unix.SYS_USTAT,
}

var archActionTests = []struct {
	name string
	call call
	want uint32
}{
	// x32 shares AUDIT_ARCH_X86_64; its numbers carry bit 30.
	{"x32 getpid", native(0x40000000 | unix.SYS_GETPID), actENOSYS},
	{"x32 socket AF_UNIX", native(0x40000000|unix.SYS_SOCKET, unix.AF_UNIX), actENOSYS},
	{"x32 highest", native(0x7fffffff), actENOSYS},
	{"nr -1", native(0xffffffff), actENOSYS},
	{"just below x32", native(0x3fffffff), actAllow},
	{"iopl", native(unix.SYS_IOPL, 3), actEPERM},
	{"arm64 arch on amd64", call{arch: unix.AUDIT_ARCH_AARCH64, nr: unix.SYS_GETPID}, actKillProcess},
}
