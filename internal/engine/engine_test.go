package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// fake is a backend whose instances run a Go function as "the code": the
// code names the behaviour, e.g. "exit 3", "sleep", "spew", "stale".
type fake struct {
	mu        sync.Mutex
	prepared  int
	discarded int
	live      int
	closed    bool
	failNext  error
}

type fakeInst struct {
	b    *fake
	once sync.Once
}

type fakeProc struct {
	kill   chan struct{}
	once   sync.Once
	done   chan Evidence
	err    error
	killed atomic.Bool
}

func (b *fake) Prepare(ctx context.Context) (Instance, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if err := b.failNext; err != nil {
		b.failNext = nil
		return nil, err
	}
	b.prepared++
	b.live++
	return &fakeInst{b: b}, nil
}

func (b *fake) Close() error {
	b.mu.Lock()
	b.closed = true
	b.mu.Unlock()
	return nil
}

func (b *fake) counts() (prepared, discarded, live int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.prepared, b.discarded, b.live
}

func (i *fakeInst) Discard() {
	i.once.Do(func() {
		i.b.mu.Lock()
		i.b.discarded++
		i.b.live--
		i.b.mu.Unlock()
	})
}

func (i *fakeInst) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error) {
	return startFake(ctx, string(code), stdout, stderr)
}

func startFake(ctx context.Context, code string, stdout, stderr io.Writer) (Process, error) {
	p := &fakeProc{kill: make(chan struct{}), done: make(chan Evidence, 1)}
	switch {
	case code == "stale":
		return nil, fmt.Errorf("fake: helper died: %w", ErrStale)
	case code == "fail start":
		return nil, errors.New("fake: could not start")
	case code == "spew at start":
		// Output past the cap before Start has returned.
		stdout.Write(bytes.Repeat([]byte("x"), 1<<20))
	}
	go func() {
		ev := Evidence{}
		switch {
		case strings.HasPrefix(code, "exit "):
			var n int
			fmt.Sscan(code[5:], &n)
			fmt.Fprintf(stdout, "out %d", n)
			fmt.Fprintf(stderr, "err %d", n)
			ev.Exited, ev.Status = true, Exit(n)
		case code == "sleep", code == "spew at start":
			<-p.kill
		case code == "spew":
			for {
				select {
				case <-p.kill:
					p.done <- ev
					return
				default:
				}
				stdout.Write([]byte("yyyyyyyy"))
			}
		case code == "no report":
			p.err = errors.New("fake: helper ended without a report")
		case code == "oom":
			ev.Memory = true
		case code == "note":
			ev.Exited, ev.Status = true, Exit(0)
			ev.Notes = []string{"a fact"}
		case code == "spend":
			ev.Exited, ev.Status = true, Exit(0)
			ev.Spent = true
		}
		p.done <- ev
	}()
	return p, nil
}

func (p *fakeProc) Kill() {
	p.killed.Store(true)
	p.once.Do(func() { close(p.kill) })
}

func (p *fakeProc) Wait() (Evidence, error) {
	ev := <-p.done
	return ev, p.err
}

func newFake(t *testing.T, cfg Config) (*Sandbox, *fake) {
	t.Helper()
	b := &fake{}
	if cfg.Level == "" {
		cfg.Level = moat.LevelSubprocess
	}
	s, err := New(cfg, b)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, b
}

func fast() moat.Limits {
	return moat.Limits{WallTime: moat.Duration(200 * time.Millisecond), Output: 1024}
}

func TestRunExitAndOutput(t *testing.T) {
	s, _ := newFake(t, Config{Limits: fast(), Notes: []string{"level note"}})
	var out bytes.Buffer
	res, err := s.Run(context.Background(), moat.Request{Code: []byte("exit 3"), Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 3 || res.Reason != "" || string(res.Stdout) != "out 3" || string(res.Stderr) != "err 3" || out.String() != "out 3" {
		t.Fatalf("result %+v, tee %q", res, out.String())
	}
	if res.Level != moat.LevelSubprocess || len(res.Notes) != 1 || res.Notes[0] != "level note" || res.Duration <= 0 {
		t.Fatalf("result %+v", res)
	}
}

func TestRunRefusals(t *testing.T) {
	s, _ := newFake(t, Config{Limits: moat.Limits{Disk: 4096}, MaxCode: 100})
	for _, code := range [][]byte{nil, {}, bytes.Repeat([]byte("x"), 101), bytes.Repeat([]byte("x"), 5000)} {
		if _, err := s.Run(context.Background(), moat.Request{Code: code}); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("code of %d bytes: %v, want ErrInvalid", len(code), err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Run(ctx, moat.Request{Code: []byte("exit 0")}); !errors.Is(err, context.Canceled) {
		t.Errorf("cancelled before the run: %v", err)
	}
	s.Close()
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); !errors.Is(err, moat.ErrClosed) {
		t.Errorf("after Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

func TestWallTimeKills(t *testing.T) {
	s, _ := newFake(t, Config{Limits: fast()})
	res, err := s.Run(context.Background(), moat.Request{Code: []byte("sleep")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonTimeout || res.ExitCode != 137 || res.Signal != "SIGKILL" {
		t.Fatalf("result %+v", res)
	}
}

func TestCancelKills(t *testing.T) {
	s, _ := newFake(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, cancel)
	res, err := s.Run(ctx, moat.Request{Code: []byte("sleep")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonCanceled || res.ExitCode != 137 {
		t.Fatalf("result %+v", res)
	}
}

func TestOutputCapKills(t *testing.T) {
	s, _ := newFake(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute), Output: 1000}})
	for _, code := range []string{"spew", "spew at start"} {
		var tee bytes.Buffer
		res, err := s.Run(context.Background(), moat.Request{Code: []byte(code), Stdout: &tee})
		if err != nil {
			t.Fatal(err)
		}
		if res.Reason != moat.ReasonOutput || res.ExitCode != 137 || !res.Truncated || len(res.Stdout) != 1000 || tee.Len() != 1000 {
			t.Fatalf("%s: result %+v (%d bytes kept, %d teed)", code, res, len(res.Stdout), tee.Len())
		}
	}
}

func TestSandboxFailureIsUnavailable(t *testing.T) {
	s, _ := newFake(t, Config{Limits: fast()})
	for _, code := range []string{"no report", "fail start"} {
		_, err := s.Run(context.Background(), moat.Request{Code: []byte(code)})
		if !errors.Is(err, moat.ErrUnavailable) {
			t.Errorf("%s: %v, want ErrUnavailable", code, err)
		}
	}
	res, err := s.Run(context.Background(), moat.Request{Code: []byte("oom")})
	if err != nil || res.Reason != moat.ReasonMemory || res.ExitCode != 137 {
		t.Fatalf("oom: %+v %v", res, err)
	}
}

func TestStaleInstanceRetried(t *testing.T) {
	s, b := newFake(t, Config{Limits: fast(), Warm: -1})
	_, err := s.Run(context.Background(), moat.Request{Code: []byte("stale")})
	if !errors.Is(err, ErrStale) {
		t.Fatalf("stale twice: %v", err)
	}
	if p, d, _ := b.counts(); p != 2 || d != 2 {
		t.Fatalf("prepared %d, discarded %d; want 2 and 2 (one retry)", p, d)
	}
}

func TestPoolKeepsWarmAndCloseDiscards(t *testing.T) {
	s, b := newFake(t, Config{Limits: fast(), Warm: 3})
	waitFor(t, func() bool { _, _, live := b.counts(); return live == 3 })
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { p, _, live := b.counts(); return live == 3 && p == 4 })
	s.Close()
	if p, d, live := b.counts(); live != 0 || p != d || !b.closed {
		t.Fatalf("after Close: prepared %d, discarded %d, live %d, closed %v", p, d, live, b.closed)
	}
}

// With RefillAfterRun the pool replaces the instance a run took once the
// run has ended, not while it runs; without it, at once.
func TestPoolRefillAfterRun(t *testing.T) {
	for _, after := range []bool{false, true} {
		s, b := newFake(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}, RefillAfterRun: after})
		waitFor(t, func() bool { p, _, _ := b.counts(); return p == 1 })
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			s.Run(ctx, moat.Request{Code: []byte("sleep")})
		}()
		if !after {
			waitFor(t, func() bool { p, _, _ := b.counts(); return p == 2 })
		} else {
			time.Sleep(100 * time.Millisecond)
			if p, _, _ := b.counts(); p != 1 {
				t.Errorf("RefillAfterRun: %d instances prepared while the run was in progress, want the one it took", p)
			}
		}
		cancel()
		<-done
		waitFor(t, func() bool { p, _, _ := b.counts(); return p == 2 })
	}
}

func TestPoolNoneWhenWarmIsMinusOne(t *testing.T) {
	s, b := newFake(t, Config{Limits: fast(), Warm: -1})
	time.Sleep(50 * time.Millisecond)
	if p, _, _ := b.counts(); p != 0 {
		t.Fatalf("warm -1 prepared %d instances ahead", p)
	}
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); err != nil {
		t.Fatal(err)
	}
	if p, d, _ := b.counts(); p != 1 || d != 1 {
		t.Fatalf("prepared %d, discarded %d", p, d)
	}
}

func TestPoolRetriesAfterPrepareFails(t *testing.T) {
	b := &fake{failNext: errors.New("not yet")}
	s, err := New(Config{Level: moat.LevelContainer, Limits: fast()}, b)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitFor(t, func() bool { _, _, live := b.counts(); return live == 1 })
}

func TestWarmValidated(t *testing.T) {
	for _, w := range []int{-2, MaxWarm + 1} {
		if _, err := New(Config{Level: moat.LevelGVisor, Warm: w}, &fake{}); !errors.Is(err, moat.ErrInvalid) || !strings.Contains(err.Error(), "warm") {
			t.Errorf("warm %d: %v", w, err)
		}
	}
}

func TestMaxRunsQueues(t *testing.T) {
	s, _ := newFake(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}, MaxRuns: 1})
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan struct{})
	go func() {
		close(started)
		s.Run(ctx, moat.Request{Code: []byte("sleep")})
	}()
	<-started
	time.Sleep(50 * time.Millisecond)
	short, cancelShort := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancelShort()
	if _, err := s.Run(short, moat.Request{Code: []byte("exit 0")}); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second run with the slot taken: %v", err)
	}
	cancel()
	if _, err := s.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); err != nil {
		t.Fatal(err)
	}
}

func waitFor(t *testing.T, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if ok() {
			return
		}
	}
	t.Fatal("condition not reached in 5s")
}

// Sessions.

type fakeSessions struct{ fake }

type fakeSession struct {
	mu     sync.Mutex
	files  map[string]string
	closed int
	runs   atomic.Int32
	active atomic.Int32
	maxAct atomic.Int32
}

func (b *fakeSessions) NewSession(ctx context.Context, opts moat.SessionOptions) (SessionInstance, error) {
	return &fakeSession{files: map[string]string{}}, nil
}

func (f *fakeSession) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (Process, error) {
	n := f.active.Add(1)
	if n > f.maxAct.Load() {
		f.maxAct.Store(n)
	}
	f.runs.Add(1)
	p, err := startFake(ctx, string(code), stdout, stderr)
	if err != nil {
		f.active.Add(-1)
		return nil, err
	}
	return &doneProc{Process: p, f: f}, nil
}

type doneProc struct {
	Process
	f *fakeSession
}

func (p *doneProc) Wait() (Evidence, error) {
	time.Sleep(5 * time.Millisecond)
	ev, err := p.Process.Wait()
	p.f.active.Add(-1)
	return ev, err
}

func (f *fakeSession) WriteFile(ctx context.Context, name string, r io.Reader) error {
	b, _ := io.ReadAll(r)
	f.mu.Lock()
	f.files[name] = string(b)
	f.mu.Unlock()
	return nil
}
func (f *fakeSession) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.files[name]
	if !ok {
		return nil, fs.ErrNotExist
	}
	return io.NopCloser(strings.NewReader(s)), nil
}
func (f *fakeSession) ListFiles(ctx context.Context) ([]moat.FileInfo, error) { return nil, nil }
func (f *fakeSession) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	return moat.FileInfo{Name: name}, nil
}
func (f *fakeSession) Mkdir(ctx context.Context, name string) error      { return nil }
func (f *fakeSession) Rename(ctx context.Context, from, to string) error { return nil }
func (f *fakeSession) RemoveFile(ctx context.Context, name string) error { return nil }
func (f *fakeSession) Close() error {
	f.mu.Lock()
	f.closed++
	f.mu.Unlock()
	return nil
}

func newSessions(t *testing.T) (*Sandbox, *fakeSession) {
	s, err := New(Config{Level: moat.LevelContainer, Limits: fast(), Warm: -1}, &fakeSessions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	ss, err := s.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return s, ss.(*Session).Instance().(*fakeSession)
}

func TestSessionRunsSerialized(t *testing.T) {
	s, _ := newSessions(t)
	ss, _ := s.NewSession(context.Background(), moat.SessionOptions{})
	f := ss.(*Session).Instance().(*fakeSession)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if f.runs.Load() != 8 || f.maxAct.Load() != 1 {
		t.Fatalf("%d runs, at most %d at once", f.runs.Load(), f.maxAct.Load())
	}
	res, err := ss.Run(context.Background(), moat.Request{Code: []byte("sleep")})
	if err != nil || res.Reason != moat.ReasonTimeout {
		t.Fatalf("timeout in a session: %+v %v", res, err)
	}
	res, err = ss.Run(context.Background(), moat.Request{Code: []byte("note")})
	if err != nil || len(res.Notes) != 1 || res.Notes[0] != "a fact" {
		t.Fatalf("a run after the timeout: %+v %v", res, err)
	}
}

func TestSessionSpentAndClosed(t *testing.T) {
	s, _ := newSessions(t)
	ss, _ := s.NewSession(context.Background(), moat.SessionOptions{})
	f := ss.(*Session).Instance().(*fakeSession)
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("spend")}); err != nil {
		t.Fatal(err)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); !errors.Is(err, moat.ErrSpent) {
		t.Fatalf("after the budget is spent: %v", err)
	}
	if err := ss.WriteFile(context.Background(), "a", strings.NewReader("x")); err != nil {
		t.Fatalf("files of a spent session: %v", err)
	}
	ss.Close()
	ss.Close()
	if f.closed != 1 {
		t.Fatalf("instance closed %d times", f.closed)
	}
	if _, err := ss.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); !errors.Is(err, moat.ErrClosed) {
		t.Fatalf("run after Close: %v", err)
	}
	if _, err := ss.ReadFile(context.Background(), "a"); !errors.Is(err, moat.ErrClosed) {
		t.Fatalf("read after Close: %v", err)
	}
}

func TestSessionCloseWhileRunsWait(t *testing.T) {
	s, _ := newSessions(t)
	ss, _ := s.NewSession(context.Background(), moat.SessionOptions{})
	long := moat.Request{Code: []byte("sleep")}
	errs := make(chan error, 3)
	for range 3 {
		go func() { _, err := ss.Run(context.Background(), long); errs <- err }()
	}
	time.Sleep(20 * time.Millisecond)
	done := make(chan struct{})
	go func() { ss.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung while runs waited")
	}
	for range 3 {
		select {
		case <-errs:
		case <-time.After(5 * time.Second):
			t.Fatal("a waiting run never returned after Close")
		}
	}
}

func TestSessionNames(t *testing.T) {
	s, _ := newSessions(t)
	ss, _ := s.NewSession(context.Background(), moat.SessionOptions{})
	bad := []string{"", ".", "/etc/passwd", "../x", "a/../../x", "a/./b", "a//b", "a/", `a\b`, "a\x00b", strings.Repeat("a", 4097)}
	for _, n := range bad {
		if err := ss.WriteFile(context.Background(), n, strings.NewReader("x")); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("WriteFile(%q): %v", n, err)
		}
		if _, err := ss.ReadFile(context.Background(), n); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("ReadFile(%q): %v", n, err)
		}
		if err := ss.Rename(context.Background(), "ok", n); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Rename to %q: %v", n, err)
		}
		if err := ss.RemoveFile(context.Background(), n); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("RemoveFile(%q): %v", n, err)
		}
	}
	for _, n := range []string{"a", "a/b.txt", ".hidden", "d/e/f", "ü"} {
		if _, err := CleanName(moat.LevelSubprocess, n); err != nil {
			t.Errorf("CleanName(%q): %v", n, err)
		}
	}
}

func TestNoSessionsAtLevelWithout(t *testing.T) {
	s, _ := newFake(t, Config{Limits: fast()})
	if _, err := s.NewSession(context.Background(), moat.SessionOptions{}); !errors.Is(err, moat.ErrUnavailable) {
		t.Fatalf("NewSession on a backend without sessions: %v", err)
	}
}
