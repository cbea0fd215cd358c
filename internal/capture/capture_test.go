package capture

import (
	"bytes"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// recorder is a tee that records what it got and counts overlapping calls.
type recorder struct {
	mu       sync.Mutex
	got      []byte
	calls    int
	inside   atomic.Int32
	overlaps atomic.Int32
}

func (r *recorder) Write(p []byte) (int, error) {
	if r.inside.Add(1) > 1 {
		r.overlaps.Add(1)
	}
	defer r.inside.Add(-1)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got = append(r.got, p...)
	r.calls++
	return len(p), nil
}

func (r *recorder) bytes() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]byte(nil), r.got...)
}

func TestTeeGetsExactlyTheKeptPrefix(t *testing.T) {
	for _, c := range []struct {
		name   string
		limit  int64
		writes []string
		// wantKept is also what the tee must have received.
		wantKept string
		wantOver bool
	}{
		{"under the cap", 10, []string{"abc", "def"}, "abcdef", false},
		{"exactly the cap", 6, []string{"abc", "def"}, "abcdef", false},
		{"one byte past", 5, []string{"abc", "def"}, "abcde", true},
		{"cut inside one write", 4, []string{"abcdefgh"}, "abcd", true},
		{"writes after the cut", 3, []string{"ab", "cd", "ef", "gh"}, "abc", true},
		{"zero cap", 0, []string{"a"}, "", true},
		{"negative cap keeps nothing", -5, []string{"a"}, "", true},
		{"empty writes only", 0, []string{"", ""}, "", false},
		// The cut is at a byte count: the first byte of "é" (0xc3 0xa9)
		// stays, as it was written; nothing is re-encoded.
		{"cut inside a UTF-8 character", 2, []string{"aé"}, "a\xc3", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			tee := &recorder{}
			var fired atomic.Int32
			b := New(c.limit, tee, func() { fired.Add(1) })
			total := 0
			for _, w := range c.writes {
				n, err := b.Write([]byte(w))
				if n != len(w) || err != nil {
					t.Fatalf("Write(%q) = %d, %v; want %d, nil", w, n, err, len(w))
				}
				total += len(w)
			}
			if got := string(b.Bytes()); got != c.wantKept {
				t.Errorf("Bytes() = %q, want %q", got, c.wantKept)
			}
			if got := string(tee.bytes()); got != c.wantKept {
				t.Errorf("the tee received %q, want exactly the kept %q", got, c.wantKept)
			}
			if b.Truncated() != c.wantOver {
				t.Errorf("Truncated() = %v, want %v", b.Truncated(), c.wantOver)
			}
			want := int32(0)
			if c.wantOver {
				want = 1
			}
			if n := fired.Load(); n != want {
				t.Errorf("the overflow hook was called %d times, want %d", n, want)
			}
			if b.Total() != int64(total) {
				t.Errorf("Total() = %d, want %d", b.Total(), total)
			}
		})
	}
}

// The tee never sees a zero-length write for what was dropped.
func TestNoTeeCallsPastTheCap(t *testing.T) {
	tee := &recorder{}
	b := New(4, tee, nil)
	for range 100 {
		b.Write([]byte("xy"))
	}
	if tee.calls != 2 || string(tee.bytes()) != "xyxy" {
		t.Errorf("the tee got %d calls, %q; want 2 calls, %q", tee.calls, tee.bytes(), "xyxy")
	}
}

// The hook runs after the kept part has reached the tee, outside the lock:
// it may read the Buffer (a level's kill path reads it to decide).
func TestOverflowHookSeesTheTeeDoneAndCanReadTheBuffer(t *testing.T) {
	tee := &recorder{}
	var b *Buffer
	var seen string
	var truncated bool
	b = New(3, tee, func() {
		seen = string(tee.bytes())
		truncated = b.Truncated()
		_ = b.Bytes()
	})
	b.Write([]byte("abcdef"))
	if seen != "abc" || !truncated {
		t.Errorf("in the hook: tee had %q, Truncated %v; want %q, true", seen, truncated, "abc")
	}
}

// Many goroutines writing at once: the kept bytes and the tee's agree, add
// up to the cap, the tee is never called concurrently, and the hook fires
// exactly once.
func TestConcurrentWrites(t *testing.T) {
	const limit = 10000
	tee := &recorder{}
	var fired atomic.Int32
	b := New(limit, tee, func() { fired.Add(1) })
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			chunk := bytes.Repeat([]byte{byte('a' + g)}, 97)
			for range 50 {
				b.Write(chunk)
			}
		})
	}
	wg.Wait()
	kept, got := b.Bytes(), tee.bytes()
	if len(kept) != limit || !bytes.Equal(kept, got) {
		t.Errorf("kept %d bytes, the tee got %d (equal: %v); want %d, the same bytes", len(kept), len(got), bytes.Equal(kept, got), limit)
	}
	if n := fired.Load(); n != 1 {
		t.Errorf("the overflow hook was called %d times, want once", n)
	}
	if n := tee.overlaps.Load(); n > 0 {
		t.Errorf("the tee was called concurrently %d times", n)
	}
	if b.Total() != 16*50*97 || !b.Truncated() {
		t.Errorf("Total() = %d, Truncated() = %v; want %d, true", b.Total(), b.Truncated(), 16*50*97)
	}
}

// A hook that blocks holds up only its writer: others may go on writing and
// reading the Buffer meanwhile, and it is still called only once.
func TestBlockingHookDoesNotHoldTheLock(t *testing.T) {
	release := make(chan struct{})
	entered := make(chan struct{})
	var fired atomic.Int32
	b := New(2, nil, func() {
		fired.Add(1)
		close(entered)
		<-release
	})
	done := make(chan struct{})
	go func() {
		b.Write([]byte("abc"))
		close(done)
	}()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the overflow hook was not called for a write past the cap")
	}
	b.Write([]byte("more"))
	if !b.Truncated() || string(b.Bytes()) != "ab" {
		t.Errorf("while the hook runs: Truncated %v, Bytes %q", b.Truncated(), b.Bytes())
	}
	close(release)
	<-done
	if n := fired.Load(); n != 1 {
		t.Errorf("the overflow hook was called %d times, want once", n)
	}
}

type failing struct{ calls int }

func (f *failing) Write(p []byte) (int, error) {
	f.calls++
	return 0, errors.New("broken pipe")
}

// A failing tee is dropped; writes still succeed and keep going into the
// buffer.
func TestFailingTee(t *testing.T) {
	f := &failing{}
	b := New(100, f, nil)
	for range 3 {
		if n, err := b.Write([]byte("abc")); n != 3 || err != nil {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if f.calls != 1 || b.TeeErr() == nil || !strings.Contains(b.TeeErr().Error(), "broken pipe") {
		t.Errorf("tee calls %d, TeeErr %v; want 1 call, the tee's error", f.calls, b.TeeErr())
	}
	if string(b.Bytes()) != "abcabcabc" {
		t.Errorf("Bytes() = %q", b.Bytes())
	}
}
