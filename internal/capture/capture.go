// Package capture bounds an output stream: it keeps the first N bytes,
// passes exactly those on to an optional writer as they come, drains and
// drops the rest, and says once when the stream passes its cap so that the
// caller can end the writer.
package capture

import (
	"io"
	"sync"
)

// Buffer is an io.Writer that keeps at most its cap of bytes. The tee, if
// any, receives exactly the kept bytes, in order, as they are written:
// nothing past the cap reaches it. Writes never fail (a failing tee is
// dropped and its error remembered), so the process on the other end of the
// pipe is never blocked by a full buffer. It is safe for concurrent use, and
// the tee is never called concurrently.
//
// The cut is at a byte count, not at a character: if it falls inside a
// multi-byte UTF-8 character, the kept prefix ends with that character's
// first bytes as they were written.
type Buffer struct {
	overflow func() // called once, at the first byte past the cap; may be nil

	mu     sync.Mutex // guards the fields below and serializes the tee
	cap    int64
	buf    []byte
	total  int64
	tee    io.Writer
	teeErr error
	fired  bool // overflow has been called, or is being called
}

// New returns a Buffer keeping at most limit bytes (none if limit < 0),
// copying them to tee if tee is not nil, and calling overflow, if not nil,
// once: in the Write that brings the total past limit, after that Write has
// passed its kept part to the tee and before it returns. overflow runs on
// the writing goroutine without the Buffer's lock held; while it runs, that
// writer is held up (which holds up the process feeding it), so it is the
// place to kill that process. It must not wait for the writer to finish.
func New(limit int64, tee io.Writer, overflow func()) *Buffer {
	return &Buffer{cap: max(limit, 0), tee: tee, overflow: overflow}
}

// Write keeps what fits under the cap, passes that part to the tee, drops
// the rest, and calls the overflow hook if this is the first Write past the
// cap. It always reports all of p written.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	b.total += int64(len(p))
	keep := p[:min(int64(len(p)), b.cap-int64(len(b.buf)))]
	b.buf = append(b.buf, keep...)
	if len(keep) > 0 && b.tee != nil && b.teeErr == nil {
		if _, err := b.tee.Write(keep); err != nil {
			b.teeErr = err
		}
	}
	fire := b.total > b.cap && !b.fired
	if fire {
		b.fired = true
	}
	b.mu.Unlock()
	if fire && b.overflow != nil {
		b.overflow()
	}
	return len(p), nil
}

// Bytes returns what was kept.
func (b *Buffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf
}

// Truncated reports whether more was written than kept: whether the stream
// passed its cap, and so whether the overflow hook has been (or is being)
// called.
func (b *Buffer) Truncated() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.total > int64(len(b.buf))
}

// Total is how many bytes were written in all, the dropped ones included.
func (b *Buffer) Total() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.total
}

// TeeErr is the error the tee writer returned, if any.
func (b *Buffer) TeeErr() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.teeErr
}
