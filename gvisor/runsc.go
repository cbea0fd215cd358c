package gvisor

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// runscCandidates are tried in order when Config.Runsc is empty. moat's own
// PATH is never searched.
var runscCandidates = []string{"/usr/local/bin/runsc", "/usr/bin/runsc", "/usr/sbin/runsc"}

// findRunsc returns the runsc binary to use.
func findRunsc(p string) (string, error) {
	cands := runscCandidates
	if p != "" {
		cands = []string{p}
	}
	for _, c := range cands {
		if st, err := os.Stat(c); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
			return c, nil
		}
	}
	return "", fmt.Errorf("runsc not found (tried %s)", strings.Join(cands, ", "))
}

// probeTimeout bounds each of runsc's answers about itself.
const probeTimeout = 10 * time.Second

// runscInfo is what a runsc binary says about itself.
type runscInfo struct {
	Version   string   // e.g. "0.0~20240729.0" or "release-20240729.0"
	Platforms []string // e.g. systrap, ptrace, kvm
}

// probeRunsc asks runsc for its version and the platforms it was built
// with (the help of its -platform flag lists them).
func probeRunsc(ctx context.Context, runsc string) (runscInfo, error) {
	var info runscInfo
	ctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	out, err := runQuiet(ctx, runsc, "--version")
	if err != nil {
		return info, fmt.Errorf("%s --version: %w", runsc, err)
	}
	info.Version = parseVersion(out)
	if info.Version == "" {
		return info, fmt.Errorf("%s --version printed no version: %q", runsc, clip(out, 200))
	}
	out, err = runQuiet(ctx, runsc, "flags")
	if err != nil {
		return info, fmt.Errorf("%s flags: %w", runsc, err)
	}
	info.Platforms = parsePlatforms(out)
	if len(info.Platforms) == 0 {
		return info, fmt.Errorf("%s flags lists no platforms", runsc)
	}
	return info, nil
}

func runQuiet(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = []string{}
	cmd.WaitDelay = time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if err != nil {
		return out.Bytes(), fmt.Errorf("%w: %s", err, clip(out.Bytes(), 300))
	}
	return out.Bytes(), nil
}

// parseVersion reads "runsc version X" from the first line.
func parseVersion(out []byte) string {
	line, _, _ := bytes.Cut(out, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) == 3 && f[0] == "runsc" && f[1] == "version" {
		return f[2]
	}
	return ""
}

// platformHelp matches the help of runsc's -platform flag, e.g.
// "specifies which platform to use: systrap (default), ptrace, kvm.".
var platformHelp = regexp.MustCompile(`specifies which platform to use: ([^.]*)\.`)

func parsePlatforms(flags []byte) []string {
	m := platformHelp.FindSubmatch(flags)
	if m == nil {
		return nil
	}
	var out []string
	for _, p := range strings.Split(string(m[1]), ",") {
		p = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(p), "(default)"))
		if p != "" {
			out = append(out, p)
		}
	}
	return out
}

// straceSyscalls are the system calls the sentry logs with their results,
// so that moat learns from gVisor's kernel, not from the code, which limit
// refused what: EAGAIN from the clone family (the task limit), EFBIG and
// ENOSPC from the calls that write file data (the file size and disk
// limits). The code's own bytes appear in the log only as a short prefix.
var straceSyscalls = []string{
	"clone", "clone3", "fork", "vfork",
	"write", "writev", "pwrite64", "pwritev", "pwritev2",
	"fallocate", "ftruncate", "truncate", "copy_file_range", "sendfile", "splice",
}

// sentryFacts is what the sentry's log says the run ran into.
type sentryFacts struct {
	pids     bool     // a clone failed with EAGAIN
	fileSize bool     // a write failed with EFBIG
	disk     bool     // a write failed with ENOSPC
	panicked bool     // the sentry itself panicked
	last     []string // the sentry's last lines that are not strace, for errors
}

// sentryEvents gathers sentryFacts from the sentry's log as it comes. It is
// safe for concurrent use.
type sentryEvents struct {
	mu sync.Mutex
	f  sentryFacts // guarded by mu
}

// straceExit matches the exit line of a traced call that failed, e.g.
//
//	I1130 21:05:21.809370 29928 strace.go:611] [   1:   1] python3 X clone(...) = 0 (0x0) errno=11 (try again) (513.076µs)
//
// The code chooses its task's name (at most 15 bytes) and its file names,
// which appear in the line, so only the shape at both ends is read: the
// syscall name after the task's name and " X ", and the errno right before
// the duration at the end. The code can make a line say what it likes about
// its own calls, and so change the Reason of its own run, but not get past
// a limit.
var straceExit = regexp.MustCompile(`^I\d{4} [0-9:.]+ +\d+ strace\.go:\d+\] \[ *\d+: *\d+\] .{0,64}? X ([a-z0-9_]+)\(.* errno=(\d+) \([^()]*\) \([^()]*\)$`)

var (
	straceMark = []byte("strace.go:")
	exitMark   = []byte(" X ")
	errnoMark  = []byte(" errno=")
)

// line reads one line of the sentry's log. Most lines are traced calls that
// succeeded or entered; they are skipped without a regexp.
func (e *sentryEvents) line(l []byte) {
	if bytes.Contains(l, straceMark) {
		if !bytes.Contains(l, errnoMark) || !bytes.Contains(l, exitMark) {
			return
		}
		m := straceExit.FindSubmatch(l)
		if m == nil {
			return
		}
		errno, _ := strconv.Atoi(string(m[2]))
		name := string(m[1])
		e.mu.Lock()
		defer e.mu.Unlock()
		switch {
		case strings.Contains(name, "clone") || strings.Contains(name, "fork"):
			if syscall.Errno(errno) == syscall.EAGAIN {
				e.f.pids = true
			}
		case syscall.Errno(errno) == syscall.EFBIG:
			e.f.fileSize = true
		case syscall.Errno(errno) == syscall.ENOSPC:
			e.f.disk = true
		}
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if bytes.HasPrefix(l, []byte("panic: ")) || bytes.HasPrefix(l, []byte("fatal error: ")) {
		e.f.panicked = true
	}
	if len(e.f.last) == 8 {
		e.f.last = e.f.last[1:]
	}
	e.f.last = append(e.f.last, clip(l, 300))
}

// maxLogLine bounds one line of the sentry's log that moat looks at; the
// rest of a longer line is skipped.
const maxLogLine = 64 << 10

// read consumes the sentry's log until EOF.
func (e *sentryEvents) read(r io.Reader) {
	br := bufio.NewReaderSize(r, maxLogLine)
	for {
		line, isPrefix, err := br.ReadLine()
		if len(line) > 0 {
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

// exitLine matches runsc's last log line, which carries the container's
// wait status, e.g. "main.go:222] Exiting with status: 35584".
var exitLine = regexp.MustCompile(`\] Exiting with status: (\d+)$`)

// runLog is what runsc's own log (the "run" command's) says.
type runLog struct {
	status   syscall.WaitStatus
	exited   bool     // a status line was found
	fatal    string   // runsc's fatal error, if it had one
	warnings []string // warning and error lines, for errors
}

func parseRunLog(b []byte) runLog {
	var rl runLog
	for _, l := range strings.Split(string(b), "\n") {
		if m := exitLine.FindStringSubmatch(l); m != nil {
			n, err := strconv.ParseUint(m[1], 10, 32)
			if err == nil {
				rl.status, rl.exited = syscall.WaitStatus(n), true
			}
		}
		if _, msg, ok := strings.Cut(l, "FATAL ERROR: "); ok {
			rl.fatal = msg
		}
		if strings.HasPrefix(l, "W") || strings.HasPrefix(l, "E") {
			rl.warnings = append(rl.warnings, l)
		}
	}
	return rl
}

// clip returns b as printable text of at most n bytes.
func clip(b []byte, n int) string {
	b = bytes.TrimSpace(b)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.ToValidUTF8(string(b), "?")
}
