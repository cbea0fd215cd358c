package e2b_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/server"
)

// onState serves on the state directory state with on_idle suspend, so
// that a graceful shutdown suspends the running sessions for the next
// server on it.
func onState(state string) func(*server.Config, *e2b.Config) {
	return func(c *server.Config, _ *e2b.Config) {
		c.StateDir = state
		c.OnIdle = server.OnIdleSuspend
	}
}

// TestSandboxesSurviveRestart: with on_idle suspend, a graceful restart of
// the server keeps the sandboxes of the E2B API, as it keeps their
// sessions: the unchanged SDK lists the sandbox (paused), connects to it
// (which resumes it), and finds its file and envVars; the access token
// given before the restart still opens it; a sandbox whose timeout passed
// while the server was down is gone. The database holds neither token.
func TestSandboxesSurviveRestart(t *testing.T) {
	for _, v := range sdkVersions {
		t.Run(v, func(t *testing.T) { testSandboxesSurviveRestart(t, filepath.Join("testdata", v)) })
	}
}

func testSandboxesSurviveRestart(t *testing.T, dir string) {
	node := nodeFor(t, dir)
	state := t.TempDir()
	ts := startServer(t, moat.Limits{}, onState(state))
	var before struct{ ID, Short, Text string }
	for line := range strings.Lines(runNode(t, node, dir, "restart.mjs", ts.URL, "MOAT_PHASE=before")) {
		json.Unmarshal([]byte(line), &before)
	}
	if before.ID == "" || before.Short == "" || before.Text != "42" {
		t.Fatalf("before the restart: %+v", before)
	}
	var got created
	if resp := ts.do(t, keyA, "GET", "/sandboxes/"+before.ID, nil, &got); resp.StatusCode != 200 {
		t.Fatalf("get: %d", resp.StatusCode)
	}
	var tokens struct {
		Traffic string `json:"trafficAccessToken"`
	}
	ts.do(t, keyA, "GET", "/sandboxes/"+before.ID, nil, &tokens)
	if got.EnvdAccessToken == "" || tokens.Traffic == "" {
		t.Fatalf("no tokens: %+v %+v", got, tokens)
	}
	ts.stop()
	// The short sandbox's timeout (3s) passes while no server runs.
	time.Sleep(3500 * time.Millisecond)

	ts = startServer(t, moat.Limits{}, onState(state))
	resp, err := sandboxClient(before.ID, got.EnvdAccessToken).Get(ts.URL + "/files?path=/home/user/data.txt")
	if err != nil {
		t.Fatal(err)
	}
	if body := readAll(t, resp); resp.StatusCode != 200 || body != "kept across the restart" {
		t.Errorf("the access token from before the restart: %d %q", resp.StatusCode, body)
	}
	out := runNode(t, node, dir, "restart.mjs", ts.URL, "MOAT_PHASE=after", "MOAT_ID="+before.ID, "MOAT_SHORT="+before.Short)
	for _, want := range []string{
		`{"step":"listed","ids":["` + before.ID + `:running"]}`,
		`{"step":"read","text":"kept across the restart"}`,
		`{"step":"command","stdout":"kept across the restart\nkept env\n"}`,
		`{"step":"cell","text":"'kept across the restart'","error":null}`,
		`{"step":"short","error":"SandboxNotFoundError"}`,
		`{"step":"kill","killed":true}`,
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("no %s in:\n%s", want, out)
		}
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("%d sessions left after the SDK's kill", n)
	}
	ts.stop()
	db, err := os.ReadFile(filepath.Join(state, "server.db"))
	if err != nil {
		t.Fatal(err)
	}
	for name, tok := range map[string]string{"envd access": got.EnvdAccessToken, "traffic": tokens.Traffic, "e2b key": keyA} {
		if bytes.Contains(db, []byte(tok)) {
			t.Errorf("the %s token is in the database", name)
		}
	}
}

// TestRestartForgetsWhatEnded: a sandbox killed before a restart, and one
// whose session was ended through moat's own API, are not found after it;
// one kept keeps its metadata and code contexts;
// a sandbox of a key that the tokens no longer give is not served by this
// API (its session stays moat's).
func TestRestartForgetsWhatEnded(t *testing.T) {
	state := t.TempDir()
	ts := startServer(t, moat.Limits{}, onState(state))
	killed := ts.create(t, keyA, nil)
	ended := ts.create(t, keyA, nil)
	kept := ts.create(t, keyA, map[string]any{"metadata": map[string]string{"k": "v"}})
	ofB := ts.create(t, keyB, nil)
	if resp := ts.do(t, keyA, "DELETE", "/sandboxes/"+killed.SandboxID, nil, nil); resp.StatusCode != http.StatusNoContent {
		t.Fatalf("kill: %d", resp.StatusCode)
	}
	if err := ts.srv.EndSession("a", ended.SandboxID); err != nil {
		t.Fatal(err)
	}
	st, ctx := interp(t, ts, kept, "POST", "/contexts", `{"cwd":"sub"}`, map[string]string{"X-Access-Token": kept.EnvdAccessToken})
	if st != 200 {
		t.Fatalf("a context: %d %s", st, ctx)
	}
	ts.stop()

	// b's key is gone from the tokens of the next server.
	ts = startServer(t, moat.Limits{}, func(c *server.Config, e *e2b.Config) {
		onState(state)(c, e)
		c.Tokens[1].E2BKey = ""
	})
	for _, id := range []string{killed.SandboxID, ended.SandboxID} {
		if resp := ts.do(t, keyA, "GET", "/sandboxes/"+id, nil, nil); resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET an ended sandbox after the restart: %d, want 404", resp.StatusCode)
		}
	}
	var list []created
	ts.do(t, keyA, "GET", "/v2/sandboxes", nil, &list)
	if len(list) != 1 || list[0].SandboxID != kept.SandboxID || list[0].Metadata["k"] != "v" || list[0].State != "paused" {
		t.Errorf("list after the restart: %+v, want only %s, paused, with its metadata", list, kept.SandboxID)
	}
	if st, list := interp(t, ts, kept, "GET", "/contexts", "", map[string]string{"X-Access-Token": kept.EnvdAccessToken}); st != 200 || "["+ctx+"]" != list {
		t.Errorf("its contexts after the restart: %d %s, want [%s]", st, list, ctx)
	}
	resp, err := sandboxClient(ofB.SandboxID, ofB.EnvdAccessToken).Get(ts.URL + "/files?path=x")
	if err != nil {
		t.Fatal(err)
	}
	if readAll(t, resp); resp.StatusCode != http.StatusBadGateway {
		t.Errorf("a sandbox of a key no longer given: %d, want 502", resp.StatusCode)
	}
	if _, err := ts.srv.Session("b", ofB.SandboxID); err != nil {
		t.Errorf("its session is moat's still: %v", err)
	}
}
