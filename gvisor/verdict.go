package gvisor

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/engine"
)

// evidence is what the level knows about how a run ended, all of it from
// outside the code: whether moat killed the sandbox, the host cgroup's
// counters, runsc's exit as the host kernel reports it, and the records
// runsc and the sentry logged (which the code cannot write; see logs.go).
// The code's stderr is here only to quote in errors.
type evidence struct {
	killed  bool // the engine killed the sandbox (Process.Kill): the wall time, a cancellation, the output cap
	cpuOver bool // the cgroup's CPU account passed the limit, and moat killed the sandbox
	// cpuUsed is the sandbox cgroup's CPU time since the run began (the
	// sentry's and the gofer's included), and cpuLimit the run's CPU time
	// limit: a death by SIGXCPU counts as the CPU limit only with the
	// first at the second (engine.XCPUAtLimit), since the code can send
	// itself the signal.
	cpuUsed, cpuLimit time.Duration
	cgroup            cgroup.Events
	// runscExit is runsc's exit code as the host kernel reports it, -1
	// when runsc did not exit by itself: runsc exits with the container's
	// exit code, or 128 plus its signal. waitErr is how it ended, for
	// errors.
	runscExit int
	waitErr   error
	run       runLog      // runsc run's own log
	sent      sentryFacts // the sentry's log
	// panicLog is the start of what the sentry's Go runtime wrote
	// (--panic-log): a panic, a fatal error. Empty when it wrote nothing.
	panicLog []byte
	stderr   []byte // the end of the code's stderr (runsc's own lands there too), for errors
}

// judge turns the evidence into the engine's Evidence, or into an error
// wrapping moat.ErrUnavailable when the sandbox itself failed; the engine
// adds its own facts and decides the reason.
//
// The container's wait status counts (Exited) only when the sentry
// reported it: the sentry logged its own end with that status, runsc run
// logged the same, runsc's exit code as the host kernel saw it matches,
// and the sentry's runtime wrote nothing; and only when nothing of moat's
// killed the sandbox. A sentry that panicked, crashed or was killed does
// none of this: runsc then reports the sentry's own exit status instead,
// which is not the code's. When moat or a host limit (the cgroup's memory
// or pids) ended the sandbox, the code was killed; when nothing of those
// did, the sandbox failed, and the run is an error.
func (ev evidence) judge() (engine.Evidence, error) {
	byUs := ev.killed || ev.cpuOver
	hostLimit := ev.cgroup.OOMKill || ev.cgroup.PidsMax
	st := ev.run.status
	reported := ev.run.exited && ev.sent.exited && ev.sent.status == st &&
		len(ev.panicLog) == 0 && ev.runscExit == exitCode(st)
	if !reported && !byUs && !hostLimit {
		return engine.Evidence{}, ev.failure()
	}
	out := engine.Evidence{
		Exited:   reported && !byUs,
		CPUTime:  ev.cpuOver || (reported && engine.XCPUAtLimit(st, ev.cpuUsed, ev.cpuLimit, engine.XCPUSlack)),
		Memory:   ev.cgroup.OOMKill,
		Pids:     ev.cgroup.PidsMax || ev.sent.pids,
		FileSize: ev.sent.fileSize,
		Disk:     ev.sent.disk,
	}
	if out.Exited {
		out.Status = st
	}
	return out, nil
}

// failure says how the sandbox failed when the sentry did not report the
// container's status and nothing of moat's ended it.
func (ev evidence) failure() error {
	var msg string
	switch {
	case ev.run.fatal != "":
		msg = "runsc failed, nothing ran: " + ev.run.fatal
	case len(ev.panicLog) > 0:
		msg = "the sentry crashed: " + firstLines(ev.panicLog, 3)
	case !ev.run.exited:
		msg = fmt.Sprintf("runsc ended (%v) without the container's status: %s %s",
			ev.waitErr, strings.Join(ev.run.warnings, " | "), clip(ev.stderr, 300))
	case !ev.sent.exited:
		msg = fmt.Sprintf("the sentry ended without reporting the container's status (runsc: %s): %s",
			strings.Join(ev.run.warnings, " | "), strings.Join(ev.sent.last, " | "))
	default:
		msg = fmt.Sprintf("runsc and the sentry disagree on how the container ended: runsc logged status %#x and exited with %d, the sentry logged %#x",
			uint32(ev.run.status), ev.runscExit, uint32(ev.sent.status))
	}
	return fmt.Errorf("gvisor: %s: %w", msg, moat.ErrUnavailable)
}

// exitCode is the exit code runsc exits with for the container's status.
func exitCode(ws syscall.WaitStatus) int {
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}

// maxPanicLog is how much of the sentry's runtime messages moat keeps;
// maxPanicRead how much of the file it reads: a longer one counts as it
// is, without dropping the sentry's log lines.
const (
	maxPanicLog  = 4 << 10
	maxPanicRead = 1 << 20
)

// sentryLogLine matches a line of the sentry's own logger in the text form
// it writes to stderr (the panic log) before runsc points it at the debug
// log, at info or warning level: "I1201 15:41:36.879382   26964
// rate_limited.go:36] ...". Loggers made that early (gVisor's rate-limited
// ones) keep writing there: the sentry logs "A process tried to create a
// raw socket without CAP_NET_RAW" so whenever the code tries one under
// --network=none. Such a line is the sentry's notice, not a crash.
var sentryLogLine = regexp.MustCompile(`^[IW]\d{4} \d{2}:\d{2}:\d{2}\.\d{6} +\d+ [\w.-]+\.go:\d+\] `)

// readPanicLog returns the start of the file runsc's --panic-log names,
// without the sentry's log lines (sentryLogLine), or nil when nothing else
// is there or it was never made (runsc failed before it started the
// sentry). When it cannot be read, the error stands in for its text, so
// that the run fails closed.
func readPanicLog(path string) []byte {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return []byte("cannot read the sentry's panic log: " + err.Error())
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxPanicRead+1))
	if err != nil {
		return []byte("cannot read the sentry's panic log: " + err.Error())
	}
	if len(b) <= maxPanicRead {
		b = dropSentryLogLines(b)
	}
	return b[:min(len(b), maxPanicLog)]
}

// dropSentryLogLines returns b without its lines that sentryLogLine
// matches, and nil when nothing else is left but blank lines.
func dropSentryLogLines(b []byte) []byte {
	var out []byte
	for line := range bytes.Lines(b) {
		if !sentryLogLine.Match(line) {
			out = append(out, line...)
		}
	}
	if len(bytes.TrimSpace(out)) == 0 {
		return nil
	}
	return out
}

// firstLines returns the first n non-empty lines of b, joined with " | ".
func firstLines(b []byte, n int) string {
	var out []string
	for _, l := range bytes.Split(b, []byte("\n")) {
		if len(out) == n {
			break
		}
		if l = bytes.TrimSpace(l); len(l) > 0 {
			out = append(out, clip(l, 200))
		}
	}
	return strings.Join(out, " | ")
}
