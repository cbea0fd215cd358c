package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/subprocess"
	"github.com/moatsandbox/moat/tool"
)

func TestMain(m *testing.M) {
	os.Exit(sandboxtest.CheckNoChildren(m.Run(), 2*time.Second))
}

// response is one recorded Messages API response.
type response struct {
	status int
	body   []byte
}

// replay is a stand-in for the Messages API: it serves recorded responses
// in order (the last one again once the others are used) and keeps the
// requests the SDK sent.
type replay struct {
	t         *testing.T
	responses []response
	base      string // the server's URL

	mu       sync.Mutex
	requests []recorded
}

type recorded struct {
	header http.Header
	body   []byte
}

func (r *replay) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if req.Method != http.MethodPost || req.URL.Path != "/v1/messages" {
		r.t.Errorf("unexpected request %s %s", req.Method, req.URL.Path)
		http.NotFound(w, req)
		return
	}
	body, err := io.ReadAll(req.Body)
	if err != nil {
		r.t.Errorf("reading the request: %v", err)
	}
	r.mu.Lock()
	n := len(r.requests)
	r.requests = append(r.requests, recorded{req.Header.Clone(), body})
	resp := r.responses[min(n, len(r.responses)-1)]
	r.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("request-id", fmt.Sprintf("req_test_%d", n))
	w.WriteHeader(resp.status)
	w.Write(resp.body)
}

func (r *replay) sent() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]recorded(nil), r.requests...)
}

// serve starts a replay server with the given responses.
func serve(t *testing.T, responses ...response) *replay {
	t.Helper()
	r := &replay{t: t, responses: responses}
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	r.base = srv.URL
	return r
}

func fixture(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func ok(body []byte) response { return response{http.StatusOK, body} }

// toolTurn returns the recorded tool_use turn with its tool_use blocks
// replaced by blocks (raw JSON), keeping the rest of the envelope.
func toolTurn(t *testing.T, blocks ...string) []byte {
	t.Helper()
	var msg map[string]any
	if err := json.Unmarshal(fixture(t, "tool_use.json"), &msg); err != nil {
		t.Fatal(err)
	}
	content := []any{msg["content"].([]any)[0]} // the text block
	for _, b := range blocks {
		var v any
		if err := json.Unmarshal([]byte(b), &v); err != nil {
			t.Fatalf("block %s: %v", b, err)
		}
		content = append(content, v)
	}
	msg["content"] = content
	out, err := json.Marshal(msg)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func useBlock(id, name, input string) string {
	return fmt.Sprintf(`{"type":"tool_use","id":%q,"name":%q,"input":%s,"caller":{"type":"direct"}}`, id, name, input)
}

// recordedTurn is what the fixtures hold, for comparing with what the agent
// did.
type recordedTurn struct {
	Content []struct {
		Type  string          `json:"type"`
		Text  string          `json:"text"`
		ID    string          `json:"id"`
		Input json.RawMessage `json:"input"`
	} `json:"content"`
}

func parseTurn(t *testing.T, b []byte) recordedTurn {
	t.Helper()
	var m recordedTurn
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// sentRequest is the part of a Messages API request the tests look at.
type sentRequest struct {
	Model     string `json:"model"`
	MaxTokens int64  `json:"max_tokens"`
	System    []struct {
		Text string `json:"text"`
	} `json:"system"`
	Tools    []json.RawMessage `json:"tools"`
	Messages []struct {
		Role    string      `json:"role"`
		Content []sentBlock `json:"content"`
	} `json:"messages"`
}

type sentBlock struct {
	Type      string `json:"type"`
	Text      string `json:"text"`
	ID        string `json:"id"`
	Name      string `json:"name"`
	ToolUseID string `json:"tool_use_id"`
	IsError   *bool  `json:"is_error"`
	Content   []struct {
		Type string `json:"type"`
		Text string `json:"text"`
	} `json:"content"`
}

func (b sentBlock) resultText() string {
	var parts []string
	for _, c := range b.Content {
		parts = append(parts, c.Text)
	}
	return strings.Join(parts, "")
}

func parseSent(t *testing.T, r recorded) sentRequest {
	t.Helper()
	var s sentRequest
	if err := json.Unmarshal(r.body, &s); err != nil {
		t.Fatalf("request body %s: %v", r.body, err)
	}
	return s
}

// toolResults returns the tool_result blocks of the last message of req.
func toolResults(t *testing.T, req sentRequest) []sentBlock {
	t.Helper()
	last := req.Messages[len(req.Messages)-1]
	if last.Role != "user" {
		t.Fatalf("last message is from %q, want user", last.Role)
	}
	var out []sentBlock
	for _, b := range last.Content {
		if b.Type == "tool_result" {
			out = append(out, b)
		}
	}
	return out
}

// countingSandbox counts the runs that reach the sandbox.
type countingSandbox struct {
	moat.Sandbox
	runs atomic.Int64
}

func (c *countingSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	c.runs.Add(1)
	return c.Sandbox.Run(ctx, req)
}

// newSandbox returns the real subprocess level, counting its runs.
func newSandbox(t *testing.T, limits moat.Limits) *countingSandbox {
	t.Helper()
	sb, err := subprocess.New(subprocess.Config{Limits: limits})
	if err != nil {
		t.Fatalf("subprocess.New: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return &countingSandbox{Sandbox: sb}
}

const testKey = "sk-ant-test-0123456789"

func newAgent(t *testing.T, sb moat.Sandbox, r *replay, cfg Config) (*Agent, *bytes.Buffer) {
	t.Helper()
	var transcript bytes.Buffer
	cfg.APIKey = testKey
	cfg.BaseURL = r.base
	cfg.Transcript = &transcript
	a, err := New(sb, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return a, &transcript
}

// The whole loop: the model calls run_python, the real sandbox runs the
// code, the result goes back, the model answers.
func TestRunToolThenAnswer(t *testing.T) {
	turn1, final := fixture(t, "tool_use.json"), fixture(t, "final.json")
	r := serve(t, ok(turn1), ok(final))
	sb := newSandbox(t, moat.Limits{})
	a, transcript := newAgent(t, sb, r, Config{})

	ans, err := a.Run(context.Background(), "What is 6 times 7?")
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	wantAnswer := parseTurn(t, final).Content[0].Text
	if ans.Text != wantAnswer || ans.StopReason != "end_turn" || ans.Turns != 2 || ans.ToolCalls != 1 {
		t.Errorf("Answer = %+v, want text %q after 2 turns and 1 call", ans, wantAnswer)
	}
	if n := sb.runs.Load(); n != 1 {
		t.Errorf("the sandbox ran %d times, want 1", n)
	}

	reqs := r.sent()
	if len(reqs) != 2 {
		t.Fatalf("%d requests, want 2", len(reqs))
	}
	first := parseSent(t, reqs[0])
	if got := reqs[0].header.Get("Authorization") + reqs[0].header.Get("X-Api-Key"); !strings.Contains(got, testKey) {
		t.Errorf("the request does not carry the key (authorization %q)", got)
	}
	if first.Model != DefaultModel || first.MaxTokens != DefaultMaxTokens {
		t.Errorf("model %q max_tokens %d, want the defaults %q %d", first.Model, first.MaxTokens, DefaultModel, DefaultMaxTokens)
	}
	if len(first.System) != 1 || first.System[0].Text != DefaultSystem {
		t.Errorf("system = %+v, want the default prompt", first.System)
	}
	if len(first.Messages) != 1 || first.Messages[0].Role != "user" || first.Messages[0].Content[0].Text != "What is 6 times 7?" {
		t.Errorf("first messages = %+v, want the task", first.Messages)
	}
	checkToolSchema(t, first.Tools)

	// The second request carries the model's turn back, then the result.
	second := parseSent(t, reqs[1])
	use := parseTurn(t, turn1).Content[1]
	if len(second.Messages) != 3 || second.Messages[1].Role != "assistant" {
		t.Fatalf("second request has %d messages, want task, assistant turn, results", len(second.Messages))
	}
	var echoed bool
	for _, b := range second.Messages[1].Content {
		echoed = echoed || (b.Type == "tool_use" && b.ID == use.ID && b.Name == tool.Name)
	}
	if !echoed {
		t.Errorf("the assistant turn sent back lacks the tool_use %s: %+v", use.ID, second.Messages[1].Content)
	}
	results := toolResults(t, second)
	if len(results) != 1 {
		t.Fatalf("%d tool results, want 1", len(results))
	}
	res := results[0]
	if res.ToolUseID != use.ID {
		t.Errorf("tool_use_id = %q, want %q", res.ToolUseID, use.ID)
	}
	if res.IsError == nil || *res.IsError {
		t.Errorf("is_error = %v, want false", res.IsError)
	}
	if text := res.resultText(); !strings.Contains(text, "stdout:\n42\n") || !strings.Contains(text, "exit code: 0") {
		t.Errorf("tool result %q lacks the sandbox's stdout 42 and exit code 0", text)
	}

	// The transcript shows the code, the result and the answer, in order.
	var code struct{ Code string }
	json.Unmarshal(use.Input, &code)
	rest := transcript.String()
	for _, w := range []string{"What is 6 times 7?", "I'll compute that with Python.", code.Code, "42", "answer:", wantAnswer} {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Fatalf("transcript lacks %q (in order):\n%s", w, transcript)
		}
		rest = rest[i+len(w):]
	}
}

// checkToolSchema checks that the request offered exactly run_python, whose
// input is code and nothing else.
func checkToolSchema(t *testing.T, tools []json.RawMessage) {
	t.Helper()
	if len(tools) != 1 {
		t.Fatalf("%d tools sent, want exactly 1", len(tools))
	}
	var tl struct {
		Name        string `json:"name"`
		Description string `json:"description"`
		InputSchema struct {
			Type       string                     `json:"type"`
			Properties map[string]json.RawMessage `json:"properties"`
			Required   []string                   `json:"required"`
			Additional *bool                      `json:"additionalProperties"`
		} `json:"input_schema"`
	}
	if err := json.Unmarshal(tools[0], &tl); err != nil {
		t.Fatal(err)
	}
	s := tl.InputSchema
	if tl.Name != "run_python" || tl.Description == "" {
		t.Errorf("tool %q with description %q, want run_python with one", tl.Name, tl.Description)
	}
	if s.Type != "object" || len(s.Properties) != 1 || s.Properties["code"] == nil {
		t.Errorf("input_schema %s: want an object with the property code only", tools[0])
	}
	var code struct{ Type string }
	json.Unmarshal(s.Properties["code"], &code)
	if code.Type != "string" {
		t.Errorf("code is of type %q, want string", code.Type)
	}
	if len(s.Required) != 1 || s.Required[0] != "code" || s.Additional == nil || *s.Additional {
		t.Errorf("required %v additionalProperties %v, want [code] and false", s.Required, s.Additional)
	}
}

func TestRunStopsAtMaxTurns(t *testing.T) {
	for _, maxTurns := range []int{1, 3} {
		t.Run(fmt.Sprint(maxTurns), func(t *testing.T) {
			r := serve(t, ok(fixture(t, "tool_use.json"))) // the model never stops calling the tool
			sb := newSandbox(t, moat.Limits{})
			a, transcript := newAgent(t, sb, r, Config{MaxTurns: maxTurns})
			ans, err := a.Run(context.Background(), "loop forever")
			if !errors.Is(err, ErrMaxTurns) {
				t.Fatalf("Run error = %v, want ErrMaxTurns", err)
			}
			if n := len(r.sent()); n != maxTurns {
				t.Errorf("%d requests, want %d", n, maxTurns)
			}
			// The last turn's call is not run: its result could not be sent.
			if n := sb.runs.Load(); n != int64(maxTurns-1) {
				t.Errorf("the sandbox ran %d times, want %d", n, maxTurns-1)
			}
			if ans == nil || ans.Turns != maxTurns || ans.StopReason != "tool_use" {
				t.Errorf("Answer = %+v", ans)
			}
			if !strings.Contains(transcript.String(), fmt.Sprintf("no final answer after %d turns", maxTurns)) {
				t.Errorf("transcript does not say the loop stopped:\n%s", transcript)
			}
		})
	}
}

// Bad tool calls come back to the model as tool errors, the code does not
// run, and the loop goes on to the answer.
func TestRunBadToolInput(t *testing.T) {
	tests := []struct {
		name, input, want string
	}{
		{"missing code", `{}`, `missing the required field "code"`},
		{"number", `{"code":42}`, `"code" must be a string, not a number`},
		{"null", `{"code":null}`, `"code" must be a string, not null`},
		{"extra field", `{"code":"print(1)","level":"none"}`, `unknown field "level"`},
		{"over the cap", fmt.Sprintf(`{"code":%q}`, "print(1)#"+strings.Repeat("x", 100)), "over the cap of 64 bytes"},
	}
	sb := newSandbox(t, moat.Limits{})
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := serve(t, ok(toolTurn(t, useBlock("toolu_bad", tool.Name, tt.input))), ok(fixture(t, "final.json")))
			before := sb.runs.Load()
			a, _ := newAgent(t, sb, r, Config{MaxCode: 64})
			ans, err := a.Run(context.Background(), "task")
			if err != nil || ans.StopReason != "end_turn" {
				t.Fatalf("Run = %+v, %v; want the final answer", ans, err)
			}
			if n := sb.runs.Load() - before; n != 0 {
				t.Errorf("the sandbox ran %d times on bad input", n)
			}
			reqs := r.sent()
			if len(reqs) != 2 {
				t.Fatalf("%d requests, want 2", len(reqs))
			}
			res := toolResults(t, parseSent(t, reqs[1]))
			if len(res) != 1 || res[0].ToolUseID != "toolu_bad" || res[0].IsError == nil || !*res[0].IsError {
				t.Fatalf("tool results %+v, want one error for toolu_bad", res)
			}
			if !strings.Contains(res[0].resultText(), tt.want) {
				t.Errorf("tool error %q does not contain %q", res[0].resultText(), tt.want)
			}
		})
	}
}

// A failure of the code is a result, not a tool error: the model gets the
// traceback and the exit code. Several calls in one turn get their results
// in order.
func TestRunCodeFailsAndSeveralCalls(t *testing.T) {
	r := serve(t,
		ok(toolTurn(t,
			useBlock("toolu_a", tool.Name, `{"code":"print('first')"}`),
			useBlock("toolu_b", tool.Name, `{"code":"1/0"}`),
			useBlock("toolu_c", "bash", `{"command":"ls"}`),
		)),
		ok(fixture(t, "final.json")))
	sb := newSandbox(t, moat.Limits{})
	a, transcript := newAgent(t, sb, r, Config{})
	ans, err := a.Run(context.Background(), "task")
	if err != nil || ans.ToolCalls != 3 {
		t.Fatalf("Run = %+v, %v", ans, err)
	}
	if n := sb.runs.Load(); n != 2 {
		t.Errorf("the sandbox ran %d times, want 2", n)
	}
	res := toolResults(t, parseSent(t, r.sent()[1]))
	if len(res) != 3 {
		t.Fatalf("%d tool results, want 3", len(res))
	}
	for i, id := range []string{"toolu_a", "toolu_b", "toolu_c"} {
		if res[i].ToolUseID != id {
			t.Errorf("result %d is for %q, want %q", i, res[i].ToolUseID, id)
		}
	}
	if text := res[0].resultText(); *res[0].IsError || !strings.Contains(text, "first") {
		t.Errorf("first result %q (is_error %v)", text, *res[0].IsError)
	}
	if text := res[1].resultText(); *res[1].IsError || !strings.Contains(text, "exit code: 1") || !strings.Contains(text, "ZeroDivisionError") {
		t.Errorf("second result %q (is_error %v), want the traceback as a result", text, *res[1].IsError)
	}
	if text := res[2].resultText(); !*res[2].IsError || !strings.Contains(text, `unknown tool "bash"`) {
		t.Errorf("third result %q (is_error %v), want an unknown tool error", text, *res[2].IsError)
	}
	if !strings.Contains(transcript.String(), "ZeroDivisionError") {
		t.Errorf("transcript lacks the traceback:\n%s", transcript)
	}
}

// failingSandbox refuses every run, as a level does when a protection
// cannot be applied.
type failingSandbox struct{}

func (failingSandbox) Run(context.Context, moat.Request) (*moat.Result, error) {
	return nil, &moat.UnavailableError{Level: moat.LevelSubprocess, Reason: "landlock is not enabled in this kernel"}
}
func (failingSandbox) Level() moat.Level { return moat.LevelSubprocess }
func (failingSandbox) Close() error      { return nil }

func TestRunSandboxError(t *testing.T) {
	r := serve(t, ok(fixture(t, "tool_use.json")), ok(fixture(t, "final.json")))
	a, _ := newAgent(t, failingSandbox{}, r, Config{})
	if _, err := a.Run(context.Background(), "task"); err != nil {
		t.Fatalf("Run: %v; a sandbox error should go to the model", err)
	}
	res := toolResults(t, parseSent(t, r.sent()[1]))
	if len(res) != 1 || !*res[0].IsError || !strings.Contains(res[0].resultText(), "landlock is not enabled") {
		t.Errorf("tool results %+v, want the sandbox's error", res)
	}
}

func TestRunAPIError(t *testing.T) {
	r := serve(t, response{http.StatusBadRequest, fixture(t, "invalid_request.json")})
	a, _ := newAgent(t, failingSandbox{}, r, Config{})
	_, err := a.Run(context.Background(), "task")
	var apiErr *anthropic.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusBadRequest {
		t.Fatalf("Run error = %v, want the API's 400", err)
	}
	if n := len(r.sent()); n != 1 {
		t.Errorf("%d requests, want 1 (a 400 is not retried)", n)
	}
}

func TestConfig(t *testing.T) {
	r := serve(t, ok(fixture(t, "final.json")))
	a, _ := newAgent(t, failingSandbox{}, r, Config{Model: "claude-opus-5-5", MaxTokens: 123, System: "be brief"})
	if _, err := a.Run(context.Background(), "task"); err != nil {
		t.Fatal(err)
	}
	s := parseSent(t, r.sent()[0])
	if s.Model != "claude-opus-5-5" || s.MaxTokens != 123 || s.System[0].Text != "be brief" {
		t.Errorf("sent model %q max_tokens %d system %+v", s.Model, s.MaxTokens, s.System)
	}
}

func TestNoAPIKey(t *testing.T) {
	for _, key := range []string{"", "  "} {
		_, err := New(failingSandbox{}, Config{APIKey: key})
		if !errors.Is(err, ErrNoAPIKey) {
			t.Errorf("New with key %q: %v, want ErrNoAPIKey", key, err)
		}
	}
	_, err := APIKeyFromEnv(func(string) (string, bool) { return "", false })
	if !errors.Is(err, ErrNoAPIKey) {
		t.Fatalf("APIKeyFromEnv without the variable: %v", err)
	}
	if msg := err.Error(); !strings.Contains(msg, "export ANTHROPIC_API_KEY=") {
		t.Errorf("the message %q does not say how to set a key", msg)
	}
	env := map[string]string{"ANTHROPIC_API_KEY": testKey}
	key, err := APIKeyFromEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil || key != testKey {
		t.Errorf("APIKeyFromEnv = %q, %v", key, err)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{APIKey: "k", MaxTurns: -1}, {APIKey: "k", MaxTokens: -1}, {APIKey: "k", MaxCode: -1}, {APIKey: "k", MaxOutput: -1}} {
		if err := c.Validate(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalid", c, err)
		}
	}
	if err := (Config{APIKey: "k"}).Validate(); err != nil {
		t.Errorf("Validate of the zero config with a key: %v", err)
	}
}
