package subprocess

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/marker"
)

// A run of the live interpreter. Start readies the interpreter (starts a
// fresh one, or thaws the one the previous run left frozen), sets the run's
// CPU allowance and routes the streams to the run; Wait hands the driver
// the code, takes the end of the run from the records that carry its nonce,
// gathers the evidence, says in the notes when the interpreter ended, and
// parks it until the next run.

// interpRun is one run of the session's live interpreter; see
// engine.Process and engine.Ender.
type interpRun struct {
	ss      *session
	in      *interpreter
	code    []byte
	nonce   []byte
	sinks   [2]*marker.Sink
	atStart map[fileKey]fileStamp // see fileAtLimit
	// restart is why the previous interpreter ended, if this run started
	// its successor.
	restart string
	stopCPU func()
	cpuOver atomic.Bool // the CPU watch killed the interpreter

	mu       sync.Mutex // guards the fields below
	finished bool       // Wait has taken the run's end: later kills are too late
	killed   bool
	why      moat.Reason   // the engine's reason, when it ended the run
	killedCh chan struct{} // closed at the first kill
}

// startInterpreterRun readies the interpreter for a run of code. The
// interpreter's start is bounded by ctx, by the session's Close and by the
// wall time; the run's own time begins when Start returns.
func (ss *session) startInterpreterRun(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	b, lim := ss.b, ss.b.limits
	if ss.cpuSpent {
		return nil, ss.errCPUSpent()
	}
	r := &interpRun{ss: ss, code: code, killedCh: make(chan struct{}), stopCPU: func() {}}
	// The session's files at the size limit, taken while the interpreter
	// is frozen or not yet started: the run's verdict counts only those it
	// writes.
	r.atStart = filesAtLimit(ss.dir, lim.FileSize)

	in := ss.interp
	if in != nil && in.dead {
		ss.endInterpreter("a failure after %s run")
		in = nil
		if ss.cpuSpent {
			return nil, ss.errCPUSpent()
		}
	}
	if in == nil {
		r.restart = ss.ended
		var err error
		if in, err = ss.readyInterpreter(ctx); err != nil {
			return nil, err
		}
	}
	r.in = in
	if in.frozen {
		if err := in.group.Thaw(); err != nil {
			ss.endInterpreter("a failure to thaw it for %s run")
			return nil, unavailable("cannot thaw the session's interpreter", "", err)
		}
		in.frozen = false
	}

	// The run may use the CPU limit, and no more than what is left of the
	// session's budget, which counts the time between runs too.
	if in.group != nil {
		used, err := in.cpu()
		if err != nil {
			ss.endInterpreter("a failure to read its CPU account for %s run")
			return nil, unavailable("cannot read the interpreter's CPU account", "", err)
		}
		left := b.sessionCPUTime() - ss.cpuUsed - used
		if left <= 0 {
			ss.endInterpreter("the session's CPU budget, spent before %s run")
			ss.cpuSpent = true
			return nil, ss.errCPUSpent()
		}
		// The watch kills the helper, init of the interpreter's PID
		// namespace; Wait ends the rest.
		r.stopCPU = in.group.WatchCPU(used, min(time.Duration(lim.CPUTime), left), func() { in.cmd.Process.Kill() }, &r.cpuOver)
	}

	var rnd [nonceLen / 2]byte
	rand.Read(rnd[:])
	r.nonce = []byte(hex.EncodeToString(rnd[:]))
	r.sinks = [2]*marker.Sink{marker.NewSink(r.nonce, in.prevNonce, stdout), marker.NewSink(r.nonce, in.prevNonce, stderr)}
	for i := range r.sinks {
		in.outs[i].Set(r.sinks[i])
	}
	return r, nil
}

// readyInterpreter starts an interpreter and waits for its driver to say it
// is ready.
func (ss *session) readyInterpreter(ctx context.Context) (*interpreter, error) {
	wall := time.Duration(ss.b.limits.WallTime)
	in, err := ss.startInterpreter()
	if err != nil {
		return nil, err
	}
	ss.setInterp(in)
	// Keep what the driver says on stderr meanwhile, for the error.
	startErr := &tailWriter{n: 4096}
	in.outs[1].Set(marker.NewSink([]byte("\x00"), nil, startErr))
	defer in.outs[1].Set(nil)
	timer := time.NewTimer(wall)
	defer timer.Stop()
	select {
	case f, ok := <-in.frames:
		if ok && f.kind == 'H' {
			return in, nil
		}
		in.kill()
		<-in.exited
		st, _ := parseStatus(readStatus(in.status))
		ss.endInterpreter("")
		if st.err != "" {
			return nil, fmt.Errorf("subprocess: sandbox set-up failed, nothing ran: %s: %w", st.err, moat.ErrUnavailable)
		}
		return nil, fmt.Errorf("subprocess: the interpreter did not start: %s: %w", tail(startErr.Bytes(), 512), moat.ErrUnavailable)
	case <-timer.C:
		ss.endInterpreter("")
		return nil, fmt.Errorf("subprocess: the interpreter did not start within the wall time %v: %s: %w", wall, tail(startErr.Bytes(), 512), moat.ErrUnavailable)
	case <-ctx.Done():
		ss.endInterpreter("")
		return nil, ctx.Err()
	case <-ss.done:
		ss.endInterpreter("")
		return nil, ss.errClosed()
	}
}

// Kill kills the interpreter's helper, init of its PID namespace, and with
// it every process of the interpreter.
func (r *interpRun) Kill() { r.End("") }

// End is Kill, for the engine's reason why; see engine.Ender.
func (r *interpRun) End(why moat.Reason) {
	r.mu.Lock()
	if r.finished {
		// The run's end is taken; the interpreter may already be
		// parked for the next run.
		r.mu.Unlock()
		return
	}
	if !r.killed {
		r.killed, r.why = true, why
		close(r.killedCh)
	}
	r.mu.Unlock()
	r.in.cmd.Process.Kill()
}

// Wait runs the code and waits for its end; see engine.Process.
func (r *interpRun) Wait() (engine.Evidence, error) {
	ss, in, lim := r.ss, r.in, r.ss.b.limits
	unset := func() {
		for i := range r.sinks {
			in.outs[i].Set(nil)
		}
	}
	defer unset()

	// A send that fails means the interpreter ended; the records say how.
	in.send(r.nonce, r.code)
	exitCode, marked, gotExit, dropped, redirected := 0, "", false, 0, false
	for f := range in.frames {
		if f.kind != 'X' {
			continue
		}
		// Only a record with this run's nonce ends this run.
		rest, ok := bytes.CutPrefix(f.payload, r.nonce)
		code, m, _ := strings.Cut(string(rest), " ")
		n, err := strconv.Atoi(code)
		if !ok || err != nil {
			dropped++
			continue
		}
		exitCode, marked, gotExit = n, m, true
		break
	}
	if dropped > 0 {
		ss.b.log.Warn("subprocess: interpreter records not of this run dropped (an earlier run forged its end, or the code writes on the control socket)",
			"session", ss.id, "records", dropped)
	}
	if gotExit {
		in.prevNonce = r.nonce
		// Wait for the end markers of the streams the driver marked, so
		// that all the run's output is in.
		wait := time.NewTimer(2 * time.Second)
		for i, c := range []string{"o", "e"} {
			if !strings.Contains(marked, c) {
				continue
			}
			select {
			case <-r.sinks[i].Seen():
			case <-in.outs[i].EOF():
			case <-wait.C:
			case <-r.killedCh:
			}
		}
		wait.Stop()
		for i := range r.sinks {
			select {
			case <-r.sinks[i].Seen():
			default:
				// The code redirected or closed its stdout or stderr: the
				// next run could not be told apart. Start afresh.
				redirected = true
				in.kill()
			}
		}
	}
	r.mu.Lock()
	r.finished = true
	killed, why := r.killed, r.why
	r.mu.Unlock()
	r.stopCPU()

	var events cgroup.Events
	if in.group != nil {
		events = in.group.Events()
	}
	if !gotExit || killed || events.OOMKill || events.PidsMax {
		in.kill()
	}
	ev := engine.Evidence{Memory: events.OOMKill, Pids: events.PidsMax, CPUTime: !gotExit && r.cpuOver.Load()}
	sig := syscall.Signal(0) // the signal that ended the interpreter during the run
	if gotExit {
		ev.Exited, ev.Status = true, engine.Exit(exitCode)
	} else {
		// The interpreter ended during the run: the helper says how.
		select {
		case <-in.exited:
		case <-time.After(5 * time.Second):
		}
		st, reported := parseStatus(readStatus(in.status))
		switch {
		case reported && st.err != "":
			unset()
			ss.endInterpreter("a failure of the sandbox set-up during %s run")
			return engine.Evidence{}, fmt.Errorf("subprocess: sandbox set-up failed: %s: %w", st.err, moat.ErrUnavailable)
		case reported && st.exited:
			ev.Exited, ev.Status = true, engine.Exit(st.code)
		case reported && st.signaled:
			ev.Exited, ev.Status = true, engine.Signaled(st.signal)
			sig = st.signal
		default:
			// Killed by moat, or the helper itself was killed: the
			// verdict is SIGKILL.
			sig = syscall.SIGKILL
		}
	}
	unset()
	for i := range r.sinks {
		r.sinks[i].Flush()
	}
	ev.FileSize = fileAtLimit(ss.dir, lim.FileSize, r.atStart)
	ev.Disk = ss.mounted && diskFull(ss.dir)

	// Say when the variables are gone: in the notes of the run that ended
	// the interpreter, and of the run that started its successor.
	if r.restart != "" {
		ev.Notes = append(ev.Notes, "interpreter restarted: the previous one was ended by "+fmt.Sprintf(r.restart, "its")+"; variables from earlier runs are gone")
		ss.ended = ""
	}
	cause := ""
	switch {
	case !in.dead:
	case killed && why == moat.ReasonCanceled:
		cause = "%s run's cancellation"
	case killed && why == moat.ReasonTimeout:
		cause = "%s run's timeout"
	case r.cpuOver.Load():
		cause = "%s run's CPU time limit"
	case events.OOMKill:
		cause = "%s run's memory limit"
	case events.PidsMax:
		cause = "%s run's process limit"
	case killed && why == moat.ReasonOutput:
		cause = "%s run's output cap"
	case killed:
		cause = "the session's Close during %s run"
	case redirected:
		cause = "%s run's code redirecting or closing its stdout or stderr"
	case !gotExit && sig != 0:
		cause = "signal " + unix.SignalName(sig) + " during %s run"
	case !gotExit:
		cause = "%s run's code exiting it (status " + strconv.Itoa(ev.Status.ExitStatus()) + ")"
	default:
		cause = "a failure after %s run"
	}
	if c := ss.park(in); cause == "" {
		cause = c
	}
	if cause != "" {
		next := "the next run starts a fresh one, without the variables of this and earlier runs"
		if ss.cpuSpent {
			next = "the session's CPU budget is spent, later runs fail"
		}
		ev.Notes = append(ev.Notes, "interpreter ended by "+fmt.Sprintf(cause, "this")+": "+next)
		ss.ended = cause
	}
	ev.Spent = ss.cpuSpent
	if ss.net != nil {
		ev.Notes = append(ev.Notes, ss.net.Notes()...)
	}
	return ev, nil
}

// park holds the interpreter still until the next run: frozen, or ended
// when it is dead, cannot be frozen, or has spent the session's budget. It
// returns why it ended a live interpreter, or "".
func (ss *session) park(in *interpreter) (cause string) {
	if !in.dead && in.group != nil {
		if err := in.group.Freeze(); err != nil {
			ss.b.log.Warn("subprocess: cannot freeze the interpreter; ending it", "session", ss.id, "err", err)
			in.kill()
			cause = "a failure to freeze it after %s run"
		} else {
			in.frozen = true
		}
	}
	if !in.dead && in.group != nil {
		if used, err := in.cpu(); err != nil {
			in.kill()
			ss.cpuSpent = true
			cause = "a failure to read its CPU account after %s run"
		} else if ss.cpuUsed+used >= ss.b.sessionCPUTime() {
			in.kill()
			ss.cpuSpent = true
			cause = "the session's CPU budget, spent by %s run"
		}
	}
	if in.dead {
		ss.endInterpreter("")
	}
	return cause
}
