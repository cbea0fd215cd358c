// Package mcpserver serves moat's tools over the Model Context Protocol, so
// that any MCP client (Claude Desktop, Claude Code, an IDE) can run the code
// its model writes in a [moat.Sandbox].
//
// It is built on the official Go SDK for MCP and speaks two transports:
// stdio ([Server.Run] with an [mcp.IOTransport] or [mcp.StdioTransport]), the
// way a client starts a local server, and streamable HTTP ([Server.Handler],
// [Server.Serve], [Listen]), on a loopback address by default.
//
// The tools are the ones the agent offers (package tool). By default there
// is one, run_python, whose input is {"code": "..."} and nothing else, and
// each call starts from nothing. With [Config.Sessions], each MCP session
// (one client connection) gets a [moat.Session] of its own, made at its
// first tool call and closed when the connection ends: run_python's calls
// run in it, so that files (and with [Config.Interpreter], variables)
// persist between them, and the file tools write_file, read_file and
// list_files work on its files. The level and the limits are the
// operator's. Bad input — a missing or extra field, code that is not a
// string, code or a file over its size cap, a file name outside the
// session — missing files and sandbox failures are tool errors (isError),
// and code that crashes or hangs is an ordinary result with its exit code
// and reason. None of them stops the server.
package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/tool"
)

// DefaultAddr is the address [Listen] uses when given none: loopback only.
const DefaultAddr = "127.0.0.1:8765"

// Config configures a [Server]. Its zero value is ready to use.
type Config struct {
	// MaxCode is the largest program the tool accepts, in bytes. Zero means
	// tool.DefaultMaxCode (1 MiB). Requests are allowed to be large enough
	// to carry it; a larger program gets a tool error.
	MaxCode int `json:"max_code,omitempty"`
	// MaxOutput is how much of each of stdout and stderr a tool result
	// shows, in bytes; the middle of longer output is cut, with a note.
	// Zero means tool.DefaultMaxOutput (8 KiB).
	MaxOutput int `json:"max_output,omitempty"`
	// Version is the server version told to clients. Empty means "devel".
	Version string `json:"version,omitempty"`
	// Sessions gives each MCP session — one per client connection — a
	// moat session of its own, made at its first tool call: run_python's
	// calls run in it, so that the files one call writes are there for the
	// next, and the file tools write_file, read_file and list_files are
	// offered on its working directory. The moat session is closed when the
	// MCP session ends (the client disconnects or its transport closes,
	// Run or Serve returns, or Close is called), so nothing of it outlives
	// the connection; two connections never see each other's files. The
	// sandbox must implement moat.Sessioner (New fails otherwise). When it
	// cannot make a session, each tool call is a tool error saying so:
	// there is no falling back to runs that start from nothing.
	// False means run_python alone, each call from nothing.
	Sessions bool `json:"sessions,omitempty"`
	// Interpreter, with Sessions, keeps a live Python interpreter in each
	// moat session (moat.SessionOptions.Interpreter), so that variables,
	// imports and definitions persist between run_python calls too, until
	// a call times out or hits a limit. It needs Sessions.
	Interpreter bool `json:"interpreter,omitempty"`
	// Tenant is every one-shot run's moat.Request.Tenant: with a level
	// that recycles instances, the server's run_python calls may reuse
	// one. Set it only when every client is the same party (one agent
	// over stdio); over HTTP, clients may be different users. Empty: a
	// fresh instance every call.
	Tenant string `json:"-"`
	// Logger receives a record per tool call and the transports' errors.
	// Nil means discard. Over stdio it must not write to stdout.
	Logger *slog.Logger `json:"-"`
}

// Validate reports whether c is usable; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	if c.MaxCode < 0 || c.MaxOutput < 0 {
		return fmt.Errorf("mcpserver: max code %d and max output %d must not be negative: %w", c.MaxCode, c.MaxOutput, moat.ErrInvalid)
	}
	if c.Interpreter && !c.Sessions {
		return fmt.Errorf("mcpserver: a live interpreter needs sessions (set sessions too): %w", moat.ErrInvalid)
	}
	return nil
}

// Server is an MCP server of moat's tools. It is safe for concurrent use:
// it may serve several sessions and transports at once, and each tool call
// gets its own run. With Config.Sessions it holds the moat sessions of the
// MCP sessions it serves: Close closes them. The caller closes the Sandbox
// after the server has stopped and been closed.
type Server struct {
	mcp       *mcp.Server
	runner    *tool.Runner   // without sessions
	sessioner moat.Sessioner // with sessions
	opts      moat.SessionOptions
	cfg       Config
	tools     []tool.Spec
	log       *slog.Logger
	maxFrame  int // the largest message accepted, in bytes

	mu     sync.Mutex
	closed bool
	bound  map[*mcp.ServerSession]*binding // the MCP sessions that have made a tool call
}

// binding is the moat session of one MCP session.
type binding struct {
	mu     sync.Mutex // held while the session is made, and while it is closed
	sess   moat.Session
	closed bool
}

// New returns a Server whose tools run code in sb. With cfg.Sessions, sb
// must implement moat.Sessioner; New fails with an error wrapping
// moat.ErrUnavailable if it does not.
func New(sb moat.Sandbox, cfg Config) (*Server, error) {
	if sb == nil {
		return nil, fmt.Errorf("mcpserver: nil sandbox: %w", moat.ErrInvalid)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.Version == "" {
		cfg.Version = "devel"
	}
	s := &Server{cfg: cfg, log: log, bound: map[*mcp.ServerSession]*binding{}}
	maxCode := cfg.MaxCode
	if maxCode == 0 {
		maxCode = tool.DefaultMaxCode
	}
	if cfg.Sessions {
		sessioner, ok := sb.(moat.Sessioner)
		if !ok {
			return nil, &moat.UnavailableError{Level: sb.Level(), Reason: "the MCP server was asked for sessions, and this sandbox keeps none",
				Remedy: "serve without sessions, or choose a level that keeps them"}
		}
		s.sessioner, s.opts = sessioner, moat.SessionOptions{Interpreter: cfg.Interpreter}
		s.tools = tool.SessionTools(cfg.Interpreter)
		maxCode = max(maxCode, tool.DefaultMaxFile) // write_file's content travels in one message too
	} else {
		s.runner = &tool.Runner{Sandbox: sb, MaxCode: cfg.MaxCode, MaxOutput: cfg.MaxOutput, Logger: log, Tenant: cfg.Tenant}
		s.tools = s.runner.Tools()
	}
	// A JSON string may take up to six bytes per byte of code ("\u0000"):
	// let a message be large enough that an over-cap program reaches the
	// tool and gets a readable tool error, within a bound.
	s.maxFrame = max(int(mcp.DefaultMaxRequestBodyBytes), 6*maxCode+64<<10)
	s.mcp = s.newMCP()
	return s, nil
}

// instructions tell the client's model what the server offers.
const (
	instructions = "run_python runs a Python 3 program in a sandbox and returns its stdout, stderr and exit code. " +
		"Each call starts fresh; nothing is kept between calls, and there is no network."
	sessionInstructions = "run_python runs Python 3 in a sandbox session kept for this connection: files in its working " +
		"directory persist between calls (variables do not: each call is a fresh interpreter), and write_file, " +
		"read_file and list_files work on those files. There is no network. The session and its files are removed " +
		"when the connection ends."
	interpreterInstructions = "run_python runs Python 3 in a live interpreter kept for this connection, like a notebook: " +
		"variables and the files of its working directory persist between calls (a call that times out or hits a " +
		"limit restarts the interpreter, and the variables are lost), and write_file, read_file and list_files work " +
		"on those files. There is no network. The session and its files are removed when the connection ends."
)

// newMCP returns an SDK server with the tools.
func (s *Server) newMCP() *mcp.Server {
	text := instructions
	switch {
	case s.cfg.Interpreter:
		text = interpreterInstructions
	case s.cfg.Sessions:
		text = sessionInstructions
	}
	m := mcp.NewServer(&mcp.Implementation{Name: "moat", Title: "moat: a sandbox for Python", Version: s.cfg.Version}, &mcp.ServerOptions{
		Instructions: text,
		Logger:       s.log,
		Capabilities: &mcp.ServerCapabilities{}, // tools only (inferred); no logging
	})
	for _, t := range s.tools {
		m.AddTool(&mcp.Tool{
			Name:        t.Name,
			Description: t.Description,
			InputSchema: t.InputSchema,
			Annotations: &mcp.ToolAnnotations{
				Title:           t.Title,
				ReadOnlyHint:    t.ReadOnly,
				DestructiveHint: new(false), // the code cannot touch the host
				OpenWorldHint:   new(false), // nor the network
			},
		}, s.handler(t.Name))
	}
	return m
}

// handler runs the calls of the tool name. It never returns a protocol
// error: every outcome, bad input included, is a result the model can read.
func (s *Server) handler(name string) mcp.ToolHandler {
	return func(ctx context.Context, req *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
		var out tool.Outcome
		if c, err := s.caller(ctx, req.Session); err != nil {
			s.log.Warn("mcpserver: no session for the call", "tool", name, "err", err)
			out = tool.Outcome{Tool: name, Err: err, Text: tool.ErrorText(err), IsError: true}
		} else {
			out = c.CallTool(ctx, name, req.Params.Arguments)
		}
		return &mcp.CallToolResult{
			Content: []mcp.Content{&mcp.TextContent{Text: out.Text}},
			IsError: out.IsError,
		}, nil
	}
}

// caller returns what runs the calls of the MCP session ss: the one-shot
// runner, or a runner over ss's moat session, made at its first call.
func (s *Server) caller(ctx context.Context, ss *mcp.ServerSession) (tool.Caller, error) {
	if s.sessioner == nil {
		return s.runner, nil
	}
	if ss == nil {
		return nil, errors.New("mcpserver: the call has no MCP session to keep a sandbox session for")
	}
	sess, err := s.session(ctx, ss)
	if err != nil {
		return nil, err
	}
	return &tool.SessionRunner{Session: sess, Interpreter: s.cfg.Interpreter, MaxCode: s.cfg.MaxCode, MaxOutput: s.cfg.MaxOutput, Logger: s.log}, nil
}

// session returns the moat session of ss, making it at the first call.
// A goroutine closes it when ss ends.
func (s *Server) session(ctx context.Context, ss *mcp.ServerSession) (moat.Session, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("mcpserver: the server is closed: %w", moat.ErrClosed)
	}
	b := s.bound[ss]
	if b == nil {
		b = &binding{}
		s.bound[ss] = b
		go func() {
			ss.Wait()
			s.release(ss)
		}()
	}
	s.mu.Unlock()

	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, fmt.Errorf("mcpserver: the MCP session has ended, and its sandbox session with it: %w", moat.ErrClosed)
	}
	if b.sess == nil {
		sess, err := s.sessioner.NewSession(ctx, s.opts)
		if err != nil {
			return nil, fmt.Errorf("mcpserver: this server runs each connection's tools in a sandbox session of its own, "+
				"and the sandbox could not make one, so nothing was run: %w", err)
		}
		b.sess = sess
		s.log.Info("mcpserver: sandbox session made", "mcp_session", ss.ID(), "interpreter", s.opts.Interpreter)
	}
	return b.sess, nil
}

// release closes the moat session of ss, if it has one, and forgets it.
// It returns once the session is closed, whoever closes it.
func (s *Server) release(ss *mcp.ServerSession) {
	s.mu.Lock()
	b := s.bound[ss]
	s.mu.Unlock()
	if b == nil {
		return
	}
	if err := b.close(); err != nil {
		s.log.Warn("mcpserver: closing a sandbox session", "mcp_session", ss.ID(), "err", err)
	} else {
		s.log.Info("mcpserver: sandbox session closed", "mcp_session", ss.ID())
	}
	s.mu.Lock()
	if s.bound[ss] == b {
		delete(s.bound, ss)
	}
	s.mu.Unlock()
}

// close closes b's session once; later calls wait for the first and
// return nil.
func (b *binding) close() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil
	}
	b.closed = true
	if b.sess == nil {
		return nil
	}
	return b.sess.Close()
}

// Close closes every moat session the server holds, and makes later tool
// calls that need one tool errors. It does not end the MCP sessions
// themselves. It may be called more than once; calls after the first
// return nil. Without Config.Sessions it does nothing.
func (s *Server) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	bound := s.bound
	s.bound = map[*mcp.ServerSession]*binding{}
	s.mu.Unlock()
	var errs []error
	for _, b := range bound {
		if err := b.close(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("mcpserver: closing sandbox sessions: %w", err)
	}
	return nil
}

// MCP returns the underlying SDK server, to connect it to another
// transport.
func (s *Server) MCP() *mcp.Server { return s.mcp }

// Run serves one session over t (an [mcp.IOTransport] on the process's
// stdin and stdout, for a client that started the server) until the client
// disconnects or ctx is cancelled, which ends the session and the tool calls
// in progress. It returns once the session's moat session, if it made one,
// is closed.
func (s *Server) Run(ctx context.Context, t mcp.Transport) error {
	ss, err := s.mcp.Connect(ctx, t, nil)
	if err != nil {
		return fmt.Errorf("mcpserver: %w", err)
	}
	ended := make(chan error, 1)
	go func() { ended <- ss.Wait() }()
	select {
	case err = <-ended:
	case <-ctx.Done():
		s.release(ss) // ends the code in progress first, so that its call returns
		ss.Close()
		<-ended
		err = nil
	}
	s.release(ss)
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, mcp.ErrConnectionClosed) {
		return fmt.Errorf("mcpserver: %w", err)
	}
	return nil
}

// Stdio returns the transport for serving over r and w, newline-delimited
// JSON as MCP's stdio transport defines it, with a frame limit that lets
// a program over the size cap through to get its tool error. A frame past
// that limit ends the session: a stream cannot skip to the next message.
func (s *Server) Stdio(r io.Reader, w io.Writer) mcp.Transport {
	return &mcp.IOTransport{Reader: io.NopCloser(r), Writer: nopCloser{w}, MaxLineLength: max(mcp.DefaultMaxLineLength, s.maxFrame)}
}

type nopCloser struct{ io.Writer }

func (nopCloser) Close() error { return nil }

// Handler returns an http.Handler that serves MCP's streamable HTTP
// transport, one session per client. It rejects requests whose Host is not
// localhost when they arrive on a loopback address (DNS rebinding). A
// session ends when its client deletes it or after 30 minutes without a
// request; Close closes the moat sessions of those still open.
func (s *Server) Handler() http.Handler { return s.handlerFor(s.mcp) }

func (s *Server) handlerFor(m *mcp.Server) http.Handler {
	return mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return m }, &mcp.StreamableHTTPOptions{
		Logger:              s.log,
		MaxRequestBodyBytes: int64(s.maxFrame),
		SessionTimeout:      30 * time.Minute,
	})
}

// Serve serves streamable HTTP on ln until ctx is cancelled, then closes
// the connections, which ends the sessions and their tool calls in progress,
// and returns nil once their moat sessions are closed. It returns an error
// if serving fails. ln is closed when Serve returns.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	// The sessions of this Serve are those of an SDK server of its own, so
	// that it can end them when it returns.
	m := s.newMCP()
	defer s.endSessions(m)
	base, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	srv := &http.Server{
		Handler:           s.handlerFor(m),
		ReadHeaderTimeout: 10 * time.Second,
		BaseContext:       func(net.Listener) context.Context { return base },
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return fmt.Errorf("mcpserver: serving http: %w", err)
	case <-ctx.Done():
	}
	// Requests' contexts end with base: hanging event streams and tool
	// calls return, so that the shutdown does not wait on them; so does
	// the code running in the sessions, which ends with them.
	cancel()
	for ss := range m.Sessions() {
		s.release(ss)
	}
	shutdownCtx, stop := context.WithTimeout(context.Background(), 5*time.Second)
	defer stop()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		srv.Close()
	}
	<-errc
	return nil
}

// endSessions ends the MCP sessions of m and closes their moat sessions.
func (s *Server) endSessions(m *mcp.Server) {
	for ss := range m.Sessions() {
		s.release(ss) // the code in progress ends, and so its call
		ss.Close()
		s.release(ss) // a session made meanwhile
	}
}

// Listen listens on addr for [Server.Serve]. An empty addr means
// DefaultAddr. The host must be a loopback address or "localhost": the
// server has no authentication, so it refuses to listen where other
// machines could reach it (bind a listener yourself and pass it to Serve if
// you really mean to, behind something that authenticates).
func Listen(addr string) (net.Listener, error) {
	if addr == "" {
		addr = DefaultAddr
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("mcpserver: address %q: %w", addr, moat.Invalid(err))
	}
	if !loopback(host) {
		return nil, fmt.Errorf("mcpserver: address %q is not loopback; the MCP server has no authentication and listens on 127.0.0.1, ::1 or localhost only: %w", addr, moat.ErrInvalid)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("mcpserver: %w", err)
	}
	return ln, nil
}

func loopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}
