package container

import (
	"bytes"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/docker/docker/api/types"
	"github.com/docker/docker/pkg/stdcopy"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/internal/engine"
)

// The live interpreter of a session (moat.SessionOptions.Interpreter).
//
// One exec in the session's container, checked as every run's process is
// (the container's cgroup, the session's uid, moat's seccomp filter) before
// it reads any code, runs interpreter_driver.py: it reads each run's code on
// its stdin, which only moat writes, and runs it with exec() in one
// persistent globals dictionary, so that variables, imports and
// definitions survive from one run to the next. After each run it writes
// an end marker carrying the run's nonce, fresh for each run, on its own
// copies of its stdout and stderr, and on stdout the run's exit status.
//
// The driver is moved into a freezer cgroup of its own under the
// container's. Between runs the container is paused, as for every
// session; a file operation between runs unpauses the container for its
// exec, and the interpreter's own cgroup is frozen meanwhile, so that
// nothing of the code (a thread it left in the interpreter) runs between
// runs. At a run's end every other process of the container but its init
// is killed, as for every session: what stays is the interpreter itself.
//
// What the host can trust. The code runs in the driver's own process: it
// can read the driver's memory (the nonce) and write on its streams
// whatever the driver could. So the markers are not authenticated, and the
// host takes from them only what the code could decide anyway: when its
// run ended and with what status. A marker counts only with the current
// run's nonce; a late marker of the previous run is dropped from the next
// run's output. Verdicts on limits (CPU, wall time, memory, processes,
// disk) come from the cgroup and the host's clock. Code of one run can
// change what later runs do and report (replace builtins, read the next
// run's code), as in a notebook: a session's later results are as
// trustworthy as its earlier code; the limits hold regardless.
//
// A run that is killed (the wall time, the output cap, a cancellation, its
// CPU time), or that hits the memory or process limit, ends the
// interpreter, and so does one that ends it itself (os._exit, a crash);
// the next run starts a fresh one, with the files still there and the
// variables gone. Both runs say so in their notes. A run whose code closes
// or redirects the driver's copies of its streams ends at the wall time.

//go:embed interpreter_driver.py
var interpreterDriver string

// driverCmd is the command of a session's interpreter.
func (s *spec) driverCmd() []string {
	return []string{"/bin/sh", "-c", "unset HOSTNAME; exec " + s.python + ` -c "$0"`, interpreterDriver}
}

// interpFreezer is the name of the interpreter's freezer cgroup, under the
// container's.
const interpFreezer = "moat-interp"

// interp is a session's live interpreter.
type interp struct {
	execID string
	hj     types.HijackedResponse
	pid    int
	pidfd  int           // of the driver; closed once dead is
	dead   chan struct{} // closed once the driver ended
	copied chan struct{} // closed once its output stream ended
	frz    cgroupFiles   // its own freezer cgroup
	frozen bool          // frz is frozen; guarded by the session's mu
	out    *router
	err    *router
	prev   []byte         // the previous run's end marker
	feed   sync.WaitGroup // the write of the current run's code
	closed sync.Once
}

// markPrefix starts every end marker; the nonce follows.
var markPrefix = []byte("\x00MOAT")

const nonceLen = 32 // hex

// startInterpRun starts r in the session's live interpreter, starting one
// first if there is none.
func (s *session) startInterpRun(ctx context.Context, r *sessionRun, code []byte, stdout, stderr io.Writer) error {
	in := s.interp
	if in != nil {
		select {
		case <-in.dead:
			s.endInterp(in, "its own end after %s run")
			in = nil
		default:
		}
	}
	if in == nil {
		r.restart = s.ended
		var err error
		if in, err = s.startDriver(ctx); err != nil {
			return err
		}
		s.mu.Lock()
		s.interp = in
		s.mu.Unlock()
	}
	r.in = in
	var nonce [nonceLen / 2]byte
	rand.Read(nonce[:])
	mark := append(bytes.Clone(markPrefix), hex.EncodeToString(nonce[:])...)
	r.end = make(chan bool, 1)
	var mu sync.Mutex
	seen := 0
	ended := func() {
		mu.Lock()
		defer mu.Unlock()
		if seen++; seen == 2 {
			r.end <- true
		}
	}
	in.out.set(stdout, mark, in.prev, ended)
	in.err.set(stderr, mark, in.prev, ended)
	in.prev = mark
	hdr := make([]byte, 0, 1+len(mark)-len(markPrefix)+4)
	hdr = append(hdr, 'R')
	hdr = append(hdr, mark[len(markPrefix):]...)
	hdr = binary.BigEndian.AppendUint32(hdr, uint32(len(code)))
	in.feed.Wait()
	in.feed.Go(func() {
		in.hj.Conn.Write(hdr)
		in.hj.Conn.Write(code)
	})
	return nil
}

// startDriver starts a session's interpreter: an exec of the driver, held
// and checked as a run's process before it can read code, then moved into
// a freezer cgroup of its own.
func (s *session) startDriver(ctx context.Context) (*interp, error) {
	execID, hj, err := s.startExec(ctx, s.b.spec.driverCmd(), true)
	if err != nil {
		return nil, err
	}
	in := &interp{execID: execID, hj: hj, pidfd: -1, dead: make(chan struct{}), copied: make(chan struct{}),
		out: &router{status: true}, err: &router{}}
	ok := false
	defer func() {
		if !ok {
			hj.Close()
			if in.pidfd >= 0 {
				unix.Close(in.pidfd)
			}
		}
	}()
	if in.pidfd, in.pid, err = s.holdExec(ctx, execID); err != nil {
		return nil, err
	}
	dir := filepath.Join(s.cg.freezer, interpFreezer)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return nil, fmt.Errorf("container: the interpreter's freezer cgroup: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(in.pid)), 0); err != nil {
		return nil, fmt.Errorf("container: move the interpreter into its freezer cgroup: %w", err)
	}
	in.frz = cgroupFiles{freezer: dir, v2: s.cg.v2}
	go func() {
		stdcopy.StdCopy(in.out, in.err, hj.Reader)
		close(in.copied)
	}()
	go func() {
		waitPidfd(in.pidfd)
		close(in.dead)
	}()
	ok = true
	return in, nil
}

// close releases what the interpreter holds; it must be dead or dying
// (its container removed, or every process of it killed).
func (in *interp) close() {
	in.closed.Do(func() {
		in.hj.Close()
		select {
		case <-in.dead:
			unix.Close(in.pidfd)
		case <-time.After(execWait):
			// Left open rather than closed under the poller.
		}
	})
}

// endInterp kills the session's interpreter in, if it is still the
// session's, and forgets it; cause, when not empty, is why it ended, for
// the notes of the run that starts the next ("%s" stands for "this" or
// "the previous").
func (s *session) endInterp(in *interp, cause string) {
	s.mu.Lock()
	if s.interp == in {
		s.interp = nil
	}
	if cause != "" {
		s.ended = cause
	}
	s.mu.Unlock()
	s.killAllButInit()
	in.close()
}

// waitInterp waits for a run in the interpreter to end: its end markers on
// both streams, or the interpreter's end.
func (r *sessionRun) waitInterp() (engine.Evidence, error) {
	s, in := r.s, r.in
	select {
	case <-r.end:
		// Nothing the run started outlives it, but the interpreter.
		kerr := s.killAllBut(in.pid)
		killed := r.finish()
		if kerr != nil {
			s.endInterp(in, "")
			return engine.Evidence{}, kerr
		}
		if !killed {
			ev := engine.Evidence{Exited: true, Status: engine.Exit(in.out.exitCode())}
			r.evidence(&ev)
			r.notes(&ev)
			switch {
			case ev.Memory:
				r.endWith(&ev, "the memory limit in %s run")
			case ev.Pids:
				r.endWith(&ev, "the process limit in %s run")
			}
			return ev, nil
		}
		// Killed as it ended: the kill ended the interpreter too.
		select {
		case <-in.dead:
		case <-time.After(execWait):
			s.endInterp(in, "")
			return engine.Evidence{}, errors.New("container: the session's interpreter outlived its kill")
		}
		return r.interpEnded(true, nil)
	case <-in.dead:
		kerr := s.killAllButInit()
		return r.interpEnded(r.finish(), kerr)
	}
}

// interpEnded is the evidence of a run that ended with its interpreter.
func (r *sessionRun) interpEnded(killed bool, kerr error) (engine.Evidence, error) {
	s, in := r.s, r.in
	select {
	case <-in.copied:
	case <-time.After(outputGrace):
		in.hj.Close()
		<-in.copied
	}
	if kerr != nil {
		s.endInterp(in, "")
		return engine.Evidence{}, kerr
	}
	code, err := s.execExit(in.execID)
	if err != nil {
		s.endInterp(in, "")
		return engine.Evidence{}, err
	}
	ev := engine.Evidence{Exited: !killed, Status: exitStatus(int64(code))}
	r.evidence(&ev)
	r.notes(&ev)
	switch {
	case ev.CPUTime:
		r.endWith(&ev, "the CPU time limit of %s run")
	case ev.Memory:
		r.endWith(&ev, "the memory limit in %s run")
	case killed:
		r.endWith(&ev, "a kill of %s run (the wall time, the output cap or a cancellation)")
	default:
		r.endWith(&ev, fmt.Sprintf("the exit of %%s run (status %d)", code))
	}
	return ev, nil
}

// notes adds the note of a run that starts a fresh interpreter.
func (r *sessionRun) notes(ev *engine.Evidence) {
	if r.restart != "" {
		ev.Notes = append(ev.Notes, "interpreter restarted: the previous one was ended by "+fmt.Sprintf(r.restart, "the previous")+"; variables from earlier runs are gone")
	}
}

// endWith ends the run's interpreter for cause and says so in the run's
// notes.
func (r *sessionRun) endWith(ev *engine.Evidence, cause string) {
	next := "the next run starts a fresh one; the files remain, the variables are gone"
	if ev.Spent {
		next = "the session's CPU budget is spent, later runs fail"
	}
	ev.Notes = append(ev.Notes, "interpreter ended by "+fmt.Sprintf(cause, "this")+": "+next)
	r.s.endInterp(r.in, cause)
}

// router passes one of the interpreter's output streams to the current
// run's writer up to the run's end marker, drops a late marker of the
// previous run, and keeps (up to a cap) what comes between runs for the
// next one. On stdout the marker is followed by " <status>\n". It is
// written by one goroutine, the interpreter's stream copy.
type router struct {
	status bool // the stream carries the status after the marker

	mu        sync.Mutex
	w         io.Writer // the current run's, or nil
	cur, prev []byte
	state     int
	held      []byte // the start of what may be a marker
	digits    []byte
	code      int // the status read after the current marker
	ended     func()
	limbo     limitedBuffer
}

const (
	passing    = iota // the run's output
	readStatus        // the status after the current marker
	skipStatus        // the status after a late marker of the previous run
	between           // after the run's end: kept for the next run
)

// maxBetween is what the router keeps of the output between runs.
const maxBetween = 64 << 10

func (r *router) set(w io.Writer, cur, prev []byte, ended func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.w, r.cur, r.prev, r.ended = w, cur, prev, ended
	r.state, r.code = passing, 0
	// What came between runs goes to this run, read for its markers as
	// if it came now.
	b := bytes.Clone(r.limbo.Bytes())
	r.limbo = limitedBuffer{max: maxBetween}
	r.write(b)
}

func (r *router) emit(b []byte) {
	if len(b) == 0 {
		return
	}
	if r.w != nil && r.state != between {
		r.w.Write(b)
		return
	}
	if r.limbo.max == 0 {
		r.limbo.max = maxBetween
	}
	r.limbo.Write(b)
}

func (r *router) Write(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.write(p)
	return len(p), nil
}

// write is Write, with r.mu held.
func (r *router) write(p []byte) {
	buf := append(r.held, p...)
	r.held = nil
	for len(buf) > 0 {
		switch r.state {
		case readStatus, skipStatus:
			i := bytes.IndexByte(buf, '\n')
			take := buf
			if i >= 0 {
				take = buf[:i]
			}
			if len(r.digits)+len(take) <= 8 {
				r.digits = append(r.digits, take...)
			}
			if i < 0 {
				return
			}
			buf = buf[i+1:]
			if r.state == skipStatus {
				r.state = passing
				continue
			}
			r.code = 1 // a status that does not parse: the driver was not itself
			if n, err := strconv.Atoi(string(bytes.TrimPrefix(r.digits, []byte(" ")))); err == nil && n >= 0 && n <= 255 {
				r.code = n
			}
			r.finish()
		case between:
			r.emit(buf)
			return
		default:
			i := bytes.Index(buf, markPrefix)
			if i < 0 {
				k := partialPrefix(buf, markPrefix)
				r.emit(buf[:len(buf)-k])
				r.held = bytes.Clone(buf[len(buf)-k:])
				return
			}
			if len(buf)-i < len(markPrefix)+nonceLen {
				r.emit(buf[:i])
				r.held = bytes.Clone(buf[i:])
				return
			}
			m := buf[i : i+len(markPrefix)+nonceLen]
			switch {
			case r.cur != nil && bytes.Equal(m, r.cur):
				r.emit(buf[:i])
				buf = buf[i+len(m):]
				r.digits = r.digits[:0]
				if r.status {
					r.state = readStatus
				} else {
					r.finish()
				}
			case r.prev != nil && bytes.Equal(m, r.prev):
				r.emit(buf[:i])
				buf = buf[i+len(m):]
				r.digits = r.digits[:0]
				if r.status {
					r.state = skipStatus
				}
			default:
				r.emit(buf[:i+1])
				buf = buf[i+1:]
			}
		}
	}
}

// exitCode is the status the driver wrote after the current run's marker.
func (r *router) exitCode() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.code
}

// finish ends the current run on this stream.
func (r *router) finish() {
	r.state = between
	r.cur = nil
	if r.ended != nil {
		r.ended()
		r.ended = nil
	}
}

// partialPrefix is the length of the longest end of b that begins prefix.
func partialPrefix(b, prefix []byte) int {
	for k := min(len(b), len(prefix)-1); k > 0; k-- {
		if bytes.Equal(b[len(b)-k:], prefix[:k]) {
			return k
		}
	}
	return 0
}
