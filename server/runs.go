// One-shot runs and execute, which every run goes through: the slot, the stream, the answer.

package server

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
)

// runRequest is the body of POST /v1/runs and POST /v1/sessions/{id}/runs.
type runRequest struct {
	Level  moat.Level `json:"level,omitempty"` // one-shot runs only
	Code   *string    `json:"code"`
	Stream bool       `json:"stream,omitempty"`
}

func (s *Server) readRun(w http.ResponseWriter, r *http.Request) (runRequest, error) {
	var req runRequest
	if err := s.decode(w, r, &req); err != nil {
		return req, err
	}
	if req.Code == nil || *req.Code == "" {
		return req, badRequest("code is missing or empty")
	}
	if len(*req.Code) > int(s.cfg.MaxCodeBytes) {
		return req, fmt.Errorf("code of %d bytes is over the %v cap: %w", len(*req.Code), s.cfg.MaxCodeBytes, errCodeTooLarge)
	}
	if strings.Contains(r.Header.Get("Accept"), "text/event-stream") {
		req.Stream = true
	}
	return req, nil
}

func (s *Server) sandbox(l moat.Level) (moat.Level, moat.Sandbox, error) {
	if l == "" {
		l = s.cfg.DefaultLevel
	}
	sb, ok := s.cfg.Sandboxes[l]
	if !ok {
		return l, nil, fmt.Errorf("level %q is not served here (see GET /v1/levels): %w", l, errUnknownLevel)
	}
	return l, sb, nil
}

func (s *Server) handleRun(w http.ResponseWriter, r *http.Request, owner string) error {
	req, err := s.readRun(w, r)
	if err != nil {
		return err
	}
	level, sb, err := s.sandbox(req.Level)
	if err != nil {
		return err
	}
	return s.execute(w, r, owner, level, "", sb.Run, req)
}

// runFunc is a Sandbox's or a Session's Run.
type runFunc func(ctx context.Context, req moat.Request) (*moat.Result, error)

// acquireSlot waits in the bounded queue for a run slot of owner.
func (s *Server) acquireSlot(ctx context.Context, owner string) (release func(), err error) {
	release, err = s.slots.acquire(ctx, owner, time.Duration(s.cfg.QueueWait))
	switch {
	case errors.Is(err, errTokenBusy):
		s.metrics.rejected.WithLabelValues("token_busy").Inc()
	case errors.Is(err, errBusy):
		s.metrics.rejected.WithLabelValues("busy").Inc()
	case errors.Is(err, errQueueTimeout):
		s.metrics.rejected.WithLabelValues("queue_timeout").Inc()
	}
	return release, err
}

// execute runs req through run, in a slot, answering with the result as
// JSON or as a stream of server-sent events. The slot is given back as soon
// as run returns — the run's processes, files and cgroups are gone then —
// and the answer is written after: a client that reads slowly, or not at
// all, holds its connection and the result in memory (bounded by the output
// cap), never a slot. A streaming run never waits for its client either
// (see sseWriter).
func (s *Server) execute(w http.ResponseWriter, r *http.Request, owner string, level moat.Level, sessionID string, run runFunc, req runRequest) error {
	ctx := r.Context()
	release, err := s.acquireSlot(ctx, owner)
	if err != nil {
		return err
	}
	defer release()
	id := newID("r")
	w.Header().Set("X-Moat-Run-Id", id)
	mreq := moat.Request{Code: []byte(*req.Code)}
	var sse *sseWriter
	if req.Stream {
		sse = newSSE(w, int64(s.cfg.StreamBuffer), s.metrics.overflows.Inc)
		if sse == nil {
			return badRequest("streaming needs a connection that can be flushed")
		}
		// Whatever happens, the handler returns only once the writer
		// has stopped touching w.
		defer sse.wait()
		mreq.Stdout = sse.stream("stdout")
		mreq.Stderr = sse.stream("stderr")
	}
	start := time.Now()
	res, err := run(ctx, mreq)
	release()
	elapsed := time.Since(start)
	s.metrics.latency.WithLabelValues(string(level)).Observe(elapsed.Seconds())
	reason := "none"
	if err != nil {
		reason = "error"
	} else if res.Reason != "" {
		reason = string(res.Reason)
	}
	s.metrics.runs.WithLabelValues(string(level), reason).Inc()
	attrs := []any{"id", id, "level", level, "owner", owner, "duration", elapsed, "reason", reason}
	if sessionID != "" {
		attrs = append(attrs, "session", sessionID)
	}
	if err != nil {
		s.log.Info("run", append(attrs, "err", err)...)
		if sse != nil {
			// The status line is sent already: the error is an event.
			_, code := classify(err)
			var body errorBody
			body.Error.Code, body.Error.Message = code, err.Error()
			sse.finish("error", body)
			return nil
		}
		return err
	}
	s.log.Info("run", append(attrs, "exit_code", res.ExitCode, "stream", req.Stream)...)
	if sse != nil {
		sse.finish("result", res)
		return nil
	}
	writeJSON(w, http.StatusOK, res)
	return nil
}

// newID returns a random id with a prefix.
func newID(prefix string) string {
	var b [12]byte
	rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}
