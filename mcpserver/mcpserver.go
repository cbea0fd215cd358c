// Package mcpserver serves moat's run_python tool over the Model Context
// Protocol, so that any MCP client (Claude Desktop, Claude Code, an IDE) can
// run the code its model writes in a [moat.Sandbox].
//
// It is built on the official Go SDK for MCP and speaks two transports:
// stdio ([Server.Run] with an [mcp.IOTransport] or [mcp.StdioTransport]), the
// way a client starts a local server, and streamable HTTP ([Server.Handler],
// [Server.Serve], [Listen]), on a loopback address by default.
//
// The tool is the one the agent offers (package tool): its input is
// {"code": "..."} and nothing else; the level and the limits are the
// operator's. Bad input — a missing or extra field, code that is not a
// string, code over the size cap — and sandbox failures are tool errors
// (isError), and code that crashes or hangs is an ordinary result with its
// exit code and reason. Neither stops the server.
package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
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
	// Logger receives a record per tool call and the transports' errors.
	// Nil means discard. Over stdio it must not write to stdout.
	Logger *slog.Logger `json:"-"`
}

// Validate reports whether c is usable; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	if c.MaxCode < 0 || c.MaxOutput < 0 {
		return fmt.Errorf("mcpserver: max code %d and max output %d must not be negative: %w", c.MaxCode, c.MaxOutput, moat.ErrInvalid)
	}
	return nil
}

// Server is an MCP server with one tool, run_python. It is safe for
// concurrent use: it may serve several sessions and transports at once, and
// each tool call gets its own run. It holds no resources of its own; the
// caller closes the Sandbox after the server has stopped.
type Server struct {
	mcp      *mcp.Server
	runner   *tool.Runner
	log      *slog.Logger
	maxFrame int // the largest message accepted, in bytes
}

// New returns a Server whose tool runs code in sb.
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
	version := cfg.Version
	if version == "" {
		version = "devel"
	}
	s := &Server{
		runner: &tool.Runner{Sandbox: sb, MaxCode: cfg.MaxCode, MaxOutput: cfg.MaxOutput, Logger: log},
		log:    log,
	}
	maxCode := cfg.MaxCode
	if maxCode == 0 {
		maxCode = tool.DefaultMaxCode
	}
	// A JSON string may take up to six bytes per byte of code ("\u0000"):
	// let a message be large enough that an over-cap program reaches the
	// tool and gets a readable tool error, within a bound.
	s.maxFrame = max(int(mcp.DefaultMaxRequestBodyBytes), 6*maxCode+64<<10)

	s.mcp = mcp.NewServer(&mcp.Implementation{Name: "moat", Title: "moat: a sandbox for Python", Version: version}, &mcp.ServerOptions{
		Instructions: "run_python runs a Python 3 program in a sandbox and returns its stdout, stderr and exit code. " +
			"Each call starts fresh; nothing is kept between calls, and there is no network.",
		Logger:       log,
		Capabilities: &mcp.ServerCapabilities{}, // tools only (inferred); no logging
	})
	s.mcp.AddTool(&mcp.Tool{
		Name:        tool.Name,
		Description: tool.Description,
		InputSchema: tool.InputSchema(),
		Annotations: &mcp.ToolAnnotations{
			Title:           "Run Python in a sandbox",
			DestructiveHint: new(false), // the code cannot touch the host
			OpenWorldHint:   new(false), // nor the network
		},
	}, s.callTool)
	return s, nil
}

// callTool runs one call of run_python. It never returns a protocol error:
// every outcome, bad input included, is a result the model can read.
func (s *Server) callTool(ctx context.Context, req *mcp.CallToolRequest) (*mcp.CallToolResult, error) {
	out := s.runner.Call(ctx, req.Params.Arguments)
	return &mcp.CallToolResult{
		Content: []mcp.Content{&mcp.TextContent{Text: out.Text}},
		IsError: out.IsError,
	}, nil
}

// MCP returns the underlying SDK server, to connect it to another
// transport.
func (s *Server) MCP() *mcp.Server { return s.mcp }

// Run serves one session over t (an [mcp.IOTransport] on the process's
// stdin and stdout, for a client that started the server) until the client
// disconnects or ctx is cancelled, which ends the session and the tool calls
// in progress.
func (s *Server) Run(ctx context.Context, t mcp.Transport) error {
	err := s.mcp.Run(ctx, t)
	if err != nil && !errors.Is(err, context.Canceled) && !errors.Is(err, io.EOF) {
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
// localhost when they arrive on a loopback address (DNS rebinding).
func (s *Server) Handler() http.Handler {
	return mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return s.mcp }, &mcp.StreamableHTTPOptions{
		Logger:              s.log,
		MaxRequestBodyBytes: int64(s.maxFrame),
		SessionTimeout:      30 * time.Minute,
	})
}

// Serve serves streamable HTTP on ln until ctx is cancelled, then closes
// the connections, which ends the sessions and their tool calls in progress,
// and returns nil. It returns an error if serving fails. ln is closed when
// Serve returns.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	base, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	srv := &http.Server{
		Handler:           s.Handler(),
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
	// calls return, so that the shutdown does not wait on them.
	cancel()
	shutdownCtx, stop := context.WithTimeout(context.Background(), 5*time.Second)
	defer stop()
	if err := srv.Shutdown(shutdownCtx); err != nil {
		srv.Close()
	}
	<-errc
	return nil
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
		return nil, fmt.Errorf("mcpserver: address %q: %w: %w", addr, err, moat.ErrInvalid)
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
