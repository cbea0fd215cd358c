package main

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

// messagesAPI replays the agent package's recorded Messages API responses
// (agent/testdata), the last one again once the others are used.
func messagesAPI(t *testing.T, fixtures ...string) (url string, requests func() int) {
	t.Helper()
	var bodies [][]byte
	for _, f := range fixtures {
		b, err := os.ReadFile(filepath.Join("..", "..", "agent", "testdata", f))
		if err != nil {
			t.Fatal(err)
		}
		bodies = append(bodies, b)
	}
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/messages" {
			http.NotFound(w, r)
			return
		}
		mu.Lock()
		body := bodies[min(n, len(bodies)-1)]
		n++
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Write(body)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, func() int { mu.Lock(); defer mu.Unlock(); return n }
}

func runAgent(args ...string) (stdout, stderr string, code int) {
	var out, errb bytes.Buffer
	code = cmdAgent(context.Background(), args, Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
	return out.String(), errb.String(), code
}

func TestAgentWithoutKey(t *testing.T) {
	t.Setenv("ANTHROPIC_API_KEY", "")
	os.Unsetenv("ANTHROPIC_API_KEY")
	for _, val := range []string{"unset", ""} {
		if val != "unset" {
			t.Setenv("ANTHROPIC_API_KEY", val)
		}
		stdout, stderr, code := runAgent("what is 6*7?")
		if code != exitUsage {
			t.Errorf("key %s: exit %d, want %d", val, code, exitUsage)
		}
		if !strings.Contains(stderr, "export ANTHROPIC_API_KEY=") || strings.Count(strings.TrimSpace(stderr), "\n") > 0 {
			t.Errorf("key %s: stderr %q, want one line saying how to set the key", val, stderr)
		}
		if stdout != "" {
			t.Errorf("key %s: stdout %q, want nothing", val, stdout)
		}
	}
}

func TestAgentBadInput(t *testing.T) {
	t.Setenv("ANTHROPIC_API_KEY", "sk-ant-test")
	for _, args := range [][]string{{}, {"  "}, {"--max-turns", "-1", "task"}, {"--max-code", "lots", "task"}, {"--level", "nope", "task"}, {"--interpreter", "task"}} {
		_, stderr, code := runAgent(args...)
		if code != exitUsage || stderr == "" {
			t.Errorf("moat agent %q: exit %d stderr %q, want exit %d with a message", args, code, stderr, exitUsage)
		}
	}
}

// The command end to end: flags, the key from the environment, the real
// subprocess level, the SDK against a local replay of the Messages API.
func TestAgentReplay(t *testing.T) {
	requireRoot(t)
	t.Setenv("ANTHROPIC_API_KEY", "sk-ant-test")
	url, requests := messagesAPI(t, "tool_use.json", "final.json")
	stdout, stderr, code := runAgent("--base-url", url, "--wall-time", "5s", "What is 6 times 7?")
	if code != exitOK {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	if requests() != 2 {
		t.Errorf("%d requests to the API, want 2", requests())
	}
	rest := stdout
	for _, w := range []string{"task: What is 6 times 7?", "level: subprocess", "run_python:", "print(6*7)", "stdout:", "42", "answer:", "6 times 7 is 42."} {
		i := strings.Index(rest, w)
		if i < 0 {
			t.Fatalf("transcript lacks %q (in order):\n%s", w, stdout)
		}
		rest = rest[i+len(w):]
	}
}

func TestAgentTurnLimit(t *testing.T) {
	requireRoot(t)
	t.Setenv("ANTHROPIC_API_KEY", "sk-ant-test")
	url, requests := messagesAPI(t, "tool_use.json") // never a final answer
	_, stderr, code := runAgent("--base-url", url, "--max-turns", "2", "loop")
	if code != exitFailure || !strings.Contains(stderr, "turn limit") {
		t.Errorf("exit %d stderr %q, want %d and the turn limit", code, stderr, exitFailure)
	}
	if requests() != 2 {
		t.Errorf("%d requests, want 2", requests())
	}
}

// moat agent --sessions, or the agent section of the config file: the task
// runs in one session, with the file tools.
func TestAgentSessions(t *testing.T) {
	requireRoot(t)
	t.Setenv("ANTHROPIC_API_KEY", "sk-ant-test")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--sessions"}, "level: subprocess (one session: files kept between calls)"},
		{[]string{"--sessions", "--interpreter"}, "level: subprocess (one session with a live interpreter: files and variables kept between calls)"},
		{[]string{"--config", writeConfig(t, `{"agent":{"sessions":true}}`)}, "level: subprocess (one session: files kept between calls)"},
		{[]string{"--config", writeConfig(t, `{"mcp":{"sessions":true}}`)}, "level: subprocess (nothing kept between calls)"},
	} {
		url, _ := messagesAPI(t, "tool_use.json", "final.json")
		stdout, stderr, code := runAgent(append(c.args, "--base-url", url, "--wall-time", "5s", "What is 6 times 7?")...)
		if code != exitOK {
			t.Fatalf("%q: exit %d, stderr %q", c.args, code, stderr)
		}
		if !strings.Contains(stdout, c.want) || !strings.Contains(stdout, "6 times 7 is 42.") {
			t.Errorf("%q: transcript lacks %q:\n%s", c.args, c.want, stdout)
		}
	}
}
