package engine

import (
	"context"
	"sync/atomic"
	"testing"

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
