package engine

import (
	"context"
	"sync/atomic"
	"testing"
	"time"
)

// slowPrepare's Prepare takes a while and, like a level restoring a VM,
// does not stop for its context.
type slowPrepare struct {
	fake
	closing atomic.Bool // the engine's Close has begun
	late    atomic.Int32
}

func (b *slowPrepare) Prepare(ctx context.Context) (Instance, error) {
	if b.closing.Load() {
		b.late.Add(1)
	}
	time.Sleep(30 * time.Millisecond)
	return b.fake.Prepare(ctx)
}

// TestPoolStopsPreparingAtClose: once Close has begun, the pool starts no
// further Prepare; the one in flight is discarded with the others.
func TestPoolStopsPreparingAtClose(t *testing.T) {
	for i := range 10 {
		b := &slowPrepare{}
		s, err := New(Config{Level: "fake", Warm: 4}, b)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(time.Duration(i*10) * time.Millisecond)
		b.closing.Store(true)
		s.Close()
		if p, d, live := b.counts(); live != 0 || p != d {
			t.Errorf("after Close: %d prepared, %d discarded", p, d)
		}
		if n := b.late.Load(); n > 0 {
			t.Errorf("%d Prepares began after Close had", n)
		}
	}
}
