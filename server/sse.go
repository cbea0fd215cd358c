package server

import (
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"unicode/utf8"
)

// maxEventBytes is the most output that chunks queued behind a slow client
// are merged into, for one event.
const maxEventBytes = 64 << 10

// sseWriter sends a run's output to its client as server-sent events, and
// never makes the run wait for the client: the sandbox's writes only queue
// the output, and a goroutine of the writer sends it. At most limit bytes of
// output are queued or being sent; a client that falls further behind gets
// no more live output, but one overflow event, and after it the final event
// (the result, which holds the output up to the level's cap) once the run
// ends; the run goes on as if it were not streamed. A write to the client
// that fails or times out (deadlineWriter) means the client is gone:
// nothing more is sent, and net/http cancels the request's context, which
// cancels the run if it is still going. (After an overflow nothing is sent
// until the run ends, so a client that stopped reading then is found out
// only by the write of the final event.)
//
// Events carry text, and end between characters: where a write ends inside
// a multi-byte UTF-8 character, its first bytes wait for the rest, in the
// next write of that stream (see utf8Cut); none is sent as U+FFFD. When the
// run ends, what is still held is sent as it is, so that bytes that are not
// UTF-8 become U+FFFD as in the result; an event whose bytes are not valid
// UTF-8 also carries them exactly, in base64, as data_b64 (and the result
// as stdout_b64/stderr_b64, see resultView). No event is empty.
//
// Only the writer's goroutine touches the ResponseWriter once newSSE has
// returned; the handler must call wait before it returns.
type sseWriter struct {
	w        http.ResponseWriter
	rc       *http.ResponseController
	limit    int64
	overflow func() // counts an overflow

	mu      sync.Mutex
	pending []chunk           // output not sent yet, in order, none empty
	held    map[string][]byte // per stream, the start of a character its last write cut
	size    int64             // bytes of output queued or being sent
	behind  bool              // the client fell limit bytes behind: live output has stopped
	told    bool              // the overflow event is sent or being sent
	final   *chunk            // the last event, once the run has ended
	closed  bool              // no event comes after final (nil when the handler gave up)
	gone    bool              // a write failed
	wake    chan struct{}
	done    chan struct{} // closed when the writer's goroutine returns
}

// chunk is one event to send: output of a stream, or the final event.
type chunk struct {
	name string
	data []byte // output; nil for the final event
	v    any    // the final event's value
}

// newSSE starts the writer's goroutine, which sends the status line and the
// headers at once. It returns nil when w cannot be flushed.
func newSSE(w http.ResponseWriter, limit int64, overflow func()) *sseWriter {
	if _, ok := w.(http.Flusher); !ok {
		return nil
	}
	e := &sseWriter{
		w: w, rc: http.NewResponseController(w), limit: limit, overflow: overflow,
		held: map[string][]byte{}, wake: make(chan struct{}, 1), done: make(chan struct{}),
	}
	go e.run()
	return e
}

// stream returns the writer for one of the run's output streams. Its
// writes never block and never fail.
func (e *sseWriter) stream(name string) writerFunc {
	return func(p []byte) (int, error) {
		e.mu.Lock()
		defer e.mu.Unlock()
		if e.gone || e.behind || e.closed || len(p) == 0 {
			return len(p), nil
		}
		data := p
		if h := e.held[name]; len(h) > 0 {
			data = append(h, p...)
		}
		cut := utf8Cut(data)
		e.queue(name, data[:cut]) // copies: data may share held's array
		e.held[name] = append(e.held[name][:0], data[cut:]...)
		return len(p), nil
	}
}

// queue adds output of a stream to what is to be sent, or stops the live
// output when the client is limit bytes behind. e.mu is held.
func (e *sseWriter) queue(name string, p []byte) {
	switch {
	case len(p) == 0:
	case e.size+int64(len(p)) > e.limit:
		e.behind = true
		e.overflow()
		e.signal()
	default:
		e.size += int64(len(p))
		if n := len(e.pending); n > 0 && e.pending[n-1].name == name && len(e.pending[n-1].data)+len(p) <= maxEventBytes {
			e.pending[n-1].data = append(e.pending[n-1].data, p...)
		} else {
			e.pending = append(e.pending, chunk{name: name, data: append([]byte(nil), p...)})
		}
		e.signal()
	}
}

// utf8Cut returns how much of p to send now: all of it, but for the first
// bytes of a UTF-8 character that p ends inside, which wait for the rest. A
// byte sequence that cannot become a character is not held.
func utf8Cut(p []byte) int {
	for i := len(p) - 1; i >= 0 && i >= len(p)-(utf8.UTFMax-1); i-- {
		if utf8.RuneStart(p[i]) {
			if !utf8.FullRune(p[i:]) {
				return i
			}
			break
		}
	}
	return len(p)
}

// finish queues the last event, a result or an error, after the output,
// and before it what the streams still hold, as it is.
func (e *sseWriter) finish(name string, v any) {
	e.mu.Lock()
	if !e.closed {
		if !e.gone && !e.behind {
			for _, s := range slices.Sorted(maps.Keys(e.held)) {
				e.queue(s, e.held[s])
			}
		}
		e.held = nil
		e.final, e.closed = &chunk{name: name, v: v}, true
	}
	e.mu.Unlock()
	e.signal()
}

// wait returns once the writer has sent everything queued, or given up on
// the client. Without finish before it, nothing more is sent.
func (e *sseWriter) wait() {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	e.signal()
	<-e.done
}

// signal wakes the writer's goroutine. e.mu may be held.
func (e *sseWriter) signal() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// run is the writer's goroutine.
func (e *sseWriter) run() {
	defer close(e.done)
	h := e.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	e.w.WriteHeader(http.StatusOK)
	err := e.rc.Flush()
	for err == nil {
		e.mu.Lock()
		for len(e.pending) == 0 && (!e.behind || e.told) && !e.closed {
			e.mu.Unlock()
			<-e.wake
			e.mu.Lock()
		}
		batch := e.pending
		e.pending = nil
		tell := e.behind && !e.told
		e.told = e.told || tell
		final, last := e.final, e.closed
		e.mu.Unlock()

		var sent int64
		for _, c := range batch {
			if len(c.data) == 0 {
				continue // never queued; an empty event would say nothing
			}
			ev := map[string]any{"data": strings.ToValidUTF8(string(c.data), "\uFFFD")}
			if !utf8.Valid(c.data) {
				ev["data_b64"] = c.data // encoding/json writes []byte as base64
			}
			if err = e.event(c.name, ev); err != nil {
				break
			}
			sent += int64(len(c.data))
		}
		if err == nil && tell {
			err = e.event("overflow", map[string]string{"message": fmt.Sprintf(
				"server: the client fell more than %d bytes behind the output: live output stops here, the result follows when the run ends", e.limit)})
		}
		if err == nil && final != nil {
			err = e.event(final.name, final.v)
		}
		if err == nil {
			err = e.rc.Flush()
		}
		e.mu.Lock()
		e.size -= sent
		e.mu.Unlock()
		if last {
			break
		}
	}
	if err != nil {
		e.mu.Lock()
		e.gone, e.pending, e.size = true, nil, 0
		e.mu.Unlock()
	}
}

// event writes one event whose data is v as JSON.
func (e *sseWriter) event(name string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Fprintf(e.w, "event: %s\ndata: %s\n\n", name, data)
	return err
}

type writerFunc func(p []byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
