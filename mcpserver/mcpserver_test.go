package mcpserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/subprocess"
	"github.com/moatsandbox/moat/tool"
)

// envServe makes the test binary an MCP server over stdio, for clients the
// tests start as processes (the TypeScript client).
const envServe = "MOAT_MCPSERVER_TEST_SERVE"

func TestMain(m *testing.M) {
	if os.Getenv(envServe) == "stdio" {
		os.Exit(serveStdio())
	}
	os.Exit(sandboxtest.CheckNoChildren(m.Run(), 2*time.Second))
}

// serveStdio serves the real subprocess level over stdin and stdout, as
// `moat mcp` does.
func serveStdio() int {
	log := slogToStderr()
	sb, err := subprocess.New(subprocess.Config{Limits: testLimits})
	if err != nil {
		fmt.Fprintln(os.Stderr, "mcpserver test server:", err)
		return 3
	}
	defer sb.Close()
	s, err := New(sb, Config{Logger: log})
	if err != nil {
		fmt.Fprintln(os.Stderr, "mcpserver test server:", err)
		return 3
	}
	if err := s.Run(context.Background(), s.Stdio(os.Stdin, os.Stdout)); err != nil {
		fmt.Fprintln(os.Stderr, "mcpserver test server:", err)
		return 1
	}
	return 0
}

// testLimits keep the hanging program's test short.
var testLimits = moat.Limits{WallTime: moat.Duration(time.Second), CPUTime: moat.Duration(time.Second)}

func newSandbox(t *testing.T) moat.Sandbox {
	t.Helper()
	sb, err := subprocess.New(subprocess.Config{Limits: testLimits})
	if err != nil {
		t.Fatalf("subprocess.New: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

func newServer(t *testing.T, cfg Config) *Server {
	t.Helper()
	s, err := New(newSandbox(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// connectInMemory connects the Go SDK's client to s over in-memory pipes.
func connectInMemory(t *testing.T, s *Server) *mcp.ClientSession {
	t.Helper()
	ctx := context.Background()
	st, ct := mcp.NewInMemoryTransports()
	ss, err := s.MCP().Connect(ctx, st, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ss.Close() })
	return connectClient(t, ct)
}

func connectClient(t *testing.T, tr mcp.Transport) *mcp.ClientSession {
	t.Helper()
	c := mcp.NewClient(&mcp.Implementation{Name: "moat-test", Version: "v0"}, nil)
	cs, err := c.Connect(context.Background(), tr, nil)
	if err != nil {
		t.Fatalf("client connect: %v", err)
	}
	t.Cleanup(func() { cs.Close() })
	return cs
}

// checkTools checks that the server lists run_python alone, with code as
// its only input.
func checkTools(t *testing.T, cs *mcp.ClientSession) {
	t.Helper()
	res, err := cs.ListTools(context.Background(), nil)
	if err != nil {
		t.Fatalf("ListTools: %v", err)
	}
	if len(res.Tools) != 1 || res.Tools[0].Name != tool.Name {
		t.Fatalf("tools = %+v, want run_python alone", res.Tools)
	}
	raw, err := json.Marshal(res.Tools[0].InputSchema)
	if err != nil {
		t.Fatal(err)
	}
	var s struct {
		Type       string                     `json:"type"`
		Properties map[string]json.RawMessage `json:"properties"`
		Required   []string                   `json:"required"`
		Additional *bool                      `json:"additionalProperties"`
	}
	if err := json.Unmarshal(raw, &s); err != nil {
		t.Fatal(err)
	}
	if s.Type != "object" || len(s.Properties) != 1 || s.Properties["code"] == nil ||
		len(s.Required) != 1 || s.Required[0] != "code" || s.Additional == nil || *s.Additional {
		t.Errorf("input schema %s: want {code: string} only, required, no additional properties", raw)
	}
	if res.Tools[0].Description != tool.Description {
		t.Errorf("description %q, want the tool's", res.Tools[0].Description)
	}
}

func call(t *testing.T, cs *mcp.ClientSession, args any) (text string, isError bool) {
	t.Helper()
	res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: tool.Name, Arguments: args})
	if err != nil {
		t.Fatalf("CallTool(%v): %v", args, err)
	}
	if len(res.Content) != 1 {
		t.Fatalf("CallTool(%v): %d content items, want 1", args, len(res.Content))
	}
	tc, ok := res.Content[0].(*mcp.TextContent)
	if !ok {
		t.Fatalf("CallTool(%v): content is %T, want text", args, res.Content[0])
	}
	return tc.Text, res.IsError
}

// checkSixTimesSeven calls print(6*7) and checks that 42 comes back.
func checkSixTimesSeven(t *testing.T, cs *mcp.ClientSession) {
	t.Helper()
	text, isErr := call(t, cs, map[string]any{"code": "print(6*7)"})
	if isErr || !strings.Contains(text, "stdout:\n42\n") || !strings.Contains(text, "exit code: 0") {
		t.Errorf("print(6*7) gave %q (isError %v), want stdout 42 and exit code 0", text, isErr)
	}
}

func TestInMemory(t *testing.T) {
	cs := connectInMemory(t, newServer(t, Config{}))
	checkTools(t, cs)
	checkSixTimesSeven(t, cs)
	if got := cs.InitializeResult().ServerInfo.Name; got != "moat" {
		t.Errorf("server name %q, want moat", got)
	}
}

// Bad input, and code that crashes or hangs, come back as tool errors or
// results, and the session keeps serving.
func TestBadInput(t *testing.T) {
	cs := connectInMemory(t, newServer(t, Config{}))
	overCap := strings.Repeat("#", tool.DefaultMaxCode) + "\nprint(1)"
	tests := []struct {
		name    string
		args    any
		isError bool
		want    []string
	}{
		{"no arguments", nil, true, []string{`missing the required field "code"`}},
		{"missing code", map[string]any{"source": "print(1)"}, true, []string{`unknown field "source"`}},
		{"number", map[string]any{"code": 42}, true, []string{`"code" must be a string, not a number`}},
		{"null", map[string]any{"code": nil}, true, []string{`"code" must be a string, not null`}},
		{"list", map[string]any{"code": []string{"print(1)"}}, true, []string{`not an array`}},
		{"extra field", map[string]any{"code": "print(1)", "timeout": "1h"}, true, []string{`unknown field "timeout"`}},
		{"empty", map[string]any{"code": ""}, true, []string{`"code" is empty`}},
		{"over the 1 MiB cap", map[string]any{"code": overCap}, true, []string{fmt.Sprintf("over the cap of %d bytes", tool.DefaultMaxCode)}},
		{"syntax error", map[string]any{"code": "def ("}, false, []string{"exit code: 1", "SyntaxError"}},
		{"exception", map[string]any{"code": "raise SystemExit(7)"}, false, []string{"exit code: 7"}},
		{"crash", map[string]any{"code": "import os\nos.abort()"}, false, []string{"exit code: 134", "signal"}},
		{"hang", map[string]any{"code": "while True:\n    pass"}, false, []string{"reason: timeout"}},
		{"sleep", map[string]any{"code": "import time\ntime.sleep(3600)"}, false, []string{"reason: timeout"}},
		{"not utf-8 output", map[string]any{"code": "import sys\nsys.stdout.buffer.write(b'a\\xffb\\n')"}, false, []string{"a\uFFFDb"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			text, isErr := call(t, cs, tt.args)
			if isErr != tt.isError {
				t.Errorf("isError = %v, want %v; text %q", isErr, tt.isError, text)
			}
			for _, w := range tt.want {
				if !strings.Contains(text, w) {
					t.Errorf("text %q does not contain %q", text, w)
				}
			}
		})
	}
	// A tool that does not exist is the SDK's protocol error.
	if _, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: "bash", Arguments: map[string]any{}}); err == nil {
		t.Error("calling an unknown tool succeeded")
	}
	// And after all that, the server still answers.
	checkSixTimesSeven(t, cs)
}

func TestMaxCodeConfig(t *testing.T) {
	cs := connectInMemory(t, newServer(t, Config{MaxCode: 100, MaxOutput: 64}))
	if text, isErr := call(t, cs, map[string]any{"code": "print(1)" + strings.Repeat(" ", 100)}); !isErr || !strings.Contains(text, "over the cap of 100 bytes") {
		t.Errorf("101-byte program with a 100-byte cap: %q (isError %v)", text, isErr)
	}
	text, isErr := call(t, cs, map[string]any{"code": "print('x' * 10000)"})
	if isErr || !strings.Contains(text, "bytes cut") || len(text) > 1000 {
		t.Errorf("long output with MaxOutput 64 gave %d bytes (isError %v): %q", len(text), isErr, text)
	}
}

func TestStdio(t *testing.T) {
	s := newServer(t, Config{})
	// Two pipes: the client writes to the server's stdin, and reads its
	// stdout.
	inR, inW := io.Pipe()
	outR, outW := io.Pipe()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, s.Stdio(inR, outW)) }()

	cs := connectClient(t, &mcp.IOTransport{Reader: outR, Writer: inW})
	checkTools(t, cs)
	checkSixTimesSeven(t, cs)

	// The client hangs up: the server returns.
	cs.Close()
	inW.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run after the client hung up: %v", err)
		}
	case <-time.After(10 * time.Second):
		cancel()
		t.Fatal("Run did not return after the client hung up")
	}
	cancel()
}

func TestStreamableHTTP(t *testing.T) {
	s := newServer(t, Config{})
	ln, err := Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx, ln) }()
	url := "http://" + ln.Addr().String()

	cs := connectClient(t, &mcp.StreamableClientTransport{Endpoint: url})
	checkTools(t, cs)
	checkSixTimesSeven(t, cs)
	if text, isErr := call(t, cs, map[string]any{"code": "print(1)", "level": "none"}); !isErr || !strings.Contains(text, `unknown field "level"`) {
		t.Errorf("extra field over HTTP: %q (isError %v)", text, isErr)
	}

	// Garbage at the transport level is refused without harm.
	for _, body := range []string{"not json", `{"jsonrpc":"2.0","id":1,"method":"no/such/method"}`, `[]`} {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept", "application/json, text/event-stream")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode < 400 {
			t.Errorf("POST %q: status %d, want an error", body, resp.StatusCode)
		}
	}
	// A body past the request limit is refused too.
	huge := fmt.Sprintf(`{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"run_python","arguments":{"code":%q}}}`, strings.Repeat("x", s.maxFrame+1))
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(huge))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Mcp-Session-Id", cs.ID())
	if resp, err := http.DefaultClient.Do(req); err == nil {
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusRequestEntityTooLarge {
			t.Errorf("a %d-byte body: status %d, want 413", len(huge), resp.StatusCode)
		}
	}
	// The session still works.
	checkSixTimesSeven(t, cs)

	cs.Close()
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("Serve: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Serve did not return after its context was cancelled")
	}
}

func TestListen(t *testing.T) {
	for _, addr := range []string{"0.0.0.0:0", ":0", "[::]:0", "192.0.2.1:0", "example.com:80", "nonsense"} {
		ln, err := Listen(addr)
		if err == nil {
			ln.Close()
			t.Errorf("Listen(%q) succeeded, want a refusal", addr)
		} else if !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Listen(%q) = %v, want ErrInvalid", addr, err)
		}
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0"} {
		ln, err := Listen(addr)
		if err != nil {
			t.Errorf("Listen(%q): %v", addr, err)
			continue
		}
		ln.Close()
	}
}

func TestNewValidates(t *testing.T) {
	if _, err := New(nil, Config{}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("New(nil) = %v, want ErrInvalid", err)
	}
	if _, err := New(newSandbox(t), Config{MaxCode: -1}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("New with a negative cap = %v, want ErrInvalid", err)
	}
}

func slogToStderr() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}
