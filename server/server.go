// Package server is moat's HTTP API: one-shot runs, sessions with files and
// an optional live interpreter, streaming of a run's output as server-sent
// events, bearer-token auth, named network profiles that a token may be
// granted (a request names one, never a policy of its own), caps, run slots shared fairly between tokens
// with a bounded queue, timeouts that no slow client outlasts, Prometheus
// metrics, and session records in an embedded database so that a restarted
// server knows what a crashed one left behind. Sessions can be suspended
// (their state on disk under <state_dir>/suspended, nothing running) by
// the API, by the sweep when Config.OnIdle is "suspend", and at Shutdown;
// the next use resumes them, in this server or the next one on the state
// directory.
//
// It serves any moat.Sandbox, one per level, and never names a concrete
// level: sessions are offered where the sandbox implements moat.Sessioner,
// and refused with 501 elsewhere; suspend where the sessions implement
// moat.Suspender and the sandbox moat.Resumer. The routes are listed in routes() and
// documented in openapi.json, which the server serves at /openapi.json.
//
// Request bodies are JSON sent as Content-Type: application/json (a form,
// as curl -d sends by default, is 415 unsupported_media_type). A result's
// stdout and stderr are text; a stream that is not valid UTF-8 is also
// given exactly, in base64 (stdout_b64, stderr_b64; data_b64 in events).
// Files are listed with their kind (file, dir, symlink, other) and their
// permissions in octal ("0755"). /healthz names the build (package
// internal/version). server/README.md has a quickstart of curl commands
// that TestREADMEQuickstart runs; the clients in clients/python and
// clients/js are tested against a real server by TestPythonClient and
// TestJSClient.
//
// Every error is a JSON body {"error": {"code", "message"}} whose code is
// stable; errorTable maps error classes to statuses.
//
// Another API in the same process (package e2b, E2B's API) uses the same
// sessions, owners, caps and run slots through the small exported seam in
// front.go: CreateSession, Session, Sessions, UseSession, RunSession,
// SuspendSession, ResumeSession, ExtendSession and EndSession; its own
// record of a session (SessionSpec.Front, SetFront, FrontSessions) is kept
// in the session's record, so that it lasts exactly as the session does.
package server

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"mime"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/version"
)

//go:embed openapi.json
var openAPI []byte

// Server serves the API. Create it with New; it is safe for concurrent
// use.
type Server struct {
	cfg     Config
	log     *slog.Logger
	store   *store
	metrics *metrics
	tokens  []tokenHash
	// grants are the network profiles each token may use, by token
	// name; read-only after New.
	grants  map[string]map[string]bool
	handler http.Handler

	slots *slots

	// base is the parent of every run's context; cancelled when Shutdown
	// gives up waiting.
	base       context.Context
	cancelBase context.CancelFunc

	// snapMu guards snapshots; a fork holds it for reading while it
	// reads a snapshot's state, a DELETE for writing.
	snapMu    sync.RWMutex
	snapshots map[string]snapshotRecord

	mu       sync.Mutex
	sessions map[string]*session
	closing  bool
	srv      *http.Server

	sweepDone chan struct{}
	stopSweep chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// New opens the state directory's database, keeps the suspended sessions
// recorded there (see recover), removes what a server that did not shut
// down cleanly left of its running ones, and returns the server.
//
// Resources of those sessions (directories, processes, containers) are
// reaped by the levels themselves when they are opened: open the sandboxes
// before calling New.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	st, err := openStore(cfg.StateDir)
	if err != nil {
		return nil, err
	}
	s := &Server{
		cfg:       cfg,
		log:       cfg.Logger,
		store:     st,
		metrics:   newMetrics(cfg.Registry),
		sessions:  map[string]*session{},
		snapshots: map[string]snapshotRecord{},
		sweepDone: make(chan struct{}),
		stopSweep: make(chan struct{}),
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	s.grants = map[string]map[string]bool{}
	for _, t := range cfg.Tokens {
		s.tokens = append(s.tokens, tokenHash{t.Name, sha256.Sum256([]byte(t.Token))})
		s.grants[t.Name] = map[string]bool{}
		for _, p := range t.NetworkProfiles {
			s.grants[t.Name][p] = true
		}
	}
	s.slots = newSlots(cfg.MaxConcurrentRuns, cfg.MaxRunsPerToken, cfg.QueueLength, cfg.QueuePerToken, func(running, waiting int) {
		s.metrics.running.Set(float64(running))
		s.metrics.queue.Set(float64(waiting))
	})
	s.base, s.cancelBase = context.WithCancel(context.Background())
	for l := range cfg.Sandboxes {
		s.metrics.sessions.WithLabelValues(string(l)).Set(0)
	}
	for p := range cfg.Profiles {
		s.metrics.profileSessions.WithLabelValues(p).Set(0)
	}
	if err := s.recover(); err != nil {
		st.close()
		return nil, err
	}
	if err := s.recoverSnapshots(); err != nil {
		st.close()
		return nil, err
	}
	s.metrics.registerStates(s.countState)
	s.metrics.reg.MustRegister(newPoolCollector(cfg))
	s.handler = s.routes()
	go s.sweep()
	return s, nil
}

// countState is how many sessions are in state.
func (s *Server) countState(state string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, ss := range s.sessions {
		if ss.creating {
			continue
		}
		ss.mu.Lock()
		if ss.rec.state() == state {
			n++
		}
		ss.mu.Unlock()
	}
	return n
}

// StateDir is the directory of the server's database.
func (s *Server) StateDir() string { return s.cfg.StateDir }

// Handler returns the server's HTTP handler.
func (s *Server) Handler() http.Handler { return s.handler }

// ListenAndServe listens on Config.Addr and serves until Shutdown.
func (s *Server) ListenAndServe() error {
	l, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	return s.Serve(l)
}

// Serve serves on l until Shutdown; it then returns http.ErrServerClosed.
// It holds at most Config.MaxConnections connections of l open at once and
// applies the read, write and idle timeouts of the Config; Handler alone
// applies only the write timeout.
func (s *Server) Serve(l net.Listener) error {
	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		l.Close()
		return http.ErrServerClosed
	}
	if s.srv == nil {
		s.srv = &http.Server{
			Handler:           s.handler,
			ReadHeaderTimeout: time.Duration(s.cfg.ReadHeaderTimeout),
			ReadTimeout:       time.Duration(s.cfg.ReadTimeout),
			IdleTimeout:       time.Duration(s.cfg.ConnIdleTimeout),
			// No WriteTimeout: it would bound the whole handling, a
			// run included; the handlers set a deadline per write.
			BaseContext: func(net.Listener) context.Context { return s.base },
		}
	}
	srv := s.srv
	s.mu.Unlock()
	return srv.Serve(newLimitListener(l, s.cfg.MaxConnections, func(delta int) { s.metrics.conns.Add(float64(delta)) }))
}

// Shutdown stops accepting requests, waits for those in progress until ctx
// ends (then cancels the runs still going), and closes the database. With
// Config.OnIdle "suspend" it suspends every running session (each bounded
// by a minute; one that cannot be suspended is ended), so that the next
// server on the state directory resumes them; with "end" it ends them.
// Suspended and broken sessions stay as they are, for the next server.
// Sessions ended this way are not left for recovery. It is safe to call
// more than once.
func (s *Server) Shutdown(ctx context.Context) error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closing = true
		srv := s.srv
		s.mu.Unlock()
		var errs []error
		if srv != nil {
			done := make(chan error, 1)
			go func() { done <- srv.Shutdown(ctx) }()
			select {
			case err := <-done:
				if err != nil {
					errs = append(errs, err)
				}
			case <-ctx.Done():
				s.cancelBase()
				srv.Close()
				errs = append(errs, <-done)
			}
		}
		s.cancelBase()
		close(s.stopSweep)
		<-s.sweepDone
		s.mu.Lock()
		all := make([]*session, 0, len(s.sessions))
		for _, ss := range s.sessions {
			all = append(all, ss)
		}
		s.mu.Unlock()
		for _, ss := range all {
			ss.mu.Lock()
			state, creating := ss.rec.state(), ss.creating
			ss.mu.Unlock()
			switch {
			case creating || state != stateRunning:
				// Suspended and broken sessions wait for the next server.
			case s.cfg.OnIdle == OnIdleSuspend:
				sctx, cancel := context.WithTimeout(context.Background(), suspendBound)
				err := s.suspend(sctx, ss, "shutdown", 0)
				cancel()
				if err != nil {
					s.log.Warn("server: a session could not be suspended at shutdown: ending it", "session", ss.rec.ID, "err", err)
					s.endSession(ss, "shutdown")
				}
			default:
				s.endSession(ss, "shutdown")
			}
		}
		if err := s.store.close(); err != nil {
			errs = append(errs, err)
		}
		s.closeErr = errors.Join(errs...)
	})
	return s.closeErr
}

// Close is Shutdown without waiting for requests in progress.
func (s *Server) Close() error {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	return s.Shutdown(ctx)
}

// route is one endpoint. Every route but the public ones needs a token.
type route struct {
	method, pattern string
	public          bool
	h               func(w http.ResponseWriter, r *http.Request, owner string) error
}

func (s *Server) routeTable() []route {
	return []route{
		{"GET", "/healthz", true, s.handleHealth},
		{"GET", "/metrics", true, nil}, // promhttp
		{"GET", "/openapi.json", true, s.handleOpenAPI},
		{"GET", "/v1/levels", false, s.handleLevels},
		{"GET", "/v1/network_profiles", false, s.handleNetworkProfiles},
		{"POST", "/v1/runs", false, s.handleRun},
		{"POST", "/v1/sessions", false, s.handleCreateSession},
		{"GET", "/v1/sessions", false, s.handleListSessions},
		{"GET", "/v1/sessions/{id}", false, s.handleGetSession},
		{"DELETE", "/v1/sessions/{id}", false, s.handleDeleteSession},
		{"POST", "/v1/sessions/{id}/runs", false, s.handleSessionRun},
		{"POST", "/v1/sessions/{id}/suspend", false, s.handleSuspend},
		{"POST", "/v1/sessions/{id}/resume", false, s.handleResume},
		{"POST", "/v1/sessions/{id}/snapshots", false, s.handleSnapshot},
		{"GET", "/v1/snapshots", false, s.handleListSnapshots},
		{"DELETE", "/v1/snapshots/{id}", false, s.handleDeleteSnapshot},
		{"GET", "/v1/sessions/{id}/files", false, s.handleListFiles},
		{"PUT", "/v1/sessions/{id}/files/{path...}", false, s.handlePutFile},
		{"GET", "/v1/sessions/{id}/files/{path...}", false, s.handleGetFile},
		{"DELETE", "/v1/sessions/{id}/files/{path...}", false, s.handleDeleteFile},
		{"GET", "/v1/sessions/{id}/stat/{path...}", false, s.handleStatFile},
		{"POST", "/v1/sessions/{id}/dirs/{path...}", false, s.handleMkdir},
		{"POST", "/v1/sessions/{id}/rename", false, s.handleRename},
	}
}

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	seen := map[string]bool{}
	for _, rt := range s.routeTable() {
		if rt.h == nil {
			mux.Handle(rt.method+" "+rt.pattern, promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
		} else {
			mux.Handle(rt.method+" "+rt.pattern, s.wrap(rt))
		}
		if !seen[rt.pattern] {
			// Any other method on a known path: a JSON 405.
			seen[rt.pattern] = true
			mux.HandleFunc(rt.pattern, func(w http.ResponseWriter, r *http.Request) {
				s.writeError(w, r, fmt.Errorf("%s %s: %w", r.Method, r.URL.Path, errMethod))
			})
		}
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		s.writeError(w, r, fmt.Errorf("no route %s: %w", r.URL.Path, errNotFound))
	})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The mux would redirect a path with dot segments or empty
		// elements to its cleaned form; such a path is refused instead,
		// so that "../" in a file name never lands elsewhere.
		if p := r.URL.Path; strings.Contains(p, "//") || strings.Contains(p, "/./") || strings.Contains(p, "/../") ||
			strings.HasSuffix(p, "/.") || strings.HasSuffix(p, "/..") {
			s.writeError(w, r, fmt.Errorf("path %q has empty, \".\" or \"..\" elements: %w", p, moat.ErrInvalid))
			return
		}
		mux.ServeHTTP(w, r)
	})
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request, _ string) error {
	s.mu.Lock()
	closing := s.closing
	s.mu.Unlock()
	if closing {
		return errShuttingDown
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok", "version": version.String()})
	return nil
}

func (s *Server) handleOpenAPI(w http.ResponseWriter, r *http.Request, _ string) error {
	w.Header().Set("Content-Type", "application/json")
	w.Write(openAPI)
	return nil
}

// levelInfo describes a served level.
type levelInfo struct {
	Level    moat.Level `json:"level"`
	Default  bool       `json:"default"`
	Sessions bool       `json:"sessions"`
	// Suspend says the level's sessions can be suspended and resumed
	// (moat.Resumer), and SuspendMemory that their memory (a live
	// interpreter's variables) is kept too, not only their files.
	Suspend       bool `json:"suspend"`
	SuspendMemory bool `json:"suspend_memory"`
}

func (s *Server) handleLevels(w http.ResponseWriter, r *http.Request, _ string) error {
	out := []levelInfo{}
	for _, l := range moat.Levels {
		if sb, ok := s.cfg.Sandboxes[l]; ok {
			_, sess := sb.(moat.Sessioner)
			_, res := sb.(moat.Resumer)
			mk, _ := sb.(moat.MemoryKeeper)
			out = append(out, levelInfo{Level: l, Default: l == s.cfg.DefaultLevel, Sessions: sess, Suspend: sess && res,
				SuspendMemory: sess && res && mk != nil && mk.SuspendKeepsMemory()})
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"levels": out})
	return nil
}

// profileInfo describes a network profile to a token that may use it.
type profileInfo struct {
	Name string `json:"name"`
	// Levels are the levels served with the profile.
	Levels []moat.Level `json:"levels"`
	// Allow is the profile's network.allow; nil when the server was not
	// given the profile's policy.
	Allow   []string     `json:"allow"`
	Secrets []secretInfo `json:"secrets,omitempty"`
}

// secretInfo is a secret as a token holder may see it: the variable the
// code gets a placeholder in, and the hosts that get the real value.
type secretInfo struct {
	Name  string   `json:"name"`
	Hosts []string `json:"hosts"`
}

func (s *Server) handleNetworkProfiles(w http.ResponseWriter, r *http.Request, owner string) error {
	out := []profileInfo{}
	for _, name := range slices.Sorted(maps.Keys(s.grants[owner])) {
		p := profileInfo{Name: name, Levels: []moat.Level{}}
		for _, l := range moat.Levels {
			if _, ok := s.cfg.Profiles[name][l]; ok {
				p.Levels = append(p.Levels, l)
			}
		}
		if e, ok := s.cfg.ProfilePolicies[name]; ok {
			p.Allow = []string{}
			if e.Network != nil {
				p.Allow = append(p.Allow, e.Network.Allow...)
			}
			for _, sn := range slices.Sorted(maps.Keys(e.Secrets)) {
				p.Secrets = append(p.Secrets, secretInfo{Name: sn, Hosts: append([]string{}, e.Secrets[sn].Hosts...)})
			}
		}
		out = append(out, p)
	}
	writeJSON(w, http.StatusOK, map[string]any{"network_profiles": out})
	return nil
}

// decode reads a JSON body of at most MaxBodyBytes into v: one value,
// known fields only, the right types. A body announced as anything but
// application/json (a form, as curl -d sends by default) is refused with
// 415 unsupported_media_type; one with no Content-Type is read as JSON.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
			hint := ""
			if mt == "application/x-www-form-urlencoded" {
				// What curl -d sends unless told otherwise.
				hint = " (curl -d sends a form unless given -H 'Content-Type: application/json')"
			}
			return fmt.Errorf("body of type %q: send the body as JSON, with the header Content-Type: application/json%s: %w", ct, hint, errMediaType)
		}
	}
	body := http.MaxBytesReader(w, r.Body, int64(s.cfg.MaxBodyBytes))
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil {
		_, err = dec.Token()
		switch {
		case errors.Is(err, io.EOF):
			return nil
		case err == nil:
			err = errors.New("more than one JSON value")
		}
	}
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
		return fmt.Errorf("body over %v: %w", s.cfg.MaxBodyBytes, errBodyTooLarge)
	}
	if errors.Is(err, moat.ErrInvalid) {
		return err
	}
	return badRequest("body: %v", err)
}
