package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

func TestOneShotRun(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	r := must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "import sys\nprint('hi')\nsys.stderr.write('err')\nsys.exit(3)"}), 200)
	m := r.JSON(t)
	for _, k := range []string{"level", "stdout", "stderr", "exit_code", "duration_ms", "reason", "truncated"} {
		if _, ok := m[k]; !ok {
			t.Errorf("result lacks %q: %s", k, r.Body)
		}
	}
	if m["level"] != "subprocess" || m["stdout"] != "hi\n" || m["stderr"] != "err" || m["exit_code"] != 3.0 || m["reason"] != "" || m["truncated"] != false {
		t.Errorf("result: %s", r.Body)
	}
	if !strings.HasPrefix(r.Header.Get("X-Moat-Run-Id"), "r_") {
		t.Errorf("no run id header: %v", r.Header)
	}
	// A limit is a result, not an error.
	r = must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print('x'*100, end='')", "level": "subprocess"}), 200)
	if m := r.JSON(t); m["stdout"] != strings.Repeat("x", 100) {
		t.Errorf("result: %s", r.Body)
	}
	r = must(t, call(t, "GET", ts.URL+"/v1/levels", tokenA, nil), 200)
	if !strings.Contains(string(r.Body), `{"level":"subprocess","default":true,"sessions":true,"suspend":true,"suspend_memory":false}`) {
		t.Errorf("levels: %s", r.Body)
	}
}

func TestSessionLifecycle(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	for _, interp := range []bool{false, true} {
		t.Run(fmt.Sprintf("interpreter=%v", interp), func(t *testing.T) {
			r := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"ttl": "5m", "interpreter": interp}), 201)
			s := r.JSON(t)
			id, _ := s["id"].(string)
			if id == "" || s["level"] != "subprocess" || s["interpreter"] != interp || s["idle_timeout"] != "5m0s" {
				t.Fatalf("created: %s", r.Body)
			}
			created, _ := time.Parse(time.RFC3339, s["created_at"].(string))
			expires, _ := time.Parse(time.RFC3339, s["expires_at"].(string))
			if d := expires.Sub(created); d < 299*time.Second || d > 301*time.Second {
				t.Errorf("ttl: expires %v after creation", d)
			}
			base := ts.URL + "/v1/sessions/" + id
			run := func(code string) map[string]any {
				t.Helper()
				return must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": code}), 200).JSON(t)
			}
			run("v = 7\nopen('made.txt', 'w').write('by run 1')")
			got := run("import os\nprint(open('made.txt').read(), 'v' in globals())")
			if want := fmt.Sprintf("by run 1 %s\n", map[bool]string{true: "True", false: "False"}[interp]); got["stdout"] != want {
				t.Errorf("run 2: %v, want %q", got, want)
			}
			// Files: upload, list, download, delete.
			payload := []byte("binary\x00\xff\xfedata")
			must(t, call(t, "PUT", base+"/files/dir/sub/up.bin", tokenA, payload), 201)
			got = run("print(open('dir/sub/up.bin','rb').read() == " + pyBytes(payload) + ")")
			if got["stdout"] != "True\n" {
				t.Errorf("the code read the upload as: %v", got)
			}
			r = must(t, call(t, "GET", base+"/files/dir/sub/up.bin", tokenA, nil), 200)
			if !bytes.Equal(r.Body, payload) {
				t.Errorf("download: %q", r.Body)
			}
			r = must(t, call(t, "GET", base+"/files/made.txt", tokenA, nil), 200)
			if string(r.Body) != "by run 1" {
				t.Errorf("download made.txt: %q", r.Body)
			}
			r = must(t, call(t, "GET", base+"/files", tokenA, nil), 200)
			var list struct {
				Files []struct {
					Name string
					Size int64
				}
			}
			json.Unmarshal(r.Body, &list)
			names := map[string]int64{}
			for _, f := range list.Files {
				names[f.Name] = f.Size
			}
			if names["made.txt"] != 8 || names["dir/sub/up.bin"] != int64(len(payload)) {
				t.Errorf("files: %s", r.Body)
			}
			// Stat, mkdir, rename.
			r = must(t, call(t, "GET", base+"/stat/made.txt", tokenA, nil), 200)
			if m := r.JSON(t); m["name"] != "made.txt" || m["size"] != float64(8) || m["is_dir"] != false {
				t.Errorf("stat: %s", r.Body)
			}
			must(t, call(t, "POST", base+"/dirs/new/deep", tokenA, nil), 201)
			if m := must(t, call(t, "GET", base+"/stat/new/deep", tokenA, nil), 200).JSON(t); m["is_dir"] != true {
				t.Errorf("stat of the made dir: %v", m)
			}
			must(t, call(t, "POST", base+"/rename", tokenA, map[string]any{"from": "dir/sub/up.bin", "to": "new/deep/moved.bin"}), 200)
			if got := run("import os\nprint(os.path.exists('dir/sub/up.bin'), os.path.getsize('new/deep/moved.bin'))"); got["stdout"] != fmt.Sprintf("False %d\n", len(payload)) {
				t.Errorf("after rename the code sees: %v", got)
			}
			if r := call(t, "GET", base+"/stat/dir/sub/up.bin", tokenA, nil); r.Status != 404 {
				t.Errorf("stat of the moved file: %d %s", r.Status, r.Body)
			}
			for _, body := range []any{map[string]any{"from": "../x", "to": "y"}, map[string]any{"from": "made.txt", "to": "/etc/passwd"}, `{"from":"made.txt"}x`, map[string]any{"from": "made.txt", "to": "y", "extra": 1}} {
				if r := call(t, "POST", base+"/rename", tokenA, body); r.Status != 400 {
					t.Errorf("rename %v: %d %s", body, r.Status, r.Body)
				}
			}
			must(t, call(t, "DELETE", base+"/files/made.txt", tokenA, nil), 204)
			if r := call(t, "GET", base+"/files/made.txt", tokenA, nil); r.Status != 404 || r.ErrorCode(t) != "not_found" {
				t.Errorf("after delete: %d %s", r.Status, r.Body)
			}
			// Listing and reading the session.
			r = must(t, call(t, "GET", ts.URL+"/v1/sessions", tokenA, nil), 200)
			if !strings.Contains(string(r.Body), id) {
				t.Errorf("list: %s", r.Body)
			}
			must(t, call(t, "GET", base, tokenA, nil), 200)
			// Delete: gone, and its runs and files with it.
			must(t, call(t, "DELETE", base, tokenA, nil), 204)
			for _, c := range []struct{ method, url string }{{"GET", base}, {"POST", base + "/runs"}, {"GET", base + "/files"}, {"DELETE", base}} {
				var body any
				if c.method == "POST" {
					body = map[string]any{"code": "print(1)"}
				}
				if r := call(t, c.method, c.url, tokenA, body); r.Status != 404 {
					t.Errorf("%s %s after delete: %d %s", c.method, c.url, r.Status, r.Body)
				}
			}
		})
	}
	if v := metric(t, ts, `moat_sessions_active{level="subprocess"}`); v != 0 {
		t.Errorf("sessions active after deleting all: %v", v)
	}
	if v := metric(t, ts, `moat_runs_total{level="subprocess",reason="none"}`); v != 8 { // four runs in each of the two sessions
		t.Errorf("runs counted: %v", v)
	}
}

func pyBytes(b []byte) string {
	var sb strings.Builder
	sb.WriteString("b'")
	for _, c := range b {
		fmt.Fprintf(&sb, "\\x%02x", c)
	}
	sb.WriteString("'")
	return sb.String()
}

func TestAuthAndIsolation(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	for _, tok := range []string{"", "wrong-token-0123456789", tokenA + "x"} {
		r := call(t, "GET", ts.URL+"/v1/sessions", tok, nil)
		if r.Status != 401 || r.ErrorCode(t) != "unauthorized" || r.Header.Get("WWW-Authenticate") == "" {
			t.Errorf("token %q: %d %s", tok, r.Status, r.Body)
		}
	}
	if r := call(t, "POST", ts.URL+"/v1/runs", "", map[string]any{"code": "print(1)"}); r.Status != 401 {
		t.Errorf("run without a token: %d", r.Status)
	}
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	must(t, call(t, "PUT", base+"/files/secret.txt", tokenA, []byte("a's secret")), 201)
	// Token b sees nothing of a's session: every route is 404, as for a
	// session that does not exist.
	for _, c := range []struct {
		method, url string
		body        any
	}{
		{"GET", base, nil},
		{"DELETE", base, nil},
		{"POST", base + "/runs", map[string]any{"code": "print(open('secret.txt').read())"}},
		{"GET", base + "/files", nil},
		{"GET", base + "/files/secret.txt", nil},
		{"PUT", base + "/files/secret.txt", []byte("b's")},
		{"DELETE", base + "/files/secret.txt", nil},
	} {
		r := call(t, c.method, c.url, tokenB, c.body)
		missing := call(t, c.method, strings.Replace(c.url, id, "s_doesnotexist", 1), tokenB, c.body)
		if r.Status != 404 || r.ErrorCode(t) != "not_found" || missing.Status != 404 {
			t.Errorf("token b, %s %s: %d %s (unknown session: %d)", c.method, c.url, r.Status, r.Body, missing.Status)
		}
	}
	if r := must(t, call(t, "GET", ts.URL+"/v1/sessions", tokenB, nil), 200); strings.Contains(string(r.Body), id) {
		t.Errorf("b lists a's session: %s", r.Body)
	}
	// Nothing changed for a.
	if r := must(t, call(t, "GET", base+"/files/secret.txt", tokenA, nil), 200); string(r.Body) != "a's secret" {
		t.Errorf("a's file: %q", r.Body)
	}
}

func TestExpiry(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	ttl := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"ttl": "1s"}), 201).JSON(t)["id"].(string)
	idle := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"ttl": "1m", "idle_timeout": "700ms"}), 201).JSON(t)["id"].(string)
	busy := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"ttl": "1m", "idle_timeout": "700ms"}), 201).JSON(t)["id"].(string)
	// A run longer than the idle timeout keeps its session alive.
	done := make(chan response, 1)
	go func() {
		done <- call(t, "POST", ts.URL+"/v1/sessions/"+busy+"/runs", tokenA, map[string]any{"code": "import time; time.sleep(2); print('slept')"})
	}()
	eventually(t, 10*time.Second, "ttl and idle sessions end", func() bool {
		return call(t, "GET", ts.URL+"/v1/sessions/"+ttl, tokenA, nil).Status == 404 &&
			call(t, "GET", ts.URL+"/v1/sessions/"+idle, tokenA, nil).Status == 404
	})
	r := <-done
	if r.Status != 200 || r.JSON(t)["stdout"] != "slept\n" {
		t.Errorf("the long run in the busy session: %d %s", r.Status, r.Body)
	}
	must(t, call(t, "GET", ts.URL+"/v1/sessions/"+busy, tokenA, nil), 200)
	eventually(t, 10*time.Second, "the busy session ends once idle", func() bool {
		return call(t, "GET", ts.URL+"/v1/sessions/"+busy, tokenA, nil).Status == 404
	})
	// A session is 404 as soon as it is taken from the table; it is
	// counted once its sandbox session is closed, which takes a moment.
	eventually(t, 10*time.Second, "the ended sessions are counted", func() bool {
		return metric(t, ts, `moat_sessions_ended_total{cause="idle"}`) >= 2 && metric(t, ts, `moat_sessions_ended_total{cause="expired"}`) >= 1
	})
	if v := metric(t, ts, `moat_sessions_ended_total{cause="expired"}`); v != 1 {
		t.Errorf("expired: %v", v)
	}
	if v := metric(t, ts, `moat_sessions_ended_total{cause="idle"}`); v != 2 {
		t.Errorf("idle: %v", v)
	}
	if left := sessionDirs(); len(left) > 0 {
		t.Errorf("session directories left after expiry: %v", left)
	}
	// Bad lifetimes.
	for _, body := range []string{`{"ttl":"9h"}`, `{"ttl":"0s"}`, `{"ttl":"-1m"}`, `{"ttl":60}`, `{"idle_timeout":"0s"}`, `{"ttl":"soon"}`} {
		if r := call(t, "POST", ts.URL+"/v1/sessions", tokenA, body); r.Status != 400 {
			t.Errorf("%s: %d %s", body, r.Status, r.Body)
		}
	}
}

// sessionDirs lists this process's session directories.
func sessionDirs() []string {
	var out []string
	for _, l := range leftovers() {
		if strings.Contains(filepath.Base(l), "-s") && strings.HasPrefix(l, "/run/moat/runs/") {
			out = append(out, l)
		}
	}
	return out
}

func TestStreaming(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(60 * time.Second)}, nil)
	// Events come as the code writes, then the result.
	body := `{"code":"import sys, time\nprint('one', flush=True)\ntime.sleep(0.3)\nsys.stderr.write('two\\n'); sys.stderr.flush()\ntime.sleep(0.3)\nprint('three')","stream":true}`
	req, _ := http.NewRequest("POST", ts.URL+"/v1/runs", strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+tokenA)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("stream: %d %v", resp.StatusCode, resp.Header)
	}
	events := make(chan event, 16)
	go readEvents(resp.Body, events)
	var got []string
	var firstAt, resultAt time.Time
	for ev := range events {
		var d map[string]any
		json.Unmarshal([]byte(ev.Data), &d)
		switch ev.Name {
		case "stdout", "stderr":
			if firstAt.IsZero() {
				firstAt = time.Now()
			}
			got = append(got, ev.Name+":"+d["data"].(string))
		case "result":
			resultAt = time.Now()
			if d["stdout"] != "one\nthree\n" || d["stderr"] != "two\n" || d["exit_code"] != 0.0 {
				t.Errorf("result event: %s", ev.Data)
			}
			got = append(got, "result")
		default:
			t.Errorf("unexpected event %s %s", ev.Name, ev.Data)
		}
	}
	resp.Body.Close()
	if want := "stdout:one\n|stderr:two\n|stdout:three\n|result"; strings.Join(got, "|") != want {
		t.Errorf("events %q, want %q", strings.Join(got, "|"), want)
	}
	if firstAt.IsZero() || resultAt.Sub(firstAt) < 300*time.Millisecond {
		t.Errorf("the first event came %v before the result: not streamed as written", resultAt.Sub(firstAt))
	}

	// A client that goes away cancels its run: the code's processes end.
	for _, url := range []string{ts.URL + "/v1/runs", ts.URL + "/v1/sessions/" + must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{"interpreter": true}), 201).JSON(t)["id"].(string) + "/runs"} {
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, "POST", url, strings.NewReader(`{"code":"import os, time\nprint(os.getuid(), flush=True)\ntime.sleep(60)"}`))
		req.Header.Set("Authorization", "Bearer "+tokenA)
		req.Header.Set("Accept", "text/event-stream")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		events := make(chan event, 16)
		go readEvents(resp.Body, events)
		ev := <-events
		var d map[string]any
		json.Unmarshal([]byte(ev.Data), &d)
		uid, err := strconv.Atoi(strings.TrimSpace(fmt.Sprint(d["data"])))
		if ev.Name != "stdout" || err != nil {
			t.Fatalf("first event: %+v", ev)
		}
		if len(processesOfUID(uid)) == 0 {
			t.Fatalf("no process of uid %d while the run goes on: the check below would prove nothing", uid)
		}
		before := metric(t, ts, `moat_runs_total{level="subprocess",reason="canceled"}`)
		cancel()
		resp.Body.Close()
		eventually(t, 10*time.Second, "the run's processes end after the client left", func() bool {
			return len(processesOfUID(uid)) == 0
		})
		eventually(t, 10*time.Second, "the run is counted as canceled", func() bool {
			return metric(t, ts, `moat_runs_total{level="subprocess",reason="canceled"}`) == max(before, 0)+1
		})
	}
}

func TestHostileRequests(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(c *server.Config) {
		c.MaxCodeBytes = 1000
		c.MaxBodyBytes = 4000
		c.MaxFileBytes = 2000
	})
	id := must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201).JSON(t)["id"].(string)
	base := ts.URL + "/v1/sessions/" + id
	outside := t.TempDir()
	secret := filepath.Join(outside, "secret")
	os.WriteFile(secret, []byte("host"), 0o644)
	// The code plants links that lead out of the session.
	r := must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": "import os\nos.symlink('" + outside + "', 'out')\nos.symlink('" + secret + "', 'sec')\nos.symlink('/etc', 'etc')\nos.mkfifo('fifo')\nopen('keep.txt','w').write('keep')"}), 200)
	if r.JSON(t)["exit_code"] != 0.0 {
		t.Fatalf("planting links: %s", r.Body)
	}
	listing := func() string { return string(must(t, call(t, "GET", base+"/files", tokenA, nil), 200).Body) }
	before := listing()

	cases := []struct {
		name, method, url string
		body              any
		status            int
		code              string
	}{
		{"malformed JSON", "POST", ts.URL + "/v1/runs", `{"code": "print(1)"`, 400, "bad_request"},
		{"not an object", "POST", ts.URL + "/v1/runs", `["print(1)"]`, 400, "bad_request"},
		{"code of the wrong type", "POST", ts.URL + "/v1/runs", `{"code": 5}`, 400, "bad_request"},
		{"stream of the wrong type", "POST", ts.URL + "/v1/runs", `{"code": "print(1)", "stream": "yes"}`, 400, "bad_request"},
		{"unknown field", "POST", ts.URL + "/v1/runs", `{"code": "print(1)", "timeout": "1h"}`, 400, "bad_request"},
		{"two values", "POST", ts.URL + "/v1/runs", `{"code": "print(1)"} {"code": "print(2)"}`, 400, "bad_request"},
		{"no code", "POST", ts.URL + "/v1/runs", `{}`, 400, "bad_request"},
		{"empty code", "POST", ts.URL + "/v1/runs", `{"code": ""}`, 400, "bad_request"},
		{"unknown level", "POST", ts.URL + "/v1/runs", `{"code": "print(1)", "level": "vm9000"}`, 400, "unknown_level"},
		{"level not served", "POST", ts.URL + "/v1/sessions", `{"level": "microvm"}`, 400, "unknown_level"},
		{"session run at another level", "POST", base + "/runs", `{"code": "print(1)", "level": "microvm"}`, 400, "invalid"},
		{"code over the cap", "POST", ts.URL + "/v1/runs", map[string]any{"code": strings.Repeat("#", 1001)}, 413, "code_too_large"},
		{"body over the cap", "POST", ts.URL + "/v1/runs", `{"code": "print(1)", "level": "` + strings.Repeat("x", 5000) + `"}`, 413, "body_too_large"},
		{"upload over the cap", "PUT", base + "/files/big", bytes.Repeat([]byte("x"), 2001), 413, "body_too_large"},
		{"upload over the cap, no length", "PUT", base + "/files/big", io.MultiReader(bytes.NewReader(bytes.Repeat([]byte("x"), 2001))), 413, "body_too_large"},
		{"wrong content type", "POST", ts.URL + "/v1/runs", []byte(`{"code": "print(1)"}`), 415, "unsupported_media_type"},
		{"dot-dot in the URL", "GET", base + "/files/../../../etc/passwd", nil, 400, "invalid"},
		{"dot-dot in the URL, put", "PUT", base + "/files/a/../../x", []byte("x"), 400, "invalid"},
		{"encoded dot-dot", "GET", base + "/files/..%2F..%2F..%2Fetc%2Fpasswd", nil, 400, "invalid"},
		{"encoded dot-dot, put", "PUT", base + "/files/..%2Fescape", []byte("x"), 400, "invalid"},
		{"absolute path", "GET", base + "/files/%2Fetc%2Fpasswd", nil, 400, "invalid"},
		{"absolute path, double slash", "PUT", base + "/files//tmp/x", []byte("x"), 400, "invalid"},
		{"planted link to a dir outside", "GET", base + "/files/out/secret", nil, 400, "invalid"},
		{"planted link to a file outside", "GET", base + "/files/sec", nil, 400, "invalid"},
		{"write through a planted link", "PUT", base + "/files/out/new", []byte("x"), 400, "invalid"},
		{"write through /etc link", "PUT", base + "/files/etc/moat-evil", []byte("x"), 400, "invalid"},
		{"delete through a planted link", "DELETE", base + "/files/out/secret", nil, 400, "invalid"},
		{"read a fifo", "GET", base + "/files/fifo", nil, 400, "invalid"},
		{"missing file", "GET", base + "/files/nothing", nil, 404, "not_found"},
		{"unknown session", "GET", ts.URL + "/v1/sessions/s_nope/files", nil, 404, "not_found"},
		{"unknown route", "GET", ts.URL + "/v2/everything", nil, 404, "not_found"},
		{"wrong method", "PATCH", base, nil, 405, "method_not_allowed"},
		{"wrong method on runs", "GET", ts.URL + "/v1/runs", nil, 405, "method_not_allowed"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := call(t, c.method, c.url, tokenA, c.body)
			if r.Status != c.status || r.ErrorCode(t) != c.code {
				t.Errorf("%d %s, want %d %s", r.Status, r.Body, c.status, c.code)
			}
			if r.Header.Get("Content-Type") != "application/json" {
				t.Errorf("content type %q", r.Header.Get("Content-Type"))
			}
		})
	}
	if after := listing(); after != before {
		t.Errorf("hostile requests changed the session:\nbefore %s\nafter  %s", before, after)
	}
	if b, _ := os.ReadFile(secret); string(b) != "host" {
		t.Errorf("the host file changed: %q", b)
	}
	if entries, _ := os.ReadDir(outside); len(entries) != 1 {
		t.Errorf("files appeared outside: %v", entries)
	}
	if _, err := os.Lstat("/etc/moat-evil"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("/etc/moat-evil: %v", err)
		os.Remove("/etc/moat-evil")
	}
	must(t, call(t, "GET", base+"/files/keep.txt", tokenA, nil), 200)
}

func TestCapsAndQueue(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(30 * time.Second)}, func(c *server.Config) {
		c.MaxSessionsPerToken = 2
		c.MaxConcurrentRuns = 1
		c.QueueLength = 1
		c.QueueWait = moat.Duration(500 * time.Millisecond)
	})
	must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201)
	must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{}), 201)
	r := call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{})
	if r.Status != 429 || r.ErrorCode(t) != "too_many_sessions" || r.Header.Get("Retry-After") == "" {
		t.Errorf("third session: %d %s %v", r.Status, r.Body, r.Header)
	}
	must(t, call(t, "POST", ts.URL+"/v1/sessions", tokenB, nil), 201) // b's cap is b's; no body means defaults

	// One run holds the only slot, one waits, the next is refused at once;
	// the waiting one gives up after QueueWait.
	var wg sync.WaitGroup
	var slow, queued response
	wg.Add(1)
	go func() {
		defer wg.Done()
		slow = call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "import time; time.sleep(3); print('done')"})
	}()
	eventually(t, 10*time.Second, "the slow run holds the slot", func() bool { return metric(t, ts, "moat_runs_in_progress") == 1 })
	wg.Add(1)
	go func() {
		defer wg.Done()
		queued = call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print(1)"})
	}()
	eventually(t, 10*time.Second, "the second run waits", func() bool { return metric(t, ts, "moat_run_queue_depth") == 1 })
	r = call(t, "POST", ts.URL+"/v1/runs", tokenB, map[string]any{"code": "print(1)"})
	if r.Status != 429 || r.ErrorCode(t) != "busy" || r.Header.Get("Retry-After") == "" {
		t.Errorf("run past the queue: %d %s", r.Status, r.Body)
	}
	wg.Wait()
	if queued.Status != 503 || queued.ErrorCode(t) != "queue_timeout" || queued.Header.Get("Retry-After") == "" {
		t.Errorf("queued run: %d %s", queued.Status, queued.Body)
	}
	if slow.Status != 200 || slow.JSON(t)["stdout"] != "done\n" {
		t.Errorf("slow run: %d %s", slow.Status, slow.Body)
	}
	if metric(t, ts, `moat_runs_rejected_total{why="busy"}`) != 1 || metric(t, ts, `moat_runs_rejected_total{why="queue_timeout"}`) != 1 {
		t.Errorf("rejections not counted")
	}
	// The queue drains: a run goes through again.
	must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print(1)"}), 200)
}

func TestMetricsAndDocs(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print(1)"}), 200)
	must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print('x'*5000)"}), 200)
	body := string(must(t, call(t, "GET", ts.URL+"/metrics", "", nil), 200).Body)
	for _, want := range []string{
		`moat_runs_total{level="subprocess",reason="none"} 2`,
		`moat_run_duration_seconds_count{level="subprocess"} 2`,
		`moat_sessions_active{level="subprocess"} 0`,
		`moat_run_queue_depth 0`,
	} {
		if !strings.Contains(body, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	r := must(t, call(t, "GET", ts.URL+"/openapi.json", "", nil), 200)
	var doc map[string]any
	if err := json.Unmarshal(r.Body, &doc); err != nil || doc["openapi"] == nil {
		t.Errorf("openapi.json: %v", err)
	}
	must(t, call(t, "GET", ts.URL+"/healthz", "", nil), 200)
}

// fakeSandbox is a level without sessions.
type fakeSandbox struct{}

func (fakeSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	return &moat.Result{Level: moat.LevelContainer, Stdout: []byte("fake")}, nil
}
func (fakeSandbox) Level() moat.Level { return moat.LevelContainer }
func (fakeSandbox) Close() error      { return nil }

// TestLevelWithoutSessions needs no root: the level is a fake.
func TestLevelWithoutSessions(t *testing.T) {
	srv, err := server.New(server.Config{
		Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelContainer: fakeSandbox{}},
		Tokens:    []server.Token{{Name: "a", Token: tokenA}},
		StateDir:  t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ts := &testServer{URL: serveHandler(t, srv.Handler())}
	r := call(t, "POST", ts.URL+"/v1/sessions", tokenA, map[string]any{})
	if r.Status != 501 || r.ErrorCode(t) != "sessions_unsupported" {
		t.Errorf("session at a level without them: %d %s", r.Status, r.Body)
	}
	r = must(t, call(t, "POST", ts.URL+"/v1/runs", tokenA, map[string]any{"code": "print(1)"}), 200)
	if r.JSON(t)["stdout"] != "fake" {
		t.Errorf("run: %s", r.Body)
	}
	// A second server cannot take the same state directory.
	if _, err := server.New(server.Config{
		Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelContainer: fakeSandbox{}},
		Tokens:    []server.Token{{Name: "a", Token: tokenA}},
		StateDir:  srv.StateDir(),
	}); err == nil {
		t.Error("two servers opened one state directory")
	}
	// Bad configs.
	for _, cfg := range []server.Config{
		{Tokens: []server.Token{{Name: "a", Token: tokenA}}},
		{Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelContainer: fakeSandbox{}}},
		{Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelContainer: fakeSandbox{}}, Tokens: []server.Token{{Name: "a", Token: "short"}}},
		{Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelContainer: fakeSandbox{}}, Tokens: []server.Token{{Name: "a", Token: tokenA}}, DefaultLevel: moat.LevelMicroVM},
		{Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelContainer: fakeSandbox{}}, Tokens: []server.Token{{Name: "a", Token: tokenA}, {Name: "b", Token: tokenA}}},
	} {
		if err := cfg.Validate(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Validate(%+v) = %v", cfg, err)
		}
	}
}
