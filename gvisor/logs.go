package gvisor

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"unicode/utf8"
)

// How moat reads runsc's and the sentry's logs without letting the code
// write them.
//
// runsc writes every log as JSON (--debug-log-format=json): one object per
// record, {"msg": "file.go:N] text", "level": ..., "time": ...}, the text
// escaped by encoding/json. The code puts text into records (its task's
// name, up to 15 bytes, in every traced call; its file names and data in
// the calls that use them), but a newline or a quote of its own arrives
// escaped inside a string: it can never end a record, start one, or add a
// field. Whatever the code names its files or tasks, a record is the
// sentry's. A line that is not JSON is never read. (Records longer than a
// pipe's atomic write may be torn by a concurrent writer; the pieces are
// not valid JSON objects with a msg, because every quote the code supplies
// arrives escaped, and they are dropped.)
//
// Go's runtime messages (a panic, a fatal error) do not go through the
// logger: runsc sends them to a file of their own (--panic-log), which
// nothing but the sentry's runtime and its fatal-error path writes.
//
// Inside a record, only the parts the sentry formats are read: the file
// and line that logged it, and for a traced call the fixed prefix, the
// call's name found by the rule in straceCall, and the result at the end.

// straceSyscalls are the system calls the sentry logs with their results,
// so that moat learns from gVisor's kernel, not from the code, which limit
// refused what: EAGAIN from the clone family (the task limit), EFBIG and
// ENOSPC from the calls that write file data (the file size and disk
// limits). Each of them has as its first argument a file descriptor, a
// path, clone's flags, or nothing (see straceCall).
var straceSyscalls = []string{
	"clone", "clone3", "fork", "vfork",
	"write", "writev", "pwrite64", "pwritev", "pwritev2",
	"fallocate", "ftruncate", "truncate", "copy_file_range", "sendfile", "splice",
}

var (
	traced    = map[string]bool{}
	cloneCall = map[string]bool{"clone": true, "clone3": true, "fork": true, "vfork": true}
)

func init() {
	for _, s := range straceSyscalls {
		traced[s] = true
	}
}

// logRecord is one record of a runsc log in its JSON format.
type logRecord struct {
	Msg   string `json:"msg"`
	Level string `json:"level"`
}

// records calls fn for each JSON record in one line of a log. Records
// written at once by two goroutines may share a line ({...}{...}); the
// line's reading stops at the first thing that is not a record.
func records(line []byte, fn func(logRecord)) {
	dec := json.NewDecoder(bytes.NewReader(line))
	for {
		var r logRecord
		if err := dec.Decode(&r); err != nil || r.Msg == "" {
			return
		}
		fn(r)
	}
}

// exitRecord is the record runsc logs last, in the sentry's log and in
// runsc run's own: the container's wait status, e.g. "main.go:222] Exiting
// with status: 35584".
var exitRecord = regexp.MustCompile(`^main\.go:\d+\] Exiting with status: (\d+)$`)

func parseExit(msg string) (syscall.WaitStatus, bool) {
	m := exitRecord.FindStringSubmatch(msg)
	if m == nil {
		return 0, false
	}
	n, err := strconv.ParseUint(m[1], 10, 32)
	if err != nil {
		return 0, false
	}
	return syscall.WaitStatus(n), true
}

// sentryFacts is what the sentry's log says.
type sentryFacts struct {
	pids     bool // a clone failed with EAGAIN
	fileSize bool // a write failed with EFBIG
	disk     bool // a write failed with ENOSPC
	// exited is set when the sentry logged its own end, with the
	// container's wait status: it ended by itself, not by a crash or a
	// kill.
	exited bool
	status syscall.WaitStatus
	last   []string // the sentry's last records that are not traced calls, for errors
	// refused counts the refusals above, so that a session's run can tell
	// its own from its predecessors'.
	refused refusals
}

// refusals counts the calls the sentry refused, by limit.
type refusals struct{ pids, fileSize, disk int }

// since is what r refused after before.
func (r refusals) since(before refusals) (pids, fileSize, disk bool) {
	return r.pids > before.pids, r.fileSize > before.fileSize, r.disk > before.disk
}

// sentryEvents gathers sentryFacts from the sentry's log as it comes. It is
// safe for concurrent use.
type sentryEvents struct {
	mu sync.Mutex
	f  sentryFacts // guarded by mu
}

var (
	straceMark = []byte("strace.go:")
	errnoMark  = []byte("errno=")
	exitMark   = []byte("Exiting with status")
)

// line reads one line of the sentry's log. Most lines are traced calls that
// succeeded or entered; they are skipped without decoding.
func (e *sentryEvents) line(l []byte) {
	if bytes.Contains(l, straceMark) && !bytes.Contains(l, errnoMark) && !bytes.Contains(l, exitMark) {
		return
	}
	records(l, e.record)
}

func (e *sentryEvents) record(r logRecord) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if strings.HasPrefix(r.Msg, "strace.go:") {
		name, errno, ok := straceFailure(r.Msg)
		switch {
		case !ok:
		case cloneCall[name] && errno == syscall.EAGAIN:
			e.f.pids = true
			e.f.refused.pids++
		case errno == syscall.EFBIG:
			e.f.fileSize = true
			e.f.refused.fileSize++
		case errno == syscall.ENOSPC:
			e.f.disk = true
			e.f.refused.disk++
		}
		return
	}
	if ws, ok := parseExit(r.Msg); ok {
		e.f.exited, e.f.status = true, ws
		return
	}
	if len(e.f.last) == 8 {
		e.f.last = e.f.last[1:]
	}
	e.f.last = append(e.f.last, clip([]byte(r.Msg), 300))
}

// stracePrefix is how the sentry begins a traced call's record: the file
// and line, then the task's ids in its PID namespace (and in the root one
// when they differ), e.g. "strace.go:611] [   1:   1] ".
var stracePrefix = regexp.MustCompile(`^strace\.go:\d+\] \[[0-9 ():]+\] `)

// straceResult is the end of a failed call's exit record, which the
// sentry formats after the arguments, e.g. ") = 0 (0x0) errno=11 (try
// again) (513.076µs)". Neither group in parentheses can span a "(".
var straceResult = regexp.MustCompile(`\) = -?\d+ \(0x[0-9a-f]+\) errno=(\d+) \([^()]*\) \([^()]*\)$`)

// maxTaskName is the longest task name in runes: gVisor cuts every name it
// is given (prctl, /proc/*/comm, execve) to TASK_COMM_LEN-1 bytes, and
// encoding/json turns each byte that is not UTF-8 into one rune.
const maxTaskName = 15

// straceFailure reads a traced call's exit record that reports an error,
// e.g.
//
//	strace.go:611] [   1:   1] python3 X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 0 (0x0) errno=11 (try again) (513.076µs)
//
// and returns the call's name and its errno.
//
// The task's name (the code's, any 15 bytes) comes between the prefix and
// " X " (an exit) or " E " (an entry), and may itself hold " X clone(" or
// " E ". The separator is therefore taken as the last " X " or " E " that
// starts within maxTaskName runes of the prefix: the real one starts
// there, one inside the name starts before it, and none can start after it
// that early, because what follows the separator is the call's name, "("
// and a first argument whose text starts with the sentry's own ("0x3 /",
// "0x7ffd... ", clone's flags, ")"), so nothing of the code's comes before
// the fifteenth rune. The call's name must then be a traced one, and the
// result is read from the end, where the sentry wrote it after the last
// argument (a number, for every traced call).
func straceFailure(msg string) (string, syscall.Errno, bool) {
	loc := stracePrefix.FindStringIndex(msg)
	if loc == nil {
		return "", 0, false
	}
	rest := msg[loc[1]:]
	sep, kind := -1, byte(0)
	for i, runes := 0, 0; i < len(rest) && runes <= maxTaskName; runes++ {
		if strings.HasPrefix(rest[i:], " X ") || strings.HasPrefix(rest[i:], " E ") {
			sep, kind = i, rest[i+1]
		}
		_, n := utf8.DecodeRuneInString(rest[i:])
		i += n
	}
	if sep < 0 || kind != 'X' {
		return "", 0, false
	}
	call := rest[sep+3:]
	name, _, ok := strings.Cut(call, "(")
	if !ok || !traced[name] {
		return "", 0, false
	}
	m := straceResult.FindStringSubmatch(call)
	if m == nil {
		return "", 0, false
	}
	errno, err := strconv.Atoi(m[1])
	if err != nil {
		return "", 0, false
	}
	return name, syscall.Errno(errno), true
}

// maxLogLine bounds one line of the sentry's log that moat looks at; the
// rest of a longer line is skipped.
const maxLogLine = 64 << 10

// read consumes the sentry's log until EOF.
func (e *sentryEvents) read(r io.Reader) {
	br := bufio.NewReaderSize(r, maxLogLine)
	for {
		line, isPrefix, err := br.ReadLine()
		if len(line) > 0 && !isPrefix {
			e.line(line)
		}
		for isPrefix && err == nil {
			_, isPrefix, err = br.ReadLine()
		}
		if err != nil {
			return
		}
	}
}

func (e *sentryEvents) snapshot() sentryFacts {
	e.mu.Lock()
	defer e.mu.Unlock()
	f := e.f
	f.last = append([]string(nil), e.f.last...)
	return f
}

// runLog is what runsc's own log (the "run" command's) says.
type runLog struct {
	status   syscall.WaitStatus
	exited   bool     // a status record was found
	fatal    string   // runsc's fatal error, if it had one
	warnings []string // warning records, for errors
}

func parseRunLog(b []byte) runLog {
	var rl runLog
	for _, l := range bytes.Split(b, []byte("\n")) {
		records(l, func(r logRecord) {
			if ws, ok := parseExit(r.Msg); ok {
				rl.status, rl.exited = ws, true
			}
			if _, msg, ok := strings.Cut(r.Msg, "] FATAL ERROR: "); ok {
				rl.fatal = msg
			}
			if r.Level == "warning" {
				rl.warnings = append(rl.warnings, r.Msg)
			}
		})
	}
	return rl
}
