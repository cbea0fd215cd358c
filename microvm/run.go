package microvm

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path/filepath"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// backstop is how long past the wall time the host waits for the agent's
// report before it kills the VM itself. The engine kills the run at the
// wall time; this covers a kill that did not take.
const backstop = 15 * time.Second

// startTimeout bounds the wait for the agent's Started once the code is
// sent.
const startTimeout = 30 * time.Second

// Prepare implements engine.Backend: a VM restored from the template (or,
// for a cold sandbox, booted), refreshed, its agent waiting for the code.
//
// The refresh is a Refresh frame (the host's clock, fresh randomness), for
// which the agent reseeds the guest's random generator and replaces the
// template's python3 with one started after the reseed: Python's string
// hash secret is drawn when python3 starts, so the template's is in every
// VM restored from it, and one run could learn it for another's. The engine
// calls Prepare ahead of runs, so the new python3 starts while the VM waits
// in the pool; the Run refreshes the clock again.
func (b *backend) Prepare(ctx context.Context) (engine.Instance, error) {
	vm, n, how, err := b.startVM(ctx)
	if err != nil {
		return nil, err
	}
	idle := make(chan struct{}, 1)
	c := newAgentConn(vm.Agent(), func() {
		select {
		case idle <- struct{}{}:
		default:
		}
	})
	in := &vmInstance{b: b, vm: vm, net: n, c: c}
	start := time.Now()
	if err := refreshAgent(ctx, c, idle, time.Duration(b.cfg.BootTimeout)); err != nil {
		in.Discard()
		return nil, err
	}
	in.how = fmt.Sprintf("%s; its python3 started afresh in %d ms", how, time.Since(start).Milliseconds())
	return in, nil
}

// refreshAgent sends the agent of a VM just started a Refresh and waits,
// at most timeout, for its Idle: the guest's clock is set, its random
// generator reseeded and the python3 that waits for the run's code started
// after that. The Idle only says the agent is ready; nothing is judged from
// it (a guest that says it early gets its own run on a python3 of its
// choosing, nothing more).
func refreshAgent(ctx context.Context, c *agentConn, idle <-chan struct{}, timeout time.Duration) error {
	s := c.runSink() // the agent's Fail, if it fails
	defer c.endRun(s)
	seed := make([]byte, 64)
	rand.Read(seed)
	if err := c.sendJSON(wire.KindRefresh, wire.Refresh{UnixNano: time.Now().UnixNano(), Seed: seed}); err != nil {
		return err
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-idle:
		return nil
	case f := <-s.ch:
		return refreshFailed(f)
	case <-ctx.Done():
		return ctx.Err()
	case <-c.done:
		// What the reader delivered before it ended comes first.
		select {
		case <-idle:
			return nil
		case f := <-s.ch:
			return refreshFailed(f)
		default:
			return fmt.Errorf("microvm: the VM ended before its agent was refreshed (%v)", c.ended())
		}
	case <-t.C:
		return fmt.Errorf("microvm: the agent did not answer the refresh within %v", timeout)
	}
}

// refreshFailed is the error of a frame other than Idle in answer to a
// Refresh.
func refreshFailed(f frame) error {
	if f.kind == wire.KindFail {
		return unavailable("the guest agent failed to refresh the VM", "", errors.New(clip(f.payload, 512)))
	}
	return fmt.Errorf("microvm: the agent sent %s in answer to the refresh", f.kind)
}

// startVM restores the template, or boots a fresh VM when the sandbox is
// cold, and returns it running with its agent waiting, and with Egress its
// network, which the caller closes after killing the VM.
func (b *backend) startVM(ctx context.Context) (VM, *vmNet, string, error) {
	start := time.Now()
	spec := b.spec
	var n *vmNet
	if b.cfg.Egress != nil {
		var err error
		if n, err = b.newNet(); err != nil {
			return nil, nil, "", err
		}
		spec.Net = n.spec
	}
	if b.cfg.Cold {
		// Never saved: its agent fills no page cache for copies.
		spec.Cmdline += " " + noSaveArg
		vm, _, err := bootToHello(ctx, b.vmm, spec, time.Duration(b.cfg.BootTimeout))
		if err != nil {
			n.close()
			return nil, nil, "", err
		}
		return vm, n, fmt.Sprintf("vm: cold boot to a ready agent in %d ms", time.Since(start).Milliseconds()), nil
	}
	vm, err := b.restore(ctx, spec)
	if err != nil {
		n.close()
		return nil, nil, "", err
	}
	return vm, n, fmt.Sprintf("vm: restored from template %s in %d ms", filepath.Base(b.tmpl)[:12], time.Since(start).Milliseconds()), nil
}

// recheckTemplate checks the template's files again, as useTemplate
// does, when they are not those checked: another sandbox pruned the
// template (it is made again here) or made it again. A damaged file
// fails its digest (moat.ErrInvalid).
func (b *backend) recheckTemplate(ctx context.Context) (state, ram *fileVersion, err error) {
	meta, err := readMeta(b.tmpl)
	if errors.Is(err, fs.ErrNotExist) {
		var dir string
		dir, meta, err = ensureTemplate(ctx, b.cfg.StateDir, b.vmm, b.spec, time.Duration(b.cfg.BootTimeout))
		if err == nil && dir != b.tmpl {
			err = fmt.Errorf("microvm: the template %s was made again as %s", b.tmpl, dir)
		}
	}
	if err != nil {
		return nil, nil, err
	}
	if state, ram, err = verifyTemplate(b.tmpl, meta); err != nil {
		return nil, nil, err
	}
	b.tmplFiles.set(state, ram)
	return state, ram, nil
}

// restore starts a VM of spec from the template and lets it run: its agent
// waits for the code.
func (b *backend) restore(ctx context.Context, spec VMSpec) (VM, error) {
	if b.tmplFiles == nil {
		return nil, fmt.Errorf("microvm: restore: no verified template: %w", moat.ErrInvalid)
	}
	spec.Restore = filepath.Join(b.tmpl, "state")
	if b.meta != nil && b.meta.SharedRAM {
		spec.RAM = filepath.Join(b.tmpl, ramFile)
	}
	// Start refuses files other than those verified (useTemplate).
	spec.stateID, spec.ramID = b.tmplFiles.get()
	vm, err := b.vmm.Start(ctx, spec)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, errChanged) {
		// A newer template of another sandbox superseded this one and
		// removed it (see pruneTemplates), or it was made again since:
		// make it again, check it.
		state, ram, rerr := b.recheckTemplate(ctx)
		if rerr != nil {
			return nil, rerr
		}
		spec.stateID, spec.ramID = state, ram
		vm, err = b.vmm.Start(ctx, spec)
	}
	if err != nil {
		return nil, err
	}
	rctx, cancel := context.WithTimeout(ctx, time.Duration(b.cfg.BootTimeout))
	defer cancel()
	if err := vm.Resume(rctx); err != nil {
		vm.Kill()
		return nil, err
	}
	return vm, nil
}

// newRun is the Run frame of code under the sandbox's limits, with the
// host's clock and fresh randomness.
func (b *backend) newRun(code []byte) wire.Run {
	lim := b.limits
	seed := make([]byte, 64)
	rand.Read(seed)
	return wire.Run{
		Code: code, UnixNano: time.Now().UnixNano(), Seed: seed,
		CPUMS:  time.Duration(lim.CPUTime).Milliseconds(),
		Memory: int64(lim.Memory), Pids: int64(lim.Pids), FileSize: int64(lim.FileSize),
		Disk: int64(lim.Disk), OpenFiles: int64(lim.OpenFiles),
	}
}

// vmInstance is one VM waiting for its one run.
type vmInstance struct {
	b   *backend
	vm  VM
	net *vmNet // with Egress
	c   *agentConn
	how string // how it was made, for the Result's notes
}

// Start implements engine.Instance: send the code and wait for the agent
// to say it runs.
func (in *vmInstance) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	select {
	case <-in.vm.Exited():
		return nil, fmt.Errorf("microvm: the VM restored ahead of the run has ended: %w", engine.ErrStale)
	case <-in.c.done:
		return nil, fmt.Errorf("microvm: the agent of the VM restored ahead of the run is gone (%v): %w", in.c.ended(), engine.ErrStale)
	default:
	}
	s := in.c.runSink()
	r := in.b.newRun(code)
	r.Egress = in.b.egressFrame(in.net)
	if err := startRun(ctx, in.c, s, r); err != nil {
		in.c.endRun(s)
		in.vm.Abort()
		return nil, err
	}
	return &runProcess{in: in, s: s, stdout: stdout, stderr: stderr,
		wall: time.Duration(in.b.limits.WallTime)}, nil
}

// startRun sends r and waits for the agent's Started.
func startRun(ctx context.Context, c *agentConn, s *sink, r wire.Run) error {
	sent := make(chan error, 1)
	go func() { sent <- c.sendJSON(wire.KindRun, r) }()
	timeout := time.NewTimer(startTimeout)
	defer timeout.Stop()
	for {
		select {
		case err := <-sent:
			if err != nil {
				return err
			}
			sent = nil
		case <-ctx.Done():
			return ctx.Err()
		case f := <-s.ch:
			return started(f)
		case <-c.done:
			// What the reader delivered before it ended comes first: a
			// Started followed by the end of the VM is a run that started.
			select {
			case f := <-s.ch:
				return started(f)
			default:
				return fmt.Errorf("microvm: the VM ended before the code started (%v)", c.ended())
			}
		case <-timeout.C:
			return fmt.Errorf("microvm: the agent did not start the code within %v", startTimeout)
		}
	}
}

// started checks the first frame of a run, which must be the agent's
// Started.
func started(f frame) error {
	switch f.kind {
	case wire.KindStarted:
		return nil
	case wire.KindFail:
		return unavailable("the guest agent failed", "", errors.New(clip(f.payload, 512)))
	default:
		return fmt.Errorf("microvm: the agent sent %s before the code started", f.kind)
	}
}

// Discard implements engine.Instance: the VM is killed, then its network
// closed.
func (in *vmInstance) Discard() {
	in.vm.Kill()
	in.net.close()
}

// runProcess is the one run of a VM.
type runProcess struct {
	in             *vmInstance
	s              *sink
	stdout, stderr io.Writer
	wall           time.Duration

	mu         sync.Mutex
	backstoped bool
}

// Kill implements engine.Process: the VM is killed, without waiting.
func (p *runProcess) Kill() { p.in.vm.Abort() }

// Wait implements engine.Process: the output frames go to the writers
// until the agent's Exit, which is the evidence.
func (p *runProcess) Wait() (engine.Evidence, error) {
	c := p.in.c
	defer c.endRun(p.s)
	e, err := waitExit(c, p.s, p.stdout, p.stderr, p.wall+backstop, func() {
		p.mu.Lock()
		p.backstoped = true
		p.mu.Unlock()
		p.in.vm.Abort()
	})
	var ev engine.Evidence
	if err == nil && (e.Fresh || e.Ended) {
		err = fmt.Errorf("microvm: the agent's exit report speaks of an interpreter, which a one-shot run has not")
	}
	if err == nil {
		ev = evidence(e, time.Duration(p.in.b.limits.CPUTime))
	}
	ev.Notes = append(ev.Notes, p.in.how)
	ev.Notes = append(ev.Notes, p.in.net.notes()...)
	p.mu.Lock()
	if p.backstoped {
		ev.Notes = append(ev.Notes, "the agent did not report within the wall time; the host killed the VM")
	}
	p.mu.Unlock()
	return ev, err
}

// waitExit writes a run's output frames to stdout and stderr until its
// Exit, which it returns checked. When no Exit has come within limit, it
// calls stop (which must make the reader end) and goes on reading what the
// reader still delivers.
func waitExit(c *agentConn, s *sink, stdout, stderr io.Writer, limit time.Duration, stop func()) (*wire.Exit, error) {
	timer := time.NewTimer(limit)
	defer timer.Stop()
	for {
		f, ok, timedOut := c.next(s, timer.C)
		if timedOut {
			stop()
			continue
		}
		if !ok {
			return nil, fmt.Errorf("microvm: the VM ended without a report (%v)", c.ended())
		}
		switch f.kind {
		case wire.KindStdout:
			stdout.Write(f.payload)
		case wire.KindStderr:
			stderr.Write(f.payload)
		case wire.KindExit:
			return parseExit(f.payload)
		case wire.KindFail:
			return nil, unavailable("the guest agent failed", "", errors.New(clip(f.payload, 512)))
		case wire.KindStarted:
			// Of a run whose start was given up on (see vmSession.Start).
		default:
			return nil, fmt.Errorf("microvm: the agent sent %s during the run", f.kind)
		}
	}
}
