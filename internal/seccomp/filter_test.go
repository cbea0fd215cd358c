//go:build linux && (amd64 || arm64)

package seccomp

import (
	"encoding/binary"
	"fmt"
	"testing"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// wantDenied is the test's own statement of the syscalls that must fail
// with EPERM whatever their arguments, kept apart from the filter's lists so
// that a syscall dropped from (or added to) the filter by mistake shows up.
// wantDeniedArch adds the architecture's own.
var wantDenied = map[string]uint32{
	"ptrace":                  unix.SYS_PTRACE,
	"process_vm_readv":        unix.SYS_PROCESS_VM_READV,
	"process_vm_writev":       unix.SYS_PROCESS_VM_WRITEV,
	"kcmp":                    unix.SYS_KCMP,
	"pidfd_getfd":             unix.SYS_PIDFD_GETFD,
	"process_madvise":         unix.SYS_PROCESS_MADVISE,
	"move_pages":              unix.SYS_MOVE_PAGES,
	"migrate_pages":           unix.SYS_MIGRATE_PAGES,
	"unshare":                 unix.SYS_UNSHARE,
	"setns":                   unix.SYS_SETNS,
	"mount":                   unix.SYS_MOUNT,
	"umount2":                 unix.SYS_UMOUNT2,
	"pivot_root":              unix.SYS_PIVOT_ROOT,
	"chroot":                  unix.SYS_CHROOT,
	"fsopen":                  unix.SYS_FSOPEN,
	"fsconfig":                unix.SYS_FSCONFIG,
	"fsmount":                 unix.SYS_FSMOUNT,
	"fspick":                  unix.SYS_FSPICK,
	"move_mount":              unix.SYS_MOVE_MOUNT,
	"open_tree":               unix.SYS_OPEN_TREE,
	"open_tree_attr":          unix.SYS_OPEN_TREE_ATTR,
	"mount_setattr":           unix.SYS_MOUNT_SETATTR,
	"statmount":               unix.SYS_STATMOUNT,
	"listmount":               unix.SYS_LISTMOUNT,
	"open_by_handle_at":       unix.SYS_OPEN_BY_HANDLE_AT,
	"name_to_handle_at":       unix.SYS_NAME_TO_HANDLE_AT,
	"keyctl":                  unix.SYS_KEYCTL,
	"add_key":                 unix.SYS_ADD_KEY,
	"request_key":             unix.SYS_REQUEST_KEY,
	"bpf":                     unix.SYS_BPF,
	"perf_event_open":         unix.SYS_PERF_EVENT_OPEN,
	"userfaultfd":             unix.SYS_USERFAULTFD,
	"io_uring_setup":          unix.SYS_IO_URING_SETUP,
	"io_uring_enter":          unix.SYS_IO_URING_ENTER,
	"io_uring_register":       unix.SYS_IO_URING_REGISTER,
	"fanotify_init":           unix.SYS_FANOTIFY_INIT,
	"mbind":                   unix.SYS_MBIND,
	"set_mempolicy":           unix.SYS_SET_MEMPOLICY,
	"get_mempolicy":           unix.SYS_GET_MEMPOLICY,
	"set_mempolicy_home_node": unix.SYS_SET_MEMPOLICY_HOME_NODE,
	"init_module":             unix.SYS_INIT_MODULE,
	"finit_module":            unix.SYS_FINIT_MODULE,
	"delete_module":           unix.SYS_DELETE_MODULE,
	"kexec_load":              unix.SYS_KEXEC_LOAD,
	"memfd_secret":            unix.SYS_MEMFD_SECRET,
	"memfd_create":            unix.SYS_MEMFD_CREATE,
	"kexec_file_load":         unix.SYS_KEXEC_FILE_LOAD,
	"reboot":                  unix.SYS_REBOOT,
	"swapon":                  unix.SYS_SWAPON,
	"swapoff":                 unix.SYS_SWAPOFF,
	"acct":                    unix.SYS_ACCT,
	"quotactl":                unix.SYS_QUOTACTL,
	"quotactl_fd":             unix.SYS_QUOTACTL_FD,
	"syslog":                  unix.SYS_SYSLOG,
	"sethostname":             unix.SYS_SETHOSTNAME,
	"setdomainname":           unix.SYS_SETDOMAINNAME,
	"vhangup":                 unix.SYS_VHANGUP,
	"lookup_dcookie":          unix.SYS_LOOKUP_DCOOKIE,
	"nfsservctl":              unix.SYS_NFSSERVCTL,
	"settimeofday":            unix.SYS_SETTIMEOFDAY,
	"clock_settime":           unix.SYS_CLOCK_SETTIME,
	"clock_adjtime":           unix.SYS_CLOCK_ADJTIME,
	"adjtimex":                unix.SYS_ADJTIMEX,
}

// wantDeniedSocket are the calls the subprocess filter refuses because
// socket() is refused (deniedSocket); the container profile keeps them for
// AF_UNIX sockets of the container's own.
var wantDeniedSocket = map[string]uint32{
	"connect": unix.SYS_CONNECT,
	"bind":    unix.SYS_BIND,
	"listen":  unix.SYS_LISTEN,
	"accept":  unix.SYS_ACCEPT,
	"accept4": unix.SYS_ACCEPT4,
}

// Actions, spelled out independently of the filter's constants.
const (
	actAllow       = 0x7fff0000
	actKillProcess = 0x80000000
	actEPERM       = 0x00050000 | 1
	actEAFNOSUP    = 0x00050000 | 97
	actENOSYS      = 0x00050000 | 38
)

// actionName makes failures readable.
func actionName(a uint32) string {
	switch a {
	case actAllow:
		return "ALLOW"
	case actKillProcess:
		return "KILL_PROCESS"
	case actEPERM:
		return "ERRNO(EPERM)"
	case actEAFNOSUP:
		return "ERRNO(EAFNOSUPPORT)"
	case actENOSYS:
		return "ERRNO(ENOSYS)"
	}
	return fmt.Sprintf("%#x", a)
}

// call is one synthetic seccomp_data.
type call struct {
	arch uint32
	nr   uint32
	args [6]uint64
}

// encode lays out struct seccomp_data for golang.org/x/net/bpf's VM. The
// kernel loads each 32-bit word of the struct in native (little-endian)
// order; the VM loads big-endian. Writing every 32-bit word big-endian at
// the offset it has in the native struct therefore gives the VM exactly
// the word values the kernel would see: args[i]'s low half at 16+8i and
// its high half at 20+8i.
func (c call) encode() []byte {
	b := make([]byte, 64)
	binary.BigEndian.PutUint32(b[0:], c.nr)
	binary.BigEndian.PutUint32(b[4:], c.arch)
	// instruction_pointer (8..15) stays zero.
	for i, a := range c.args {
		binary.BigEndian.PutUint32(b[16+8*i:], uint32(a))
		binary.BigEndian.PutUint32(b[20+8*i:], uint32(a>>32))
	}
	return b
}

// newVM interprets the program Filter returns, not the builder's
// intermediate form, so the test covers the assembly step too.
func newVM(t *testing.T) *bpf.VM {
	t.Helper()
	prog, err := Filter()
	if err != nil {
		t.Fatalf("Filter: %v", err)
	}
	raw := make([]bpf.RawInstruction, len(prog))
	for i, f := range prog {
		raw[i] = bpf.RawInstruction{Op: f.Code, Jt: f.Jt, Jf: f.Jf, K: f.K}
	}
	ins, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatalf("Filter returned instructions the disassembler does not know")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatalf("bpf.NewVM: %v", err)
	}
	return vm
}

func run(t *testing.T, vm *bpf.VM, c call) uint32 {
	t.Helper()
	n, err := vm.Run(c.encode())
	if err != nil {
		t.Fatalf("vm.Run(%+v): %v", c, err)
	}
	return uint32(n)
}

func native(nr uint32, args ...uint64) call {
	c := call{arch: auditArch, nr: nr}
	copy(c.args[:], args)
	return c
}

func TestFilterActions(t *testing.T) {
	vm := newVM(t)
	const high = 1 << 32
	const sigchld = uint64(unix.SIGCHLD)
	// What glibc's pthread_create passes to clone.
	const threadFlags = unix.CLONE_VM | unix.CLONE_FS | unix.CLONE_FILES |
		unix.CLONE_SIGHAND | unix.CLONE_THREAD | unix.CLONE_SYSVSEM |
		unix.CLONE_SETTLS | unix.CLONE_PARENT_SETTID | unix.CLONE_CHILD_CLEARTID

	tests := []struct {
		name string
		call call
		want uint32
	}{
		{"getpid", native(unix.SYS_GETPID), actAllow},
		{"read", native(unix.SYS_READ, 0, 0, 0), actAllow},
		{"futex", native(unix.SYS_FUTEX), actAllow},
		{"mmap", native(unix.SYS_MMAP), actAllow},
		{"execve", native(unix.SYS_EXECVE), actAllow},
		{"prctl", native(unix.SYS_PRCTL), actAllow},
		{"seccomp", native(unix.SYS_SECCOMP), actAllow},
		{"exit_group", native(unix.SYS_EXIT_GROUP), actAllow},

		{"foreign arch i386", call{arch: unix.AUDIT_ARCH_I386, nr: 20}, actKillProcess},
		{"foreign arch arm", call{arch: unix.AUDIT_ARCH_ARM, nr: 20}, actKillProcess},
		{"foreign arch zero", call{arch: 0, nr: unix.SYS_GETPID}, actKillProcess},
		{"foreign arch, native denied nr", call{arch: unix.AUDIT_ARCH_I386, nr: unix.SYS_PTRACE}, actKillProcess},

		{"socket AF_UNIX", native(unix.SYS_SOCKET, unix.AF_UNIX, unix.SOCK_STREAM), actEPERM},
		{"socket AF_INET", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM), actEAFNOSUP},
		{"socket AF_INET6", native(unix.SYS_SOCKET, unix.AF_INET6, unix.SOCK_DGRAM), actEAFNOSUP},
		{"socket AF_NETLINK", native(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW), actEAFNOSUP},
		{"socket AF_PACKET", native(unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_RAW), actEAFNOSUP},
		{"socket AF_VSOCK", native(unix.SYS_SOCKET, unix.AF_VSOCK, unix.SOCK_STREAM), actEAFNOSUP},
		{"socket AF_UNSPEC", native(unix.SYS_SOCKET, unix.AF_UNSPEC), actEAFNOSUP},
		// The kernel's family is an int: only the low half counts.
		{"socket AF_INET, junk high half", native(unix.SYS_SOCKET, high|unix.AF_INET), actEAFNOSUP},
		{"socket AF_UNIX, junk high half", native(unix.SYS_SOCKET, 0xffffffff<<32|unix.AF_UNIX), actEPERM},
		{"socket AF_INET in the high half", native(unix.SYS_SOCKET, unix.AF_INET<<32|unix.AF_UNIX), actEPERM},
		{"socketpair AF_UNIX", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_STREAM), actAllow},
		{"socketpair AF_INET", native(unix.SYS_SOCKETPAIR, unix.AF_INET, unix.SOCK_STREAM), actEAFNOSUP},
		{"socketpair AF_UNIX seqpacket cloexec", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC), actAllow},
		{"socketpair AF_UNIX stream nonblock cloexec", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC), actAllow},
		{"socketpair AF_UNIX datagram", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_DGRAM), actEPERM},
		{"socketpair AF_UNIX datagram cloexec", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC), actEPERM},
		{"socketpair AF_UNIX raw", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_RAW), actEPERM},
		{"socketpair AF_UNIX stream, high bits", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_STREAM|1<<20), actEPERM},

		{"clone fork", native(unix.SYS_CLONE, sigchld), actAllow},
		{"clone vfork", native(unix.SYS_CLONE, unix.CLONE_VM|unix.CLONE_VFORK|sigchld), actAllow},
		{"clone thread", native(unix.SYS_CLONE, threadFlags), actAllow},
		{"clone CLONE_NEWNS", native(unix.SYS_CLONE, unix.CLONE_NEWNS|sigchld), actEPERM},
		{"clone CLONE_NEWUTS", native(unix.SYS_CLONE, unix.CLONE_NEWUTS|sigchld), actEPERM},
		{"clone CLONE_NEWIPC", native(unix.SYS_CLONE, unix.CLONE_NEWIPC|sigchld), actEPERM},
		{"clone CLONE_NEWUSER", native(unix.SYS_CLONE, unix.CLONE_NEWUSER|sigchld), actEPERM},
		{"clone CLONE_NEWPID", native(unix.SYS_CLONE, unix.CLONE_NEWPID|sigchld), actEPERM},
		{"clone CLONE_NEWNET", native(unix.SYS_CLONE, unix.CLONE_NEWNET|sigchld), actEPERM},
		{"clone CLONE_NEWCGROUP", native(unix.SYS_CLONE, unix.CLONE_NEWCGROUP|sigchld), actEPERM},
		{"clone CLONE_NEWTIME", native(unix.SYS_CLONE, unix.CLONE_NEWTIME), actEPERM},
		{"clone thread|CLONE_NEWNET", native(unix.SYS_CLONE, threadFlags|unix.CLONE_NEWNET), actEPERM},
		// The kernel takes lower_32_bits(flags).
		{"clone CLONE_NEWNET, junk high half", native(unix.SYS_CLONE, 0xffffffff<<32|unix.CLONE_NEWNET|sigchld), actEPERM},
		{"clone CLONE_NEWNET in the high half", native(unix.SYS_CLONE, unix.CLONE_NEWNET<<32|sigchld), actAllow},
		{"clone3", native(unix.SYS_CLONE3), actENOSYS},
		{"clone3 with args", native(unix.SYS_CLONE3, 0x1000, 88), actENOSYS},

		{"ioctl TCGETS", native(unix.SYS_IOCTL, 0, unix.TCGETS), actAllow},
		{"ioctl TIOCGWINSZ", native(unix.SYS_IOCTL, 1, unix.TIOCGWINSZ), actAllow},
		{"ioctl TIOCGPGRP", native(unix.SYS_IOCTL, 3, unix.TIOCGPGRP), actAllow},
		{"ioctl TIOCSTI", native(unix.SYS_IOCTL, 0, unix.TIOCSTI), actEPERM},
		{"ioctl TIOCLINUX", native(unix.SYS_IOCTL, 0, unix.TIOCLINUX), actEPERM},
		// The kernel's cmd is an unsigned int: only the low half counts.
		{"ioctl TIOCSTI, junk high half", native(unix.SYS_IOCTL, 0, high|unix.TIOCSTI), actEPERM},
		{"ioctl TIOCSTI, all-ones high half", native(unix.SYS_IOCTL, 0, 0xffffffff<<32|unix.TIOCSTI), actEPERM},
		{"ioctl TIOCLINUX, junk high half", native(unix.SYS_IOCTL, 0, 7<<32|unix.TIOCLINUX), actEPERM},
		{"ioctl TIOCSTI in the high half", native(unix.SYS_IOCTL, 0, unix.TIOCSTI<<32|unix.TCGETS), actAllow},
		{"ioctl TIOCSTI as fd", native(unix.SYS_IOCTL, unix.TIOCSTI, unix.TCGETS), actAllow},

		{"personality query", native(unix.SYS_PERSONALITY, 0xffffffff), actAllow},
		{"personality query, 64-bit -1", native(unix.SYS_PERSONALITY, 0xffffffffffffffff), actAllow},
		{"personality PER_LINUX", native(unix.SYS_PERSONALITY, 0), actAllow},
		{"personality PER_LINUX32", native(unix.SYS_PERSONALITY, 0x0008), actEPERM},
		{"personality ADDR_NO_RANDOMIZE", native(unix.SYS_PERSONALITY, 0x0040000), actEPERM},
		{"personality READ_IMPLIES_EXEC", native(unix.SYS_PERSONALITY, 0x0400000), actEPERM},
		{"personality PER_LINUX, junk high half", native(unix.SYS_PERSONALITY, high), actAllow},
		{"personality PER_LINUX32, junk high half", native(unix.SYS_PERSONALITY, high|0x0008), actEPERM},
	}
	tests = append(tests, archActionTests...)
	for _, tt := range tests {
		if got := run(t, vm, tt.call); got != tt.want {
			t.Errorf("%s: got %s, want %s", tt.name, actionName(got), actionName(tt.want))
		}
	}
}

// TestFilterDeniedSet sweeps every syscall number with zero arguments and
// checks that exactly the expected ones are refused: the listed syscalls
// with EPERM, clone3 with ENOSYS, socket and socketpair (family AF_UNSPEC)
// with EAFNOSUPPORT, personality(0) allowed, everything else allowed.
func TestFilterDeniedSet(t *testing.T) {
	vm := newVM(t)
	want := make(map[uint32]string)
	for name, nr := range wantDenied {
		want[nr] = name
	}
	for name, nr := range wantDeniedArch {
		want[nr] = name
	}
	for name, nr := range wantDeniedSocket {
		want[nr] = name
	}
	if n := len(wantDenied) + len(wantDeniedArch) + len(wantDeniedSocket); len(want) != n {
		t.Fatalf("the test's deny lists repeat a syscall number: %d names, %d numbers", n, len(want))
	}
	for nr := uint32(0); nr < 1024; nr++ {
		var exp uint32
		switch {
		case want[nr] != "":
			exp = actEPERM
		case nr == unix.SYS_CLONE3:
			exp = actENOSYS
		case nr == unix.SYS_SOCKET || nr == unix.SYS_SOCKETPAIR:
			exp = actEAFNOSUP
		default:
			exp = actAllow
		}
		if got := run(t, vm, native(nr)); got != exp {
			t.Errorf("syscall %d (%s) with zero args: got %s, want %s", nr, want[nr], actionName(got), actionName(exp))
		}
	}
}

// TestFilterInstructions checks what the kernel's seccomp verifier checks
// beyond the VM: word-sized, aligned loads inside struct seccomp_data, and
// a program that fits in BPF_MAXINSNS. Every instruction must also be one
// the seccomp filter accepts (loads, conditional jumps, constant returns).
func TestFilterInstructions(t *testing.T) {
	prog, err := program(false)
	if err != nil {
		t.Fatalf("program: %v", err)
	}
	if len(prog) > unix.BPF_MAXINSNS {
		t.Fatalf("program has %d instructions, over %d", len(prog), unix.BPF_MAXINSNS)
	}
	for i, ins := range prog {
		switch ins := ins.(type) {
		case bpf.LoadAbsolute:
			if ins.Size != 4 || ins.Off%4 != 0 || ins.Off+4 > 64 {
				t.Errorf("instruction %d: %v: seccomp accepts only aligned 32-bit loads within seccomp_data", i, ins)
			}
		case bpf.JumpIf, bpf.RetConstant:
		default:
			t.Errorf("instruction %d: unexpected %T %v", i, ins, ins)
		}
	}
	if _, ok := prog[len(prog)-1].(bpf.RetConstant); !ok {
		t.Errorf("last instruction is %v, want a return", prog[len(prog)-1])
	}
}

func TestBuilderRejectsBadJumps(t *testing.T) {
	var b builder
	b.jumpIf(bpf.JumpEqual, 1, "nowhere", next)
	b.emit(bpf.RetConstant{})
	if _, err := b.assemble(); err == nil {
		t.Errorf("assemble accepted a jump to an undefined label")
	}

	b = builder{}
	b.mark("back")
	b.emit(bpf.RetConstant{})
	b.jumpIf(bpf.JumpEqual, 1, "back", next)
	b.emit(bpf.RetConstant{})
	if _, err := b.assemble(); err == nil {
		t.Errorf("assemble accepted a backward jump")
	}

	b = builder{}
	b.jumpIf(bpf.JumpEqual, 1, "far", next)
	for range 256 {
		b.emit(bpf.RetConstant{})
	}
	b.mark("far")
	b.emit(bpf.RetConstant{})
	if _, err := b.assemble(); err == nil {
		t.Errorf("assemble accepted a jump of 256 instructions")
	}
}
