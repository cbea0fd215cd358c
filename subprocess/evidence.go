package subprocess

import (
	"bytes"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/engine"
)

// The evidence of a run's end, all of it from the host side: the helper's
// report (the wait status of python3, which the helper, outside the code's
// reach, took from the kernel), the run's cgroup (its OOM kill and pids-max
// counters, its CPU account through the watch), the files of its working
// directory at the size limit and the tmpfs's free space. The engine turns
// it into the verdict (engine.Judge); this package chooses no reason.

// evidence reads how p's run ended, once its helper has exited with waitErr
// and reported status. An error means the sandbox failed: the helper's
// set-up did, or it ended without a report that nothing explains.
func (p *process) evidence(waitErr error, status []byte) (engine.Evidence, error) {
	lim := p.b.limits
	st, reported := parseStatus(status)
	if reported && st.err != "" {
		return engine.Evidence{}, fmt.Errorf("subprocess: sandbox set-up failed, nothing ran: %s: %w", st.err, moat.ErrUnavailable)
	}
	var events cgroup.Events
	if p.group != nil {
		// The helper killed and reaped every other process of the run
		// before its report, or the namespace went with the helper; this
		// only makes sure. A helper that reported is spared: its exit is
		// its owner's to wait for (reap).
		kill := p.group.Kill
		if p.reported.Load() {
			kill = func() error { return p.group.KillBut(p.h.cmd.Process.Pid) }
		}
		if err := kill(); err != nil {
			return engine.Evidence{}, fmt.Errorf("subprocess: %w", err)
		}
		events = p.group.Events()
	}
	ev := engine.Evidence{
		CPUTime: p.cpuOver.Load(),
		// RLIMIT_AS shows as a MemoryError at the end (tutorial hardening
		// only, where nothing of the host side sees memory; the code
		// could print it).
		Memory:   events.OOMKill || (!p.b.strict && memoryErrorAtEnd(p.stderrTail.Bytes())),
		Pids:     events.PidsMax,
		FileSize: fileAtLimit(p.dir, lim.FileSize, p.atStart),
		Disk:     p.mounted && diskFull(p.dir),
	}
	switch {
	case reported && st.exited:
		ev.Exited, ev.Status = true, engine.Exit(st.code)
	case reported && st.signaled:
		ev.Exited, ev.Status = true, engine.Signaled(st.signal)
		// RLIMIT_CPU's hard limit, a second past its SIGXCPU; or its soft
		// limit's SIGXCPU, when python3's usage (the reaper's rusage, out
		// of the code's reach) shows it, since the code can send itself
		// the signal.
		used := time.Duration(st.cpuMS) * time.Millisecond
		ev.CPUTime = ev.CPUTime || (st.signal == syscall.SIGKILL && st.cpuMS >= time.Duration(lim.CPUTime).Milliseconds()) ||
			engine.XCPUAtLimit(ev.Status, used, time.Duration(lim.CPUTime), engine.XCPUSlack)
	case p.cpuOver.Load(), p.killed.Load(), events.OOMKill:
		// The helper was killed before python3 ended: by the CPU watch,
		// by the engine, or by the kernel's OOM killer (the helper is in
		// the run's memory cgroup). Not Exited: the verdict is SIGKILL.
	default:
		return engine.Evidence{}, fmt.Errorf("subprocess: helper ended without a report: %v: %s: %w", waitErr, tail(p.stderrTail.Bytes(), 512), moat.ErrUnavailable)
	}
	return ev, nil
}

// memoryErrorAtEnd reports whether Python ended on a MemoryError, which is
// how RLIMIT_AS shows (tutorial hardening only; the code could print it).
func memoryErrorAtEnd(stderr []byte) bool {
	lines := bytes.Split(bytes.TrimRight(stderr, "\n"), []byte("\n"))
	return len(lines) > 0 && bytes.HasPrefix(lines[len(lines)-1], []byte("MemoryError"))
}

// fileAtLimit reports whether the run wrote a file that reached the file
// size limit: the host-side trace of RLIMIT_FSIZE (Python ignores SIGXFSZ
// and gets EFBIG instead). Only what this run wrote counts: a session's
// earlier files may sit at the limit legitimately, so a file that was at the
// limit when the run began (atStart) counts only if it changed since.
//
// The test is against the files' own earlier stamps, not against the host's
// clock: file times come from the kernel's coarse clock, which lags
// time.Now by up to a tick (4 ms here), so a file written at once after a
// run's start would look older than the run. Since Linux 6.13 (multigrain
// timestamps, tmpfs included) a change after the stat that took the stamp
// always gets a new time; on older kernels a rewrite to the same size in the
// same tick as the run's start is missed.
func fileAtLimit(dir string, limit moat.Bytes, atStart map[fileKey]fileStamp) bool {
	found := false
	walkAtLimit(dir, int64(limit), func(k fileKey, st fileStamp) bool {
		if old, ok := atStart[k]; !ok || old != st {
			found = true
		}
		return !found
	})
	return found
}

// fileKey names a file by its inode; fileStamp is what a write changes.
type (
	fileKey   struct{ dev, ino uint64 }
	fileStamp struct {
		size         int64
		mtime, ctime syscall.Timespec
	}
)

// filesAtLimit returns the files under dir at or past the file size limit.
func filesAtLimit(dir string, limit moat.Bytes) map[fileKey]fileStamp {
	m := map[fileKey]fileStamp{}
	walkAtLimit(dir, int64(limit), func(k fileKey, st fileStamp) bool {
		m[k] = st
		return true
	})
	return m
}

// walkAtLimit calls fn for each regular file under dir at or past the file
// size limit, without following symbolic links, until fn returns false.
func walkAtLimit(dir string, limit int64, fn func(fileKey, fileStamp) bool) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return filepath.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		info, err := d.Info()
		if err != nil || info.Size() < limit {
			return nil
		}
		st, ok := info.Sys().(*syscall.Stat_t)
		if !ok {
			return nil
		}
		k := fileKey{uint64(st.Dev), st.Ino}
		if !fn(k, fileStamp{st.Size, st.Mtim, st.Ctim}) {
			return filepath.SkipAll
		}
		return nil
	})
}

// diskFull reports whether the working directory's tmpfs ran out of blocks
// or inodes.
func diskFull(dir string) bool {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false
	}
	return st.Bavail == 0 || st.Ffree == 0
}

// tailWriter keeps the last n bytes written to it.
type tailWriter struct {
	mu sync.Mutex
	n  int
	b  []byte
}

func (t *tailWriter) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if extra := len(t.b) - t.n; extra > 0 {
		t.b = t.b[:copy(t.b, t.b[extra:])]
	}
	return len(p), nil
}

// Bytes returns a copy of what is kept.
func (t *tailWriter) Bytes() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return bytes.Clone(t.b)
}

// tail returns the last n bytes of b, for error messages.
func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return strings.ToValidUTF8(string(bytes.TrimSpace(b)), "?")
}
