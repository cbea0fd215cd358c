package engine

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// ctxBackend counts the instances prepared with the caller's context
// (marked by callerKey), not the pool's.
type ctxBackend struct {
	fake
	forCaller atomic.Int32
}

type callerKey struct{}

func (b *ctxBackend) Prepare(ctx context.Context) (Instance, error) {
	if ctx.Value(callerKey{}) != nil {
		b.forCaller.Add(1)
	}
	return b.fake.Prepare(ctx)
}

// TestTakeComesFromThePool: Take hands out an instance the pool prepared
// ahead, and prepares one on the caller's path only when none is ready (as
// after Close).
func TestTakeComesFromThePool(t *testing.T) {
	b := &ctxBackend{}
	s, err := New(Config{Level: "fake", Limits: fast(), Warm: 1}, b)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitFor(t, func() bool { _, _, live := b.counts(); return live == 1 })
	ctx := context.WithValue(context.Background(), callerKey{}, true)
	inst, err := s.Take(ctx)
	if err != nil {
		t.Fatal(err)
	}
	inst.Discard()
	if n := b.forCaller.Load(); n != 0 {
		t.Errorf("Take prepared %d instances on the caller's path while one was ready", n)
	}
	waitFor(t, func() bool { p, _, live := b.counts(); return p == 2 && live == 1 })
	s.Close()
	inst, err = s.Take(ctx)
	if err != nil {
		t.Fatalf("Take after Close: %v", err)
	}
	inst.Discard()
	if n := b.forCaller.Load(); n != 1 {
		t.Errorf("after Close, Take prepared %d instances on the caller's path, want 1", n)
	}
	// One take found an instance ready, one prepared its own.
	if st := s.PoolStats(); st.Size != 1 || st.Hits != 1 || st.Misses != 1 || st.Ready != 0 {
		t.Errorf("pool stats %+v, want size 1, 1 hit, 1 miss, none ready after Close", st)
	}
}

// TestPoolGrowsForBursts: takes that find none ready grow the pool, one
// each, up to WarmMax; without misses for the decay it shrinks back to
// Warm, discarding what it no longer keeps.
func TestPoolGrowsForBursts(t *testing.T) {
	old := burstDecay
	burstDecay = 200 * time.Millisecond
	defer func() { burstDecay = old }()
	b := &fake{}
	s, err := New(Config{Level: "fake", Limits: fast(), Warm: 1, WarmMax: 3}, b)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitFor(t, func() bool { _, _, live := b.counts(); return live == 1 })
	// A burst: five takes at once; the first finds one ready.
	for range 5 {
		inst, err := s.Take(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		inst.Discard()
	}
	if st := s.PoolStats(); st.Size != 3 || st.Max != 3 || st.Hits+st.Misses != 5 {
		t.Errorf("after a burst: %+v, want size 3 of at most 3, 5 takes", st)
	}
	waitFor(t, func() bool { return s.PoolStats().Ready == 3 })
	// Quiet: back to one, the others discarded.
	waitFor(t, func() bool { st := s.PoolStats(); return st.Size == 1 && st.Ready == 1 })
	if _, _, live := b.counts(); live != 1 {
		t.Errorf("%d instances live after the pool shrank, want 1", live)
	}
	if _, err := New(Config{Level: "fake", Warm: 2, WarmMax: 1}, &fake{}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("warm_max under warm: %v, want ErrInvalid", err)
	}
}

// pooledSessions makes each session's instance out of a pooled one, as the
// microvm level does.
type pooledSessions struct {
	fake
	s      *Sandbox
	pooled atomic.Int32
}

func (b *pooledSessions) NewSession(ctx context.Context, opts moat.SessionOptions) (SessionInstance, error) {
	if inst, ok := b.s.TakeReady(); ok {
		b.pooled.Add(1)
		inst.Discard() // the fake's session is not made of it
	}
	return &fakeSession{files: map[string]string{}}, nil
}

// TestTakeReady: TakeReady hands out what the pool prepared ahead and
// never prepares one; with RefillAfterRun, a session's creation that took
// one has it replaced once the creation is over, as a run's end does.
func TestTakeReady(t *testing.T) {
	none, b0 := newFake(t, Config{Limits: fast(), Warm: -1})
	if inst, ok := none.TakeReady(); ok || inst != nil {
		t.Errorf("TakeReady of an empty pool = %v, %v; want nothing", inst, ok)
	}
	if p, _, _ := b0.counts(); p != 0 {
		t.Errorf("TakeReady of an empty pool prepared %d instances", p)
	}

	b := &pooledSessions{}
	s, err := New(Config{Level: "fake", Limits: fast(), Warm: 1, RefillAfterRun: true}, b)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	b.s = s
	waitFor(t, func() bool { p, _, live := b.counts(); return p == 1 && live == 1 })
	ss, err := s.NewSession(context.Background(), moat.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	if b.pooled.Load() != 1 {
		t.Fatal("the session found no pooled instance")
	}
	waitFor(t, func() bool { p, _, live := b.counts(); return p == 2 && live == 1 })
}
