package e2b_test

import (
	"bufio"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// execute posts a cell to the code interpreter's port and returns its
// NDJSON objects, failing on a blank or malformed line.
func execute(t testing.TB, ts *testServer, c created, body map[string]any) (int, []map[string]any) {
	t.Helper()
	b, _ := json.Marshal(body)
	req, _ := http.NewRequest("POST", ts.URL+"/execute", strings.NewReader(string(b)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("E2b-Sandbox-Id", c.SandboxID)
	req.Header.Set("E2b-Sandbox-Port", "49999")
	if c.EnvdAccessToken != "" {
		req.Header.Set("X-Access-Token", c.EnvdAccessToken)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return resp.StatusCode, nil
	}
	var out []map[string]any
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("not one JSON object a line: %q", sc.Text())
		}
		out = append(out, m)
	}
	return resp.StatusCode, out
}

// of returns the objects of type kind, and the text of those with one.
func of(objs []map[string]any, kind string) (got []map[string]any, text string) {
	for _, o := range objs {
		if o["type"] == kind {
			got = append(got, o)
			if s, ok := o["text"].(string); ok {
				text += s
			}
		}
	}
	return got, text
}

func TestExecute(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(5 * time.Second)}, nil)
	c := ts.create(t, keyA, map[string]any{"templateID": "code-interpreter-v1"})

	_, objs := execute(t, ts, c, map[string]any{"code": "a = 2\nprint('x')\nprint()\nprint('y', end='')\na * 21"})
	results, _ := of(objs, "result")
	_, stdout := of(objs, "stdout")
	if len(results) != 1 || results[0]["text"] != "42" || results[0]["is_main_result"] != true || stdout != "x\n\ny\n" {
		t.Errorf("a cell: %v", objs)
	}
	if last := objs[len(objs)-1]; last["type"] != "end_of_execution" {
		t.Errorf("the last object: %v, want end_of_execution", last)
	}
	if n, _ := of(objs, "number_of_executions"); len(n) != 1 || n[0]["execution_count"] != 1.0 {
		t.Errorf("execution count: %v", n)
	}
	// The variable is kept.
	_, objs = execute(t, ts, c, map[string]any{"code": "a"})
	if r, _ := of(objs, "result"); len(r) != 1 || r[0]["text"] != "2" {
		t.Errorf("a kept variable: %v", objs)
	}
	// Errors are structured; the output before them is kept.
	_, objs = execute(t, ts, c, map[string]any{"code": "print('before')\nraise ValueError('bad value')"})
	errs, _ := of(objs, "error")
	if len(errs) != 1 || errs[0]["name"] != "ValueError" || errs[0]["value"] != "bad value" || !strings.Contains(errs[0]["traceback"].(string), "ValueError") {
		t.Errorf("an error: %v", objs)
	}
	if _, out := of(objs, "stdout"); out != "before\n" {
		t.Errorf("output before an error: %q", out)
	}
	_, objs = execute(t, ts, c, map[string]any{"code": "def f(:\n  pass"})
	if errs, _ := of(objs, "error"); len(errs) != 1 || errs[0]["name"] != "SyntaxError" {
		t.Errorf("a syntax error: %v", objs)
	}
	// env_vars hold for the cell only.
	_, objs = execute(t, ts, c, map[string]any{"code": "import os\nos.environ.get('ONLY_HERE')", "env_vars": map[string]string{"ONLY_HERE": "yes"}})
	if r, _ := of(objs, "result"); len(r) != 1 || r[0]["text"] != "'yes'" {
		t.Errorf("env_vars: %v", objs)
	}
	_, objs = execute(t, ts, c, map[string]any{"code": "import os\nos.environ.get('ONLY_HERE')"})
	if r, _ := of(objs, "result"); len(r) != 0 {
		t.Errorf("env_vars outlived their cell: %v", objs)
	}
	// A cell that forges the runner's lines forges only its own result.
	_, objs = execute(t, ts, c, map[string]any{"code": "print('{\"type\": \"result\", \"text\": \"forged\"}')"})
	if r, _ := of(objs, "result"); len(r) != 0 {
		t.Errorf("a cell's plain output was taken for a result: %v", objs)
	}
	// A cell past the wall time is ended by moat and said so; the next
	// one runs (in a fresh interpreter).
	_, objs = execute(t, ts, c, map[string]any{"code": "import time\ntime.sleep(60)"})
	if errs, _ := of(objs, "error"); len(errs) != 1 || !strings.Contains(errs[0]["value"].(string), "timeout") {
		t.Errorf("a cell past the wall time: %v", objs)
	}
	_, objs = execute(t, ts, c, map[string]any{"code": "1 + 1"})
	if r, _ := of(objs, "result"); len(r) != 1 || r[0]["text"] != "2" {
		t.Errorf("after a timeout: %v", objs)
	}
	_, objs = execute(t, ts, c, map[string]any{"code": "import sys\nsys.exit(3)"})
	if errs, _ := of(objs, "error"); len(errs) != 1 || errs[0]["name"] != "SystemExit" || errs[0]["value"] != "3" {
		t.Errorf("sys.exit(3): %v", objs)
	}
	// Refused: no token, an unknown context, another language.
	if st, _ := execute(t, ts, created{SandboxID: c.SandboxID}, map[string]any{"code": "1"}); st != 401 {
		t.Errorf("no access token: %d, want 401", st)
	}
	if st, _ := execute(t, ts, c, map[string]any{"code": "1", "context_id": "ctx"}); st != 404 {
		t.Errorf("a context that does not exist: %d, want 404", st)
	}
	if st, _ := execute(t, ts, c, map[string]any{"code": "1", "language": "r"}); st != 400 {
		t.Errorf("language r: %d, want 400", st)
	}
}

// interp sends a request to sandbox c's code interpreter port with the
// headers hdr (tokens among them) and returns its status and body.
func interp(t testing.TB, ts *testServer, c created, method, path, body string, hdr map[string]string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, ts.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("E2b-Sandbox-Id", c.SandboxID)
	req.Header.Set("E2b-Sandbox-Port", "49999")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, readAll(t, resp)
}

// TestContextsWire: /contexts takes the sandbox's traffic token (all the
// SDK sends there) or its access token, and nothing else; the traffic
// token opens neither /execute nor envd; a context's cwd is under
// /home/user; a sandbox keeps at most 32 contexts.
func TestContextsWire(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, map[string]any{"templateID": "code-interpreter-v1"})
	other := ts.create(t, keyA, nil)
	var tok struct {
		Traffic string `json:"trafficAccessToken"`
	}
	ts.do(t, keyA, "GET", "/sandboxes/"+c.SandboxID, nil, &tok)
	var otherTok struct {
		Traffic string `json:"trafficAccessToken"`
	}
	ts.do(t, keyA, "GET", "/sandboxes/"+other.SandboxID, nil, &otherTok)
	traffic := map[string]string{"E2B-Traffic-Access-Token": tok.Traffic}
	for _, h := range []map[string]string{
		nil,
		{"E2B-Traffic-Access-Token": otherTok.Traffic},
		{"E2B-Traffic-Access-Token": other.EnvdAccessToken},
		{"X-Access-Token": tok.Traffic + "x"},
	} {
		if st, body := interp(t, ts, c, "POST", "/contexts", `{}`, h); st != 401 {
			t.Errorf("create a context with %v: %d %s, want 401", h, st, body)
		}
	}
	st, body := interp(t, ts, c, "POST", "/contexts", `{"cwd":"/home/user"}`, traffic)
	var ctx map[string]string
	json.Unmarshal([]byte(body), &ctx)
	if st != 200 || ctx["id"] == "" || ctx["cwd"] != "/home/user" || ctx["language"] != "python" {
		t.Fatalf("create a context with the traffic token: %d %s", st, body)
	}
	if st, _ := interp(t, ts, c, "GET", "/contexts", "", map[string]string{"X-Access-Token": c.EnvdAccessToken}); st != 200 {
		t.Errorf("list with the access token: %d", st)
	}
	// The traffic token runs no code and opens no file.
	for _, p := range []string{"/execute", "/contexts/../execute", "/contexts/%2e%2e/execute", "/contexts/x/../../execute"} {
		if st, _ := interp(t, ts, c, "POST", p, `{"code":"1","context_id":"`+ctx["id"]+`"}`, traffic); st != 401 {
			t.Errorf("%s with the traffic token only: %d, want 401", p, st)
		}
	}
	resp, err := sandboxClient(c.SandboxID, tok.Traffic).Get(ts.URL + "/files?path=x")
	if err != nil {
		t.Fatal(err)
	}
	if readAll(t, resp); resp.StatusCode != 401 {
		t.Errorf("envd with the traffic token: %d, want 401", resp.StatusCode)
	}
	for _, cwd := range []string{"/etc", "/home/user/../../etc", "/tmp"} {
		if st, _ := interp(t, ts, c, "POST", "/contexts", `{"cwd":"`+cwd+`"}`, traffic); st != 400 {
			t.Errorf("a context in %s: %d, want 400", cwd, st)
		}
	}
	if st, _ := interp(t, ts, c, "POST", "/contexts/nope/restart", "", traffic); st != 404 {
		t.Errorf("restart an unknown context: %d, want 404", st)
	}
	for i := 1; i < 32; i++ {
		if st, body := interp(t, ts, c, "POST", "/contexts", `{}`, traffic); st != 200 {
			t.Fatalf("context %d: %d %s", i+1, st, body)
		}
	}
	if st, _ := interp(t, ts, c, "POST", "/contexts", `{}`, traffic); st != 409 {
		t.Errorf("a 33rd context: %d, want 409", st)
	}
	// A context of one sandbox is not another's.
	if st, _ := execute(t, ts, other, map[string]any{"code": "1", "context_id": ctx["id"]}); st != 404 {
		t.Errorf("another sandbox's context: %d, want 404", st)
	}
}
