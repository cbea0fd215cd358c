package microvm

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// Sessions: one VM per session, restored from the template, whose agent
// serves the session's runs and file operations (see the package doc).

const (
	// idleGrace is how long after a run's end the host waits for the
	// agent's Idle (the next run's python3 is ready) before it pauses the
	// VM anyway.
	idleGrace = 20 * time.Second
	// killBackstop is how long the host waits for the agent to report a
	// run it asked it to kill before it kills the VM, and with it the
	// session.
	killBackstop = 15 * time.Second
	// opTimeout bounds one file operation's wait for the agent.
	opTimeout = 2 * time.Minute
	// budgetTick is how often a run's share of the session's CPU budget
	// is looked at.
	budgetTick = 100 * time.Millisecond
)

// NewSession implements engine.SessionBackend. The session's VM is one
// the engine's pool restored and refreshed ahead of a one-shot run, when
// one is ready (the restore and the first python3's start are then off the
// session's path), else one restored now; see fromPool.
func (b *backend) NewSession(ctx context.Context, opts moat.SessionOptions) (engine.SessionInstance, error) {
	if b.takeReady != nil {
		if inst, ok := b.takeReady(); ok {
			ss, err := b.fromPool(ctx, inst.(*vmInstance), opts)
			if err == nil {
				b.log.Debug("microvm: session", "vm", ss.how)
				return ss, nil
			}
			if !errors.Is(err, engine.ErrStale) || ctx.Err() != nil {
				return nil, err
			}
			b.log.Info("microvm: a pooled VM went stale before it became a session's; restoring one", "err", err)
		}
	}
	vm, n, how, err := b.startVM(ctx)
	if err != nil {
		return nil, err
	}
	ss := b.newSession(vm, n, opts, how)
	ss.c = newAgentConn(vm.Agent(), ss.onIdle)
	if err := ss.open(ctx); err != nil {
		vm.Kill()
		n.close()
		return nil, err
	}
	b.log.Debug("microvm: session", "vm", ss.how)
	return ss, nil
}

func (b *backend) newSession(vm VM, n *vmNet, opts moat.SessionOptions, how string) *vmSession {
	return &vmSession{b: b, vm: vm, net: n, idle: make(chan struct{}, 1), interp: opts.Interpreter,
		budget: time.Duration(b.cfg.SessionCPUTime), how: how}
}

// fromPool makes in, a VM of the pool that no run has used, a session's:
// the Session frame that every new session's agent gets (the clock and the
// kernel's random generator set again, the writable layer sized to the
// disk limit, the working directory opened, the interpreter of an
// interpreter session made) is all that is left to do. What Prepare's
// Refresh made stays: the python3 waiting for a plain session's first run
// started after that refresh, in this VM alone; an interpreter session's
// agent hands that python3 the interpreter's driver as its code, so that
// Python's start (about 0.9s under TCG) is off the session's path too and
// the interpreter's hash secret is still this VM's own. A VM that
// ended while it waited (or ends before its agent answers) is discarded
// and the error wraps engine.ErrStale: the caller makes a fresh one.
// Whatever fails, in is discarded.
func (b *backend) fromPool(ctx context.Context, in *vmInstance, opts moat.SessionOptions) (*vmSession, error) {
	stale := func() error {
		select {
		case <-in.vm.Exited():
			return fmt.Errorf("microvm: session: the VM restored ahead has ended: %w", engine.ErrStale)
		case <-in.c.done:
			return fmt.Errorf("microvm: session: the agent of the VM restored ahead is gone (%v): %w", in.c.ended(), engine.ErrStale)
		default:
			return nil
		}
	}
	if err := stale(); err != nil {
		in.Discard()
		return nil, err
	}
	start := time.Now()
	ss := b.newSession(in.vm, in.net, opts, "")
	ss.c = in.c
	in.c.setIdle(ss.onIdle)
	if err := ss.open(ctx); err != nil {
		// Discarded after the look at how it ended: once discarded, any VM
		// has ended.
		defer in.Discard()
		if ctx.Err() != nil {
			return nil, err
		}
		// A write to a VM that ended fails a moment before its reader
		// sees the end.
		select {
		case <-in.c.done:
		case <-in.vm.Exited():
		case <-time.After(time.Second):
		}
		if serr := stale(); serr != nil {
			return nil, fmt.Errorf("%w; %v", serr, err)
		}
		return nil, err
	}
	ss.how = fmt.Sprintf("%s (the pool's); a session's in %d ms", in.how, time.Since(start).Milliseconds())
	return ss, nil
}

// vmSession is one session's VM.
type vmSession struct {
	b      *backend
	vm     VM
	net    *vmNet // with Egress: one proxy run for the session's life
	c      *agentConn
	idle   chan struct{} // a token for each Idle of the agent's, at most one kept
	interp bool          // a live interpreter (moat.SessionOptions.Interpreter)
	budget time.Duration
	how    string        // how the VM was made, for the log and the tests
	ids    atomic.Uint64 // file operation ids

	mu    sync.Mutex
	users int // runs and file operations that need the VM running
	// pending counts the runs started whose Idle the agent has not sent
	// yet: the agent is busy (a run, or the next run's python3) until it
	// is 0.
	pending int
	paused  bool  // the VM is paused (QMP stop)
	broken  error // the VM failed; every later use fails with it
	grace   *time.Timer
	used    time.Duration // the QEMU CPU time of the session's runs so far
	closed  bool
}

var _ engine.SessionInstance = (*vmSession)(nil)

// open makes the VM a session's and pauses it once the agent is idle.
func (ss *vmSession) open(ctx context.Context) error {
	b := ss.b
	seed := make([]byte, 64)
	rand.Read(seed)
	if err := ss.c.sendJSON(wire.KindSession, wire.Session{
		UnixNano: time.Now().UnixNano(), Seed: seed, Disk: int64(b.limits.Disk), FileSize: int64(b.limits.FileSize),
		Interpreter: ss.interp, Egress: b.egressFrame(ss.net),
	}); err != nil {
		return err
	}
	if err := ss.awaitIdle(ctx, "session"); err != nil {
		return err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.pauseLocked()
}

// awaitIdle waits, at most the boot timeout, for the agent's Idle that
// answers the Session (or, for a resume, the Refresh) just sent.
func (ss *vmSession) awaitIdle(ctx context.Context, what string) error {
	timeout := time.NewTimer(time.Duration(ss.b.cfg.BootTimeout))
	defer timeout.Stop()
	select {
	case <-ss.idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-ss.c.done:
		return fmt.Errorf("microvm: %s: the VM ended before its agent was ready (%v)", what, ss.c.ended())
	case <-timeout.C:
		return fmt.Errorf("microvm: %s: the agent did not answer within %v", what, ss.b.cfg.BootTimeout)
	}
}

// onIdle is the agent's Idle: the VM may pause once nothing needs it.
func (ss *vmSession) onIdle() {
	select {
	case ss.idle <- struct{}{}:
	default:
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.pending = max(ss.pending-1, 0)
	ss.pauseLocked()
}

// acquire counts a user of the VM in and lets the VM run.
func (ss *vmSession) acquire(ctx context.Context) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.broken != nil {
		return ss.broken
	}
	if ss.closed {
		return fmt.Errorf("microvm: session: %w", moat.ErrClosed)
	}
	if ss.paused {
		if err := ss.vm.Resume(ctx); err != nil {
			ss.breakLocked(fmt.Errorf("microvm: session: resume the VM: %w", err))
			return ss.broken
		}
		ss.paused = false
	}
	ss.users++
	return nil
}

// release counts a user out; the VM pauses when nothing needs it.
func (ss *vmSession) release() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.users--
	ss.pauseLocked()
}

// pauseLocked pauses the VM when no run or file operation needs it.
func (ss *vmSession) pauseLocked() error {
	if ss.paused || ss.users > 0 || ss.pending > 0 || ss.broken != nil || ss.closed {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ss.vm.Pause(ctx); err != nil {
		ss.breakLocked(fmt.Errorf("microvm: session: pause the VM: %w", err))
		return ss.broken
	}
	ss.paused = true
	return nil
}

// breakLocked marks the session's VM as failed and kills it.
func (ss *vmSession) breakLocked(err error) {
	if ss.broken == nil {
		ss.broken = err
		ss.b.log.Warn("microvm: session VM failed", "err", err)
	}
	ss.vm.Abort()
}

func (ss *vmSession) fail(err error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.breakLocked(err)
}

// cpu is the QEMU process's CPU time so far, user and system, from
// /proc: a figure of the host kernel's that nothing in the guest can set.
func (ss *vmSession) cpu() (time.Duration, error) {
	return processCPU(ss.vm.Pid())
}

// processCPU reads utime and stime of /proc/PID/stat, in clock ticks
// (USER_HZ, 100 on Linux).
func processCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces.
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("microvm: /proc/%d/stat: %q", pid, clip(b, 64))
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("microvm: /proc/%d/stat: %q", pid, clip(b, 64))
	}
	utime, err1 := strconv.ParseInt(f[11], 10, 64)
	stime, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("microvm: /proc/%d/stat: %q", pid, clip(b, 64))
	}
	return time.Duration(utime+stime) * 10 * time.Millisecond, nil
}

// Start implements engine.SessionInstance: resume the VM and start the run.
func (ss *vmSession) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	if err := ss.acquire(ctx); err != nil {
		return nil, err
	}
	ss.mu.Lock()
	ss.pending++
	if ss.grace != nil {
		ss.grace.Stop()
	}
	ss.mu.Unlock()
	base, err := ss.cpu()
	if err != nil {
		ss.fail(err)
		ss.endRun()
		return nil, err
	}
	s := ss.c.runSink()
	p := &sessionProcess{ss: ss, s: s, stdout: stdout, stderr: stderr, base: base, done: make(chan struct{})}
	if err := startRun(ctx, ss.c, s, ss.b.newRun(code)); err != nil {
		if ctx.Err() != nil && ss.c.ended() == nil {
			// The run may have started in the guest: end it there, and
			// keep the session only when the agent reports its end.
			p.Kill()
			if _, werr := p.Wait(); werr != nil {
				ss.fail(werr)
			}
			return nil, ctx.Err()
		}
		ss.c.endRun(s)
		ss.fail(err)
		ss.endRun()
		return nil, err
	}
	go p.watchBudget()
	return p, nil
}

// endRun counts the run's use of the VM out; the VM pauses at the agent's
// Idle, or idleGrace from now.
func (ss *vmSession) endRun() {
	ss.mu.Lock()
	if ss.pending > 0 {
		ss.grace = time.AfterFunc(idleGrace, func() {
			ss.mu.Lock()
			defer ss.mu.Unlock()
			ss.pending = 0
			ss.pauseLocked()
		})
	}
	ss.mu.Unlock()
	ss.release()
}

// sessionProcess is one run of a session.
type sessionProcess struct {
	ss             *vmSession
	s              *sink
	stdout, stderr io.Writer
	base           time.Duration // the QEMU CPU time when the run began
	done           chan struct{} // closed when Wait returns

	killOnce   sync.Once
	mu         sync.Mutex
	overBudget bool
}

// Kill implements engine.Process: the agent is asked to kill every process
// of the run; when it does not report the run's end within killBackstop,
// the VM is killed, and the session with it.
func (p *sessionProcess) Kill() {
	p.killOnce.Do(func() {
		go func() {
			if err := p.ss.c.send(wire.KindKill, nil); err != nil {
				p.ss.fail(err)
				return
			}
			select {
			case <-p.done:
			case <-time.After(killBackstop):
				p.ss.fail(fmt.Errorf("microvm: session: the agent did not end a run within %v of the kill; the VM is killed", killBackstop))
			}
		}()
	})
}

// watchBudget kills the run when the session's runs have used its CPU
// budget.
func (p *sessionProcess) watchBudget() {
	tick := time.NewTicker(budgetTick)
	defer tick.Stop()
	for {
		select {
		case <-p.done:
			return
		case <-tick.C:
			if p.spent() {
				p.mu.Lock()
				p.overBudget = true
				p.mu.Unlock()
				p.Kill()
				return
			}
		}
	}
}

// spent says whether the session's runs, this one included so far, have
// used the budget.
func (p *sessionProcess) spent() bool {
	now, err := p.ss.cpu()
	if err != nil {
		return false
	}
	p.ss.mu.Lock()
	defer p.ss.mu.Unlock()
	return p.ss.used+(now-p.base) >= p.ss.budget
}

// Wait implements engine.Process.
func (p *sessionProcess) Wait() (engine.Evidence, error) {
	ss := p.ss
	defer ss.endRun()
	defer ss.c.endRun(p.s)
	defer close(p.done)
	wall := time.Duration(ss.b.limits.WallTime)
	e, err := waitExit(ss.c, p.s, p.stdout, p.stderr, wall+backstop, func() {
		ss.fail(fmt.Errorf("microvm: session: the agent did not report a run within %v past its wall time; the VM is killed", backstop))
	})
	var ev engine.Evidence
	if err == nil && !ss.interp && (e.Fresh || e.Ended) {
		err = fmt.Errorf("microvm: session: the agent's exit report speaks of an interpreter, which the session has not")
	}
	if err == nil {
		ev = evidence(e, time.Duration(ss.b.limits.CPUTime))
		if e.Fresh {
			ev.Notes = append(ev.Notes, "interpreter restarted: the previous one ended with its run; variables from earlier runs are gone")
		}
		if e.Ended {
			ev.Notes = append(ev.Notes, "interpreter ended with this run (killed at a limit, cancelled, or it exited): the next run starts a fresh one; the files remain")
		}
	}
	ev.Notes = append(ev.Notes, ss.net.notes()...)
	if now, cerr := ss.cpu(); cerr == nil {
		ss.mu.Lock()
		ss.used += now - p.base
		ev.Spent = ss.used >= ss.budget
		ss.mu.Unlock()
	}
	p.mu.Lock()
	if p.overBudget {
		ev.CPUTime, ev.Spent = true, true
		ev.Notes = append(ev.Notes, fmt.Sprintf("the session's CPU budget (%v) is used up: its later runs are refused, its files can still be read", ss.budget))
	}
	p.mu.Unlock()
	if err != nil {
		ss.fail(err)
	}
	return ev, err
}

// Close implements engine.SessionInstance: the VM is killed.
func (ss *vmSession) Close() error {
	ss.mu.Lock()
	ss.closed = true
	if ss.grace != nil {
		ss.grace.Stop()
	}
	ss.mu.Unlock()
	ss.vm.Kill()
	ss.net.close()
	return nil
}
