package gvisor

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/marker"
)

// The live interpreter of a session (SessionOptions.Interpreter).
//
// A python3 driven by interpreter_driver.py stays alive between the runs
// of the session and runs each run's code with exec() in one persistent
// globals dictionary. It is started by the session's container init
// (launcher.py's mode init, interpinit.go) as a run's launcher starts a
// run: as the init of a PID namespace of its own, as the session's uid
// with no capability, no_new_privs and the guest seccomp filter; the init
// reports its pid and, from its wait status, its end. The driver reads its
// runs on stdin and writes its records on fd 4, a pipe only it holds. All of these are pipes of the sandbox's own
// kernel, which the init relays to and from the host's pipes in frames of
// its own; so nothing of the interpreter holds a host file, and a
// checkpoint of the sandbox keeps it (suspend.go).
//
// Between runs the whole sandbox is paused (runsc pause): no task of it,
// the interpreter and whatever its runs left running included, is
// scheduled, whatever timers or signals the code arranged. The file
// operations do not resume it: the session's working directory is a
// directory of the host (hostfiles.go), and they are done there.
//
// The interpreter lives across runs, so RLIMIT_CPU, which counts a
// process's whole life, is lifted for it (the launcher does so before it
// drops its capabilities); the sandbox's cgroup bounds each run's CPU time
// and the session's budget, as for runs without an interpreter. A run that
// is killed (wall time, CPU time, output cap, cancel) kills the
// interpreter's PID namespace, and so everything of the interpreter; the
// next run starts a fresh one. Both runs say so in their notes.
//
// What the host trusts of the driver, which shares its process with the
// code: as at the subprocess level, only "the run of this nonce says it
// ended, with this status". The host draws a fresh nonce for each run; a
// record or an output marker counts only with it, so a record of an
// earlier run is never a later run's end. Verdicts on limits come from
// the cgroup, the sentry's log and the host's clock. Code of one run can
// change what later runs do and report (as in a notebook); the limits
// hold regardless.

//go:embed interpreter_driver.py
var interpreterDriver string

// nonceLen is the length of a run's nonce (hex).
const nonceLen = 32

// maxRecord bounds a record line from the driver; longer lines are not the
// driver's and are dropped.
const maxRecord = 4 << 10

// driverCaps are the capabilities of the init that starts the
// interpreter (interpinit.go): a run launcher's, and CAP_SYS_RESOURCE to
// lift RLIMIT_CPU. The interpreter itself has none.
var driverCaps = append(append([]string{}, launcherCaps...), "CAP_SYS_RESOURCE")

// driver is the session's live interpreter.
type driver struct {
	proc    *interpProc // its streams and its launcher's reports, through the init
	records chan string // the record lines wanted (see want); closed at the end
	wantMu  sync.Mutex
	wanted  func(string) bool // the one line readRecords passes on next, or nil
	outs    [2]*marker.Router
	prev    []byte      // the nonce of the last run whose end was taken
	dead    atomic.Bool // killed or ended: the next run starts a fresh one
}

// startDriver starts the interpreter and waits for its first record. The
// caller holds the sandbox.
func (ss *session) startDriver(ctx context.Context) (*driver, error) {
	proc, err := ss.init.start()
	if err != nil {
		return nil, err
	}
	d := newDriver(proc)
	ctx, cancel := context.WithTimeout(ctx, bootTimeout)
	defer cancel()
	for {
		select {
		case line, ok := <-d.records:
			if ok && line != "H" {
				continue
			}
			if ok {
				return d, nil
			}
		case <-ctx.Done():
		}
		d.kill()
		<-proc.exited
		if ctx.Err() != nil && ctx.Err() != context.DeadlineExceeded {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("gvisor: session: the interpreter did not start (%v): %s: %w", proc.waitErr, clip(proc.tail.bytes(), 300), moat.ErrUnavailable)
	}
}

// newDriver reads the streams and records of proc.
func newDriver(proc *interpProc) *driver {
	d := &driver{proc: proc, records: make(chan string, 16)}
	d.want(func(line string) bool { return line == "H" })
	go d.readRecords(proc.records)
	for i, f := range []*os.File{proc.stdout, proc.stderr} {
		d.outs[i] = marker.NewRouter(f)
	}
	return d
}

// want makes the next line that is wanted the one line readRecords
// passes on, until then; each call wants one line more.
func (d *driver) want(wanted func(string) bool) {
	d.wantMu.Lock()
	d.wanted = wanted
	d.wantMu.Unlock()
}

// readRecords passes on the driver's record lines that are wanted (the
// driver's start, then each run's end), until the pipe ends, and drops
// the others as they come: it never waits on a line nobody wants. The
// code shares the driver's fd of records and can write lines at any rate,
// past its run's end too, when nothing reads d.records; waiting then would
// stop the init's frames (interpinit.go) once this pipe is full, and with
// them the interpreter's end, and the host's end of it after Close.
// Lines too long to be the driver's are dropped.
func (d *driver) readRecords(f *os.File) {
	defer close(d.records)
	defer f.Close()
	r := bufio.NewReaderSize(f, maxRecord)
	for {
		line, err := r.ReadSlice('\n')
		if err == bufio.ErrBufferFull {
			for err == bufio.ErrBufferFull {
				_, err = r.ReadSlice('\n')
			}
			continue
		}
		if err != nil {
			return
		}
		text := string(bytes.TrimSuffix(line, []byte("\n")))
		d.wantMu.Lock()
		ok := d.wanted != nil && d.wanted(text)
		if ok {
			d.wanted = nil
		}
		d.wantMu.Unlock()
		if ok {
			d.records <- text // at most one per want: never more than its room
		}
	}
}

// runEnd parses the end record of the run whose record prefix is prefix:
// ok only for a well-formed one.
func runEnd(line, prefix string) (status int, marked string, ok bool) {
	i := strings.Index(line, prefix)
	if i < 0 {
		return 0, "", false
	}
	st, m, _ := strings.Cut(line[i+len(prefix):], " ")
	n, err := strconv.Atoi(st)
	if err != nil || n < 0 || n > 255 {
		return 0, "", false
	}
	return n, m, true
}

// kill ends the interpreter's PID namespace.
func (d *driver) kill() {
	d.dead.Store(true)
	d.proc.kill()
}

// ended reports whether the interpreter has ended.
func (d *driver) ended() bool {
	select {
	case <-d.proc.exited:
		return true
	default:
		return false
	}
}

// interpRun is one run of the live interpreter; see engine.Process and
// engine.Ender.
type interpRun struct {
	ss      *session
	d       *driver
	nonce   []byte
	sinks   [2]*marker.Sink
	restart string // why the previous interpreter ended, if this run started a fresh one
	feed    chan struct{}

	base          time.Duration
	startEvents   cgroup.Events
	startFacts    sentryFacts
	stopCPU       func()
	cpuOver       atomic.Bool
	budgetLimited bool

	mu     sync.Mutex
	killed bool
	why    moat.Reason // the engine's reason, when it ended the run
}

// startInterpRun readies the interpreter (a fresh one if there is none),
// resumes the sandbox and hands the driver the code.
func (ss *session) startInterpRun(ctx context.Context, code []byte, stdout, stderr io.Writer) (_ engine.Process, err error) {
	if err := ss.hold(); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			ss.release()
		}
	}()
	r := &interpRun{ss: ss, feed: make(chan struct{})}
	d := ss.interp
	if d != nil && (d.dead.Load() || d.ended()) {
		if ss.ended == "" {
			ss.ended = "it ended between runs"
		}
		ss.dropDriver()
		d = nil
	}
	if d == nil {
		r.restart = ss.ended
		if d, err = ss.startDriver(ctx); err != nil {
			return nil, err
		}
		ss.mu.Lock()
		ss.interp = d
		ss.mu.Unlock()
		ss.ended = ""
	}
	r.d = d
	var rnd [nonceLen / 2]byte
	rand.Read(rnd[:])
	r.nonce = []byte(hex.EncodeToString(rnd[:]))
	for i, w := range []io.Writer{stdout, stderr} {
		r.sinks[i] = marker.NewSink(r.nonce, d.prev, w)
		d.outs[i].Set(r.sinks[i])
	}
	lim := ss.b.limits
	r.base, _ = ss.bt.group.CPUUsage()
	r.startEvents, r.startFacts = ss.bt.group.Events(), ss.bt.events.snapshot()
	prefix := "X" + string(r.nonce) + " "
	d.want(func(line string) bool { _, _, ok := runEnd(line, prefix); return ok })
	hdr := append([]byte{'R'}, r.nonce...)
	hdr = binary.BigEndian.AppendUint32(hdr, uint32(len(code)))
	go func() {
		defer close(r.feed)
		if _, err := d.proc.stdin.Write(hdr); err == nil {
			d.proc.stdin.Write(code)
		}
	}()
	ss.mu.Lock()
	left := ss.budget - ss.spent
	ss.mu.Unlock()
	limit := min(time.Duration(lim.CPUTime), left)
	r.budgetLimited = left < time.Duration(lim.CPUTime)
	r.stopCPU = ss.bt.group.WatchCPU(r.base, limit, r.kill, &r.cpuOver)
	return r, nil
}

// dropDriver forgets the session's interpreter once it has been killed:
// the init reports its end once its PID namespace is gone.
func (ss *session) dropDriver() {
	d := ss.interp
	if d == nil {
		return
	}
	d.kill()
	ss.mu.Lock()
	ss.interp = nil
	ss.mu.Unlock()
}

// Kill ends the run, and with it the interpreter: see engine.Process.
func (r *interpRun) Kill() {
	r.mu.Lock()
	r.killed = true
	r.mu.Unlock()
	r.kill()
}

// End is Kill, with the engine's reason; see engine.Ender.
func (r *interpRun) End(why moat.Reason) {
	r.mu.Lock()
	if !r.killed {
		r.why = why
	}
	r.killed = true
	r.mu.Unlock()
	r.kill()
}

func (r *interpRun) kill() { r.d.kill() }

// Wait waits for the run's end record, or for the interpreter's end,
// takes the run's output up to its markers, pauses the sandbox and
// returns the evidence.
func (r *interpRun) Wait() (engine.Evidence, error) {
	ss, d := r.ss, r.d
	prefix := "X" + string(r.nonce) + " "
	var status int
	var marked string
	got := false
	take := func(line string) {
		if n, m, ok := runEnd(line, prefix); ok && !got {
			status, marked, got = n, m, true
		}
	}
	for !got && d.records != nil {
		select {
		case line, ok := <-d.records:
			if !ok {
				d.records = nil
				break
			}
			take(line)
		case <-d.proc.exited:
			// What the driver wrote before its end is still to be read.
			for timeout := time.After(streamDrain); d.records != nil; {
				select {
				case line, ok := <-d.records:
					if !ok {
						d.records = nil
						break
					}
					take(line)
				case <-timeout:
					d.records = nil
				}
			}
		}
	}
	<-r.feed
	r.stopCPU()
	lost := false // a marker the record names did not come: the interpreter is killed
	if got {
		// The driver wrote its markers before the record; wait until they
		// have passed through.
		for i, c := range "oe" {
			if strings.ContainsRune(marked, c) {
				select {
				case <-r.sinks[i].Seen():
				case <-time.After(streamDrain):
					ss.b.log.Warn("gvisor: session: an interpreter's output marker did not come", "id", ss.bt.id)
					lost = true
					d.kill()
				}
			}
		}
	}
	killed, why := r.state()
	// Whatever killed the interpreter, the run waits for its end: the
	// next run's start needs the init to have none (interpinit.go).
	if killed || !got || lost {
		d.dead.Store(true)
		// Its PID namespace is gone once the init reported its end (after
		// everything it wrote): then nothing of it writes the streams,
		// and what is left of them is this run's.
		select {
		case <-d.proc.exited:
		case <-time.After(killGrace):
			d.proc.giveUp()
			<-d.proc.exited
		}
		for i := range d.outs {
			select {
			case <-d.outs[i].EOF():
			case <-time.After(streamDrain):
			}
		}
	}
	for i := range d.outs {
		d.outs[i].Set(nil)
		r.sinks[i].Flush()
	}
	d.prev = r.nonce

	used, cpuErr := ss.bt.group.CPUUsage()
	used -= r.base
	events, facts := ss.bt.group.Events(), ss.bt.events.snapshot()
	out := engine.Evidence{CPUTime: r.cpuOver.Load()}
	out.Memory = events.OOMKill && !r.startEvents.OOMKill
	pids, fileSize, disk := facts.refused.since(r.startFacts.refused)
	out.Pids = pids || (events.PidsMax && !r.startEvents.PidsMax)
	out.FileSize, out.Disk = fileSize, disk

	ss.mu.Lock()
	closed := ss.closed
	if cpuErr != nil {
		ss.spent = ss.budget // fail closed: an account that cannot be read spends the budget
	} else {
		ss.spent += used
	}
	spent := ss.spent >= ss.budget
	ss.mu.Unlock()
	sandboxDead := !ss.bt.alive()
	byUs := killed || out.CPUTime || closed
	switch {
	case got && !byUs:
		out.Exited, out.Status = true, syscall.WaitStatus(status<<8)
	case !got && !byUs && d.proc.report.hasStatus && !sandboxDead:
		// The code ended the interpreter itself (os._exit, a signal):
		// the run's end is the interpreter's.
		out.Exited, out.Status = true, d.proc.report.status
	case !byUs && !out.Memory && !out.Pids:
		ss.release()
		msg := "the interpreter ended without the run's end"
		if sandboxDead {
			msg = "the session's sandbox ended during the run: " + ss.sandboxEvidence().failure().Error()
		}
		return engine.Evidence{}, fmt.Errorf("gvisor: session: %s: %w", msg, moat.ErrUnavailable)
	}
	if r.restart != "" {
		out.Notes = append(out.Notes, "gvisor: a fresh interpreter started for this run, without the variables of earlier runs: the previous one ended ("+r.restart+")")
	}
	if d.dead.Load() || !got {
		cause := "a run of it was killed"
		switch {
		case why == moat.ReasonTimeout:
			cause = "a run of it timed out"
		case why == moat.ReasonOutput:
			cause = "a run of it passed the output limit"
		case why == moat.ReasonCanceled:
			cause = "a run of it was canceled"
		case out.CPUTime:
			cause = "a run of it passed its CPU time"
		case lost:
			cause = "a run of it hid the end of its output"
		case !killed:
			cause = "a run of it ended it"
		}
		ss.ended = cause
		ss.dropDriver()
		out.Notes = append(out.Notes, "gvisor: the session's interpreter ended with this run ("+cause+"); the next run starts a fresh one, without the variables")
	}
	ss.release()
	if n := ss.bt.net; n != nil {
		out.Notes = append(out.Notes, n.Notes()...)
	}
	out.Spent = spent
	if spent && out.CPUTime && r.budgetLimited {
		out.Notes = append(out.Notes, fmt.Sprintf("gvisor: this run used up the session's CPU budget of %v (session_cpu_time); later runs fail, the files stay readable", ss.budget))
	}
	return out, nil
}

func (r *interpRun) state() (bool, moat.Reason) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.killed, r.why
}
