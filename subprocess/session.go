package subprocess

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// Sessions.
//
// A session keeps, for its whole life, a working directory under the runs
// directory named "<owner id>-s<id>" (so that New's reaper removes it once
// its owner is dead), mounted as a tmpfs of the disk limit, and the lease of
// one sandbox uid. Each Run goes through the same hardened path as a one-shot
// run — a fresh helper as PID 1 of a fresh PID namespace, a fresh cgroup,
// rlimits, no_new_privs, Landlock granting read-write only to the session's
// directory, seccomp — with that directory as working directory and HOME,
// and the same evidence (evidence.go). Between runs nothing of a session
// without an interpreter runs: its helper and cgroup end with each run.
//
// The engine (internal/engine) serializes the runs, checks the file names,
// judges each run and refuses runs once the session's CPU budget is spent;
// this file and interpreter*.go are its instance. The session as a whole
// has the disk limit (its tmpfs); each run has the memory and process
// limits, and so has an interpreter for its life.
//
// With SessionOptions.Interpreter, a python3 started through the same helper
// path stays alive between runs, driven by a small driver
// (interpreter_driver.py) that reads code on a socket and runs it with
// exec() in one persistent globals dictionary (see interpreter.go and
// interpreter_run.go). Its
// specifics:
//
//   - The interpreter has one cgroup for its life: the memory and process
//     limits cover all it holds; the CPU limit applies per run, to the
//     cgroup's usage since the run began.
//   - Between runs its cgroup is frozen: no thread or process the code left
//     behind runs while no run is going on, whatever it armed to wake itself
//     (a SIGCONT from a timer wakes a process stopped by SIGSTOP, not a frozen
//     one). Without a cgroup freezer, NewSession refuses an interpreter with
//     an error wrapping moat.ErrUnavailable.
//   - The session's interpreters together may use Config.SessionCPUTime of
//     CPU over the session's life, counted from their cgroups, runs and the
//     time between them alike. The run that reaches it ends with
//     moat.ReasonTimeout, like one that reaches its own CPU limit; then the
//     session is spent (engine.Evidence.Spent): later Runs fail with an
//     error wrapping moat.ErrSpent, while its files can still be read,
//     until Close.
//   - A run that times out, is cancelled, hits the CPU, memory or process
//     limit, or writes past the output cap ends the interpreter (the wall
//     timeout and the output cap kill its whole PID namespace); the next run
//     starts a fresh one, with the files still there and the variables gone.
//     Both runs say so in their Result.Notes (engine.Evidence.Notes; the
//     engine says why it ended a run through engine.Ender): the one that ended the
//     interpreter ("interpreter ended by this run's timeout: ...") and the
//     one that started the next ("interpreter restarted: the previous one
//     was ended by its run's timeout; variables from earlier runs are
//     gone").
//   - What the code writes to file descriptors 1 and 2 is the run's stdout and
//     stderr; what processes it left behind write between runs is dropped.
//   - The end of a run and its exit status are taken from the driver, only
//     when marked with that run's nonce, so that nothing from an earlier run
//     becomes a later run's result; but the code shares the driver's process
//     and can change what later runs do and report. See interpreter.go.

// Session is a subprocess session: the engine's session (see moat.Session)
// over this level's instance. Runs take turns; file operations may go on
// during a run.
type Session struct {
	*engine.Session
	inst *session
}

var _ moat.Session = (*Session)(nil)

// ID names the session. It is also the name of its working directory.
func (s *Session) ID() string { return s.inst.id }

// Dir is the session's working directory on the host.
func (s *Session) Dir() string { return s.inst.dir }

// session is one session's instance; see engine.SessionInstance.
type session struct {
	b       *backend
	id      string
	dir     string
	opts    moat.SessionOptions
	lease   *uidpool.Lease // strict only
	mounted bool
	// net serves the connections of all the session's runs to the egress
	// proxy (network.go): one set of placeholders for the session's life,
	// notes per run. Nil without Config.Egress.
	net *egress.Run

	mu     sync.Mutex // guards the fields below
	closed bool
	done   chan struct{}  // closed by Close
	cur    engine.Process // the run in progress, once started
	idle   chan struct{}  // while a run is in progress; closed when its Wait ends
	ops    sync.WaitGroup // file operations in progress
	// interp is the live interpreter, if any: written under mu by the run
	// in progress (and Close, after it), which alone reads it without.
	interp *interpreter

	// Used by the run in progress only, and by Close after it.

	// cpuUsed is the CPU time of the session's interpreters that have
	// ended; cpuSpent is set once they have used the session's budget.
	cpuUsed  time.Duration
	cpuSpent bool
	// ended says why the last interpreter ended, as a format with one %s
	// for whose run ("its run's timeout"), until the run that starts the
	// next one has said so in its notes.
	ended string
}

// NewSession makes a session's directory and leases its uid; see
// engine.SessionBackend.
func (b *backend) NewSession(ctx context.Context, opts moat.SessionOptions) (engine.SessionInstance, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if opts.Interpreter && b.strict {
		if err := b.cg.Freezer(); err != nil {
			return nil, errNoFreezer(err)
		}
	}
	var rnd [8]byte
	rand.Read(rnd[:])
	ss := &session{b: b, id: b.owner + "-s" + hex.EncodeToString(rnd[:]), opts: opts, done: make(chan struct{})}
	ss.dir = b.runsDir + "/" + ss.id
	if err := ss.create(); err != nil {
		ss.remove()
		return nil, err
	}
	if b.cfg.Egress != nil {
		ss.net = b.cfg.Egress.NewRun()
	}
	b.log.Debug("subprocess: session created", "session", ss.id, "interpreter", opts.Interpreter)
	return ss, nil
}

func (ss *session) create() error {
	b := ss.b
	if err := os.Mkdir(ss.dir, 0o700); err != nil {
		return fmt.Errorf("subprocess: session: %w", err)
	}
	if !b.strict {
		return nil
	}
	lease, err := b.uids.Acquire()
	if err != nil {
		return fmt.Errorf("subprocess: session: %w", err)
	}
	ss.lease = lease
	if err := mountWorkDir(ss.dir, b.limits.Disk, lease.UID, lease.UID); err != nil {
		return err
	}
	ss.mounted = true
	return nil
}

// remove releases the directory and the lease.
func (ss *session) remove() {
	if ss.mounted {
		if err := unix.Unmount(ss.dir, unix.MNT_DETACH); err != nil {
			ss.b.log.Warn("subprocess: session cleanup", "session", ss.id, "err", err)
		}
		ss.mounted = false
	}
	if err := os.RemoveAll(ss.dir); err != nil {
		ss.b.log.Warn("subprocess: session cleanup", "session", ss.id, "err", err)
	}
	if ss.lease != nil {
		ss.lease.Release()
		ss.lease = nil
	}
}

func (ss *session) uid() (int, int) {
	if ss.lease == nil {
		return -1, -1
	}
	return ss.lease.UID, ss.lease.UID
}

func (ss *session) errClosed() error {
	return fmt.Errorf("subprocess: session %s: %w", ss.id, moat.ErrClosed)
}

// Start starts one run of the session: a fresh helper, or the live
// interpreter; see engine.SessionInstance.
func (ss *session) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil, ss.errClosed()
	}
	ss.idle = make(chan struct{})
	ss.mu.Unlock()
	var p engine.Process
	var err error
	if ss.opts.Interpreter {
		p, err = ss.startInterpreterRun(ctx, code, stdout, stderr)
	} else {
		p, err = ss.startPlain(ctx, code, stdout, stderr)
	}
	if err != nil {
		ss.runEnded()
		return nil, err
	}
	ss.mu.Lock()
	ss.cur = p
	closed := ss.closed
	ss.mu.Unlock()
	if closed {
		p.Kill() // Close came during the start; Wait returns soon
	}
	return &sessionRun{Process: p, ss: ss}, nil
}

// runEnded marks the run in progress ended, for Close.
func (ss *session) runEnded() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.idle != nil {
		close(ss.idle)
		ss.idle = nil
	}
	ss.cur = nil
}

// sessionRun is a run of the session, which says when it has ended.
type sessionRun struct {
	engine.Process
	ss *session
}

// End passes the engine's reason on; see engine.Ender.
func (r *sessionRun) End(why moat.Reason) {
	if e, ok := r.Process.(engine.Ender); ok {
		e.End(why)
		return
	}
	r.Process.Kill()
}

func (r *sessionRun) Wait() (engine.Evidence, error) {
	defer r.ss.runEnded()
	return r.Process.Wait()
}

// startPlain starts a run under a fresh helper and python3, through the
// same path as a one-shot run, in the session's directory and under its
// uid, its helper the backend's spare (spare.go).
func (ss *session) startPlain(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	b, lim := ss.b, ss.b.limits
	uid, gid := ss.uid()
	// The directory holds whatever the code planted: the code file is
	// created anew under a fresh name, never through a link.
	var rnd [4]byte
	rand.Read(rnd[:])
	name := ".moat-run-" + hex.EncodeToString(rnd[:]) + ".py"
	if err := writeNewFile(ss.dir, name, code, uid, gid); err != nil {
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EFBIG) {
			return nil, fmt.Errorf("subprocess: code of %d bytes does not fit in the session's working directory: %w", len(code), moat.ErrInvalid)
		}
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	p := &process{b: b, dir: ss.dir, mounted: ss.mounted}
	// What the directory holds at the size limit now, the code file
	// included, is not this run's doing (see fileAtLimit).
	p.atStart = filesAtLimit(ss.dir, lim.FileSize)
	id := b.newID()
	p.release = func() {
		if p.group != nil {
			if err := p.group.Kill(); err != nil {
				b.log.Warn("subprocess: cleanup", "id", id, "err", err)
			}
			if err := p.group.Remove(); err != nil {
				b.log.Warn("subprocess: cleanup", "id", id, "err", err)
			}
		}
		if root, err := os.OpenRoot(ss.dir); err == nil {
			root.Remove(name)
			root.Close()
		}
	}
	if b.strict {
		g, err := b.cg.New(id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids)})
		if err != nil {
			p.release()
			return nil, unavailable("cannot create the run's cgroup", "", err)
		}
		p.group = g
	}
	sp := b.runSpec(ss.dir, uid, gid, p.group, []string{"python3", ss.dir + "/" + name})
	if ss.net != nil {
		b.withNetwork(&sp, ss.net)
		p.net = ss.net
	}
	for attempt := 0; ; attempt++ {
		h, err := b.sessionHelper()
		if err != nil {
			p.release()
			return nil, err
		}
		p.h = h
		if ss.net != nil {
			// Served until the helper ends, which closes its listener.
			go serve(b, ss.net, h.listener)
		}
		err = p.launch(sp, stdout, stderr)
		if errors.Is(err, errHelperGone) && attempt == 0 {
			continue // it died while it waited in the pool: once more
		}
		if err != nil {
			p.release()
			return nil, err
		}
		return p, nil
	}
}

// Close kills the run in progress, waits for its end and for the file
// operations in progress, ends the interpreter, removes the directory and
// closes the session's egress proxy run.
// Calls after the first return nil.
func (ss *session) Close() error {
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil
	}
	ss.closed = true
	close(ss.done)
	cur, idle := ss.cur, ss.idle
	ss.mu.Unlock()
	if cur != nil {
		cur.Kill()
	}
	if idle != nil {
		<-idle
	}
	ss.ops.Wait()
	ss.endInterpreter("")
	ss.remove()
	if ss.net != nil {
		ss.net.Close()
	}
	ss.b.log.Debug("subprocess: session closed", "session", ss.id)
	return nil
}
