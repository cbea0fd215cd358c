// Package capture keeps the first N bytes of an output stream, drains the
// rest, and passes every byte on to an optional writer as it comes.
package capture

import (
	"io"
	"sync"
)

// Buffer is an io.Writer that keeps at most Cap bytes. Writes never fail
// (a failing Tee is dropped and the error remembered), so the process on the
// other end of the pipe is never blocked by a full buffer. It is safe for
// concurrent use.
type Buffer struct {
	mu     sync.Mutex
	cap    int64
	buf    []byte
	total  int64
	tee    io.Writer
	teeErr error
}

// New returns a Buffer keeping at most limit bytes and copying every byte to
// tee, if tee is not nil.
func New(limit int64, tee io.Writer) *Buffer {
	return &Buffer{cap: limit, tee: tee}
}

// Write keeps what fits under the cap and passes all of p to the tee.
func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.total += int64(len(p))
	if room := b.cap - int64(len(b.buf)); room > 0 {
		keep := p
		if int64(len(keep)) > room {
			keep = keep[:room]
		}
		b.buf = append(b.buf, keep...)
	}
	if b.tee != nil && b.teeErr == nil {
		if _, err := b.tee.Write(p); err != nil {
			b.teeErr = err
		}
	}
	return len(p), nil
}

// Bytes returns what was kept.
func (b *Buffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf
}

// Truncated reports whether more was written than kept.
func (b *Buffer) Truncated() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.total > int64(len(b.buf))
}

// Total is how many bytes were written in all.
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
