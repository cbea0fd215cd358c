// Package uidpool hands out unprivileged uids from a range, one per
// concurrent sandbox run, so that per-uid limits (RLIMIT_NPROC) and file
// permissions separate runs from each other and from the host's users.
//
// A uid is held by an flock(2) on a file named after it in a lock
// directory, so separate moat processes on one machine never hand out the
// same uid at once, and a uid held by a process that died is free again.
package uidpool

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// Pool hands out uids in [First, First+Count). Its methods are safe for
// concurrent use.
type Pool struct {
	first, count int
	dir          string
}

// HostDir is the lock directory every pool of a root moat uses, whatever
// its level or run directory: one lock file per uid for the whole host, so
// that two moat processes configured with different run directories (or
// levels with overlapping ranges) never lease the same uid at once.
const HostDir = "/run/moat/uids"

// New returns a pool over [first, first+count), locked through files in dir
// (created 0700 if missing). A root moat passes HostDir.
func New(first, count int, dir string) (*Pool, error) {
	if first <= 0 || count <= 0 || first+count > 1<<31 {
		return nil, fmt.Errorf("uidpool: bad range %d+%d", first, count)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("uidpool: %w", err)
	}
	return &Pool{first: first, count: count, dir: dir}, nil
}

// Lease is one uid held until Release.
type Lease struct {
	UID int
	f   *os.File
}

// ErrExhausted means every uid in the range is in use.
var ErrExhausted = errors.New("uidpool: every uid in the range is in use")

// Acquire returns a free uid. It starts at a random point of the range, so
// concurrent callers rarely contend for the same lock.
func (p *Pool) Acquire() (*Lease, error) {
	start := rand.IntN(p.count)
	for i := 0; i < p.count; i++ {
		uid := p.first + (start+i)%p.count
		path := filepath.Join(p.dir, strconv.Itoa(uid))
		f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|syscall.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("uidpool: %w", err)
		}
		err = syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return &Lease{UID: uid, f: f}, nil
		}
		f.Close()
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("uidpool: lock %s: %w", path, err)
		}
	}
	return nil, ErrExhausted
}

// Release frees the uid. It is safe to call more than once.
func (l *Lease) Release() {
	if l.f != nil {
		l.f.Close()
		l.f = nil
	}
}
