package agent

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
	"github.com/moatsandbox/moat/tool"
)

// spySessioner is the real subprocess level, keeping the sessions it makes
// to look at them after the agent is done.
type spySessioner struct {
	*subprocess.Sandbox

	mu       sync.Mutex
	opts     []moat.SessionOptions
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

func (s *spySession) closed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closes > 0
}

func (s *spySessioner) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	sess, err := s.Sandbox.NewSession(ctx, opts)
	if err != nil {
		return nil, err
	}
	spy := &spySession{Session: sess}
	s.mu.Lock()
	s.opts = append(s.opts, opts)
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
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatalf("subprocess.New: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return &spySessioner{Sandbox: sb}
}

func toolNames(t *testing.T, tools []json.RawMessage) []string {
	t.Helper()
	var names []string
	for _, raw := range tools {
		var tl struct {
			Name        string          `json:"name"`
			Description string          `json:"description"`
			InputSchema json.RawMessage `json:"input_schema"`
		}
		if err := json.Unmarshal(raw, &tl); err != nil {
			t.Fatal(err)
		}
		names = append(names, tl.Name)
	}
	return names
}

// With sessions, the conversation keeps one session: a file written with
// write_file is read by the code, a file the code writes is read with
// read_file, and the session is closed, its directory gone, when Run
// returns.
func TestRunWithSession(t *testing.T) {
	r := serve(t,
		ok(toolTurn(t, useBlock("toolu_1", tool.WriteFileName, `{"path":"in.txt","content":"six times seven\n"}`))),
		ok(toolTurn(t, useBlock("toolu_2", tool.Name, `{"code":"s = open('in.txt').read()\nprint(s.strip())\nopen('out.txt', 'w').write(str(6*7))"}`))),
		ok(toolTurn(t,
			useBlock("toolu_3", tool.ReadFileName, `{"path":"out.txt"}`),
			useBlock("toolu_4", tool.ListFilesName, `{}`),
			useBlock("toolu_5", tool.Name, `{"code":"print(s)"}`),
		)),
		ok(fixture(t, "final.json")))
	spy := newSpy(t)
	a, transcript := newAgent(t, spy, r, Config{Sessions: true})
	ans, err := a.Run(context.Background(), "task")
	if err != nil || ans.ToolCalls != 5 {
		t.Fatalf("Run = %+v, %v", ans, err)
	}
	reqs := r.sent()
	first := parseSent(t, reqs[0])
	if got := toolNames(t, first.Tools); !slices.Equal(got, []string{tool.Name, tool.WriteFileName, tool.ReadFileName, tool.ListFilesName}) {
		t.Errorf("tools sent %v", got)
	}
	if !strings.Contains(string(first.Tools[0]), "variables, imports and definitions are NOT kept") {
		t.Errorf("run_python's description is not the session one: %s", first.Tools[0])
	}
	if !strings.Contains(string(first.Tools[1]), `"enum":["text","base64"]`) {
		t.Errorf("write_file's schema lost its encoding enum: %s", first.Tools[1])
	}
	if first.System[0].Text != DefaultSessionSystem {
		t.Errorf("system %q, want the session prompt", first.System[0].Text)
	}
	result := func(req, i int) sentBlock {
		t.Helper()
		res := toolResults(t, parseSent(t, reqs[req]))
		if i >= len(res) {
			t.Fatalf("request %d has %d results", req, len(res))
		}
		return res[i]
	}
	if b := result(1, 0); *b.IsError || b.resultText() != "wrote in.txt (16 bytes)" {
		t.Errorf("write_file: %q", b.resultText())
	}
	if b := result(2, 0); *b.IsError || !strings.Contains(b.resultText(), "stdout:\nsix times seven\n") {
		t.Errorf("the code did not read write_file's file: %q", b.resultText())
	}
	if b := result(3, 0); *b.IsError || b.resultText() != "out.txt: 2 bytes of text:\n42" {
		t.Errorf("read_file of the code's file: %q", b.resultText())
	}
	if b := result(3, 1); *b.IsError || b.resultText() != "2 entries in the working directory:\nin.txt  16 bytes\nout.txt  2 bytes" {
		t.Errorf("list_files: %q", b.resultText())
	}
	if b := result(3, 2); *b.IsError || !strings.Contains(b.resultText(), "NameError") {
		t.Errorf("a variable persisted without an interpreter: %q", b.resultText())
	}
	for _, w := range []string{"one session: files kept between calls", "write_file:\n", `"path":"in.txt"`, "read_file:\n"} {
		if !strings.Contains(transcript.String(), w) {
			t.Errorf("the transcript lacks %q:\n%s", w, transcript)
		}
	}
	made := spy.made()
	if len(made) != 1 || spy.opts[0].Interpreter {
		t.Fatalf("%d sessions made (%+v), want 1 without an interpreter", len(made), spy.opts)
	}
	if !made[0].closed() {
		t.Error("the session is still open after Run returned")
	}
	if dir := made[0].Session.(*subprocess.Session).Dir(); dir == "" {
		t.Error("no directory")
	} else if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the session's directory %s is still there after Run: %v", dir, err)
	}
}

// With an interpreter, variables persist between calls of one Run; a
// second Run has a session of its own.
func TestRunWithInterpreter(t *testing.T) {
	r := serve(t,
		ok(toolTurn(t, useBlock("toolu_1", tool.Name, `{"code":"x = 41"}`))),
		ok(toolTurn(t, useBlock("toolu_2", tool.Name, `{"code":"print(x + 1)"}`))),
		ok(fixture(t, "final.json")))
	spy := newSpy(t)
	a, _ := newAgent(t, spy, r, Config{Sessions: true, Interpreter: true})
	if _, err := a.Run(context.Background(), "task"); err != nil {
		t.Fatal(err)
	}
	reqs := r.sent()
	if b := toolResults(t, parseSent(t, reqs[2]))[0]; *b.IsError || !strings.Contains(b.resultText(), "stdout:\n42\n") {
		t.Errorf("the variable did not persist: %q", b.resultText())
	}
	first := parseSent(t, reqs[0])
	if first.System[0].Text != DefaultInterpreterSystem || !strings.Contains(string(first.Tools[0]), "Variables, imports and definitions from earlier calls are kept") {
		t.Errorf("system %q, run_python %s: want the interpreter's", first.System[0].Text, first.Tools[0])
	}
	if len(spy.opts) != 1 || !spy.opts[0].Interpreter || !spy.made()[0].closed() {
		t.Errorf("sessions %+v: want one with an interpreter, closed", spy.opts)
	}
}

// fakeSessioner refuses to make sessions, as a level without them does.
type fakeSessioner struct{ failingSandbox }

func (fakeSessioner) NewSession(context.Context, moat.SessionOptions) (moat.Session, error) {
	return nil, &moat.UnavailableError{Level: moat.LevelContainer, Reason: "this level keeps no sessions"}
}

// No session, no run: Run fails before asking the model anything, and a
// sandbox that cannot keep sessions at all is refused by New.
func TestRunSessionUnavailable(t *testing.T) {
	r := serve(t, ok(fixture(t, "final.json")))
	a, _ := newAgent(t, fakeSessioner{}, r, Config{Sessions: true})
	_, err := a.Run(context.Background(), "task")
	if !errors.Is(err, moat.ErrUnavailable) || !strings.Contains(err.Error(), "this level keeps no sessions") {
		t.Errorf("Run: %v, want the sandbox's ErrUnavailable", err)
	}
	if n := len(r.sent()); n != 0 {
		t.Errorf("%d requests to the model without a session", n)
	}
	if _, err := New(failingSandbox{}, Config{APIKey: testKey, Sessions: true}); !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("New with a sandbox that is no Sessioner: %v, want ErrUnavailable", err)
	}
	if err := (Config{APIKey: testKey, Interpreter: true}).Validate(); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("Interpreter without Sessions: %v, want ErrInvalid", err)
	}
}

// The session is closed when the loop ends with an error too.
func TestRunSessionClosedOnAPIError(t *testing.T) {
	r := serve(t, response{http.StatusBadRequest, fixture(t, "invalid_request.json")})
	spy := newSpy(t)
	a, _ := newAgent(t, spy, r, Config{Sessions: true})
	if _, err := a.Run(context.Background(), "task"); err == nil {
		t.Fatal("Run succeeded on a 400")
	}
	if made := spy.made(); len(made) != 1 || !made[0].closed() {
		t.Errorf("sessions %d: want one, closed", len(made))
	}
}
