package mcpserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
	"github.com/moatsandbox/moat/tool"
)

// fakeSessioner is a sandbox that makes in-memory sessions and counts what
// it makes and closes. Its one-shot Run counts too, to catch a fallback.
type fakeSessioner struct {
	err error // NewSession's, when set

	mu       sync.Mutex
	made     int
	closed   int
	oneShots int
	opts     []moat.SessionOptions
}

func (f *fakeSessioner) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	f.mu.Lock()
	f.oneShots++
	f.mu.Unlock()
	return &moat.Result{Level: moat.LevelSubprocess, Stdout: []byte("one-shot\n")}, nil
}
func (f *fakeSessioner) Level() moat.Level { return moat.LevelSubprocess }
func (f *fakeSessioner) Close() error      { return nil }

func (f *fakeSessioner) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	if f.err != nil {
		return nil, f.err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.made++
	f.opts = append(f.opts, opts)
	return &fakeSession{f: f, n: f.made, files: map[string]string{}}, nil
}

func (f *fakeSessioner) counts() (made, closed, oneShots int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.made, f.closed, f.oneShots
}

// fakeSession answers a run with its number; its files are a map.
type fakeSession struct {
	f *fakeSessioner
	n int

	mu     sync.Mutex
	files  map[string]string
	closed bool
}

func (s *fakeSession) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	return &moat.Result{Level: moat.LevelSubprocess, Stdout: fmt.Appendf(nil, "session %d\n", s.n)}, nil
}

func (s *fakeSession) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.closed {
		s.closed = true
		s.f.mu.Lock()
		s.f.closed++
		s.f.mu.Unlock()
	}
	return nil
}

func (s *fakeSession) WriteFile(ctx context.Context, name string, r io.Reader) error {
	b, _ := io.ReadAll(r)
	s.mu.Lock()
	defer s.mu.Unlock()
	s.files[name] = string(b)
	return nil
}

func (s *fakeSession) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.files[name]
	if !ok {
		return nil, fmt.Errorf("fake: %q: %w", name, os.ErrNotExist)
	}
	return io.NopCloser(strings.NewReader(b)), nil
}

func (s *fakeSession) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []moat.FileInfo
	for name, b := range s.files {
		out = append(out, moat.FileInfo{Name: name, Size: int64(len(b)), Mode: 0o644})
	}
	return out, nil
}

func (s *fakeSession) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b, ok := s.files[name]
	if !ok {
		return moat.FileInfo{}, fmt.Errorf("fake: %q: %w", name, os.ErrNotExist)
	}
	return moat.FileInfo{Name: name, Size: int64(len(b)), Mode: 0o644}, nil
}

func (s *fakeSession) Mkdir(ctx context.Context, name string) error { return errors.ErrUnsupported }
func (s *fakeSession) Rename(ctx context.Context, from, to string) error {
	return errors.ErrUnsupported
}
func (s *fakeSession) RemoveFile(ctx context.Context, name string) error {
	return errors.ErrUnsupported
}

// eventually waits up to 10 s for cond, failing t if it never holds.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("after 10s: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func callTool(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) (text string, isError bool) {
	t.Helper()
	res, err := cs.CallTool(context.Background(), &mcp.CallToolParams{Name: name, Arguments: args})
	if err != nil {
		t.Fatalf("%s(%v): %v", name, args, err)
	}
	if len(res.Content) != 1 {
		t.Fatalf("%s(%v): %d content items, want 1", name, args, len(res.Content))
	}
	return res.Content[0].(*mcp.TextContent).Text, res.IsError
}

// mustCall calls a tool and fails t on a tool error.
func mustCall(t *testing.T, cs *mcp.ClientSession, name string, args map[string]any) string {
	t.Helper()
	text, isErr := callTool(t, cs, name, args)
	if isErr {
		t.Fatalf("%s(%v): tool error %q", name, args, text)
	}
	return text
}

func TestSessionsConfig(t *testing.T) {
	if _, err := New(&fakeSessioner{}, Config{Interpreter: true}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("Interpreter without Sessions: %v, want ErrInvalid", err)
	}
	// A sandbox that keeps no sessions is refused up front.
	if _, err := New(newSandbox(t).(*subprocess.Sandbox), Config{Sessions: true}); err != nil {
		t.Errorf("subprocess with sessions: %v", err)
	}
	if _, err := New(oneShotOnly{}, Config{Sessions: true}); !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("a sandbox without sessions, Sessions on: %v, want ErrUnavailable", err)
	}
}

// oneShotOnly is a sandbox that is not a moat.Sessioner.
type oneShotOnly struct{}

func (oneShotOnly) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	return &moat.Result{}, nil
}
func (oneShotOnly) Level() moat.Level { return moat.LevelSubprocess }
func (oneShotOnly) Close() error      { return nil }

// With sessions the server lists run_python, described for the mode, and
// the file tools; without, run_python alone (TestInMemory).
func TestSessionsTools(t *testing.T) {
	for _, interp := range []bool{false, true} {
		s, err := New(&fakeSessioner{}, Config{Sessions: true, Interpreter: interp})
		if err != nil {
			t.Fatal(err)
		}
		cs := connectInMemory(t, s)
		res, err := cs.ListTools(context.Background(), nil)
		if err != nil {
			t.Fatal(err)
		}
		want := tool.SessionTools(interp)
		if len(res.Tools) != len(want) {
			t.Fatalf("interpreter %v: %d tools, want %d", interp, len(res.Tools), len(want))
		}
		for _, w := range want { // the SDK lists them by name
			i := slices.IndexFunc(res.Tools, func(got *mcp.Tool) bool { return got.Name == w.Name })
			if i < 0 {
				t.Errorf("interpreter %v: %s is not listed", interp, w.Name)
				continue
			}
			got := res.Tools[i]
			if got.Description != w.Description {
				t.Errorf("interpreter %v: %s's description %q, want %q", interp, w.Name, got.Description, w.Description)
			}
			if got.Annotations == nil || got.Annotations.ReadOnlyHint != w.ReadOnly {
				t.Errorf("%s: annotations %+v", got.Name, got.Annotations)
			}
		}
		instr := cs.InitializeResult().Instructions
		if !strings.Contains(instr, "persist") || strings.Contains(instr, "nothing is kept") || strings.Contains(instr, "variables do not") == interp {
			t.Errorf("interpreter %v: instructions %q", interp, instr)
		}
	}
}

// One moat session per MCP session: made at the first tool call, used by
// every call of that connection, closed when the client disconnects.
func TestSessionPerConnection(t *testing.T) {
	f := &fakeSessioner{}
	s, err := New(f, Config{Sessions: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	connect := func() (*mcp.ClientSession, *mcp.ServerSession) {
		st, ct := mcp.NewInMemoryTransports()
		ss, err := s.MCP().Connect(context.Background(), st, nil)
		if err != nil {
			t.Fatal(err)
		}
		return connectClient(t, ct), ss
	}
	a, _ := connect()
	if made, _, _ := f.counts(); made != 0 {
		t.Fatalf("%d sessions made before any tool call", made)
	}
	for range 3 {
		if text := mustCall(t, a, tool.Name, map[string]any{"code": "print(1)"}); !strings.Contains(text, "stdout:\nsession 1\n") {
			t.Errorf("a's run: %q, want session 1's", text)
		}
	}
	mustCall(t, a, tool.WriteFileName, map[string]any{"path": "x", "content": "a's"})
	b, _ := connect()
	if text := mustCall(t, b, tool.Name, map[string]any{"code": "print(1)"}); !strings.Contains(text, "stdout:\nsession 2\n") {
		t.Errorf("b's run: %q, want session 2's", text)
	}
	if text, isErr := callTool(t, b, tool.ReadFileName, map[string]any{"path": "x"}); !isErr || !strings.Contains(text, `no file "x"`) {
		t.Errorf("b read a's file: %q (isError %v)", text, isErr)
	}
	if made, closed, oneShots := f.counts(); made != 2 || closed != 0 || oneShots != 0 {
		t.Errorf("made %d, closed %d, one-shot runs %d; want 2, 0, 0", made, closed, oneShots)
	}
	if f.opts[0].Interpreter {
		t.Error("a session with an interpreter, not asked for")
	}

	// a hangs up: its session is closed, b's is not.
	a.Close()
	eventually(t, "a's moat session was not closed after a disconnected", func() bool { _, closed, _ := f.counts(); return closed == 1 })
	mustCall(t, b, tool.ListFilesName, map[string]any{})
	b.Close()
	eventually(t, "b's moat session was not closed after b disconnected", func() bool { _, closed, _ := f.counts(); return closed == 2 })
	if made, _, _ := f.counts(); made != 2 {
		t.Errorf("%d sessions made, want 2", made)
	}
}

// A sandbox that cannot make a session fails the call; nothing runs in a
// one-shot run instead.
func TestSessionsUnavailableFailsClosed(t *testing.T) {
	f := &fakeSessioner{err: &moat.UnavailableError{Level: moat.LevelContainer, Reason: "this level keeps no sessions"}}
	s, err := New(f, Config{Sessions: true})
	if err != nil {
		t.Fatal(err)
	}
	cs := connectInMemory(t, s)
	for _, c := range []struct {
		name string
		args map[string]any
	}{
		{tool.Name, map[string]any{"code": "print(1)"}},
		{tool.WriteFileName, map[string]any{"path": "x", "content": "y"}},
		{tool.ListFilesName, map[string]any{}},
	} {
		text, isErr := callTool(t, cs, c.name, c.args)
		if !isErr || !strings.Contains(text, "could not make one, so nothing was run") || !strings.Contains(text, "this level keeps no sessions") {
			t.Errorf("%s: %q (isError %v), want a tool error saying the sandbox cannot make sessions", c.name, text, isErr)
		}
	}
	if _, _, oneShots := f.counts(); oneShots != 0 {
		t.Errorf("%d one-shot runs: the server fell back to runs without a session", oneShots)
	}
}

func TestServerCloseClosesSessions(t *testing.T) {
	f := &fakeSessioner{}
	s, err := New(f, Config{Sessions: true, Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	cs := connectInMemory(t, s)
	mustCall(t, cs, tool.Name, map[string]any{"code": "print(1)"})
	if !f.opts[0].Interpreter {
		t.Error("Interpreter was not passed to NewSession")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if _, closed, _ := f.counts(); closed != 1 {
		t.Errorf("after Close, %d sessions closed, want 1", closed)
	}
	if text, isErr := callTool(t, cs, tool.Name, map[string]any{"code": "print(1)"}); !isErr || !strings.Contains(text, "server is closed") {
		t.Errorf("a call after Close: %q (isError %v)", text, isErr)
	}
	if made, _, _ := f.counts(); made != 1 {
		t.Errorf("a session was made after Close")
	}
	if err := s.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// Serve returns only once the sessions of its clients are closed.
func TestSessionsServeClosesOnReturn(t *testing.T) {
	f := &fakeSessioner{}
	s, err := New(f, Config{Sessions: true})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- s.Serve(ctx, ln) }()
	cs := connectClient(t, &mcp.StreamableClientTransport{Endpoint: "http://" + ln.Addr().String()})
	mustCall(t, cs, tool.WriteFileName, map[string]any{"path": "a", "content": "b"})
	if text := mustCall(t, cs, tool.ReadFileName, map[string]any{"path": "a"}); !strings.Contains(text, "a: 1 byte of text:\nb") {
		t.Errorf("read over HTTP: %q", text)
	}
	cancel() // the client is still connected
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("Serve: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Serve did not return after its context was cancelled")
	}
	if made, closed, _ := f.counts(); made != 1 || closed != 1 {
		t.Errorf("after Serve returned: %d sessions made, %d closed; want 1, 1", made, closed)
	}
}

// spySessioner passes the real sandbox through and keeps the sessions it
// makes, to look at them after the server is done.
type spySessioner struct {
	*subprocess.Sandbox

	mu       sync.Mutex
	sessions []*spySession
}

type spySession struct {
	moat.Session
	mu     sync.Mutex
	closes int
}

func (s *spySession) Close() error {
	s.mu.Lock()
	s.closes++
	s.mu.Unlock()
	return s.Session.Close()
}

func (s *spySessioner) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	sess, err := s.Sandbox.NewSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	spy := &spySession{Session: sess}
	s.mu.Lock()
	s.sessions = append(s.sessions, spy)
	s.mu.Unlock()
	return spy, nil
}

func (s *spySessioner) made() []*spySession {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.sessions)
}

func newSpy(t *testing.T) *spySessioner {
	t.Helper()
	return &spySessioner{Sandbox: newSandbox(t).(*subprocess.Sandbox)}
}

// At the subprocess level: files written with write_file are read by the
// code and the other way round; two clients do not see each other's files.
func TestSessionsFilesSubprocess(t *testing.T) {
	spy := newSpy(t)
	s, err := New(spy, Config{Sessions: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	a, b := connectInMemory(t, s), connectInMemory(t, s)

	mustCall(t, a, tool.WriteFileName, map[string]any{"path": "in/data.txt", "content": "from write_file\n"})
	text := mustCall(t, a, tool.Name, map[string]any{"code": "print(open('in/data.txt').read(), end='')\nopen('out.bin', 'wb').write(bytes(range(4)))\nopen('out.txt', 'w').write('from the code\\n')"})
	if !strings.Contains(text, "stdout:\nfrom write_file\n") {
		t.Errorf("the code did not read write_file's file: %q", text)
	}
	if text := mustCall(t, a, tool.ReadFileName, map[string]any{"path": "out.txt"}); text != "out.txt: 14 bytes of text:\nfrom the code\n" {
		t.Errorf("read_file of the code's file: %q", text)
	}
	if text := mustCall(t, a, tool.ReadFileName, map[string]any{"path": "out.bin"}); !strings.HasSuffix(text, "binary, shown as base64:\nAAECAw==") {
		t.Errorf("read_file of a binary file: %q", text)
	}
	if text := mustCall(t, a, tool.ListFilesName, nil); !strings.Contains(text, "in/\nin/data.txt  16 bytes\nout.bin  4 bytes\nout.txt  14 bytes") {
		t.Errorf("list_files: %q", text)
	}
	// Variables do not persist without an interpreter.
	mustCall(t, a, tool.Name, map[string]any{"code": "x = 41"})
	if text := mustCall(t, a, tool.Name, map[string]any{"code": "print(x + 1)"}); !strings.Contains(text, "NameError") {
		t.Errorf("a variable persisted without an interpreter: %q", text)
	}

	// b sees none of it, by any tool.
	if text := mustCall(t, b, tool.ListFilesName, nil); text != "the working directory is empty" {
		t.Errorf("b's list_files: %q", text)
	}
	if text, isErr := callTool(t, b, tool.ReadFileName, map[string]any{"path": "out.txt"}); !isErr || !strings.Contains(text, `no file "out.txt"`) {
		t.Errorf("b read a's file: %q (isError %v)", text, isErr)
	}
	// (The level's own code file of the run aside.)
	if text := mustCall(t, b, tool.Name, map[string]any{"code": "import os\nprint(sorted(n for n in os.listdir('.') if not n.startswith('.moat-run-')))"}); !strings.Contains(text, "stdout:\n[]\n") {
		t.Errorf("b's code sees files: %q", text)
	}
	// Names that leave the working directory are tool errors.
	for _, p := range []string{"../x", "/etc/passwd", "in/../../x"} {
		if text, isErr := callTool(t, b, tool.WriteFileName, map[string]any{"path": p, "content": "x"}); !isErr || !strings.Contains(text, "must be a relative") {
			t.Errorf("write_file %q: %q (isError %v)", p, text, isErr)
		}
	}
	if n := len(spy.made()); n != 2 {
		t.Errorf("%d sessions made for two clients", n)
	}
}

// With an interpreter, variables persist between run_python calls.
func TestSessionsInterpreterSubprocess(t *testing.T) {
	s, err := New(newSpy(t), Config{Sessions: true, Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	cs := connectInMemory(t, s)
	mustCall(t, cs, tool.Name, map[string]any{"code": "x = 41\nopen('f', 'w').write('kept')"})
	if text := mustCall(t, cs, tool.Name, map[string]any{"code": "print(x + 1, open('f').read())"}); !strings.Contains(text, "stdout:\n42 kept\n") {
		t.Errorf("the variable or the file did not persist: %q", text)
	}
	// A timeout ends the interpreter, and both results say so, as
	// run_python's description promises.
	if text := mustCall(t, cs, tool.Name, map[string]any{"code": "while True:\n    pass"}); !strings.Contains(text, "reason: timeout") || !strings.Contains(text, "note: interpreter ended by") {
		t.Errorf("the timeout's result: %q", text)
	}
	text := mustCall(t, cs, tool.Name, map[string]any{"code": "print(open('f').read())\nprint(x)"})
	if !strings.Contains(text, "note: interpreter restarted") || !strings.Contains(text, "stdout:\nkept\n") || !strings.Contains(text, "NameError") {
		t.Errorf("the run after the timeout: %q, want a note, the file kept and the variable gone", text)
	}
}

// Run returns after the client hangs up, and by then the moat session is
// closed and its directory gone.
func TestSessionClosedAfterDisconnectSubprocess(t *testing.T) {
	spy := newSpy(t)
	s, err := New(spy, Config{Sessions: true})
	if err != nil {
		t.Fatal(err)
	}
	st, ct := mcp.NewInMemoryTransports()
	done := make(chan error, 1)
	go func() { done <- s.Run(context.Background(), st) }()
	cs := connectClient(t, ct)
	mustCall(t, cs, tool.WriteFileName, map[string]any{"path": "f", "content": "x"})
	mustCall(t, cs, tool.Name, map[string]any{"code": "open('g', 'w').write('y')"})
	made := spy.made()
	if len(made) != 1 {
		t.Fatalf("%d sessions made, want 1", len(made))
	}
	dir := made[0].Session.(*subprocess.Session).Dir()
	if _, err := os.Stat(dir + "/g"); err != nil {
		t.Fatalf("the session's file: %v", err)
	}
	cs.Close()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("Run did not return after the client hung up")
	}
	made[0].mu.Lock()
	closes := made[0].closes
	made[0].mu.Unlock()
	if closes == 0 {
		t.Error("the moat session was not closed when Run returned")
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the session's directory %s is still there after the client disconnected: %v", dir, err)
	}
	if n := len(spy.made()); n != 1 {
		t.Errorf("%d sessions made, want 1", n)
	}
}
