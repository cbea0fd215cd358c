package gvisor

import (
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/net/bpf"
	"golang.org/x/sys/unix"
)

// The guest filter is guestSeccomp's policy as a classic BPF program, for
// the processes that runsc exec starts in a session's sandbox: gVisor's
// kernel applies the spec's seccomp filter (--oci-seccomp) to the
// container's init only, never to an exec'd process, so the session's
// launcher installs this one itself (prctl(PR_SET_SECCOMP)) on the run's
// process right before it execs Python. gVisor's kernel runs the filter
// as Linux would, and the code inherits it through every fork and exec.
//
// The policy is the same: deniedSyscalls fail with EPERM, clone with a
// namespace flag fails with EPERM, clone3 fails with ENOSYS (so that the C
// library falls back to clone), and a system call of another architecture's
// convention kills the process. On amd64 the x32 numbers fail with ENOSYS.

// errNoGuestFilter says that this architecture has no guest filter.
var errNoGuestFilter = errors.New("gvisor: no guest seccomp filter for " + runtime.GOARCH)

// seccomp_data offsets: the syscall number, the architecture, and the low
// half of the first argument (both supported architectures are
// little-endian).
const (
	offNr   = 0
	offArch = 4
	offArg0 = 16
)

// guestFilter returns the guest filter for the running architecture,
// assembled, as prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER) takes it.
func guestFilter() ([]bpf.RawInstruction, error) {
	if guestArch == 0 {
		return nil, errNoGuestFilter
	}
	var p asm
	p.op(bpf.LoadAbsolute{Off: offArch, Size: 4}, "", "")
	p.op(bpf.JumpIf{Cond: bpf.JumpEqual, Val: guestArch}, "", "kill")
	p.op(bpf.LoadAbsolute{Off: offNr, Size: 4}, "", "")
	if guestX32 != 0 {
		p.op(bpf.JumpIf{Cond: bpf.JumpGreaterOrEqual, Val: guestX32}, "enosys", "")
	}
	p.op(bpf.JumpIf{Cond: bpf.JumpEqual, Val: sysClone3}, "enosys", "")
	p.op(bpf.JumpIf{Cond: bpf.JumpEqual, Val: sysClone}, "clone", "")
	for _, name := range deniedSyscalls {
		if nr, ok := guestSyscalls[name]; ok {
			p.op(bpf.JumpIf{Cond: bpf.JumpEqual, Val: nr}, "eperm", "")
		}
	}
	p.op(bpf.RetConstant{Val: unix.SECCOMP_RET_ALLOW}, "", "")
	p.label("clone")
	p.op(bpf.LoadAbsolute{Off: offArg0, Size: 4}, "", "")
	var ns uint32
	for _, f := range namespaceFlags {
		ns |= uint32(f)
	}
	p.op(bpf.JumpIf{Cond: bpf.JumpBitsSet, Val: ns}, "eperm", "")
	p.op(bpf.RetConstant{Val: unix.SECCOMP_RET_ALLOW}, "", "")
	p.label("eperm")
	p.op(bpf.RetConstant{Val: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)}, "", "")
	p.label("enosys")
	p.op(bpf.RetConstant{Val: unix.SECCOMP_RET_ERRNO | uint32(unix.ENOSYS)}, "", "")
	p.label("kill")
	p.op(bpf.RetConstant{Val: unix.SECCOMP_RET_KILL_PROCESS}, "", "")
	ins, err := p.resolve()
	if err != nil {
		return nil, err
	}
	return bpf.Assemble(ins)
}

// asm is a classic BPF program whose conditional jumps name labels that
// come later ("" is the next instruction).
type asm struct {
	ins    []bpf.Instruction
	jumps  map[int][2]string
	labels map[string]int
}

func (p *asm) op(ins bpf.Instruction, onTrue, onFalse string) {
	if onTrue != "" || onFalse != "" {
		if p.jumps == nil {
			p.jumps = map[int][2]string{}
		}
		p.jumps[len(p.ins)] = [2]string{onTrue, onFalse}
	}
	p.ins = append(p.ins, ins)
}

func (p *asm) label(l string) {
	if p.labels == nil {
		p.labels = map[string]int{}
	}
	p.labels[l] = len(p.ins)
}

func (p *asm) resolve() ([]bpf.Instruction, error) {
	skip := func(pc int, l string) (uint8, error) {
		if l == "" {
			return 0, nil
		}
		to, ok := p.labels[l]
		if !ok || to <= pc || to-pc-1 > 255 {
			return 0, fmt.Errorf("gvisor: guest filter: bad jump from %d to %q", pc, l)
		}
		return uint8(to - pc - 1), nil
	}
	out := append([]bpf.Instruction(nil), p.ins...)
	for pc, j := range p.jumps {
		ins := out[pc].(bpf.JumpIf)
		var err error
		if ins.SkipTrue, err = skip(pc, j[0]); err != nil {
			return nil, err
		}
		if ins.SkipFalse, err = skip(pc, j[1]); err != nil {
			return nil, err
		}
		out[pc] = ins
	}
	return out, nil
}
