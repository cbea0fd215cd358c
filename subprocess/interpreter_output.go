package subprocess

import (
	"bytes"
	"io"
	"sync"
)

// The live interpreter's output. Its stdout and stderr pipes last as long
// as the interpreter; a router per stream passes what comes to the run in
// progress, up to that run's end marker (its nonce, which the driver writes
// when the run's code has returned), and drops what processes the code left
// behind write between runs.

// streamRouter passes what the interpreter writes on one stream to the
// current run's sink, and drops it between runs.
type streamRouter struct {
	mu   sync.Mutex
	sink *markSink
	eof  chan struct{}
}

func (sr *streamRouter) pump(r io.ReadCloser) {
	defer close(sr.eof)
	defer r.Close()
	buf := make([]byte, 64*1024)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			sr.mu.Lock()
			if sr.sink != nil {
				sr.sink.feed(buf[:n])
			}
			sr.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

func (sr *streamRouter) set(m *markSink) {
	sr.mu.Lock()
	sr.sink = m
	sr.mu.Unlock()
}

// markSink feeds a run's stream until the run's end marker, leaving out any
// occurrence of drop (the previous run's marker) on the way. The engine's
// cap on the stream may kill the run from inside a Write (engine.Ender).
type markSink struct {
	marker  []byte
	drop    []byte    // nil: nothing to drop
	w       io.Writer // the run's stream (the engine's, with its cap)
	pending []byte    // a tail that may be the start of the marker or of drop
	seen    chan struct{}
	done    bool
}

func newMarkSink(marker, drop []byte, w io.Writer) *markSink {
	return &markSink{marker: marker, drop: drop, w: w, seen: make(chan struct{})}
}

func (m *markSink) feed(p []byte) {
	if m.done {
		return // after the marker: output of processes left behind
	}
	data := append(m.pending, p...)
	m.pending = nil
	for {
		i := bytes.Index(data, m.marker)
		j := -1
		if len(m.drop) > 0 {
			j = bytes.Index(data, m.drop)
		}
		if j >= 0 && (i < 0 || j < i) {
			m.w.Write(data[:j])
			data = data[j+len(m.drop):]
			continue
		}
		if i >= 0 {
			m.w.Write(data[:i])
			m.done = true
			close(m.seen)
			return
		}
		break
	}
	keep := max(prefixAtEnd(data, m.marker), prefixAtEnd(data, m.drop))
	m.w.Write(data[:len(data)-keep])
	m.pending = append([]byte(nil), data[len(data)-keep:]...)
}

// prefixAtEnd returns the length of the longest proper prefix of pat that
// data ends with.
func prefixAtEnd(data, pat []byte) int {
	for k := min(len(pat)-1, len(data)); k > 0; k-- {
		if bytes.HasSuffix(data, pat[:k]) {
			return k
		}
	}
	return 0
}

// flush passes on a held-back tail when the marker never came.
func (m *markSink) flush() {
	if !m.done && len(m.pending) > 0 {
		m.w.Write(m.pending)
		m.pending = nil
	}
}
