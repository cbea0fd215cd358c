// Package server is moat's HTTP API: one-shot runs, sessions with files and
// an optional live interpreter, streaming of a run's output as server-sent
// events, bearer-token auth, caps, run slots shared fairly between tokens
// with a bounded queue, timeouts that no slow client outlasts, Prometheus
// metrics, and session records in an embedded database so that a restarted
// server knows what a crashed one left behind.
//
// It serves any moat.Sandbox, one per level, and never names a concrete
// level: sessions are offered where the sandbox implements moat.Sessioner,
// and refused with 501 elsewhere. The routes are listed in routes() and
// documented in openapi.json, which the server serves at /openapi.json.
//
// Every error is a JSON body {"error": {"code", "message"}} whose code is
// stable; errorTable maps error classes to statuses.
package server

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	_ "embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/moatsandbox/moat"
)

//go:embed openapi.json
var openAPI []byte

// Token is one bearer token the operator gives out. Name identifies its
// holder in logs, metrics and session ownership; it is never secret.
type Token struct {
	Name  string `json:"name"`
	Token string `json:"token"`
}

// Config configures a Server. Zero values are documented per field.
type Config struct {
	// Sandboxes are the levels served. At least one is required. The
	// server does not close them.
	Sandboxes map[moat.Level]moat.Sandbox `json:"-"`
	// DefaultLevel is used when a request names none. Zero means
	// subprocess when served, else the lightest level served.
	DefaultLevel moat.Level `json:"default_level,omitempty"`
	// Tokens are the accepted bearer tokens. At least one is required: a
	// server without tokens would serve no one.
	Tokens []Token `json:"tokens"`
	// Addr is where ListenAndServe listens. Zero means 127.0.0.1:8080.
	Addr string `json:"addr,omitempty"`
	// StateDir holds the session database. Zero means /var/lib/moat when
	// root, else $XDG_STATE_HOME/moat or ~/.local/state/moat.
	StateDir string `json:"state_dir,omitempty"`

	// MaxCodeBytes caps the code of one run. Zero means 1MiB.
	MaxCodeBytes moat.Bytes `json:"max_code_bytes,omitempty"`
	// MaxBodyBytes caps a JSON request body. Zero means MaxCodeBytes plus
	// 64KiB (JSON escaping can make code longer: send it as it is).
	MaxBodyBytes moat.Bytes `json:"max_body_bytes,omitempty"`
	// MaxFileBytes caps one uploaded file. Zero means 16MiB; the level's
	// own file size and disk limits apply as well.
	MaxFileBytes moat.Bytes `json:"max_file_bytes,omitempty"`
	// MaxSessionsPerToken caps the sessions one token holds at once. Zero
	// means 16.
	MaxSessionsPerToken int `json:"max_sessions_per_token,omitempty"`
	// MaxConcurrentRuns is how many runs execute at once, all levels and
	// tokens together. Zero means twice the number of CPUs.
	MaxConcurrentRuns int `json:"max_concurrent_runs,omitempty"`
	// QueueLength is how many runs may wait for a slot; one more gets 429
	// with Retry-After. Zero means 64.
	QueueLength int `json:"queue_length,omitempty"`
	// QueueWait is the longest a run waits for a slot before it gets 503
	// with Retry-After. Zero means 30s.
	QueueWait moat.Duration `json:"queue_wait,omitempty"`
	// MaxRunsPerToken is how many runs of one token execute at once, so
	// that one token cannot take every slot: its further runs wait in the
	// queue while other tokens' runs start. Zero means half of
	// MaxConcurrentRuns, rounded up, or all of them when there is one
	// token; more than MaxConcurrentRuns means MaxConcurrentRuns.
	MaxRunsPerToken int `json:"max_runs_per_token,omitempty"`
	// QueuePerToken is how many runs of one token may wait for a slot;
	// one more gets 429 token_busy with Retry-After. Zero means half of
	// QueueLength, rounded up, or all of it when there is one token.
	QueuePerToken int `json:"queue_per_token,omitempty"`
	// StreamBuffer is how far a streaming client may fall behind the
	// code's output, in bytes, before live output to it stops (it gets an
	// overflow event, then the result when the run ends). The run itself
	// never waits for a client. Zero means 2MiB, twice the default output
	// cap.
	StreamBuffer moat.Bytes `json:"stream_buffer,omitempty"`

	// ReadHeaderTimeout is the longest a connection may take to send a
	// request's headers; a connection that sends nothing is closed then.
	// Zero means 10s.
	ReadHeaderTimeout moat.Duration `json:"read_header_timeout,omitempty"`
	// ReadTimeout is the longest a connection may take to send a whole
	// request, headers and body. It does not bound the handling: a run
	// may last longer. Zero means 1m.
	ReadTimeout moat.Duration `json:"read_timeout,omitempty"`
	// WriteTimeout is the longest one write of a response may block on a
	// client that does not read; the client is then dropped as gone, and a
	// run still going for it is cancelled, as when a client disconnects
	// (a streaming run whose client stopped reading while output was
	// being sent to it). It is set anew before each write, so a long
	// stream is not bounded by it. Zero means 30s.
	WriteTimeout moat.Duration `json:"write_timeout,omitempty"`
	// ConnIdleTimeout closes a keep-alive connection that sends no new
	// request for that long. Zero means 1m.
	ConnIdleTimeout moat.Duration `json:"conn_idle_timeout,omitempty"`
	// MaxConnections caps the connections Serve holds open at once, with
	// or without a token; further ones wait in the listen backlog until
	// one closes. Zero means 512.
	MaxConnections int `json:"max_connections,omitempty"`

	// SessionTTL is a session's time to live when the request names none.
	// Zero means 30m.
	SessionTTL moat.Duration `json:"session_ttl,omitempty"`
	// MaxSessionTTL caps the time to live a request may ask for. Zero
	// means 8h.
	MaxSessionTTL moat.Duration `json:"max_session_ttl,omitempty"`
	// IdleTimeout ends a session with no run and no file operation for
	// that long, when the request names none. Zero means 10m.
	IdleTimeout moat.Duration `json:"idle_timeout,omitempty"`
	// SweepInterval is how often expired and idle sessions are looked
	// for. Zero means 1s.
	SweepInterval moat.Duration `json:"sweep_interval,omitempty"`

	// Logger gets one line per run and per session event. Nil means
	// discard.
	Logger *slog.Logger `json:"-"`
}

func (c Config) withDefaults() Config {
	if c.DefaultLevel == "" {
		if _, ok := c.Sandboxes[moat.LevelSubprocess]; ok {
			c.DefaultLevel = moat.LevelSubprocess
		} else {
			for _, l := range moat.Levels {
				if _, ok := c.Sandboxes[l]; ok {
					c.DefaultLevel = l
					break
				}
			}
		}
	}
	if c.Addr == "" {
		c.Addr = "127.0.0.1:8080"
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir()
	}
	if c.MaxCodeBytes == 0 {
		c.MaxCodeBytes = moat.MiB
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = c.MaxCodeBytes + 64*moat.KiB
	}
	if c.MaxFileBytes == 0 {
		c.MaxFileBytes = 16 * moat.MiB
	}
	if c.MaxSessionsPerToken == 0 {
		c.MaxSessionsPerToken = 16
	}
	if c.MaxConcurrentRuns == 0 {
		c.MaxConcurrentRuns = 2 * numCPU()
	}
	if c.QueueLength == 0 {
		c.QueueLength = 64
	}
	if c.QueueWait == 0 {
		c.QueueWait = moat.Duration(30 * time.Second)
	}
	// With one token there is no one to be fair to.
	if c.MaxRunsPerToken == 0 {
		c.MaxRunsPerToken = (c.MaxConcurrentRuns + 1) / 2
		if len(c.Tokens) == 1 {
			c.MaxRunsPerToken = c.MaxConcurrentRuns
		}
	}
	c.MaxRunsPerToken = min(c.MaxRunsPerToken, c.MaxConcurrentRuns)
	if c.QueuePerToken == 0 {
		c.QueuePerToken = (c.QueueLength + 1) / 2
		if len(c.Tokens) == 1 {
			c.QueuePerToken = c.QueueLength
		}
	}
	if c.StreamBuffer == 0 {
		c.StreamBuffer = 2 * moat.MiB
	}
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = moat.Duration(10 * time.Second)
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = moat.Duration(time.Minute)
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = moat.Duration(30 * time.Second)
	}
	if c.ConnIdleTimeout == 0 {
		c.ConnIdleTimeout = moat.Duration(time.Minute)
	}
	if c.MaxConnections == 0 {
		c.MaxConnections = 512
	}
	if c.SessionTTL == 0 {
		c.SessionTTL = moat.Duration(30 * time.Minute)
	}
	if c.MaxSessionTTL == 0 {
		c.MaxSessionTTL = moat.Duration(8 * time.Hour)
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = moat.Duration(10 * time.Minute)
	}
	if c.SweepInterval == 0 {
		c.SweepInterval = moat.Duration(time.Second)
	}
	return c
}

// Validate reports whether c can serve; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	var errs []error
	if len(c.Sandboxes) == 0 {
		errs = append(errs, errors.New("no level to serve"))
	}
	for l, sb := range c.Sandboxes {
		if sb == nil {
			errs = append(errs, fmt.Errorf("level %s has no sandbox", l))
		}
	}
	if c.DefaultLevel != "" {
		if _, ok := c.Sandboxes[c.DefaultLevel]; !ok {
			errs = append(errs, fmt.Errorf("default level %s is not served", c.DefaultLevel))
		}
	}
	if len(c.Tokens) == 0 {
		errs = append(errs, errors.New("no bearer token: give at least one"))
	}
	names, secrets := map[string]bool{}, map[string]string{}
	for i, t := range c.Tokens {
		if t.Name == "" || len(t.Token) < 16 {
			errs = append(errs, fmt.Errorf("token %d needs a name and a secret of at least 16 characters", i))
		}
		if names[t.Name] {
			errs = append(errs, fmt.Errorf("token name %q given twice", t.Name))
		}
		names[t.Name] = true
		// One secret under two names would make its holders one owner,
		// each seeing the other's sessions.
		if other, ok := secrets[t.Token]; ok && t.Token != "" {
			errs = append(errs, fmt.Errorf("tokens %q and %q have the same secret", other, t.Name))
		}
		secrets[t.Token] = t.Name
	}
	if c.MaxCodeBytes < 0 || c.MaxBodyBytes < 0 || c.MaxFileBytes < 0 || c.MaxSessionsPerToken < 0 ||
		c.MaxConcurrentRuns < 0 || c.QueueLength < 0 || c.QueueWait < 0 || c.SessionTTL < 0 ||
		c.MaxSessionTTL < 0 || c.IdleTimeout < 0 || c.SweepInterval < 0 ||
		c.MaxRunsPerToken < 0 || c.QueuePerToken < 0 || c.StreamBuffer < 0 || c.ReadHeaderTimeout < 0 ||
		c.ReadTimeout < 0 || c.WriteTimeout < 0 || c.ConnIdleTimeout < 0 || c.MaxConnections < 0 {
		errs = append(errs, errors.New("caps and durations must not be negative"))
	}
	if d := c.withDefaults(); d.SessionTTL > d.MaxSessionTTL || d.IdleTimeout > d.MaxSessionTTL {
		errs = append(errs, fmt.Errorf("session ttl %v and idle timeout %v must be at most the maximum ttl %v", d.SessionTTL, d.IdleTimeout, d.MaxSessionTTL))
	}
	if len(errs) > 0 {
		return fmt.Errorf("server: config: %w: %w", errors.Join(errs...), moat.ErrInvalid)
	}
	return nil
}

// DefaultStateDir is where the session database lives when Config.StateDir
// is empty.
func DefaultStateDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/moat"
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "moat")
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".local", "state", "moat")
}

// Server serves the API. Create it with New; it is safe for concurrent
// use.
type Server struct {
	cfg     Config
	log     *slog.Logger
	store   *store
	metrics *metrics
	tokens  []tokenHash
	handler http.Handler

	slots *slots

	// base is the parent of every run's context; cancelled when Shutdown
	// gives up waiting.
	base       context.Context
	cancelBase context.CancelFunc

	mu       sync.Mutex
	sessions map[string]*session
	closing  bool
	srv      *http.Server

	sweepDone chan struct{}
	stopSweep chan struct{}
	closeOnce sync.Once
	closeErr  error
}

type tokenHash struct {
	name string
	sum  [32]byte
}

// New opens the state directory's database, removes what a server that did
// not shut down cleanly left recorded there, and returns the server.
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
		metrics:   newMetrics(),
		sessions:  map[string]*session{},
		sweepDone: make(chan struct{}),
		stopSweep: make(chan struct{}),
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	for _, t := range cfg.Tokens {
		s.tokens = append(s.tokens, tokenHash{t.Name, sha256.Sum256([]byte(t.Token))})
	}
	s.slots = newSlots(cfg.MaxConcurrentRuns, cfg.MaxRunsPerToken, cfg.QueueLength, cfg.QueuePerToken, func(running, waiting int) {
		s.metrics.running.Set(float64(running))
		s.metrics.queue.Set(float64(waiting))
	})
	s.base, s.cancelBase = context.WithCancel(context.Background())
	if err := s.recover(); err != nil {
		st.close()
		return nil, err
	}
	for l := range cfg.Sandboxes {
		s.metrics.sessions.WithLabelValues(string(l)).Set(0)
	}
	s.handler = s.routes()
	go s.sweep()
	return s, nil
}

// recover removes the records of sessions a previous server left.
func (s *Server) recover() error {
	recs, err := s.store.all()
	if err != nil {
		return fmt.Errorf("server: read sessions: %w", err)
	}
	for _, r := range recs {
		s.log.Warn("server: removing a session left by a server that did not shut down cleanly",
			"session", r.ID, "owner", r.Owner, "level", r.Level, "backend", r.Backend, "created_at", r.CreatedAt, "pid", r.PID)
		if err := s.store.delete(r.ID); err != nil {
			return fmt.Errorf("server: %w", err)
		}
		s.metrics.recovered.Inc()
	}
	return nil
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
// ends (then cancels the runs still going), ends every session and closes
// the database. Sessions ended this way are not left for recovery. It is
// safe to call more than once.
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
			s.endSession(ss, "shutdown")
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
		{"POST", "/v1/runs", false, s.handleRun},
		{"POST", "/v1/sessions", false, s.handleCreateSession},
		{"GET", "/v1/sessions", false, s.handleListSessions},
		{"GET", "/v1/sessions/{id}", false, s.handleGetSession},
		{"DELETE", "/v1/sessions/{id}", false, s.handleDeleteSession},
		{"POST", "/v1/sessions/{id}/runs", false, s.handleSessionRun},
		{"GET", "/v1/sessions/{id}/files", false, s.handleListFiles},
		{"PUT", "/v1/sessions/{id}/files/{path...}", false, s.handlePutFile},
		{"GET", "/v1/sessions/{id}/files/{path...}", false, s.handleGetFile},
		{"DELETE", "/v1/sessions/{id}/files/{path...}", false, s.handleDeleteFile},
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

// wrap authenticates and turns a handler's error into the JSON error. The
// handler's writes have a deadline each (Config.WriteTimeout). (net/http
// lifts the read deadline once the request is read, so ReadTimeout bounds
// the reading and not the handling.)
func (s *Server) wrap(rt route) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w := newDeadlineWriter(rw, time.Duration(s.cfg.WriteTimeout))
		// The final flush, after the handler, gets a full deadline too.
		defer w.extend()
		owner := ""
		if !rt.public {
			var ok bool
			owner, ok = s.authenticate(r)
			if !ok {
				w.Header().Set("WWW-Authenticate", `Bearer realm="moat"`)
				s.writeError(w, r, errUnauthorized)
				return
			}
		}
		if err := rt.h(w, r, owner); err != nil {
			s.writeError(w, r, err)
		}
	})
}

// authenticate returns the name of the request's token.
func (s *Server) authenticate(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	tok, ok := strings.CutPrefix(h, "Bearer ")
	if !ok || tok == "" {
		return "", false
	}
	sum := sha256.Sum256([]byte(tok))
	name, found := "", 0
	for _, t := range s.tokens {
		if subtle.ConstantTimeCompare(sum[:], t.sum[:]) == 1 {
			name, found = t.name, 1
		}
	}
	return name, found == 1
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request, _ string) error {
	s.mu.Lock()
	closing := s.closing
	s.mu.Unlock()
	if closing {
		return errShuttingDown
	}
	writeJSON(w, http.StatusOK, map[string]any{"status": "ok"})
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
}

func (s *Server) handleLevels(w http.ResponseWriter, r *http.Request, _ string) error {
	out := []levelInfo{}
	for _, l := range moat.Levels {
		if sb, ok := s.cfg.Sandboxes[l]; ok {
			_, sess := sb.(moat.Sessioner)
			out = append(out, levelInfo{Level: l, Default: l == s.cfg.DefaultLevel, Sessions: sess})
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"levels": out})
	return nil
}

// decode reads a JSON body of at most MaxBodyBytes into v: one value,
// known fields only, the right types.
func (s *Server) decode(w http.ResponseWriter, r *http.Request, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return badRequest("content type %q: send application/json", ct)
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

// Sessions.

// session is a live session and its record.
type session struct {
	rec  record
	sess moat.Session

	mu         sync.Mutex
	lastActive time.Time
	busy       int  // runs and file operations in progress
	ended      bool // set once, by endSession
}

// sessionView is a session as the API shows it.
type sessionView struct {
	ID           string        `json:"id"`
	Level        moat.Level    `json:"level"`
	Interpreter  bool          `json:"interpreter"`
	CreatedAt    time.Time     `json:"created_at"`
	ExpiresAt    time.Time     `json:"expires_at"`
	IdleTimeout  moat.Duration `json:"idle_timeout"`
	LastActiveAt time.Time     `json:"last_active_at"`
}

func (ss *session) view() sessionView {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return sessionView{
		ID: ss.rec.ID, Level: ss.rec.Level, Interpreter: ss.rec.Interpreter,
		CreatedAt: ss.rec.CreatedAt, ExpiresAt: ss.rec.ExpiresAt,
		IdleTimeout: ss.rec.IdleTimeout, LastActiveAt: ss.lastActive,
	}
}

// createRequest is the body of POST /v1/sessions.
type createRequest struct {
	Level       moat.Level     `json:"level,omitempty"`
	TTL         *moat.Duration `json:"ttl,omitempty"`
	IdleTimeout *moat.Duration `json:"idle_timeout,omitempty"`
	Interpreter bool           `json:"interpreter,omitempty"`
}

func (s *Server) handleCreateSession(w http.ResponseWriter, r *http.Request, owner string) error {
	var req createRequest
	if r.ContentLength != 0 { // no body: every default
		if err := s.decode(w, r, &req); err != nil {
			return err
		}
	}
	level, sb, err := s.sandbox(req.Level)
	if err != nil {
		return err
	}
	sr, ok := sb.(moat.Sessioner)
	if !ok {
		return fmt.Errorf("level %s: %w", level, errNoSessions)
	}
	ttl, idle := s.cfg.SessionTTL, s.cfg.IdleTimeout
	if req.TTL != nil {
		ttl = *req.TTL
	}
	if req.IdleTimeout != nil {
		idle = *req.IdleTimeout
	}
	if ttl <= 0 || ttl > s.cfg.MaxSessionTTL {
		return fmt.Errorf("ttl %v must be above zero and at most %v: %w", ttl, s.cfg.MaxSessionTTL, moat.ErrInvalid)
	}
	if idle <= 0 {
		return fmt.Errorf("idle_timeout %v must be above zero: %w", idle, moat.ErrInvalid)
	}
	if idle > ttl {
		idle = ttl
	}

	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return errShuttingDown
	}
	n := 0
	for _, ss := range s.sessions {
		if ss.rec.Owner == owner {
			n++
		}
	}
	// Count the session being made now, so that concurrent creations
	// cannot pass the cap together.
	id := newID("s")
	placeholder := &session{rec: record{ID: id, Owner: owner}, ended: true}
	if n >= s.cfg.MaxSessionsPerToken {
		s.mu.Unlock()
		return fmt.Errorf("%d sessions already: %w", n, errTooMany)
	}
	s.sessions[id] = placeholder
	s.mu.Unlock()
	fail := func(err error) error {
		s.mu.Lock()
		delete(s.sessions, id)
		s.mu.Unlock()
		return err
	}

	sess, err := sr.NewSession(r.Context(), moat.SessionOptions{Interpreter: req.Interpreter})
	if err != nil {
		return fail(err)
	}
	now := time.Now().UTC()
	ss := &session{
		rec: record{
			ID: id, Owner: owner, Level: level, Interpreter: req.Interpreter,
			CreatedAt: now, ExpiresAt: now.Add(time.Duration(ttl)), IdleTimeout: idle, PID: os.Getpid(),
		},
		sess:       sess,
		lastActive: now,
	}
	if b, ok := sess.(interface{ ID() string }); ok {
		ss.rec.Backend = b.ID()
	}
	if err := s.store.put(ss.rec); err != nil {
		sess.Close()
		return fail(err)
	}
	s.mu.Lock()
	if s.closing {
		delete(s.sessions, id)
		s.mu.Unlock()
		sess.Close()
		s.store.delete(id)
		return errShuttingDown
	}
	s.sessions[id] = ss
	s.mu.Unlock()
	s.metrics.sessions.WithLabelValues(string(level)).Inc()
	s.log.Info("session created", "session", id, "owner", owner, "level", level, "interpreter", req.Interpreter, "ttl", ttl, "idle_timeout", idle, "backend", ss.rec.Backend)
	writeJSON(w, http.StatusCreated, ss.view())
	return nil
}

// lookup returns owner's live session id; any other is not found.
func (s *Server) lookup(r *http.Request, owner string) (*session, error) {
	id := r.PathValue("id")
	s.mu.Lock()
	ss, ok := s.sessions[id]
	s.mu.Unlock()
	if !ok || ss.rec.Owner != owner || ss.sess == nil {
		return nil, fmt.Errorf("session %q: %w", id, errNotFound)
	}
	return ss, nil
}

// useSession looks up owner's session named in the path and marks it busy
// for an operation; done marks it idle again.
func (s *Server) useSession(r *http.Request, owner string) (ss *session, done func(), err error) {
	ss, err = s.lookup(r, owner)
	if err != nil {
		return nil, nil, err
	}
	done, err = ss.use()
	if err != nil {
		return nil, nil, err
	}
	return ss, done, nil
}

// use marks ss busy for an operation; done marks it idle again. It fails
// when the session has ended.
func (ss *session) use() (done func(), err error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.ended {
		return nil, fmt.Errorf("session %s: %w", ss.rec.ID, errSessionClosed)
	}
	ss.busy++
	ss.lastActive = time.Now().UTC()
	return func() {
		ss.mu.Lock()
		ss.busy--
		ss.lastActive = time.Now().UTC()
		ss.mu.Unlock()
	}, nil
}

// endSession closes ss and forgets it. It is safe to call more than once.
func (s *Server) endSession(ss *session, cause string) {
	ss.mu.Lock()
	if ss.ended {
		ss.mu.Unlock()
		return
	}
	ss.ended = true
	ss.mu.Unlock()
	s.mu.Lock()
	delete(s.sessions, ss.rec.ID)
	s.mu.Unlock()
	if err := ss.sess.Close(); err != nil {
		s.log.Warn("server: closing a session", "session", ss.rec.ID, "err", err)
	}
	if err := s.store.delete(ss.rec.ID); err != nil {
		s.log.Warn("server: forgetting a session", "session", ss.rec.ID, "err", err)
	}
	s.metrics.sessions.WithLabelValues(string(ss.rec.Level)).Dec()
	s.metrics.sessionEnd.WithLabelValues(cause).Inc()
	s.log.Info("session ended", "session", ss.rec.ID, "owner", ss.rec.Owner, "level", ss.rec.Level, "cause", cause)
}

// sweep ends expired and idle sessions until Shutdown.
func (s *Server) sweep() {
	defer close(s.sweepDone)
	t := time.NewTicker(time.Duration(s.cfg.SweepInterval))
	defer t.Stop()
	for {
		select {
		case <-s.stopSweep:
			return
		case <-t.C:
		}
		now := time.Now()
		var ends []*session
		var causes []string
		s.mu.Lock()
		for _, ss := range s.sessions {
			if ss.sess == nil {
				continue // being created
			}
			ss.mu.Lock()
			switch {
			case now.After(ss.rec.ExpiresAt):
				ends, causes = append(ends, ss), append(causes, "expired")
			case ss.busy == 0 && now.Sub(ss.lastActive) > time.Duration(ss.rec.IdleTimeout):
				ends, causes = append(ends, ss), append(causes, "idle")
			}
			ss.mu.Unlock()
		}
		s.mu.Unlock()
		for i, ss := range ends {
			s.endSession(ss, causes[i])
		}
	}
}

func (s *Server) handleListSessions(w http.ResponseWriter, r *http.Request, owner string) error {
	s.mu.Lock()
	var mine []*session
	for _, ss := range s.sessions {
		if ss.rec.Owner == owner && ss.sess != nil {
			mine = append(mine, ss)
		}
	}
	s.mu.Unlock()
	out := make([]sessionView, 0, len(mine))
	for _, ss := range mine {
		out = append(out, ss.view())
	}
	slices.SortFunc(out, func(a, b sessionView) int { return a.CreatedAt.Compare(b.CreatedAt) })
	writeJSON(w, http.StatusOK, map[string]any{"sessions": out})
	return nil
}

func (s *Server) handleGetSession(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, ss.view())
	return nil
}

func (s *Server) handleDeleteSession(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	s.endSession(ss, "deleted")
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) handleSessionRun(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, done, err := s.useSession(r, owner)
	if err != nil {
		return err
	}
	defer done()
	req, err := s.readRun(w, r)
	if err != nil {
		return err
	}
	if req.Level != "" && req.Level != ss.rec.Level {
		return fmt.Errorf("the session's level is %s, not %s: %w", ss.rec.Level, req.Level, moat.ErrInvalid)
	}
	return s.execute(w, r, owner, ss.rec.Level, ss.rec.ID, ss.sess.Run, req)
}

func (s *Server) handleListFiles(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, done, err := s.useSession(r, owner)
	if err != nil {
		return err
	}
	defer done()
	files, err := ss.sess.ListFiles(r.Context())
	if err != nil {
		return err
	}
	if files == nil {
		files = []moat.FileInfo{}
	}
	writeJSON(w, http.StatusOK, map[string]any{"files": files})
	return nil
}

func (s *Server) handlePutFile(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, done, err := s.useSession(r, owner)
	if err != nil {
		return err
	}
	defer done()
	name := r.PathValue("path")
	if r.ContentLength > int64(s.cfg.MaxFileBytes) {
		return fmt.Errorf("file of %d bytes is over the %v cap: %w", r.ContentLength, s.cfg.MaxFileBytes, errBodyTooLarge)
	}
	body := http.MaxBytesReader(w, r.Body, int64(s.cfg.MaxFileBytes))
	if err := ss.sess.WriteFile(r.Context(), name, body); err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			return fmt.Errorf("file over the %v cap: %w", s.cfg.MaxFileBytes, errBodyTooLarge)
		}
		return err
	}
	writeJSON(w, http.StatusCreated, map[string]any{"name": name})
	return nil
}

func (s *Server) handleGetFile(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, done, err := s.useSession(r, owner)
	if err != nil {
		return err
	}
	defer done()
	rc, err := ss.sess.ReadFile(r.Context(), r.PathValue("path"))
	if err != nil {
		return err
	}
	defer rc.Close()
	w.Header().Set("Content-Type", "application/octet-stream")
	if f, ok := rc.(interface{ Stat() (os.FileInfo, error) }); ok {
		if st, err := f.Stat(); err == nil {
			// The length announced is what is sent, even if the file
			// changes meanwhile.
			w.Header().Set("Content-Length", strconv.FormatInt(st.Size(), 10))
			w.WriteHeader(http.StatusOK)
			io.CopyN(w, rc, st.Size())
			return nil
		}
	}
	w.WriteHeader(http.StatusOK)
	io.Copy(w, rc)
	return nil
}

func (s *Server) handleDeleteFile(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, done, err := s.useSession(r, owner)
	if err != nil {
		return err
	}
	defer done()
	if err := ss.sess.RemoveFile(r.Context(), r.PathValue("path")); err != nil {
		return err
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func numCPU() int { return runtime.NumCPU() }
