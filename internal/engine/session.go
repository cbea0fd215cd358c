package engine

import (
	"context"
	"errors"
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
	if s.cfg.RefillAfterRun {
		// The backend may have taken a pooled instance (TakeReady): its
		// replacement is prepared now that the creation is over, as after
		// a run.
		s.pool.poke()
	}
	if err != nil {
		return nil, s.setupError(ctx, err)
	}
	return &Session{s: s, inst: inst, opts: opts, sem: make(chan struct{}, 1)}, nil
}

// Session is a moat.Session over a SessionInstance: the engine serializes
// its runs, runs each through the one lifecycle, checks file names, and
// closes the instance once, after everything that used it has ended.
type Session struct {
	s    *Sandbox
	inst SessionInstance
	opts moat.SessionOptions
	sem  chan struct{} // held by the run in progress

	mu     sync.Mutex
	closed bool
	spent  bool
	saved  bool             // the instance ended in StateSaver.SaveState
	ops    map[*op]struct{} // the run, file operations and open readers in progress
	busy   sync.WaitGroup   // counts the ops
}

var (
	_ moat.Session      = (*Session)(nil)
	_ moat.Suspender    = (*Session)(nil)
	_ moat.Resumer      = (*Sandbox)(nil)
	_ moat.MemoryKeeper = (*Sandbox)(nil)
)

// op is one use of the instance in progress: a run, a file operation, or a
// reader ReadFile returned. Its context is the caller's, ended as well when
// the session closes.
type op struct {
	cancel context.CancelCauseFunc
	r      *reader // set once ReadFile has returned it
}

// Instance returns the backend's instance under ss.
func (ss *Session) Instance() SessionInstance { return ss.inst }

func (ss *Session) errClosed() error {
	return fmt.Errorf("%s: session: %w", ss.s.cfg.Level, moat.ErrClosed)
}

// enter counts a use of the instance in, unless the session is closed. The
// use runs under the returned context, which Close ends; the caller calls
// leave when the use has ended.
func (ss *Session) enter(ctx context.Context) (context.Context, *op, error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return nil, nil, ss.errClosed()
	}
	ctx, cancel := context.WithCancelCause(ctx)
	o := &op{cancel: cancel}
	if ss.ops == nil {
		ss.ops = map[*op]struct{}{}
	}
	ss.ops[o] = struct{}{}
	ss.busy.Add(1)
	return ctx, o, nil
}

func (ss *Session) leave(o *op) {
	ss.mu.Lock()
	delete(ss.ops, o)
	ss.mu.Unlock()
	o.cancel(nil)
	ss.busy.Done()
}

// ended is err, or the session's ErrClosed when Close ended the use whose
// context is ctx.
func (ss *Session) ended(ctx context.Context, err error) error {
	if err != nil && ctx.Err() != nil {
		if cause := context.Cause(ctx); errors.Is(cause, moat.ErrClosed) {
			return cause
		}
	}
	return err
}

// Run runs req in the session, after its previous run has ended; see
// moat.Session. A run that Close ends reports reason canceled.
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
	ctx, o, err := ss.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer ss.leave(o)
	ss.mu.Lock()
	spent := ss.spent
	ss.mu.Unlock()
	if spent {
		return nil, fmt.Errorf("%s: session: its CPU budget is used up; its files can still be read: %w", ss.s.cfg.Level, moat.ErrSpent)
	}
	if err := ctx.Err(); err != nil {
		return nil, ss.ended(ctx, err)
	}
	start := time.Now()
	release, err := ss.s.slot(ctx, false)
	if err != nil {
		return nil, ss.ended(ctx, err)
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
		return nil, ss.ended(ctx, err)
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

// Close ends what still uses the session's instance, then closes it: the
// run in progress is killed as a cancellation would (its Run reports
// reason canceled), the file operations in progress and those waiting fail
// with moat.ErrClosed, and so does every later Read of a reader ReadFile
// returned. Calls after the first return nil.
func (ss *Session) Close() error {
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil
	}
	ss.closed = true
	var ops []*op
	var readers []*reader
	for o := range ss.ops {
		ops = append(ops, o)
		if o.r != nil {
			readers = append(readers, o.r)
		}
	}
	ss.mu.Unlock()
	cause := ss.errClosed()
	for _, o := range ops {
		o.cancel(cause)
	}
	for _, r := range readers {
		r.close(cause)
	}
	// The instance is closed once nothing uses it: SessionInstance's
	// contract.
	ss.busy.Wait()
	ss.mu.Lock()
	saved := ss.saved
	ss.mu.Unlock()
	if saved {
		return nil
	}
	return ss.inst.Close()
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

// use runs one file operation on the instance, unless the session is closed.
func (ss *Session) use(ctx context.Context, f func(ctx context.Context) error) error {
	ctx, o, err := ss.enter(ctx)
	if err != nil {
		return err
	}
	defer ss.leave(o)
	return ss.ended(ctx, f(ctx))
}

// WriteFile: see moat.Files.
func (ss *Session) WriteFile(ctx context.Context, name string, r io.Reader) error {
	name, err := ss.file(name)
	if err != nil {
		return err
	}
	return ss.use(ctx, func(ctx context.Context) error { return ss.inst.WriteFile(ctx, name, r) })
}

// ReadFile: see moat.Files. The reader counts as a use of the instance
// until it is closed; the session's Close closes it.
func (ss *Session) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	name, err := ss.file(name)
	if err != nil {
		return nil, err
	}
	ctx, o, err := ss.enter(ctx)
	if err != nil {
		return nil, err
	}
	rc, err := ss.inst.ReadFile(ctx, name)
	if err != nil {
		ss.leave(o)
		return nil, ss.ended(ctx, err)
	}
	r := &reader{ss: ss, o: o, ctx: ctx, rc: rc}
	ss.mu.Lock()
	closed := ss.closed
	o.r = r
	ss.mu.Unlock()
	if closed {
		// Close began while the instance opened it, and did not see it.
		r.close(ss.errClosed())
		return nil, ss.errClosed()
	}
	return r, nil
}

// reader is a reader of the instance's, ended by the session's Close.
type reader struct {
	ss  *Session
	o   *op
	ctx context.Context
	mu  sync.Mutex // held by Read and by close
	rc  io.ReadCloser
	err error // once closed: what Read returns
}

func (r *reader) Read(p []byte) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return 0, r.err
	}
	n, err := r.rc.Read(p)
	if err != nil && err != io.EOF {
		err = r.ss.ended(r.ctx, err)
	}
	return n, err
}

// Close closes the instance's reader and ends a Read in progress.
func (r *reader) Close() error {
	return r.close(fmt.Errorf("%s: session: read: %w", r.ss.s.cfg.Level, fs.ErrClosed))
}

// close ends the reader for why: its context first, so that a Read in
// progress returns, then the instance's reader.
func (r *reader) close(why error) error {
	r.o.cancel(why)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.err != nil {
		return nil
	}
	r.err = why
	err := r.rc.Close()
	r.ss.leave(r.o)
	return err
}

// ListFiles: see moat.Files.
func (ss *Session) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	var list []moat.FileInfo
	err := ss.use(ctx, func(ctx context.Context) (err error) {
		list, err = ss.inst.ListFiles(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return list, nil
}

// Stat: see moat.Files.
func (ss *Session) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	name, err := ss.file(name)
	if err != nil {
		return moat.FileInfo{}, err
	}
	var fi moat.FileInfo
	err = ss.use(ctx, func(ctx context.Context) (err error) {
		fi, err = ss.inst.Stat(ctx, name)
		return err
	})
	if err != nil {
		return moat.FileInfo{}, err
	}
	return fi, nil
}

// Mkdir: see moat.Files.
func (ss *Session) Mkdir(ctx context.Context, name string) error {
	name, err := ss.file(name)
	if err != nil {
		return err
	}
	return ss.use(ctx, func(ctx context.Context) error { return ss.inst.Mkdir(ctx, name) })
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
	return ss.use(ctx, func(ctx context.Context) error { return ss.inst.Rename(ctx, from, to) })
}

// RemoveFile: see moat.Files.
func (ss *Session) RemoveFile(ctx context.Context, name string) error {
	name, err := ss.file(name)
	if err != nil {
		return err
	}
	return ss.use(ctx, func(ctx context.Context) error { return ss.inst.RemoveFile(ctx, name) })
}
