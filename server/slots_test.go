package server

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestSlots checks the slot rules without a sandbox: the per-token cap, the
// per-token and global queue caps, arrival order among the runs that can
// start, and giving up.
func TestSlots(t *testing.T) {
	var running, waiting int
	s := newSlots(2, 1, 2, 1, func(r, w int) { running, waiting = r, w })
	ctx := context.Background()
	long := time.Minute
	must := func(owner string) func() {
		t.Helper()
		release, err := s.acquire(ctx, owner, long)
		if err != nil {
			t.Fatalf("%s: %v", owner, err)
		}
		return release
	}
	// wait starts an acquire that must wait; the channel gets its release.
	wait := func(owner string) chan func() {
		t.Helper()
		ch := make(chan func(), 1)
		before := waiting
		go func() {
			release, err := s.acquire(ctx, owner, long)
			if err != nil {
				t.Errorf("%s: %v", owner, err)
			}
			ch <- release
		}()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			s.mu.Lock()
			n := len(s.waiting)
			s.mu.Unlock()
			if n == before+1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s does not wait", owner)
			}
		}
		return ch
	}
	a1 := must("a")
	a2 := wait("a") // a is at its cap although a slot is free
	b1 := must("b") // b is not
	if _, err := s.acquire(ctx, "a", long); !errors.Is(err, errTokenBusy) {
		t.Errorf("a's third: %v, want token_busy", err)
	}
	c1 := wait("c") // no slot free
	if _, err := s.acquire(ctx, "d", long); !errors.Is(err, errBusy) {
		t.Errorf("d, with the queue full: %v, want busy", err)
	}
	if running != 2 || waiting != 2 {
		t.Errorf("running %d, waiting %d; want 2, 2", running, waiting)
	}
	a1()
	a1() // a second release is nothing
	rel := <-a2
	b1()
	rel2 := <-c1
	if running != 2 || waiting != 0 {
		t.Errorf("after two releases: running %d, waiting %d; want 2, 0", running, waiting)
	}
	// Giving up: by timeout and by cancellation, leaving nothing behind.
	if _, err := s.acquire(ctx, "e", time.Millisecond); !errors.Is(err, errQueueTimeout) {
		t.Errorf("e: %v, want queue_timeout", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := s.acquire(cctx, "e", long); !errors.Is(err, context.Canceled) {
		t.Errorf("e, cancelled: %v", err)
	}
	rel()
	rel2()
	if running != 0 || waiting != 0 || len(s.tokens) != 0 {
		t.Errorf("at the end: running %d, waiting %d, tokens %v", running, waiting, s.tokens)
	}
}
