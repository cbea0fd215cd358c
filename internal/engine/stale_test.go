package engine

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
	"testing"

	"github.com/moatsandbox/moat"
)

// staleBackend's instances have all gone stale.
type staleBackend struct{ starts atomic.Int32 }

func (b *staleBackend) Prepare(context.Context) (Instance, error) { return staleInstance{b}, nil }
func (b *staleBackend) Close() error                              { return nil }

type staleInstance struct{ b *staleBackend }

func (i staleInstance) Start(context.Context, []byte, io.Writer, io.Writer) (Process, error) {
	i.b.starts.Add(1)
	return nil, fmt.Errorf("fake: the helper died: %w", ErrStale)
}

func (staleInstance) Discard() {}

// TestStaleTwiceIsUnavailable: a stale instance is retried once, and when
// the retry is stale too, Run fails with an error of moat's class for it.
func TestStaleTwiceIsUnavailable(t *testing.T) {
	b := &staleBackend{}
	s, err := New(Config{Level: "fake", Warm: -1}, b)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = s.Run(context.Background(), moat.Request{Code: []byte("x")})
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("Run after two stale instances: %v, want an error wrapping moat.ErrUnavailable", err)
	}
	if n := b.starts.Load(); n != 2 {
		t.Errorf("%d starts, want 2 (one retry)", n)
	}
}
