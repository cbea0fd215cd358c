// One-shot runs and execute, which every run goes through: the slot, the stream, the answer.

package server

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/moatsandbox/moat"
)

// runRequest is the body of POST /v1/runs and POST /v1/sessions/{id}/runs.
type runRequest struct {
	Level moat.Level `json:"level,omitempty"` // one-shot runs only
	// Network names the network profile of a one-shot run; a session's
	// run may only repeat its session's.
	Network profileRef `json:"network,omitempty"`
	Code    *string    `json:"code"`
	Stream  bool       `json:"stream,omitempty"`
}

// profileRef is a request's "network": the name of a network profile the
// operator defined, or empty (or null) for the default sandboxes. Anything
// but a string is refused, an object or a list of hosts above all: a
// request never carries a policy of its own.
type profileRef string

func (p *profileRef) UnmarshalJSON(b []byte) error {
	var name string
	if err := json.Unmarshal(b, &name); err != nil {
		return badRequest("network: want the name of a network profile (a string, see GET /v1/network_profiles); a request cannot carry a policy of its own")
	}
	*p = profileRef(name)
	return nil
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

// sandbox returns what owner's request for level l (empty: the default
// level) and network profile network (empty: none) runs in: a default
// sandbox, or the profile's sandbox of that level when owner's token may
// use the profile. A profile that exists but is not the token's, and one
// that does not exist, get the same error.
func (s *Server) sandbox(owner string, l moat.Level, network profileRef) (moat.Level, moat.Sandbox, error) {
	if l == "" {
		l = s.cfg.DefaultLevel
	}
	if network != "" && !s.grants[owner][string(network)] {
		// The log, for the operator, tells the two cases apart.
		_, exists := s.cfg.Profiles[string(network)]
		s.log.Info("server: network profile refused", "owner", owner, "network", string(network), "defined", exists)
		return l, nil, fmt.Errorf("network profile %q is not one this token may use (see GET /v1/network_profiles): %w", network, errProfileForbidden)
	}
	sb, ok := s.cfg.Sandboxes[l]
	if !ok {
		return l, nil, fmt.Errorf("level %q is not served here (see GET /v1/levels): %w", l, errUnknownLevel)
	}
	if network != "" {
		if sb, ok = s.cfg.Profiles[string(network)][l]; !ok {
			return l, nil, fmt.Errorf("level %s is not served with network profile %q (see GET /v1/network_profiles): %w", l, network, errUnknownLevel)
		}
	}
	return l, sb, nil
}

func (s *Server) handleRun(w http.ResponseWriter, r *http.Request, owner string) error {
	req, err := s.readRun(w, r)
	if err != nil {
		return err
	}
	level, sb, err := s.sandbox(owner, req.Level, req.Network)
	if err != nil {
		return err
	}
	return s.execute(w, r, owner, level, string(req.Network), "", sb.Run, req)
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
// (see sseWriter). network is the run's network profile, for the logs and
// metrics ("" for none).
func (s *Server) execute(w http.ResponseWriter, r *http.Request, owner string, level moat.Level, network, sessionID string, run runFunc, req runRequest) error {
	ctx := r.Context()
	release, err := s.acquireSlot(ctx, owner)
	if err != nil {
		return err
	}
	defer release()
	id := newID("r")
	w.Header().Set("X-Moat-Run-Id", id)
	// The token is the tenant: a level that recycles instances reuses one
	// only for runs of the same token (moat.Request.Tenant).
	mreq := moat.Request{Code: []byte(*req.Code), Tenant: owner}
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
	if network != "" {
		s.metrics.profileRuns.WithLabelValues(network, string(level)).Inc()
		attrs = append(attrs, "network", network)
	}
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
		sse.finish("result", resultView{res})
		return nil
	}
	writeJSON(w, http.StatusOK, resultView{res})
	return nil
}

// resultView is a Result as the API answers it: moat.Result's JSON (the
// `moat run --json` fields, stdout and stderr as text in which bytes that
// are not UTF-8 became U+FFFD), plus stdout_b64 and stderr_b64, the exact
// bytes in standard base64, for each stream that is not valid UTF-8 and
// only then. A client that needs the bytes takes the _b64 field when it is
// there and the text's UTF-8 otherwise.
type resultView struct{ r *moat.Result }

func (v resultView) MarshalJSON() ([]byte, error) {
	data, err := json.Marshal(v.r)
	if err != nil || (utf8.Valid(v.r.Stdout) && utf8.Valid(v.r.Stderr)) {
		return data, err
	}
	extra, err := json.Marshal(struct {
		Stdout []byte `json:"stdout_b64,omitempty"`
		Stderr []byte `json:"stderr_b64,omitempty"`
	}{rawIfInvalid(v.r.Stdout), rawIfInvalid(v.r.Stderr)})
	if err != nil {
		return nil, err
	}
	// Both are JSON objects: splice the second's fields into the first.
	data = bytes.TrimRight(data, " \n")
	return append(append(data[:len(data)-1], ','), extra[1:]...), nil
}

// rawIfInvalid is p if it is not valid UTF-8, else nil.
func rawIfInvalid(p []byte) []byte {
	if utf8.Valid(p) {
		return nil
	}
	return p
}

// newID returns a random id with a prefix.
func newID(prefix string) string {
	var b [12]byte
	rand.Read(b[:])
	return prefix + "_" + hex.EncodeToString(b[:])
}
