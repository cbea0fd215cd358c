// Package marker routes a live interpreter's long-lived output streams to
// the run in progress: a Router per stream passes what comes to the current
// run's Sink, up to that run's end marker (its nonce, which the driver
// writes when the run's code has returned), and drops what processes the
// code left behind write between runs. The subprocess and gvisor levels'
// interpreters use it.
package marker

import (
	"bytes"
	"io"
	"sync"
)

// Router passes what the interpreter writes on one stream to the
// current run's sink, and drops it between runs.
type Router struct {
	mu   sync.Mutex
	sink *Sink
	eof  chan struct{}
}

func (sr *Router) pump(r io.ReadCloser) {
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

// Set makes m the sink of what comes next; nil drops it.
func (sr *Router) Set(m *Sink) {
	sr.mu.Lock()
	sr.sink = m
	sr.mu.Unlock()
}

// Sink feeds a run's stream until the run's end marker, leaving out any
// occurrence of drop (the previous run's marker) on the way. The engine's
// cap on the stream may kill the run from inside a Write (engine.Ender).
type Sink struct {
	marker  []byte
	drop    []byte    // nil: nothing to drop
	w       io.Writer // the run's stream (the engine's, with its cap)
	pending []byte    // a tail that may be the start of the marker or of drop
	seen    chan struct{}
	done    bool
}

// NewSink returns a sink that writes to w until marker, leaving out drop.
func NewSink(marker, drop []byte, w io.Writer) *Sink {
	return &Sink{marker: marker, drop: drop, w: w, seen: make(chan struct{})}
}

func (m *Sink) feed(p []byte) {
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

// Flush passes on a held-back tail when the marker never came.
func (m *Sink) Flush() {
	if !m.done && len(m.pending) > 0 {
		m.w.Write(m.pending)
		m.pending = nil
	}
}

// NewRouter starts routing r, until it ends; see EOF.
func NewRouter(r io.ReadCloser) *Router {
	sr := &Router{eof: make(chan struct{})}
	go sr.pump(r)
	return sr
}

// EOF is closed once the stream has ended.
func (sr *Router) EOF() <-chan struct{} { return sr.eof }

// Seen is closed once the marker has come.
func (m *Sink) Seen() <-chan struct{} { return m.seen }
