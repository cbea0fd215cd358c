package gvisor

import (
	"encoding/binary"
	"runtime"
	"slices"
	"testing"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// TestGuestFilter runs the guest filter in a BPF interpreter: the policy
// must be guestSeccomp's, call for call.
func TestGuestFilter(t *testing.T) {
	raw, err := guestFilter()
	if err != nil {
		t.Skipf("no guest filter here: %v", err)
	}
	// Every denied name has its number here, but the amd64-only ones on
	// arm64.
	for _, name := range deniedSyscalls {
		if _, ok := guestSyscalls[name]; !ok && (runtime.GOARCH == "amd64" || !slices.Contains([]string{"iopl", "ioperm", "modify_ldt"}, name)) {
			t.Errorf("the guest filter has no number for %s", name)
		}
	}
	ins, ok := bpf.Disassemble(raw)
	if !ok {
		t.Fatal("the guest filter does not disassemble")
	}
	vm, err := bpf.NewVM(ins)
	if err != nil {
		t.Fatal(err)
	}
	run := func(arch, nr uint32, arg0 uint64) uint32 {
		// The interpreter loads words big-endian; the kernel loads them
		// native-endian. Each word is laid out for the interpreter, the
		// argument's low half first as on a little-endian machine.
		data := make([]byte, 64)
		binary.BigEndian.PutUint32(data[offNr:], nr)
		binary.BigEndian.PutUint32(data[offArch:], arch)
		binary.BigEndian.PutUint32(data[offArg0:], uint32(arg0))
		binary.BigEndian.PutUint32(data[offArg0+4:], uint32(arg0>>32))
		out, err := vm.Run(data)
		if err != nil {
			t.Fatal(err)
		}
		return uint32(out)
	}
	const (
		allow  = unix.SECCOMP_RET_ALLOW
		eperm  = unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)
		enosys = unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)
		kill   = unix.SECCOMP_RET_KILL_PROCESS
	)
	for name, nr := range guestSyscalls {
		if got := run(guestArch, nr, 0); got != eperm {
			t.Errorf("%s: %#x, want EPERM", name, got)
		}
	}
	for _, f := range namespaceFlags {
		if got := run(guestArch, sysClone, f|uint64(unix.SIGCHLD)); got != eperm {
			t.Errorf("clone(%#x): %#x, want EPERM", f, got)
		}
	}
	for _, c := range []struct {
		name string
		arch uint32
		nr   uint32
		arg0 uint64
		want uint32
	}{
		{"fork by clone", guestArch, sysClone, uint64(unix.SIGCHLD), allow},
		{"thread by clone", guestArch, sysClone, unix.CLONE_VM | unix.CLONE_THREAD | unix.CLONE_SIGHAND | unix.CLONE_FS | unix.CLONE_FILES, allow},
		{"clone3", guestArch, sysClone3, 0, enosys},
		{"write", guestArch, unix.SYS_WRITE, 1, allow},
		{"getpid", guestArch, unix.SYS_GETPID, 0, allow},
		{"another architecture", guestArch ^ 1, unix.SYS_WRITE, 1, kill},
	} {
		if got := run(c.arch, c.nr, c.arg0); got != c.want {
			t.Errorf("%s: %#x, want %#x", c.name, got, c.want)
		}
	}
	if guestX32 != 0 {
		if got := run(guestArch, guestX32|unix.SYS_UNSHARE, 0); got != enosys {
			t.Errorf("x32 unshare: %#x, want ENOSYS", got)
		}
	}
}
