package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
)

// SuspendFileSize is the size of the file each measured session holds when
// it is suspended.
const SuspendFileSize = 10 << 20 // 10 MiB

// SuspendCost is what suspending and resuming one kind of session costs at
// one level, each figure the median over Runs.
type SuspendCost struct {
	Level       moat.Level `json:"level"`
	Interpreter bool       `json:"interpreter"`
	Runs        int        `json:"runs"`
	// Memory says the level kept the session's memory (SuspendInfo.Memory):
	// the interpreter's variable came back on resume. Without it only the
	// files did.
	Memory bool `json:"memory"`
	// Suspend is the time Suspend took, the session idle.
	Suspend time.Duration `json:"suspend_ns"`
	// StateBytes is the state's size as SuspendInfo.Bytes says, DiskBytes
	// what its directory holds on disk (allocated blocks, as du counts).
	StateBytes int64 `json:"state_bytes"`
	DiskBytes  int64 `json:"disk_bytes"`
	// Resume is ResumeSession and the first run on the resumed session
	// (reading the file and, when the memory was kept, printing the
	// variable), to its output; Fresh is NewSession and a first run of
	// print(1), to its output, at the same level. Ratio is Resume/Fresh.
	Resume time.Duration `json:"resume_ns"`
	Fresh  time.Duration `json:"fresh_ns"`
	Ratio  float64       `json:"ratio"`
	// RunningHost and SuspendedHost are the growth of the host's used
	// memory (MemTotal minus MemAvailable) from before the session was
	// opened to while it ran idle and to after it was suspended. They are
	// noisy (everything else on the host allocates meanwhile) and may be
	// negative; a suspended session should hold about nothing.
	RunningHost   int64 `json:"running_host_bytes"`
	SuspendedHost int64 `json:"suspended_host_bytes"`
}

// settle is how long the measurement waits before reading the host's used
// memory, for transient memory to go back.
var settle = time.Second

// MeasureSuspend suspends and resumes sessions of sb runs times and reports
// the medians: per run, a session (with a live interpreter when
// interpreter is set) gets a file of SuspendFileSize bytes and, with an
// interpreter, a variable; it is suspended into a fresh directory of a
// private (0700) temporary parent, resumed, and its first run checked to
// see the file (and the variable when the level kept the memory); a fresh
// session of the same kind is timed beside it, the two in alternating
// order. Everything MeasureSuspend opens or writes is closed and removed
// before it returns.
//
// sb must be a moat.Sessioner whose sessions are moat.Suspenders and a
// moat.Resumer; otherwise, or when runs is not positive, the error wraps
// moat.ErrInvalid. A level that refuses interpreter sessions gives its
// error (wrapping moat.ErrUnavailable). A wrong output is an error.
func MeasureSuspend(ctx context.Context, sb moat.Sandbox, interpreter bool, runs int) (SuspendCost, error) {
	c := SuspendCost{Level: sb.Level(), Interpreter: interpreter, Runs: runs}
	ser, ok := sb.(moat.Sessioner)
	res, rok := sb.(moat.Resumer)
	if !ok || !rok || runs <= 0 {
		return c, fmt.Errorf("bench: %s has no sessions to resume, or runs=%d: %w", sb.Level(), runs, moat.ErrInvalid)
	}
	parent, err := os.MkdirTemp("", "moat-bench-suspend-")
	if err != nil {
		return c, fmt.Errorf("bench: %w", err)
	}
	defer os.RemoveAll(parent)
	data := make([]byte, SuspendFileSize)
	rng := rand.NewChaCha8([32]byte{'m', 'o', 'a', 't'}) // incompressible, the same every time
	rng.Read(data)
	var suspend, resume, fresh []time.Duration
	var state, disk, running, suspended []int64
	memory := true
	for i := 0; i < runs; i++ {
		m, err := suspendOnce(ctx, ser, res, interpreter, data, filepath.Join(parent, strconv.Itoa(i)), i%2 == 1)
		if err != nil {
			return c, fmt.Errorf("bench: %s: suspend run %d of %d: %w", sb.Level(), i+1, runs, err)
		}
		memory = memory && m.info.Memory
		suspend, resume, fresh = append(suspend, m.suspend), append(resume, m.resume), append(fresh, m.fresh)
		state, disk = append(state, m.info.Bytes), append(disk, m.disk)
		running, suspended = append(running, m.running), append(suspended, m.suspended)
	}
	c.Memory = memory
	c.Suspend, c.Resume, c.Fresh = summarize(suspend).Median, summarize(resume).Median, summarize(fresh).Median
	if c.Fresh > 0 {
		c.Ratio = float64(c.Resume) / float64(c.Fresh)
	}
	c.StateBytes, c.DiskBytes = medianInt(state), medianInt(disk)
	c.RunningHost, c.SuspendedHost = medianInt(running), medianInt(suspended)
	return c, nil
}

// oneSuspend is what one suspend run measured.
type oneSuspend struct {
	info                   moat.SuspendInfo
	suspend, resume, fresh time.Duration
	disk                   int64
	running, suspended     int64
}

// suspendVar is the variable an interpreter session holds across a suspend.
const suspendVar = "moat_kept"

func suspendOnce(ctx context.Context, ser moat.Sessioner, res moat.Resumer, interpreter bool, data []byte, dir string, freshFirst bool) (m oneSuspend, err error) {
	opts := moat.SessionOptions{Interpreter: interpreter}
	timeFresh := func() error {
		start := time.Now()
		s, err := ser.NewSession(ctx, opts)
		if err != nil {
			return fmt.Errorf("a fresh session: %w", err)
		}
		defer s.Close()
		if err := runWants(ctx, s, Code, Want); err != nil {
			return fmt.Errorf("a fresh session: %w", err)
		}
		m.fresh = time.Since(start)
		return nil
	}
	if freshFirst {
		if err := timeFresh(); err != nil {
			return m, err
		}
	}
	before, err := usedMemory()
	if err != nil {
		return m, err
	}
	s, err := ser.NewSession(ctx, opts)
	if err != nil {
		return m, err
	}
	defer func() {
		if s != nil {
			s.Close()
		}
	}()
	sus, ok := s.(moat.Suspender)
	if !ok {
		return m, fmt.Errorf("its sessions do not suspend: %w", moat.ErrInvalid)
	}
	if err := s.WriteFile(ctx, "data.bin", bytes.NewReader(data)); err != nil {
		return m, err
	}
	setup := "print('ok')"
	if interpreter {
		setup = suspendVar + " = 'kept'\nprint('ok')"
	}
	if err := runWants(ctx, s, setup, "ok\n"); err != nil {
		return m, err
	}
	if m.running, err = usedAfterSettle(ctx, before); err != nil {
		return m, err
	}
	start := time.Now()
	m.info, err = sus.Suspend(ctx, dir)
	if err != nil {
		return m, err
	}
	m.suspend = time.Since(start)
	s = nil // closed by Suspend
	defer os.RemoveAll(dir)
	if m.disk, err = diskUsage(dir); err != nil {
		return m, err
	}
	if m.suspended, err = usedAfterSettle(ctx, before); err != nil {
		return m, err
	}
	code := "import os\nprint(os.path.getsize('data.bin'))"
	want := strconv.Itoa(len(data)) + "\n"
	if interpreter && m.info.Memory {
		code += "\nprint(" + suspendVar + ")"
		want += "kept\n"
	}
	start = time.Now()
	rs, _, err := res.ResumeSession(ctx, dir)
	if err != nil {
		return m, err
	}
	defer rs.Close()
	if err := runWants(ctx, rs, code, want); err != nil {
		return m, fmt.Errorf("the resumed session: %w", err)
	}
	m.resume = time.Since(start)
	rs.Close()
	if !freshFirst {
		if err := timeFresh(); err != nil {
			return m, err
		}
	}
	return m, nil
}

// runWants runs code in s and checks its result: exit 0 and stdout want.
func runWants(ctx context.Context, s moat.Session, code, want string) error {
	r, err := s.Run(ctx, moat.Request{Code: []byte(code)})
	if err != nil {
		return err
	}
	if r.ExitCode != 0 || string(r.Stdout) != want {
		return fmt.Errorf("a run printed %q (exit %d, stderr %q), want %q", r.Stdout, r.ExitCode, truncate(r.Stderr), want)
	}
	return nil
}

func truncate(b []byte) []byte {
	if len(b) > 200 {
		return b[:200]
	}
	return b
}

// usedAfterSettle waits for settle and returns the growth of the host's
// used memory since before.
func usedAfterSettle(ctx context.Context, before int64) (int64, error) {
	select {
	case <-time.After(settle):
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	after, err := usedMemory()
	return after - before, err
}

// diskUsage is what the tree at root holds on disk: the allocated blocks
// of its files and directories, each inode once, as du counts.
func diskUsage(root string) (int64, error) {
	seen := map[uint64]bool{}
	var total int64
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		st, ok := fi.Sys().(*syscall.Stat_t)
		if !ok {
			return errors.New("no stat_t")
		}
		if !seen[st.Ino] {
			seen[st.Ino] = true
			total += st.Blocks * 512
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("bench: du %s: %w", root, err)
	}
	return total, nil
}

// medianInt is the median of v (the mean of the middle two for an even
// count), or 0 when v is empty.
func medianInt(v []int64) int64 {
	n := len(v)
	if n == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if n%2 == 0 {
		return s[n/2-1] + (s[n/2]-s[n/2-1])/2
	}
	return s[n/2]
}
