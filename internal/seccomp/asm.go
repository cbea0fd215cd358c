//go:build linux

package seccomp

import (
	"fmt"

	"golang.org/x/net/bpf"
)

// label names a place in a program under construction. The empty label,
// next, means "the following instruction".
type label string

const next label = ""

// builder assembles a classic BPF program whose conditional jumps name
// labels instead of offsets, so that the policy reads as a list of rules.
// Jumps may only go forward, at most 255 instructions (the width of the
// jt/jf fields); assemble reports a program that breaks either rule.
type builder struct {
	ins    []bpf.Instruction
	labels map[label]int
	jumps  []jump
}

// jump records a conditional jump whose targets are resolved by assemble.
type jump struct {
	pc              int
	onTrue, onFalse label
}

// emit appends one instruction that is not a labelled jump.
func (b *builder) emit(ins bpf.Instruction) {
	b.ins = append(b.ins, ins)
}

// mark makes l name the next instruction emitted.
func (b *builder) mark(l label) {
	if b.labels == nil {
		b.labels = make(map[label]int)
	}
	b.labels[l] = len(b.ins)
}

// jumpIf appends "if A <cond> val goto onTrue else goto onFalse".
func (b *builder) jumpIf(cond bpf.JumpTest, val uint32, onTrue, onFalse label) {
	b.jumps = append(b.jumps, jump{pc: len(b.ins), onTrue: onTrue, onFalse: onFalse})
	b.ins = append(b.ins, bpf.JumpIf{Cond: cond, Val: val})
}

// assemble resolves the labels and returns the finished program.
func (b *builder) assemble() ([]bpf.Instruction, error) {
	prog := make([]bpf.Instruction, len(b.ins))
	copy(prog, b.ins)
	for _, j := range b.jumps {
		t, err := b.skip(j.pc, j.onTrue)
		if err != nil {
			return nil, err
		}
		f, err := b.skip(j.pc, j.onFalse)
		if err != nil {
			return nil, err
		}
		ins := prog[j.pc].(bpf.JumpIf)
		ins.SkipTrue, ins.SkipFalse = t, f
		prog[j.pc] = ins
	}
	return prog, nil
}

// skip returns how many instructions a jump at pc skips to reach l.
func (b *builder) skip(pc int, l label) (uint8, error) {
	if l == next {
		return 0, nil
	}
	to, ok := b.labels[l]
	if !ok {
		return 0, fmt.Errorf("seccomp: undefined label %q", l)
	}
	d := to - pc - 1
	if d < 0 || d > 255 {
		return 0, fmt.Errorf("seccomp: jump from %d to label %q (%d) out of range", pc, l, to)
	}
	return uint8(d), nil
}
