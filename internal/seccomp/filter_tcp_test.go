//go:build linux && (amd64 || arm64)

package seccomp

import (
	"testing"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// newTCPVM interprets the program FilterTCP returns.
func newTCPVM(t *testing.T) *bpf.VM {
	t.Helper()
	prog, err := FilterTCP()
	if err != nil {
		t.Fatalf("FilterTCP: %v", err)
	}
	raw := make([]bpf.RawInstruction, len(prog))
	for i, f := range prog {
		raw[i] = bpf.RawInstruction{Op: f.Code, Jt: f.Jt, Jf: f.Jf, K: f.K}
	}
	ins, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatalf("FilterTCP returned instructions the disassembler does not know")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatalf("bpf.NewVM: %v", err)
	}
	return vm
}

// TestFilterTCPActions checks that the TCP variant opens IPv4 TCP sockets
// and connect, and nothing else: every other family, type and protocol,
// and bind, listen and accept, stay refused.
func TestFilterTCPActions(t *testing.T) {
	vm := newTCPVM(t)
	const high = 1 << 32
	tests := []struct {
		name string
		call call
		want uint32
	}{
		{"socket AF_INET stream", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM, 0), actAllow},
		{"socket AF_INET stream cloexec", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0), actAllow},
		{"socket AF_INET stream nonblock cloexec tcp", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP), actAllow},
		// The kernel takes ints: only the low halves count.
		{"socket AF_INET stream, junk high halves", native(unix.SYS_SOCKET, high|unix.AF_INET, high|unix.SOCK_STREAM, high), actAllow},
		{"socket AF_INET stream mptcp", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_MPTCP), actEAFNOSUP},
		{"socket AF_INET stream sctp", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM, unix.IPPROTO_SCTP), actEAFNOSUP},
		{"socket AF_INET dgram", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_DGRAM, 0), actEAFNOSUP},
		{"socket AF_INET dgram icmp", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_DGRAM, unix.IPPROTO_ICMP), actEAFNOSUP},
		{"socket AF_INET raw", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_RAW, unix.IPPROTO_RAW), actEAFNOSUP},
		{"socket AF_INET seqpacket", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_SEQPACKET, 0), actEAFNOSUP},
		{"socket AF_INET stream, high type bits", native(unix.SYS_SOCKET, unix.AF_INET, unix.SOCK_STREAM|1<<20, 0), actEAFNOSUP},
		{"socket AF_INET6 stream", native(unix.SYS_SOCKET, unix.AF_INET6, unix.SOCK_STREAM, 0), actEAFNOSUP},
		{"socket AF_UNIX stream", native(unix.SYS_SOCKET, unix.AF_UNIX, unix.SOCK_STREAM, 0), actEPERM},
		{"socket AF_NETLINK", native(unix.SYS_SOCKET, unix.AF_NETLINK, unix.SOCK_RAW, 0), actEAFNOSUP},
		{"socket AF_PACKET", native(unix.SYS_SOCKET, unix.AF_PACKET, unix.SOCK_RAW, 0), actEAFNOSUP},
		{"socket AF_VSOCK stream", native(unix.SYS_SOCKET, unix.AF_VSOCK, unix.SOCK_STREAM, 0), actEAFNOSUP},
		{"socket AF_INET in the high half", native(unix.SYS_SOCKET, unix.AF_INET<<32|unix.AF_VSOCK, unix.SOCK_STREAM, 0), actEAFNOSUP},
		{"connect", native(unix.SYS_CONNECT, 3, 0, 16), actAllow},
		{"bind", native(unix.SYS_BIND, 3, 0, 16), actEPERM},
		{"listen", native(unix.SYS_LISTEN, 3, 1), actEPERM},
		{"accept", native(unix.SYS_ACCEPT, 3), actEPERM},
		{"accept4", native(unix.SYS_ACCEPT4, 3), actEPERM},
		{"socketpair AF_UNIX stream", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_STREAM), actAllow},
		{"socketpair AF_UNIX dgram", native(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_DGRAM), actEPERM},
		{"io_uring_setup", native(unix.SYS_IO_URING_SETUP), actEPERM},
		{"ptrace", native(unix.SYS_PTRACE), actEPERM},
		{"clone CLONE_NEWNET", native(unix.SYS_CLONE, unix.CLONE_NEWNET|uint64(unix.SIGCHLD)), actEPERM},
		{"getpid", native(unix.SYS_GETPID), actAllow},
	}
	for _, tt := range tests {
		if got := run(t, vm, tt.call); got != tt.want {
			t.Errorf("%s: got %s, want %s", tt.name, actionName(got), actionName(tt.want))
		}
	}
}

// TestFilterTCPSameElsewhere sweeps every syscall number with zero
// arguments: the TCP variant differs from the default filter in connect
// only (socket with zero arguments, AF_UNSPEC, is refused by both).
func TestFilterTCPSameElsewhere(t *testing.T) {
	def, tcp := newVM(t), newTCPVM(t)
	for nr := uint32(0); nr < 1024; nr++ {
		d, c := run(t, def, native(nr)), run(t, tcp, native(nr))
		switch {
		case nr == unix.SYS_CONNECT:
			if d != actEPERM || c != actAllow {
				t.Errorf("connect: default %s, tcp %s; want EPERM and ALLOW", actionName(d), actionName(c))
			}
		case d != c:
			t.Errorf("syscall %d: default %s, tcp %s", nr, actionName(d), actionName(c))
		}
	}
}
