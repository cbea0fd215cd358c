package e2b_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// The keys of the test server's two tokens, a and b.
const (
	keyA = "e2b_00112233445566778899aabbccddeeff00112233"
	keyB = "e2b_ffeeddccbbaa99887766554433221100ffeeddcc"
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

type testServer struct {
	URL string
	srv *server.Server
	// stop shuts the server down gracefully, as at the end of the test;
	// it may be called before.
	stop func()
}

// startServer serves moat's API and the E2B API over a subprocess sandbox
// with lim, on loopback. Everything is shut down at the end of the test,
// which then checks that no child process is left.
func startServer(t testing.TB, lim moat.Limits, edit func(*server.Config, *e2b.Config)) *testServer {
	t.Helper()
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{Limits: lim})
	if err != nil {
		t.Fatal(err)
	}
	cfg := server.Config{
		Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelSubprocess: sb},
		Tokens: []server.Token{
			{Name: "a", Token: "token-a-0123456789abcdef", E2BKey: keyA},
			{Name: "b", Token: "token-b-0123456789abcdef", E2BKey: keyB},
		},
		StateDir:      t.TempDir(),
		SweepInterval: moat.Duration(50 * time.Millisecond),
	}
	ecfg := e2b.Config{MaxFileBytes: 64 << 10}
	if edit != nil {
		edit(&cfg, &ecfg)
	}
	srv, err := server.New(cfg)
	if err != nil {
		sb.Close()
		t.Fatal(err)
	}
	ecfg.Sessions, ecfg.Tokens = srv, cfg.Tokens
	api, err := e2b.New(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: api.Handler()}
	served := make(chan error, 1)
	go func() { served <- hs.Serve(l) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			hs.Close()
			<-served
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			if err := srv.Shutdown(ctx); err != nil {
				t.Errorf("Shutdown: %v", err)
			}
			sb.Close()
			if left := sandboxtest.ChildrenLeft(5 * time.Second); len(left) > 0 {
				t.Errorf("left running: %v", left)
			}
		})
	}
	t.Cleanup(stop)
	return &testServer{URL: "http://" + l.Addr().String(), srv: srv, stop: stop}
}

// do sends a control-plane request with key and decodes a JSON answer into
// out (when not nil); it returns the response, its body read.
func (ts *testServer) do(t testing.TB, key, method, path string, body any, out any) *http.Response {
	t.Helper()
	var rd io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequest(method, ts.URL+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("X-API-KEY", key)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	if out != nil && len(data) > 0 {
		if err := json.Unmarshal(data, out); err != nil {
			t.Fatalf("%s %s: %d %q: %v", method, path, resp.StatusCode, data, err)
		}
	}
	resp.Body = io.NopCloser(bytes.NewReader(data))
	return resp
}

// created is what POST /v2/sandboxes answers.
type created struct {
	SandboxID       string            `json:"sandboxID"`
	TemplateID      string            `json:"templateID"`
	EnvdVersion     string            `json:"envdVersion"`
	EnvdAccessToken string            `json:"envdAccessToken"`
	State           string            `json:"state"`
	EndAt           time.Time         `json:"endAt"`
	StartedAt       time.Time         `json:"startedAt"`
	Metadata        map[string]string `json:"metadata"`
}

// create makes a sandbox of key's and fails the test if it cannot.
func (ts *testServer) create(t testing.TB, key string, body map[string]any) created {
	t.Helper()
	var c created
	if resp := ts.do(t, key, "POST", "/v2/sandboxes", body, &c); resp.StatusCode != http.StatusCreated {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("create: %d %s", resp.StatusCode, b)
	}
	return c
}

// sandboxClient is an http.Client whose requests carry a sandbox's routing
// headers and access token, as the SDKs send them.
func sandboxClient(id, token string) *http.Client {
	return &http.Client{Transport: headerTransport{id: id, token: token}}
}

type headerTransport struct{ id, token string }

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("E2b-Sandbox-Id", h.id)
	r.Header.Set("E2b-Sandbox-Port", e2b.EnvdPort)
	if h.token != "" {
		r.Header.Set("X-Access-Token", h.token)
	}
	return http.DefaultTransport.RoundTrip(r)
}

func readAll(t testing.TB, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func stringsReader(s string) io.Reader { return strings.NewReader(s) }
