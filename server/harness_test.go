package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// The tokens every test server accepts.
const (
	tokenA = "token-a-0123456789abcdef"
	tokenB = "token-b-0123456789abcdef"
)

// requireRoot skips only outside CI: the subprocess level needs root, and
// CI runs as root, so there the test must run.
func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root: the subprocess level needs it")
		}
		t.Skip("the subprocess level needs root (CI runs this as root)")
	}
}

// testServer is a server on a real loopback listener.
type testServer struct {
	URL string
	srv *server.Server
	sb  *subprocess.Sandbox
	cfg server.Config
}

// startServer starts a server over a strict subprocess sandbox with lim,
// after edit changes its config. It is shut down at the end of the test,
// and the test then checks that nothing of its runs is left.
func startServer(t testing.TB, lim moat.Limits, edit func(*server.Config)) *testServer {
	t.Helper()
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{Limits: lim})
	if err != nil {
		t.Fatal(err)
	}
	cfg := server.Config{
		Sandboxes:     map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb},
		Tokens:        []server.Token{{Name: "a", Token: tokenA}, {Name: "b", Token: tokenB}},
		StateDir:      t.TempDir(),
		SweepInterval: moat.Duration(50 * time.Millisecond),
	}
	if edit != nil {
		edit(&cfg)
	}
	srv, err := server.New(cfg)
	if err != nil {
		sb.Close()
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	ts := &testServer{URL: "http://" + l.Addr().String(), srv: srv, sb: sb, cfg: cfg}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			t.Errorf("Shutdown: %v", err)
		}
		if err := <-served; err != http.ErrServerClosed {
			t.Errorf("Serve returned %v", err)
		}
		sb.Close()
		if left := leftovers(); len(left) > 0 {
			t.Errorf("left behind after shutdown: %v", left)
		}
	})
	return ts
}

// leftovers lists what this process's sandboxes left on the host: working
// directories and cgroups named for this process's owner id, and child
// processes.
func leftovers() []string {
	id, err := owner.Self("/run/moat/owners")
	if err != nil {
		return []string{err.Error()}
	}
	var out []string
	for _, dir := range []string{"/run/moat/runs", "/sys/fs/cgroup/memory/moat", "/sys/fs/cgroup/pids/moat", "/sys/fs/cgroup/cpuacct/moat", "/sys/fs/cgroup/moat"} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if strings.HasPrefix(e.Name(), id+"-") {
				out = append(out, filepath.Join(dir, e.Name()))
			}
		}
	}
	// Helpers started in advance are the sandbox's, alive until Close;
	// the callers check after Close.
	for _, p := range sandboxtest.ChildrenLeft(0) {
		out = append(out, "process "+p)
	}
	return out
}

// processesOfUID lists the live processes of uid.
func processesOfUID(uid int) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		status, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue
		}
		m := regexp.MustCompile(`(?m)^Uid:\s+(\d+)`).FindSubmatch(status)
		st := regexp.MustCompile(`(?m)^State:\s+(\S)`).FindSubmatch(status)
		if m != nil && string(m[1]) == strconv.Itoa(uid) && (st == nil || string(st[1]) != "Z") {
			out = append(out, e.Name())
		}
	}
	return out
}

// response is an HTTP answer, read whole.
type response struct {
	Status int
	Header http.Header
	Body   []byte
}

// JSON decodes the body into a map.
func (r response) JSON(t testing.TB) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal(r.Body, &m); err != nil {
		t.Fatalf("status %d: body is not a JSON object: %q", r.Status, r.Body)
	}
	return m
}

// ErrorCode returns the stable code of an error body.
func (r response) ErrorCode(t testing.TB) string {
	t.Helper()
	e, ok := r.JSON(t)["error"].(map[string]any)
	if !ok {
		t.Fatalf("status %d: no error object in %s", r.Status, r.Body)
	}
	code, _ := e["code"].(string)
	return code
}

// call sends a request with token (none when empty) and body (JSON when
// not []byte or io.Reader).
func call(t testing.TB, method, url, token string, body any) response {
	t.Helper()
	var rd io.Reader
	ctype := ""
	switch b := body.(type) {
	case nil:
	case []byte:
		rd = bytes.NewReader(b)
		ctype = "application/octet-stream"
	case string:
		rd = strings.NewReader(b)
		ctype = "application/json"
	case io.Reader:
		rd = b
		ctype = "application/octet-stream"
	default:
		data, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(data)
		ctype = "application/json"
	}
	req, err := http.NewRequest(method, url, rd)
	if err != nil {
		t.Fatal(err)
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading: %v", method, url, err)
	}
	return response{resp.StatusCode, resp.Header, data}
}

// must fails the test unless r has status want.
func must(t testing.TB, r response, want int) response {
	t.Helper()
	if r.Status != want {
		t.Fatalf("status %d, want %d: %s", r.Status, want, r.Body)
	}
	return r
}

// event is one server-sent event.
type event struct {
	Name string
	Data string
}

// readEvents reads server-sent events from r until it ends, sending each.
func readEvents(r io.Reader, events chan<- event) {
	defer close(events)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 4<<20)
	var ev event
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if ev.Name != "" {
				events <- ev
			}
			ev = event{}
		case strings.HasPrefix(line, "event: "):
			ev.Name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			ev.Data += strings.TrimPrefix(line, "data: ")
		}
	}
}

// metric returns the value of the sample named by a line prefix in the
// server's /metrics, or -1.
func metric(t testing.TB, ts *testServer, prefix string) float64 {
	t.Helper()
	r := must(t, call(t, "GET", ts.URL+"/metrics", "", nil), 200)
	for _, line := range strings.Split(string(r.Body), "\n") {
		if strings.HasPrefix(line, prefix+" ") {
			v, err := strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, prefix)), 64)
			if err == nil {
				return v
			}
		}
	}
	return -1
}

// eventually polls cond until it holds or the bound passes.
func eventually(t testing.TB, bound time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// serveHandler serves h on a loopback httptest server for the test.
func serveHandler(t testing.TB, h http.Handler) string {
	t.Helper()
	hs := httptest.NewServer(h)
	t.Cleanup(hs.Close)
	return hs.URL
}
