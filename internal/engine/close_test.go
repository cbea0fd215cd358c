package engine

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// strictSessions is a session backend that checks the engine keeps the
// SessionInstance contract: Close comes once, after every run, file
// operation and reader has ended, and nothing is called after it. Its runs
// and file operations block until their context ends or the instance is
// closed, as a real level's do.
type strictSessions struct{ fake }

type strictSession struct {
	t      *testing.T
	mu     sync.Mutex
	busy   int           // runs, file operations and open readers
	closed chan struct{} // closed by Close
	starts int
}

func (b *strictSessions) NewSession(context.Context, moat.SessionOptions) (SessionInstance, error) {
	return &strictSession{closed: make(chan struct{})}, nil
}

// in counts one use in, and fails the test if the instance is closed.
func (f *strictSession) in(what string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	select {
	case <-f.closed:
		f.t.Errorf("%s after the instance's Close", what)
	default:
	}
	f.busy++
}

func (f *strictSession) out() {
	f.mu.Lock()
	f.busy--
	f.mu.Unlock()
}

// block waits for ctx or the instance's Close, whichever comes first.
func (f *strictSession) block(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-f.closed:
		return errors.New("strict: the instance was closed under the operation")
	}
}

func (f *strictSession) Close() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.busy != 0 {
		f.t.Errorf("the instance's Close with %d runs, file operations or readers still in progress", f.busy)
	}
	select {
	case <-f.closed:
		f.t.Error("the instance's Close called twice")
	default:
		close(f.closed)
	}
	return nil
}

func (f *strictSession) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error) {
	f.in("Start")
	f.mu.Lock()
	f.starts++
	f.mu.Unlock()
	p := &strictProc{f: f, killed: make(chan struct{})}
	return p, nil
}

type strictProc struct {
	f      *strictSession
	once   sync.Once
	killed chan struct{}
}

func (p *strictProc) Kill() { p.once.Do(func() { close(p.killed) }) }

func (p *strictProc) Wait() (Evidence, error) {
	defer p.f.out()
	select {
	case <-p.killed:
		return Evidence{}, nil
	case <-p.f.closed:
		return Evidence{}, errors.New("strict: the instance was closed under the run")
	}
}

func (f *strictSession) WriteFile(ctx context.Context, name string, r io.Reader) error {
	f.in("WriteFile")
	defer f.out()
	return f.block(ctx)
}

func (f *strictSession) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	f.in("ReadFile")
	if name == "block" {
		defer f.out()
		return nil, f.block(ctx)
	}
	return &strictReader{f: f, ctx: ctx, slow: name == "slow"}, nil
}

// strictReader gives "x" forever, until closed or its context ends; a slow
// one gives nothing and blocks until its context ends, as a reader of an
// instance that stopped sending does.
type strictReader struct {
	f      *strictSession
	ctx    context.Context
	slow   bool
	closed bool
}

func (r *strictReader) Read(p []byte) (int, error) {
	if r.closed {
		return 0, errors.New("strict: Read after Close")
	}
	select {
	case <-r.f.closed:
		r.f.t.Error("a reader read after the instance's Close")
		return 0, errors.New("strict: the instance is closed")
	default:
	}
	if r.slow {
		<-r.ctx.Done()
	}
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	if len(p) == 0 {
		return 0, nil
	}
	p[0] = 'x'
	return 1, nil
}

func (r *strictReader) Close() error {
	if !r.closed {
		r.closed = true
		r.f.out()
	}
	return nil
}

func (f *strictSession) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	f.in("ListFiles")
	defer f.out()
	return nil, f.block(ctx)
}
func (f *strictSession) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	f.in("Stat")
	defer f.out()
	return moat.FileInfo{}, f.block(ctx)
}
func (f *strictSession) Mkdir(ctx context.Context, name string) error {
	f.in("Mkdir")
	defer f.out()
	return f.block(ctx)
}
func (f *strictSession) Rename(ctx context.Context, from, to string) error {
	f.in("Rename")
	defer f.out()
	return f.block(ctx)
}
func (f *strictSession) RemoveFile(ctx context.Context, name string) error {
	f.in("RemoveFile")
	defer f.out()
	return f.block(ctx)
}

func newStrict(t *testing.T, cfg Config) (*Sandbox, *Session, *strictSession) {
	t.Helper()
	cfg.Level = moat.LevelContainer
	cfg.Warm = -1
	s, err := New(cfg, &strictSessions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ms, err := s.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ss := ms.(*Session)
	inst := ss.Instance().(*strictSession)
	inst.t = t
	return s, ss, inst
}

// within runs f and fails the test if it has not returned in d.
func within(t *testing.T, d time.Duration, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s did not return within %v", what, d)
	}
}

// TestSessionCloseEndsWhatRunsFirst: a session's Close ends the run and the
// file operations in progress and closes the readers ReadFile returned
// before it closes the instance; the run reports canceled, the operations
// and later reads fail with moat.ErrClosed.
func TestSessionCloseEndsWhatRunsFirst(t *testing.T) {
	_, ss, inst := newStrict(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}})
	ctx := context.Background()
	rc, err := ss.ReadFile(ctx, "r")
	if err != nil {
		t.Fatal(err)
	}
	if n, err := rc.Read(make([]byte, 4)); n != 1 || err != nil {
		t.Fatalf("Read before Close = %d, %v", n, err)
	}
	type outcome struct {
		res *moat.Result
		err error
	}
	run := make(chan outcome, 1)
	go func() {
		res, err := ss.Run(ctx, moat.Request{Code: []byte("x")})
		run <- outcome{res, err}
	}()
	ops := map[string]func() error{
		"WriteFile":  func() error { return ss.WriteFile(ctx, "w", strings.NewReader("x")) },
		"ReadFile":   func() error { _, err := ss.ReadFile(ctx, "block"); return err },
		"ListFiles":  func() error { _, err := ss.ListFiles(ctx); return err },
		"Stat":       func() error { _, err := ss.Stat(ctx, "s"); return err },
		"Mkdir":      func() error { return ss.Mkdir(ctx, "d") },
		"Rename":     func() error { return ss.Rename(ctx, "a", "b") },
		"RemoveFile": func() error { return ss.RemoveFile(ctx, "f") },
	}
	errs := make(map[string]chan error)
	for name, op := range ops {
		c := make(chan error, 1)
		errs[name] = c
		go func() { c <- op() }()
	}
	waitFor(t, func() bool {
		inst.mu.Lock()
		defer inst.mu.Unlock()
		return inst.busy == 2+len(ops) // the run, the reader, the operations
	})
	within(t, 10*time.Second, "the session's Close", func() {
		if err := ss.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	o := <-run
	if o.err != nil || o.res.Reason != moat.ReasonCanceled || o.res.ExitCode != 137 {
		t.Errorf("the run Close ended: %+v, %v; want a Result with reason canceled", o.res, o.err)
	}
	for name, c := range errs {
		if err := <-c; !errors.Is(err, moat.ErrClosed) {
			t.Errorf("%s in progress at Close = %v, want an error wrapping moat.ErrClosed", name, err)
		}
	}
	if _, err := rc.Read(make([]byte, 4)); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Read of a reader after the session's Close = %v, want an error wrapping moat.ErrClosed", err)
	}
	if err := rc.Close(); err != nil {
		t.Errorf("the reader's Close after the session's: %v", err)
	}
}

// TestSessionCloseWhileARunWaitsForASlot: a session run waiting for one of
// the sandbox's MaxRuns slots when its session closes fails with
// moat.ErrClosed and never starts; Close does not wait for the slot.
func TestSessionCloseWhileARunWaitsForASlot(t *testing.T) {
	s, ss, inst := newStrict(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}, MaxRuns: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	other, err := s.NewSession(ctx, moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	other.(*Session).Instance().(*strictSession).t = t
	defer other.Close()
	go other.Run(ctx, moat.Request{Code: []byte("x")}) // takes the one slot
	waitFor(t, func() bool { return len(s.slots) == 1 })
	run := make(chan error, 1)
	go func() { _, err := ss.Run(context.Background(), moat.Request{Code: []byte("x")}); run <- err }()
	time.Sleep(50 * time.Millisecond) // the run waits for the slot
	within(t, 10*time.Second, "the session's Close", func() { ss.Close() })
	var rerr error
	within(t, 10*time.Second, "the run waiting for a slot", func() { rerr = <-run })
	if !errors.Is(rerr, moat.ErrClosed) {
		t.Errorf("the run waiting for a slot at Close = %v, want an error wrapping moat.ErrClosed", rerr)
	}
	cancel()
	inst.mu.Lock()
	defer inst.mu.Unlock()
	if inst.starts != 0 {
		t.Errorf("the closed session's instance saw %d Starts, want none", inst.starts)
	}
}

// TestReaderCloseUnblocksRead: closing a reader from another goroutine ends
// a Read in progress, as closing an os.File does, even when the instance's
// reader only watches its context.
func TestReaderCloseUnblocksRead(t *testing.T) {
	_, ss, _ := newStrict(t, Config{})
	ctx := context.Background()
	rc, err := ss.ReadFile(ctx, "slow")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := io.Copy(io.Discard, rc); done <- err }()
	time.Sleep(20 * time.Millisecond)
	within(t, 10*time.Second, "the reader's Close", func() { rc.Close() })
	within(t, 10*time.Second, "the Read in progress", func() { <-done })
	within(t, 10*time.Second, "the session's Close", func() { ss.Close() })
}
