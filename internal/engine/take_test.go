package engine

import (
	"context"
	"sync/atomic"
	"testing"
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
