package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// killedBackend's runs run until killed, then end with err from Wait.
type killedBackend struct {
	fake
	err error
}

func (b *killedBackend) Prepare(context.Context) (Instance, error) { return killedInst{b}, nil }

type killedInst struct{ b *killedBackend }

func (i killedInst) Start(context.Context, []byte, io.Writer, io.Writer) (Process, error) {
	return &killedProc{err: i.b.err, killed: make(chan struct{})}, nil
}

func (killedInst) Discard() {}

type killedProc struct {
	err    error
	killed chan struct{}
}

func (p *killedProc) Kill() {
	select {
	case <-p.killed:
	default:
		close(p.killed)
	}
}

func (p *killedProc) Wait() (Evidence, error) {
	<-p.killed
	return Evidence{}, p.err
}

// TestFailureAfterOurKillIsAnError: a run the engine killed (at the wall
// time, or cancelled) whose Wait then says the sandbox itself failed (an
// error wrapping moat.ErrUnavailable: a kill that did not take, a sentry
// that crashed) is an error, not a Result; an error of no class after the
// kill is taken as the kill's own doing (a helper killed before it could
// report) and the run gets its verdict.
func TestFailureAfterOurKillIsAnError(t *testing.T) {
	for _, c := range []struct {
		name   string
		err    error
		cancel bool
		fails  bool
	}{
		{"unavailable after the wall time", fmt.Errorf("fake: the kill did not take: %w", moat.ErrUnavailable), false, true},
		{"unavailable after a cancel", fmt.Errorf("fake: the sentry crashed: %w", moat.ErrUnavailable), true, true},
		{"no report after the wall time", errors.New("fake: the helper ended without a report"), false, false},
		{"no report after a cancel", errors.New("fake: the helper ended without a report"), true, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, err := New(Config{Level: moat.LevelGVisor, Warm: -1, Limits: fast()}, &killedBackend{err: c.err})
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if c.cancel {
				time.AfterFunc(20*time.Millisecond, cancel)
			}
			res, err := s.Run(ctx, moat.Request{Code: []byte("x")})
			switch {
			case c.fails && !errors.Is(err, moat.ErrUnavailable):
				t.Errorf("Run = %+v, %v; want an error wrapping moat.ErrUnavailable", res, err)
			case !c.fails && (err != nil || res.ExitCode != 137):
				t.Errorf("Run = %+v, %v; want the verdict of a run moat killed", res, err)
			}
		})
	}
}

// TestCloseFailsRunsWaitingForASlot: Close makes the runs still waiting
// for one of MaxRuns' slots fail with moat.ErrClosed; they never start, and
// Close waits only for the run in progress.
func TestCloseFailsRunsWaitingForASlot(t *testing.T) {
	s, b := newFake(t, Config{Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}, MaxRuns: 1, Warm: -1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := make(chan error, 1)
	go func() { _, err := s.Run(ctx, moat.Request{Code: []byte("sleep")}); first <- err }()
	waitFor(t, func() bool { return len(s.slots) == 1 })
	queued := make(chan error, 1)
	go func() { _, err := s.Run(context.Background(), moat.Request{Code: []byte("exit 0")}); queued <- err }()
	time.Sleep(50 * time.Millisecond) // the second run waits for the slot
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case err := <-queued:
		if !errors.Is(err, moat.ErrClosed) {
			t.Errorf("a run waiting for a slot at Close = %v, want an error wrapping moat.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("a run waiting for a slot at Close was still waiting 5s later")
	}
	select {
	case <-closed:
		t.Error("Close returned while a run was in progress")
	default:
	}
	cancel()
	<-first
	<-closed
	if p, _, _ := b.counts(); p != 1 {
		t.Errorf("%d instances prepared, want 1: a run queued at Close went on", p)
	}
}
