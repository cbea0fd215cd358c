package subprocess

import (
	"bytes"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/cgroup"
)

// The live interpreter.
//
// A python3 started through the helper like any run stays alive between the
// runs of a session, driven by interpreter_driver.py, which reads code from
// a control socket and runs it with exec() in one persistent globals
// dictionary.
//
// Between runs the interpreter's cgroup is frozen (cgroup.Group.Freeze): no
// process of it, forked ones and threads included, runs until the next run
// thaws it, whatever timers or signals the code arranged (a process stopped
// with SIGSTOP is woken by a SIGCONT it armed itself). Without a freezer the
// interpreter is refused.
//
// The interpreter's cgroup counts its CPU time over its whole life. Each run
// may use Limits.CPUTime of it; the session's interpreters together may use
// Config.SessionCPUTime (see Sandbox.sessionCPUTime).
//
// The control channel and what the host can trust. The code runs in the
// driver's own process: it can read the driver's memory (the nonce, the
// socket's descriptor) and write on the control socket and on fds 1 and 2
// whatever the driver could. So nothing the driver sends is authenticated,
// and the host takes from it only what the code could decide anyway:
//
//   - when its run ended and with what status. A record counts for a run
//     only if it carries that run's nonce, which the host draws afresh for
//     each run: a record made in an earlier run (among them the real end of
//     a run whose end the code forged, which the driver sends late) is
//     dropped and never becomes a later run's end or status.
//   - where the run's output ends, by the same nonce on fds 1 and 2; the
//     previous run's marker, which a late driver writes at the start of
//     the next run, is dropped from the output.
//
// The socket is SOCK_SEQPACKET, so whatever the code writes on it is one
// record of its own and cannot shift the framing of the driver's later
// records. Verdicts on limits (CPU, wall time, memory, processes, disk) come
// from the cgroup and the host's clock, never from the channel.
//
// What stays possible, by the nature of a shared interpreter: code of one run
// can change what later runs do and report (replace builtins, hook os.read
// and read the next run's nonce and code, leave a thread that answers in the
// driver's place). A session's later results are as trustworthy as its
// earlier code, as in a notebook; the limits hold regardless.

//go:embed interpreter_driver.py
var interpreterDriver string

const (
	// nonceLen is the length of a run's nonce (hex).
	nonceLen = 32
	// maxFrame is the largest record the driver sends; a larger one is not
	// the driver's.
	maxFrame = 4096
	// codeChunk is the largest record of code moat sends: well under the
	// socket's send buffer, which bounds a SOCK_SEQPACKET record.
	codeChunk = 32 << 10
)

// sessionCPUTime is the CPU budget of a session's interpreters, all of them
// over the session's life: Config.SessionCPUTime, by default ten times the
// per-run CPU time.
func (s *Sandbox) sessionCPUTime() time.Duration {
	if s.cfg.SessionCPUTime != 0 {
		return time.Duration(s.cfg.SessionCPUTime)
	}
	return 10 * time.Duration(s.limits.CPUTime)
}

// frame is one record from the driver.
type frame struct {
	kind    byte
	payload []byte
}

// interpreter is a live python3 under the helper.
type interpreter struct {
	s      *Sandbox
	cmd    *exec.Cmd
	ctl    *os.File // moat's end of the control socket
	status *os.File // the helper's status pipe
	group  *cgroup.Group
	frames chan frame    // closed when the control socket ends
	exited chan struct{} // closed when the helper has exited
	outs   [2]*streamRouter

	// Used by the session's run in progress only.
	frozen    bool
	dead      bool          // killed or ended: the next run starts a new one
	closed    bool          // close has run
	lastCPU   time.Duration // the last reading of the group's CPU account
	prevNonce []byte        // the nonce of the last run whose end was taken
}

// streamRouter passes what the interpreter writes on one stream to the
// current run's sink, and drops it between runs.
type streamRouter struct {
	mu   sync.Mutex
	sink *markSink
	eof  chan struct{}
}

func (sr *streamRouter) pump(r io.ReadCloser) {
	defer close(sr.eof)
	defer r.Close()
	buf := make([]byte, 64*1024)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			sr.mu.Lock()
			if sr.sink != nil {
				sr.sink.feed(buf[:n])
			}
			sr.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

func (sr *streamRouter) set(m *markSink) {
	sr.mu.Lock()
	sr.sink = m
	sr.mu.Unlock()
}

// markSink feeds a run's capture buffer until the run's end marker, leaving
// out any occurrence of drop (the previous run's marker) on the way.
type markSink struct {
	marker  []byte
	drop    []byte // nil: nothing to drop
	buf     *capture.Buffer
	pending []byte // a tail that may be the start of the marker or of drop
	seen    chan struct{}
	done    bool
}

func newMarkSink(marker, drop []byte, buf *capture.Buffer) *markSink {
	return &markSink{marker: marker, drop: drop, buf: buf, seen: make(chan struct{})}
}

func (m *markSink) feed(p []byte) {
	if m.done {
		return // after the marker: output of processes left behind
	}
	data := append(m.pending, p...)
	m.pending = nil
	for {
		i := bytes.Index(data, m.marker)
		j := -1
		if len(m.drop) > 0 {
			j = bytes.Index(data, m.drop)
		}
		if j >= 0 && (i < 0 || j < i) {
			m.buf.Write(data[:j])
			data = data[j+len(m.drop):]
			continue
		}
		if i >= 0 {
			m.buf.Write(data[:i])
			m.done = true
			close(m.seen)
			return
		}
		break
	}
	keep := max(prefixAtEnd(data, m.marker), prefixAtEnd(data, m.drop))
	m.buf.Write(data[:len(data)-keep])
	m.pending = append([]byte(nil), data[len(data)-keep:]...)
}

// prefixAtEnd returns the length of the longest proper prefix of pat that
// data ends with.
func prefixAtEnd(data, pat []byte) int {
	for k := min(len(pat)-1, len(data)); k > 0; k-- {
		if bytes.HasSuffix(data, pat[:k]) {
			return k
		}
	}
	return 0
}

// flush passes on a held-back tail when the marker never came.
func (m *markSink) flush() {
	if !m.done && len(m.pending) > 0 {
		m.buf.Write(m.pending)
		m.pending = nil
	}
}

// startInterpreter starts python3 and the driver under the helper. The
// caller waits for the driver's 'H' record.
func (ss *Session) startInterpreter() (*interpreter, error) {
	s := ss.s
	in := &interpreter{s: s, frames: make(chan frame, 4), exited: make(chan struct{})}
	var rnd [8]byte
	rand.Read(rnd[:])
	id := s.owner + "-" + hex.EncodeToString(rnd[:])
	lim := s.limits
	if s.strict {
		g, err := s.cg.New(id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids), Freezable: true})
		if errors.Is(err, cgroup.ErrNoFreezer) {
			return nil, errNoFreezer(err)
		}
		if err != nil {
			return nil, unavailable("cannot create the interpreter's cgroup", "", err)
		}
		in.group = g
	}
	// -I: no environment variables, no user site; the driver puts the
	// working directory on sys.path itself.
	sp := ss.spec(in.group, []string{"python3", "-I", "-c", interpreterDriver})
	if s.strict {
		// RLIMIT_CPU counts a process's whole life, and the interpreter
		// lives across runs: the cgroup's account bounds each run instead.
		for i := range sp.Rlimits {
			if sp.Rlimits[i].Resource == unix.RLIMIT_CPU {
				sp.Rlimits[i].Cur, sp.Rlimits[i].Max = unix.RLIM_INFINITY, unix.RLIM_INFINITY
			}
		}
	}
	arg, err := json.Marshal(sp)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	// SOCK_SEQPACKET: every write is a record of its own, so what the code
	// writes on the socket cannot shift the framing of the driver's.
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	// moat's end is non-blocking, so that it is read through the runtime's
	// poller; the driver's end stays blocking.
	if err := unix.SetNonblock(fds[0], true); err != nil {
		unix.Close(fds[0])
		unix.Close(fds[1])
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	in.ctl = os.NewFile(uintptr(fds[0]), "interpreter-control")
	child := os.NewFile(uintptr(fds[1]), "interpreter-control-child")
	defer child.Close()
	statusR, statusW, err := os.Pipe()
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer statusW.Close()
	in.status = statusR
	specR, specW, err := os.Pipe()
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer specR.Close()
	defer specW.Close()
	var childEnds []*os.File
	defer func() {
		for _, f := range childEnds {
			f.Close()
		}
	}()
	var readers [2]*os.File
	for i := range readers {
		r, w, err := os.Pipe()
		if err != nil {
			for _, f := range readers {
				if f != nil {
					f.Close()
				}
			}
			in.close()
			return nil, fmt.Errorf("subprocess: %w", err)
		}
		readers[i] = r
		childEnds = append(childEnds, w)
	}

	// The same helper as a one-shot run's (see warm.go), with the control
	// socket as its stdin, which python3 inherits.
	cmd := s.helperCmd()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = child, childEnds[0], childEnds[1]
	cmd.ExtraFiles = []*os.File{statusW, specR} // fds 3 and 4
	if err := cmd.Start(); err != nil {
		readers[0].Close()
		readers[1].Close()
		in.close()
		return nil, unavailable("cannot start the sandbox helper", "", err)
	}
	in.cmd = cmd
	specR.Close()
	if _, err := specW.Write(arg); err != nil {
		in.s.log.Warn("subprocess: interpreter spec", "err", err)
	}
	specW.Close()
	for i := range in.outs {
		in.outs[i] = &streamRouter{eof: make(chan struct{})}
		go in.outs[i].pump(readers[i])
	}
	go func() {
		cmd.Wait()
		close(in.exited)
	}()
	go in.readFrames()
	return in, nil
}

func errNoFreezer(err error) error {
	return unavailable("no cgroup freezer: a live interpreter's processes could not be held still between runs",
		"mount the v1 freezer hierarchy at /sys/fs/cgroup/freezer, or use cgroup v2 on Linux 5.2 or later; sessions without an interpreter work without it", err)
}

// readFrames reads the driver's records until the socket ends or breaks.
// Records that cannot be the driver's (too long) are dropped.
func (in *interpreter) readFrames() {
	defer close(in.frames)
	rc, err := in.ctl.SyscallConn()
	if err != nil {
		return
	}
	buf := make([]byte, maxFrame+1)
	for {
		var n, flags int
		var rerr error
		end := false
		err := rc.Read(func(fd uintptr) bool {
			n, _, flags, _, rerr = unix.Recvmsg(int(fd), buf, nil, unix.MSG_DONTWAIT)
			if rerr == unix.EAGAIN {
				return false
			}
			// Zero bytes: the end, or an empty record (the code's). The
			// end leaves the socket hung up.
			end = rerr != nil || (n == 0 && peerGone(int(fd)))
			return true
		})
		if err != nil || end {
			return
		}
		if n == 0 || n > maxFrame || flags&unix.MSG_TRUNC != 0 {
			continue
		}
		in.frames <- frame{buf[0], append([]byte(nil), buf[1:n]...)}
	}
}

// peerGone reports whether the other end of the socket fd has shut down
// its writing side or closed.
func peerGone(fd int) bool {
	p := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLRDHUP}}
	n, err := unix.Poll(p, 0)
	return err != nil || (n > 0 && p[0].Revents&(unix.POLLRDHUP|unix.POLLHUP|unix.POLLERR) != 0)
}

// send hands the driver a run: the header record, then the code in
// records of at most codeChunk bytes. An error means the interpreter ended.
func (in *interpreter) send(nonce, code []byte) error {
	hdr := make([]byte, 0, 1+nonceLen+4)
	hdr = append(hdr, 'R')
	hdr = append(hdr, nonce...)
	hdr = binary.BigEndian.AppendUint32(hdr, uint32(len(code)))
	if _, err := in.ctl.Write(hdr); err != nil {
		return err
	}
	for len(code) > 0 {
		n := min(len(code), codeChunk)
		if _, err := in.ctl.Write(code[:n]); err != nil {
			return err
		}
		code = code[n:]
	}
	return nil
}

// cpu reads the CPU time the interpreter's cgroup has used in its life.
func (in *interpreter) cpu() (time.Duration, error) {
	used, err := in.group.CPUUsage()
	if err == nil {
		in.lastCPU = used
	}
	return used, err
}

// kill ends the interpreter and everything it started. It may be called
// from the run's watchers while the run waits.
func (in *interpreter) kill() {
	in.dead = true
	if in.cmd != nil && in.cmd.Process != nil {
		in.cmd.Process.Kill()
	}
	if in.group != nil {
		in.group.Kill()
	}
}

// close releases what the interpreter held, after it has ended, and returns
// the CPU time it used in all (the last reading, if the final one fails).
// Calls after the first do nothing but return it again.
func (in *interpreter) close() time.Duration {
	in.dead = true
	if in.closed {
		return in.lastCPU
	}
	in.closed = true
	if in.cmd != nil {
		select {
		case <-in.exited:
		case <-time.After(5 * time.Second):
			in.s.log.Warn("subprocess: interpreter helper did not exit")
		}
	}
	if in.ctl != nil {
		in.ctl.Close()
		go func() {
			for range in.frames {
			}
		}()
	}
	if in.status != nil {
		in.status.Close()
	}
	if in.group != nil {
		if err := in.group.Kill(); err != nil {
			in.s.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
		if _, err := in.cpu(); err != nil {
			in.s.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
		if err := in.group.Remove(); err != nil {
			in.s.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
	}
	return in.lastCPU
}

// endInterpreter kills the session's interpreter, if any, releases it and
// adds the CPU time it used to the session's account. cause, if not empty,
// says why it ended, for the notes of the run that starts the next one (see
// Session.ended). The caller holds the session's turn.
func (ss *Session) endInterpreter(cause string) {
	in := ss.interp
	if in == nil {
		return
	}
	if cause != "" {
		ss.ended = cause
	}
	in.kill()
	ss.cpuUsed += in.close()
	ss.interp = nil
	if ss.cpuUsed >= ss.s.sessionCPUTime() {
		ss.cpuSpent = true
	}
}

// errCPUSpent is what Run returns once the session's CPU budget is spent.
func (ss *Session) errCPUSpent() error {
	return fmt.Errorf("subprocess: session %s: its interpreter's CPU budget of %v (session_cpu_time) is spent; only its files remain: %w",
		ss.id, ss.s.sessionCPUTime(), moat.ErrSpent)
}

// runInterpreter runs req in the live interpreter, starting one if needed.
// The caller holds the session's turn.
func (ss *Session) runInterpreter(ctx context.Context, req moat.Request) (*moat.Result, error) {
	s, lim := ss.s, ss.s.limits
	if ss.cpuSpent {
		return nil, ss.errCPUSpent()
	}
	start := time.Now()
	runCtx, cancel := context.WithTimeout(ctx, time.Duration(lim.WallTime))
	defer cancel()
	// The session's files at the size limit, taken while the interpreter
	// is frozen or not yet started: the run's verdict counts only those it
	// writes (see run.fileAtLimit).
	probe := &run{dir: ss.dir, mounted: ss.mounted, start: start, atStart: filesAtLimit(ss.dir, int64(lim.FileSize))}

	in := ss.interp
	if in != nil && in.dead {
		ss.endInterpreter("a failure after %s run")
		in = nil
		if ss.cpuSpent {
			return nil, ss.errCPUSpent()
		}
	}
	// restart is why the previous interpreter ended, if this run starts
	// its successor.
	restart := ""
	if in == nil {
		restart = ss.ended
		var err error
		in, err = ss.startInterpreter()
		if err != nil {
			return nil, err
		}
		ss.interp = in
		// Wait for the driver to be ready, within the run's time; keep
		// what it says on stderr meanwhile, for the error.
		startErr := capture.New(4096, nil, nil)
		in.outs[1].set(newMarkSink([]byte("\x00"), nil, startErr))
		defer in.outs[1].set(nil)
		select {
		case f, ok := <-in.frames:
			if !ok || f.kind != 'H' {
				in.kill()
				<-in.exited
				st, _ := parseStatus(readStatus(in.status))
				ss.endInterpreter("")
				if st.err != "" {
					return nil, fmt.Errorf("subprocess: sandbox set-up failed, nothing ran: %s: %w", st.err, moat.ErrUnavailable)
				}
				return nil, fmt.Errorf("subprocess: the interpreter did not start: %s: %w", tail(startErr.Bytes(), 512), moat.ErrUnavailable)
			}
		case <-runCtx.Done():
			ss.endInterpreter("")
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("subprocess: the interpreter did not start within the wall time %v: %s: %w", lim.WallTime, tail(startErr.Bytes(), 512), moat.ErrUnavailable)
		}
	}
	if in.frozen {
		if err := in.group.Thaw(); err != nil {
			ss.endInterpreter("a failure to thaw it for %s run")
			return nil, unavailable("cannot thaw the session's interpreter", "", err)
		}
		in.frozen = false
	}

	// The run may use the CPU limit, and no more than what is left of the
	// session's budget, which counts the time between runs too.
	var baseCPU time.Duration
	cpuLimit := time.Duration(lim.CPUTime)
	if in.group != nil {
		used, err := in.cpu()
		if err != nil {
			ss.endInterpreter("a failure to read its CPU account for %s run")
			return nil, unavailable("cannot read the interpreter's CPU account", "", err)
		}
		left := s.sessionCPUTime() - ss.cpuUsed - used
		if left <= 0 {
			ss.endInterpreter("the session's CPU budget, spent before %s run")
			ss.cpuSpent = true
			return nil, ss.errCPUSpent()
		}
		baseCPU, cpuLimit = used, min(cpuLimit, left)
	}

	var rnd [nonceLen / 2]byte
	rand.Read(rnd[:])
	nonce := []byte(hex.EncodeToString(rnd[:]))
	// The first byte past the output cap kills the interpreter's helper, the
	// init of its PID namespace, as the wall timeout does; the run marks the
	// interpreter dead below (in.kill is not for the streams' goroutines).
	over := func() { in.cmd.Process.Kill() }
	bufs := [2]*capture.Buffer{capture.New(int64(lim.Output), req.Stdout, over), capture.New(int64(lim.Output), req.Stderr, over)}
	sinks := [2]*markSink{newMarkSink(nonce, in.prevNonce, bufs[0]), newMarkSink(nonce, in.prevNonce, bufs[1])}
	for i := range sinks {
		in.outs[i].set(sinks[i])
	}
	unset := func() {
		for i := range sinks {
			in.outs[i].set(nil)
		}
	}
	defer unset()

	var killedByUs, cpuOver atomic.Bool
	finished := make(chan struct{})
	var watchers sync.WaitGroup
	watchers.Add(1)
	go func() {
		defer watchers.Done()
		select {
		case <-finished:
		case <-runCtx.Done():
			killedByUs.Store(true)
			in.kill()
		}
	}()
	stopCPU := func() {}
	if in.group != nil {
		stopCPU = in.group.WatchCPU(baseCPU, cpuLimit, in.kill, &cpuOver)
	}

	// A send that fails means the interpreter ended; the records say how.
	in.send(nonce, req.Code)

	exitCode, marked, gotExit, dropped, redirected := 0, "", false, 0, false
	for f := range in.frames {
		if f.kind != 'X' {
			continue
		}
		// Only a record with this run's nonce ends this run.
		rest, ok := bytes.CutPrefix(f.payload, nonce)
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
		s.log.Warn("subprocess: interpreter records not of this run dropped (an earlier run forged its end, or the code writes on the control socket)",
			"session", ss.id, "records", dropped)
	}
	if gotExit {
		in.prevNonce = nonce
		// Wait for the end markers of the streams the driver marked, so
		// that all the run's output is in.
		wait := time.NewTimer(2 * time.Second)
		for i, c := range []string{"o", "e"} {
			if !strings.Contains(marked, c) {
				continue
			}
			select {
			case <-sinks[i].seen:
			case <-in.outs[i].eof:
			case <-wait.C:
			case <-runCtx.Done():
			}
		}
		wait.Stop()
		for i := range sinks {
			select {
			case <-sinks[i].seen:
			default:
				// The code redirected or closed its stdout or stderr: the
				// next run could not be told apart. Start afresh.
				redirected = true
				in.kill()
			}
		}
	}
	close(finished)
	watchers.Wait()
	stopCPU()
	end := time.Now()

	var events cgroup.Events
	if in.group != nil {
		events = in.group.Events()
	}
	if !gotExit || events.OOMKill || events.PidsMax {
		in.kill()
	}
	res := &moat.Result{Level: moat.LevelSubprocess, Notes: slices.Clip(s.notes)}
	signaled := false
	if gotExit {
		res.ExitCode = exitCode
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
			return nil, fmt.Errorf("subprocess: sandbox set-up failed: %s: %w", st.err, moat.ErrUnavailable)
		case reported && st.exited:
			res.ExitCode = st.code
		case reported && st.signaled:
			res.ExitCode = 128 + int(st.signal)
			res.Signal = unix.SignalName(st.signal)
			signaled = true
		default:
			// Killed by moat, or the helper itself was killed.
			res.ExitCode = 128 + int(syscall.SIGKILL)
			res.Signal = unix.SignalName(syscall.SIGKILL)
			signaled = true
		}
	}
	unset()
	for i := range sinks {
		sinks[i].flush()
	}
	res.Stdout, res.Stderr = bufs[0].Bytes(), bufs[1].Bytes()
	res.Truncated = bufs[0].Truncated() || bufs[1].Truncated()
	if res.Truncated {
		// Killed for its output, even if the code had ended first; the
		// next run starts a fresh interpreter.
		in.kill()
		res.ExitCode, res.Signal, signaled = 128+int(syscall.SIGKILL), unix.SignalName(syscall.SIGKILL), true
	}
	switch {
	case !gotExit && killedByUs.Load() && ctx.Err() != nil:
		res.Reason = moat.ReasonCanceled
	case !gotExit && (killedByUs.Load() || cpuOver.Load()):
		res.Reason = moat.ReasonTimeout
	case events.OOMKill:
		res.Reason = moat.ReasonMemory
	case events.PidsMax:
		res.Reason = moat.ReasonPids
	case probe.fileAtLimit(int64(lim.FileSize)):
		res.Reason = moat.ReasonFileSize
	case ss.mounted && probe.diskFull():
		res.Reason = moat.ReasonDisk
	case res.Truncated:
		res.Reason = moat.ReasonOutput
	case signaled:
		res.Reason = moat.ReasonSignal
	}
	res.Duration = end.Sub(start)

	// Say when the variables are gone: in the notes of the run that ended
	// the interpreter, and of the run that started its successor.
	if restart != "" {
		res.Notes = append(res.Notes, "interpreter restarted: the previous one was ended by "+fmt.Sprintf(restart, "its")+"; variables from earlier runs are gone")
		ss.ended = ""
	}
	cause := ""
	switch {
	case !in.dead:
	case killedByUs.Load() && ctx.Err() != nil:
		cause = "%s run's cancellation"
	case killedByUs.Load():
		cause = "%s run's timeout"
	case cpuOver.Load():
		cause = "%s run's CPU time limit"
	case events.OOMKill:
		cause = "%s run's memory limit"
	case events.PidsMax:
		cause = "%s run's process limit"
	case res.Truncated:
		cause = "%s run's output cap"
	case redirected:
		cause = "%s run's code redirecting or closing its stdout or stderr"
	case !gotExit && signaled:
		cause = "signal " + res.Signal + " during %s run"
	case !gotExit:
		cause = "%s run's code exiting it (status " + strconv.Itoa(res.ExitCode) + ")"
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
		res.Notes = append(res.Notes, "interpreter ended by "+fmt.Sprintf(cause, "this")+": "+next)
		ss.ended = cause
	}
	return res, nil
}

// park holds the interpreter still until the next run: frozen, or ended
// when it is dead, cannot be frozen, or has spent the session's budget. It
// returns why it ended a live interpreter, or "".
func (ss *Session) park(in *interpreter) (cause string) {
	if !in.dead && in.group != nil {
		if err := in.group.Freeze(); err != nil {
			ss.s.log.Warn("subprocess: cannot freeze the interpreter; ending it", "session", ss.id, "err", err)
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
		} else if ss.cpuUsed+used >= ss.s.sessionCPUTime() {
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

// readStatus reads what the helper reported, once it has exited.
func readStatus(f *os.File) []byte {
	if f == nil {
		return nil
	}
	f.SetReadDeadline(time.Now().Add(time.Second))
	b, _ := io.ReadAll(io.LimitReader(f, 4096))
	return b
}
