package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
)

// ForkCost is what N sessions forked from one suspended state cost at one
// level against N fresh sessions, and how many sessions of that kind the
// machine holds.
type ForkCost struct {
	Level       moat.Level `json:"level"`
	Interpreter bool       `json:"interpreter"`
	N           int        `json:"n"`
	// Memory says the forks came back with the state's memory (the
	// interpreter's variable); without it they got its files only.
	Memory bool `json:"memory"`
	// ForkStart is the median of ResumeSession from the one state and a
	// first run reading its file (and variable) to its output; FreshStart
	// the median of NewSession and a first print(1).
	ForkStart  time.Duration `json:"fork_start_ns"`
	FreshStart time.Duration `json:"fresh_start_ns"`
	// ForksHost and FreshHost are the growth of the host's used memory
	// (MemTotal minus MemAvailable) with the N forks, then the N fresh
	// sessions, open and idle, each after settling: noisy, as for
	// SuspendCost.
	ForksHost int64 `json:"forks_host_bytes"`
	FreshHost int64 `json:"fresh_host_bytes"`
	// StateDisk is the suspended state's blocks on disk.
	StateDisk int64 `json:"state_disk_bytes"`
	// SuspendedFit is how many states of StateDisk the file system of the
	// measurement's directory has room for (its free blocks for
	// unprivileged use); RunningFit how many sessions of the larger of
	// ForksHost/N and FreshHost/N fit in MemAvailable. Both are zero when
	// the per-session figure is not positive.
	SuspendedFit int64 `json:"suspended_fit"`
	RunningFit   int64 `json:"running_fit"`
}

// forkFileSize is the size of the file the forked state holds.
const forkFileSize = 1 << 20

// MeasureForks suspends one session (with a live interpreter when
// interpreter is set) holding a file of forkFileSize bytes and, with an
// interpreter, a variable; opens n sessions from its state at once, each
// checked to see the file (and the variable where the level kept the
// memory) and to write a file of its own that no other fork sees; and then
// n fresh sessions of the same kind. Everything it opens or writes is
// closed and removed before it returns.
//
// sb must be a moat.Sessioner whose sessions are moat.Suspenders and a
// moat.Resumer, and n positive; otherwise the error wraps moat.ErrInvalid.
// A fork that sees another's write is an error.
func MeasureForks(ctx context.Context, sb moat.Sandbox, interpreter bool, n int) (ForkCost, error) {
	c := ForkCost{Level: sb.Level(), Interpreter: interpreter, N: n}
	ser, ok := sb.(moat.Sessioner)
	res, rok := sb.(moat.Resumer)
	if !ok || !rok || n <= 0 {
		return c, fmt.Errorf("bench: %s has no sessions to fork, or n=%d: %w", sb.Level(), n, moat.ErrInvalid)
	}
	parent, err := os.MkdirTemp("", "moat-bench-forks-")
	if err != nil {
		return c, fmt.Errorf("bench: %w", err)
	}
	defer os.RemoveAll(parent)
	dir := filepath.Join(parent, "state")
	opts := moat.SessionOptions{Interpreter: interpreter}

	info, err := suspendOne(ctx, ser, opts, dir)
	if err != nil {
		return c, fmt.Errorf("bench: %s: %w", sb.Level(), err)
	}
	c.Memory = info.Memory
	if c.StateDisk, err = diskUsage(dir); err != nil {
		return c, err
	}

	check := "import os\nprint(os.path.getsize('data.bin'))"
	want := strconv.Itoa(forkFileSize) + "\n"
	if interpreter && c.Memory {
		check += "\nprint(" + suspendVar + ")"
		want += "kept\n"
	}
	forks, starts, host, err := openMany(ctx, n, func() (moat.Session, error) {
		s, _, err := res.ResumeSession(ctx, dir)
		return s, err
	}, check, want)
	defer func() { closeAll(forks) }()
	if err != nil {
		return c, fmt.Errorf("bench: %s: fork: %w", sb.Level(), err)
	}
	// Each fork writes a file of its own; no fork may see another's.
	for i, s := range forks {
		name := "fork-" + strconv.Itoa(i)
		if err := runWants(ctx, s, "open('"+name+"', 'w').write('x')\nimport glob\nprint(sorted(glob.glob('fork-*')))", "['"+name+"']\n"); err != nil {
			return c, fmt.Errorf("bench: %s: forks share files: %w", sb.Level(), err)
		}
	}
	c.ForkStart, c.ForksHost = summarize(starts).Median, host
	closeAll(forks)
	forks = nil

	fresh, starts, host, err := openMany(ctx, n, func() (moat.Session, error) { return ser.NewSession(ctx, opts) }, Code, Want)
	defer func() { closeAll(fresh) }()
	if err != nil {
		return c, fmt.Errorf("bench: %s: fresh session: %w", sb.Level(), err)
	}
	c.FreshStart, c.FreshHost = summarize(starts).Median, host

	var st unix.Statfs_t
	if err := unix.Statfs(parent, &st); err != nil {
		return c, fmt.Errorf("bench: statfs %s: %w", parent, err)
	}
	if c.StateDisk > 0 {
		c.SuspendedFit = int64(st.Bavail) * int64(st.Bsize) / c.StateDisk
	}
	_, avail, err := memInfo()
	if err != nil {
		return c, err
	}
	if per := max(c.ForksHost, c.FreshHost) / int64(n); per > 0 {
		c.RunningFit = avail / per
	}
	return c, nil
}

// suspendOne opens a session, gives it the file (and the variable), and
// suspends it into dir.
func suspendOne(ctx context.Context, ser moat.Sessioner, opts moat.SessionOptions, dir string) (moat.SuspendInfo, error) {
	s, err := ser.NewSession(ctx, opts)
	if err != nil {
		return moat.SuspendInfo{}, err
	}
	sus, ok := s.(moat.Suspender)
	if !ok {
		s.Close()
		return moat.SuspendInfo{}, fmt.Errorf("its sessions do not suspend: %w", moat.ErrInvalid)
	}
	setup := "open('data.bin', 'wb').write(os.urandom(" + strconv.Itoa(forkFileSize) + "))\nprint('ok')"
	if opts.Interpreter {
		setup += "\n" + suspendVar + " = 'kept'"
	}
	if err := runWants(ctx, s, "import os\n"+setup, "ok\n"); err != nil {
		s.Close()
		return moat.SuspendInfo{}, err
	}
	info, err := sus.Suspend(ctx, dir) // ends s once it returns nil
	if err != nil {
		s.Close() // a failed Suspend leaves the session as it was
		return info, fmt.Errorf("suspend: %w", err)
	}
	return info, nil
}

// openMany opens n sessions with open, one after another, each checked with
// a first run of code printing want, and returns them, the time of each to
// its first output, and the growth of the host's used memory with all of
// them open after settling. On error the sessions opened so far are
// returned for the caller to close.
func openMany(ctx context.Context, n int, open func() (moat.Session, error), code, want string) ([]moat.Session, []time.Duration, int64, error) {
	before, err := usedAfterSettle(ctx, 0)
	if err != nil {
		return nil, nil, 0, err
	}
	var ss []moat.Session
	var starts []time.Duration
	for i := 0; i < n; i++ {
		start := time.Now()
		s, err := open()
		if err != nil {
			return ss, nil, 0, err
		}
		ss = append(ss, s)
		if err := runWants(ctx, s, code, want); err != nil {
			return ss, nil, 0, err
		}
		starts = append(starts, time.Since(start))
	}
	grown, err := usedAfterSettle(ctx, before)
	return ss, starts, grown, err
}

func closeAll(ss []moat.Session) {
	for _, s := range ss {
		s.Close()
	}
}
