// Package e2b serves the API of E2B (e2b.dev) over moat's sessions, so that
// E2B's own SDKs, unchanged, run code in a self-hosted moat serve: a user
// sets E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL to the key and the
// address the operator gives, and changes no code.
//
// One listener serves both sides of E2B's API. A request that carries an
// E2b-Sandbox-Id header is for a sandbox, checked against the sandbox's
// X-Access-Token: on port 49983 (E2b-Sandbox-Port), E2B's in-sandbox
// daemon, envd: GET /health, GET and POST /files, and the Connect-RPC
// services process.Process and filesystem.Filesystem; on port 49999 the
// code interpreter's POST /execute (runCode) and its /contexts, each
// context a namespace of its own in the sandbox's live interpreter (see
// contexts.go). Any
// other request is for the control plane (POST /v2/sandboxes and the
// rest), checked against its X-API-KEY, an e2b_ key that the tokens file
// gives a moat token (server.Token.E2BKey).
//
// A sandbox is a moat session of the key's token, made through the
// server's own session store (server.Server's CreateSession and the rest):
// the same owner, caps, run slots, time to live, suspend and resume as a
// session of moat's own API. Its template names one of the operator's
// Templates (a level and a network profile); the request never carries a
// level or a policy. Paths under /home/user are the session's files: see
// MapPath. Commands are run as a run of the session whose Python code
// executes the command (commands.run's bash -c) in the session's
// directory; code interpreter cells as a run whose runner evaluates the
// cell's last expression.
//
// What this API keeps of a sandbox (sandboxRecord) is in its session's
// record in the server's database, so that a sandbox lasts exactly as its
// session does, across a restart of moat serve too; its tokens are derived
// from the owner's key, never stored.
//
// What is not mapped yet, and the error an SDK shows for it, is in
// docs/e2b.md.
package e2b

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

// EnvdVersion is the version of E2B's in-sandbox daemon that moat says it
// serves: the SDKs pick their wire shapes by it (0.5.7 has closeStdin and
// octet-stream uploads, no default user; file metadata, 0.6.2, is not
// served).
const EnvdVersion = "0.5.7"

// EnvdPort is the port of E2B's in-sandbox daemon, in E2b-Sandbox-Port.
const EnvdPort = "49983"

// Template is what an E2B template name stands for: where its sandboxes run.
type Template struct {
	// Level is the sandboxes' isolation level. Empty means the server's
	// default level.
	Level moat.Level `json:"level,omitempty"`
	// Network is the network profile of its sandboxes; the key's token
	// must be granted it. Empty means the server's sandboxes without a
	// profile (server.Config.Sandboxes), whose policy is Config.Policy:
	// no network unless the operator gave those one.
	Network string `json:"network,omitempty"`
	// Interpreter keeps a live interpreter in its sandboxes' sessions, so
	// that runCode's variables stay from one call to the next (as the
	// code interpreter's). A run that hits a limit ends it; the files
	// stay.
	Interpreter bool `json:"interpreter,omitempty"`
}

// DefaultTemplates are the templates served when Config.Templates is nil:
// E2B's default template names ("base" for Sandbox.create(), the code
// interpreter's "code-interpreter-v1", with a live interpreter), at the
// default level without network.
var DefaultTemplates = map[string]Template{"base": {}, "code-interpreter-v1": {Interpreter: true}}

// Config configures a Server.
type Config struct {
	// Sessions is moat's server whose session store sandboxes live in.
	// Required.
	Sessions *server.Server
	// Tokens are moat's tokens; those with an E2BKey may use this API,
	// as their token's owner.
	Tokens []server.Token
	// Templates are the template names a create may ask for. Nil means
	// DefaultTemplates; an unknown name is refused with 400.
	Templates map[string]Template
	// Policy is the egress policy of the server's sandboxes without a
	// network profile (server.Config.Sandboxes): what a template without
	// Network reaches, held against what a create asks as a profile's is.
	// The zero value says those sandboxes have no network; an embedder
	// whose Sandboxes have one must set it, or a create that asks for no
	// network (allowInternetAccess false) would get theirs.
	Policy moat.Egress
	// MaxFileBytes caps one uploaded file. Zero means 16MiB; the level's
	// own file size and disk limits apply as well.
	MaxFileBytes moat.Bytes
	// WriteTimeout is the longest one write of an answer may wait for a
	// client that does not read (a command's or a cell's output above
	// all); the client is then dropped as gone and the command or cell it
	// was for is ended. It is set anew before each write, so a long
	// stream that keeps moving is not cut. Zero means 30s.
	WriteTimeout moat.Duration
	// Logger gets one line per sandbox event. Nil means discard.
	Logger *slog.Logger
}

// Server serves E2B's API. It is safe for concurrent use. It holds no
// resources of its own: the sessions are the moat server's, which ends
// them.
type Server struct {
	cfg  Config
	log  *slog.Logger
	keys []keyHash
	// secrets are the owners' e2b keys, from which their sandboxes'
	// tokens are derived (deriveToken).
	secrets map[string]string
	handler http.Handler
	interp  http.Handler

	// stopWatches is closed by EndWatches.
	stopWatches chan struct{}
	endOnce     sync.Once

	mu sync.Mutex
	// sandboxes are the sessions made through this API, by id, from
	// before a restart too (load); one whose session has ended is
	// forgotten when next looked up.
	sandboxes map[string]*sandbox
}

// keyForm is the form of an e2b key (server.Token.E2BKey).
var keyForm = regexp.MustCompile(`^e2b_[0-9a-f]{40,}$`)

type keyHash struct {
	owner string
	sum   [32]byte
}

// sandbox is what this API keeps of a sandbox beside its moat session,
// and in the session's record (sandboxRecord). Every field but procs is
// fixed at creation, except where noted.
type sandbox struct {
	id, owner, template string
	metadata            map[string]string
	envs                map[string]string
	// nonce is what the sandbox's tokens are derived from, with the
	// owner's key.
	nonce string
	// access is the sandbox's envd access token, which the sandbox side
	// checks; accessSum its digest. traffic is its traffic access token,
	// which the code interpreter's /contexts calls carry instead.
	access, traffic       string
	accessSum, trafficSum [32]byte
	started               time.Time
	// interpreter says the session keeps a live interpreter: commands
	// then run as its children, never in its place.
	interpreter bool
	procs       procTable
	executions  atomic.Int64
	// watches counts the watches in progress: WatchDir streams and
	// watchers.
	watches atomic.Int32
	// watchMu guards watchers, the watches that clients poll, by id.
	watchMu  sync.Mutex
	watchers map[string]*watcher

	// ctxMu guards contexts, the code interpreter's contexts in the
	// order they were made, and orders their writes to the record.
	ctxMu    sync.Mutex
	contexts []codeContext
}

// New returns a Server over cfg.Sessions.
func New(cfg Config) (*Server, error) {
	if cfg.Sessions == nil {
		return nil, fmt.Errorf("e2b: no moat server to keep sandboxes in: %w", moat.ErrInvalid)
	}
	if cfg.Templates == nil {
		cfg.Templates = DefaultTemplates
	}
	if cfg.MaxFileBytes == 0 {
		cfg.MaxFileBytes = 16 << 20
	}
	if cfg.WriteTimeout == 0 {
		cfg.WriteTimeout = moat.Duration(30 * time.Second)
	}
	s := &Server{cfg: cfg, log: cfg.Logger, sandboxes: map[string]*sandbox{}, secrets: map[string]string{}, stopWatches: make(chan struct{})}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	seen := map[string]bool{}
	for _, t := range cfg.Tokens {
		if t.E2BKey == "" {
			continue
		}
		// The server's own checks of its tokens file, again: the keys
		// may come from another list than the server's.
		switch owner, ok := cfg.Sessions.Owner(t.Token); {
		case !ok || owner != t.Name:
			return nil, fmt.Errorf("e2b: token %q is not one of the moat server's: its key would make sandboxes for an owner the server does not know: %w", t.Name, moat.ErrInvalid)
		case !keyForm.MatchString(t.E2BKey):
			return nil, fmt.Errorf("e2b: token %q: its e2b key is not \"e2b_\" and at least 40 lower-case hex digits: %w", t.Name, moat.ErrInvalid)
		case seen[t.E2BKey]:
			return nil, fmt.Errorf("e2b: token %q: its e2b key is another token's too: %w", t.Name, moat.ErrInvalid)
		}
		seen[t.E2BKey] = true
		s.keys = append(s.keys, keyHash{t.Name, sha256.Sum256([]byte(t.E2BKey))})
		s.secrets[t.Name] = t.E2BKey
	}
	if len(s.keys) == 0 {
		return nil, fmt.Errorf("e2b: no token has an e2b key (e2b_key in the tokens file): the API would serve no one: %w", moat.ErrInvalid)
	}
	s.load()
	s.interp = s.interpreterRoutes()
	s.handler = s.routes()
	return s, nil
}

// EndWatches ends every files.watchDir stream in progress, and refuses new
// ones (unavailable): a watch is no work that a shutdown should wait for.
// Give it to http.Server.RegisterOnShutdown. It is safe to call more than
// once.
func (s *Server) EndWatches() { s.endOnce.Do(func() { close(s.stopWatches) }) }

// Handler returns the server's HTTP handler: the sandbox side for
// requests with an E2b-Sandbox-Id header, the control plane for the rest.
func (s *Server) Handler() http.Handler { return s.handler }

func (s *Server) routes() http.Handler {
	control := s.controlRoutes()
	envd := s.envdRoutes()
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w := newDeadlineWriter(rw, time.Duration(s.cfg.WriteTimeout))
		if r.Header.Get("E2b-Sandbox-Id") != "" {
			s.serveSandbox(w, r, envd)
			return
		}
		control.ServeHTTP(w, r)
	})
}

// owner returns the owner of the request's X-API-KEY.
func (s *Server) owner(r *http.Request) (string, bool) {
	key := r.Header.Get("X-API-KEY")
	if key == "" {
		return "", false
	}
	sum := sha256.Sum256([]byte(key))
	owner, found := "", 0
	for _, k := range s.keys {
		if subtle.ConstantTimeCompare(sum[:], k.sum[:]) == 1 {
			owner, found = k.owner, 1
		}
	}
	return owner, found == 1
}

// apiError is an error with the status E2B's API answers it with.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func errorf(status int, format string, args ...any) error {
	return &apiError{status, "e2b: " + fmt.Sprintf(format, args...)}
}

// statusOf is the status err is answered with: its own, or the moat
// server's for the server's errors.
func statusOf(err error) int {
	if ae, ok := errors.AsType[*apiError](err); ok {
		return ae.status
	}
	st, _ := server.ErrorStatus(err)
	return st
}

// writeError writes err as E2B's API does: {"code": status, "message"},
// the message cut to maxErrorMessage bytes.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	st := statusOf(err)
	if st >= 500 && st != http.StatusBadGateway && st != http.StatusNotImplemented {
		s.log.Warn("e2b: request failed", "method", r.Method, "path", r.URL.Path, "status", st, "err", err)
	}
	writeJSON(w, st, map[string]any{"code": st, "message": cutMessage(err.Error())})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// newSecret returns a random secret with a prefix.
func newSecret(prefix string) string {
	var b [20]byte
	rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// lookupSandbox returns the sandbox id if its session is still there,
// forgetting it otherwise.
func (s *Server) lookupSandbox(id string) (*sandbox, server.SessionInfo, bool) {
	s.mu.Lock()
	sb, ok := s.sandboxes[id]
	s.mu.Unlock()
	if !ok {
		return nil, server.SessionInfo{}, false
	}
	info, err := s.cfg.Sessions.Session(sb.owner, id)
	if err != nil {
		s.forget(sb)
		return nil, server.SessionInfo{}, false
	}
	return sb, info, true
}

// forget drops sb and cancels its commands still running.
func (s *Server) forget(sb *sandbox) {
	s.mu.Lock()
	delete(s.sandboxes, sb.id)
	s.mu.Unlock()
	sb.procs.killAll()
}

// checkAccess compares the request's X-Access-Token with sb's.
func checkAccess(r *http.Request, sb *sandbox) bool {
	sum := sha256.Sum256([]byte(r.Header.Get("X-Access-Token")))
	return subtle.ConstantTimeCompare(sum[:], sb.accessSum[:]) == 1
}

// checkTraffic compares the request's E2B-Traffic-Access-Token with sb's
// traffic token.
func checkTraffic(r *http.Request, sb *sandbox) bool {
	sum := sha256.Sum256([]byte(r.Header.Get("E2B-Traffic-Access-Token")))
	return subtle.ConstantTimeCompare(sum[:], sb.trafficSum[:]) == 1
}

// trimHome is used in messages: the E2B path of a session file name.
func homePath(name string) string {
	if name == "" || name == "." {
		return Home
	}
	return Home + "/" + strings.TrimPrefix(name, "/")
}

// deadlineWriter sets the connection's write deadline to timeout from now
// before each write and flush, so that a client that stops reading fails
// the write after timeout instead of holding the handler (and the command
// it streams) for ever. A write that fails makes net/http cancel the
// request's context, which ends the run.
type deadlineWriter struct {
	http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
}

func newDeadlineWriter(w http.ResponseWriter, timeout time.Duration) *deadlineWriter {
	return &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: timeout}
}

func (w *deadlineWriter) Write(p []byte) (int, error) {
	w.rc.SetWriteDeadline(time.Now().Add(w.timeout))
	return w.ResponseWriter.Write(p)
}

// FlushError is what http.ResponseController.Flush calls.
func (w *deadlineWriter) FlushError() error {
	w.rc.SetWriteDeadline(time.Now().Add(w.timeout))
	return w.rc.Flush()
}

func (w *deadlineWriter) Flush() { w.FlushError() }

func (w *deadlineWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
