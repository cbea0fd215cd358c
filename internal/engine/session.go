package engine

import (
	"context"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
)

// NewSession makes a session at the backend's level; see moat.Sessioner.
// It fails with an error wrapping moat.ErrUnavailable when the backend
// keeps no sessions.
func (s *Sandbox) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	sb, ok := s.b.(SessionBackend)
	if !ok {
		return nil, &moat.UnavailableError{Level: s.cfg.Level, Reason: "this level keeps no sessions"}
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("%s: %w", s.cfg.Level, moat.ErrClosed)
	}
	s.runs.Add(1) // Close waits for the creation, not for the session
	s.mu.Unlock()
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	inst, err := sb.NewSession(ctx, opts)
	if err != nil {
		return nil, s.setupError(ctx, err)
	}
	return &Session{s: s, inst: inst, sem: make(chan struct{}, 1)}, nil
}

// Session is a moat.Session over a SessionInstance: the engine serializes
// its runs, runs each through the one lifecycle, checks file names, and
// closes the instance once.
type Session struct {
	s    *Sandbox
	inst SessionInstance
	sem  chan struct{} // held by the run in progress

	mu     sync.Mutex
	closed bool
	spent  bool
	files  sync.WaitGroup // file operations in progress
}

var _ moat.Session = (*Session)(nil)

// Instance returns the backend's instance under ss.
func (ss *Session) Instance() SessionInstance { return ss.inst }

func (ss *Session) errClosed() error {
	return fmt.Errorf("%s: session: %w", ss.s.cfg.Level, moat.ErrClosed)
}

// Run runs req in the session, after its previous run has ended; see
// moat.Session.
func (ss *Session) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	if err := ss.s.checkCode(req.Code); err != nil {
		return nil, err
	}
	select {
	case ss.sem <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-ss.sem }()
	ss.mu.Lock()
	closed, spent := ss.closed, ss.spent
	ss.mu.Unlock()
	switch {
	case closed:
		return nil, ss.errClosed()
	case spent:
		return nil, fmt.Errorf("%s: session: its CPU budget is used up; its files can still be read: %w", ss.s.cfg.Level, moat.ErrSpent)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	start := time.Now()
	release, err := ss.s.slot(ctx)
	if err != nil {
		return nil, err
	}
	defer release()
	var ev Evidence
	res, err := ss.s.runIn(ctx, func(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error) {
		p, err := ss.inst.Start(ctx, code, stdout, stderr)
		if err != nil {
			return nil, err
		}
		return &spy{Process: p, ev: &ev}, nil
	}, req, start)
	if ev.Spent {
		ss.mu.Lock()
		ss.spent = true
		ss.mu.Unlock()
	}
	if err != nil {
		return nil, err
	}
	res.Duration = time.Since(start)
	return res, nil
}

// spy keeps a copy of the evidence for the session.
type spy struct {
	Process
	ev *Evidence
}

// End passes the engine's reason on to the backend's process; see Ender.
func (p *spy) End(why moat.Reason) { end(p.Process, why) }

func (p *spy) Wait() (Evidence, error) {
	ev, err := p.Process.Wait()
	*p.ev = ev
	return ev, err
}

// Close kills what still runs of the session and removes it. Calls after
// the first return nil.
func (ss *Session) Close() error {
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil
	}
	ss.closed = true
	ss.mu.Unlock()
	// A run in progress ends with the instance; its Run then returns.
	err := ss.inst.Close()
	// Wait for the run in progress to return; runs still waiting find the
	// session closed.
	ss.sem <- struct{}{}
	<-ss.sem
	ss.files.Wait()
	return err
}

// enterFiles counts a file operation in, unless the session is closed.
func (ss *Session) enterFiles() error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return ss.errClosed()
	}
	ss.files.Add(1)
	return nil
}

// CleanName checks a session file name: relative, slash-separated, no
// empty, "." or ".." element, no NUL, at most 4096 bytes. The error wraps
// moat.ErrInvalid.
func CleanName(level moat.Level, name string) (string, error) {
	if name == "" || name == "." || len(name) > 4096 || !fs.ValidPath(name) || strings.ContainsRune(name, 0) || strings.Contains(name, `\`) {
		return "", fmt.Errorf("%s: file name %q must be a relative slash-separated path without \".\" or \"..\" elements: %w", level, name, moat.ErrInvalid)
	}
	return name, nil
}

func (ss *Session) file(name string) (string, error) { return CleanName(ss.s.cfg.Level, name) }

// WriteFile: see moat.Files.
func (ss *Session) WriteFile(ctx context.Context, name string, r io.Reader) error {
	name, err := ss.file(name)
	if err != nil {
		return err
	}
	if err := ss.enterFiles(); err != nil {
		return err
	}
	defer ss.files.Done()
	return ss.inst.WriteFile(ctx, name, r)
}

// ReadFile: see moat.Files.
func (ss *Session) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	name, err := ss.file(name)
	if err != nil {
		return nil, err
	}
	if err := ss.enterFiles(); err != nil {
		return nil, err
	}
	defer ss.files.Done()
	return ss.inst.ReadFile(ctx, name)
}

// ListFiles: see moat.Files.
func (ss *Session) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	if err := ss.enterFiles(); err != nil {
		return nil, err
	}
	defer ss.files.Done()
	return ss.inst.ListFiles(ctx)
}

// Stat: see moat.Files.
func (ss *Session) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	name, err := ss.file(name)
	if err != nil {
		return moat.FileInfo{}, err
	}
	if err := ss.enterFiles(); err != nil {
		return moat.FileInfo{}, err
	}
	defer ss.files.Done()
	return ss.inst.Stat(ctx, name)
}

// Mkdir: see moat.Files.
func (ss *Session) Mkdir(ctx context.Context, name string) error {
	name, err := ss.file(name)
	if err != nil {
		return err
	}
	if err := ss.enterFiles(); err != nil {
		return err
	}
	defer ss.files.Done()
	return ss.inst.Mkdir(ctx, name)
}

// Rename: see moat.Files.
func (ss *Session) Rename(ctx context.Context, from, to string) error {
	from, err := ss.file(from)
	if err != nil {
		return err
	}
	if to, err = ss.file(to); err != nil {
		return err
	}
	if err := ss.enterFiles(); err != nil {
		return err
	}
	defer ss.files.Done()
	return ss.inst.Rename(ctx, from, to)
}

// RemoveFile: see moat.Files.
func (ss *Session) RemoveFile(ctx context.Context, name string) error {
	name, err := ss.file(name)
	if err != nil {
		return err
	}
	if err := ss.enterFiles(); err != nil {
		return err
	}
	defer ss.files.Done()
	return ss.inst.RemoveFile(ctx, name)
}
