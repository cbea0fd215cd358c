package egress

import (
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moatsandbox/moat"
)

// secretHarness is a harness whose policy has secrets: API_KEY (headers
// only) and URL_KEY (in the URL too), both for api.test, pinned to
// 127.0.0.1.
func secretHarness(t *testing.T, port int) *harness {
	t.Helper()
	h := &harness{reg: prometheus.NewRegistry(), logs: &syncBuffer{}, done: make(chan error, 1)}
	allow := fmt.Sprintf("api.test:%d", port)
	p, err := New(Config{
		Egress: moat.Egress{
			Network: &moat.Network{Allow: []string{allow}, Resolve: map[string]string{"api.test": "127.0.0.1"}},
			Secrets: map[string]moat.Secret{
				"API_KEY": {FromEnv: "V1", Hosts: []string{allow}},
				"URL_KEY": {FromEnv: "V2", Hosts: []string{allow}, InURL: true},
			},
		},
		Getenv:     testEnv(map[string]string{"V1": realAPI, "V2": realOther}),
		CADir:      t.TempDir(),
		Logger:     slog.New(slog.NewTextHandler(h.logs, nil)),
		Registerer: h.reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	h.p = p
	h.r = p.NewRun()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.addr = l.Addr().String()
	go func() { h.done <- h.r.Serve(l) }()
	t.Cleanup(func() {
		h.r.Close()
		p.Close()
	})
	return h
}

// TestForwardEchoHidden: a secret's host reached over plain http:// (no
// real value goes there so, but the host knows it) that sends the value in
// its response's header (a redirect, a header), status line, a 103, the
// trailer or the body does not hand it to the sandbox: the forward path
// hides it as the intercepted tunnel does.
func TestForwardEchoHidden(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		w.Header().Set("Link", "<"+realAPI+">")
		w.WriteHeader(http.StatusEarlyHints)
		w.Header().Del("Link")
		w.Header().Set("Location", "https://api.test/next?key="+url.QueryEscape(realOther))
		w.Header().Set("X-Echo", "Bearer "+realAPI)
		w.Header().Set("Trailer", "X-Trailer")
		w.WriteHeader(http.StatusFound)
		echoBody(w, "moved")
		w.(http.Flusher).Flush() // chunked, with the trailer after
		w.Header().Set("X-Trailer", realAPI)
	}))
	t.Cleanup(srv.Close)
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	h := secretHarness(t, port)
	env := map[string]string{}
	for _, kv := range h.r.Env("http://"+h.addr, "/ca.pem") {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	head := fmt.Sprintf("GET http://api.test:%d/v1 HTTP/1.1\r\nHost: api.test:%d\r\n\r\n", port, port)
	_, br, resp := h.raw(t, head)
	if resp.StatusCode != http.StatusEarlyHints {
		t.Fatalf("got %s, want the upstream's 103 first", resp.Status)
	}
	assertNoValue(t, "the 103's header", resp.Header.Get("Link"))
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	assertNoValue(t, "the trailer", resp.Trailer.Get("X-Trailer"))
	if resp.Trailer.Get("X-Trailer") == "" {
		t.Errorf("no trailer came through: the test checks nothing of it")
	}
	if resp.StatusCode != http.StatusFound {
		t.Fatalf("got %s, want the upstream's 302", resp.Status)
	}
	var all strings.Builder
	resp.Header.Write(&all)
	assertNoValue(t, "the response's header", all.String())
	assertNoValue(t, "the response's status", resp.Status)
	assertNoForm(t, "the response's body", string(body))
	if !strings.Contains(string(body), "form 0: "+env["API_KEY"]+"\n") {
		t.Errorf("the body's value did not become the placeholder:\n%s", body)
	}
	if got := resp.Header.Get("X-Echo"); got != "Bearer "+env["API_KEY"] {
		t.Errorf("X-Echo %q, want the value turned back into the placeholder", got)
	}
}

// TestMITMEchoInInterimAndTrailer: a secret's host that echoes the real
// value in an informational (103) response's header or in the trailer
// does not hand it to the sandbox.
func TestMITMEchoInInterimAndTrailer(t *testing.T) {
	r := testSecrets(t).forRun()
	api := placeholders(r)["API_KEY"]
	up := newMITMUpstream(t)
	tn, err := openTunnel(t, r, up, mitmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(tn.conn, "GET /echo-more HTTP/1.1\r\nHost: example.com\r\nX-Echo: "+api+"\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	early, err := http.ReadResponse(tn.br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if early.StatusCode != http.StatusEarlyHints {
		t.Fatalf("got %s, want the upstream's 103 first", early.Status)
	}
	assertNoValue(t, "the 103's header", early.Header.Get("Link"))
	resp, err := http.ReadResponse(tn.br, nil)
	if err != nil {
		t.Fatal(err)
	}
	io.ReadAll(resp.Body)
	if got := resp.Trailer.Get("X-Trailer"); got != api {
		assertNoValue(t, "the trailer", got)
		t.Errorf("trailer %q, want the placeholder", got)
	}
	tn.end(t)
}

// TestDeniedAddressForms: the forms of an address that a resolver or a
// URL parser might read as loopback (decimal, hex, octal, short,
// trailing-dot, IPv4-mapped, zoned), userinfo put before an address, and
// a CONNECT authority with userinfo all reach no upstream: each is either
// an IP address or a name no Allow entry matches.
func TestDeniedAddressForms(t *testing.T) {
	u := newUpstream(t, false)
	h := newHarness(t, &moat.Network{
		Allow:   []string{fmt.Sprintf("pypi.test:%d", u.port), "*.pypi.test"},
		Resolve: map[string]string{"pypi.test": "127.0.0.1"},
	}, nil)
	p := u.port
	for _, target := range []string{
		fmt.Sprintf("http://2130706433:%d/", p),
		fmt.Sprintf("http://0x7f.1:%d/", p),
		fmt.Sprintf("http://0177.0.0.1:%d/", p),
		fmt.Sprintf("http://127.1:%d/", p),
		fmt.Sprintf("http://127.0.0.1.:%d/", p),
		fmt.Sprintf("http://[::ffff:127.0.0.1]:%d/", p),
		fmt.Sprintf("http://[::ffff:7f00:1]:%d/", p),
		fmt.Sprintf("http://[fe80::1%%25lo]:%d/", p),
		fmt.Sprintf("http://pypi.test:%d@127.0.0.1:%d/", p, p),
		fmt.Sprintf("http://127.0.0.1:%d#@pypi.test:%d/", p, p),
		fmt.Sprintf("http://127.0.0.1.pypi.test.evil:%d/", p),
		fmt.Sprintf("CONNECT pypi.test:%d@127.0.0.1:%d", p, p),
		fmt.Sprintf("CONNECT 127.0.0.1.:%d", p),
		fmt.Sprintf("CONNECT [::1%%lo]:%d", p),
		fmt.Sprintf("CONNECT localhost:%d", p),
	} {
		head := "GET " + target + " HTTP/1.1\r\nHost: " + fmt.Sprintf("pypi.test:%d", p) + "\r\n\r\n"
		if strings.HasPrefix(target, "CONNECT ") {
			head = target + " HTTP/1.1\r\n\r\n"
		}
		_, _, resp := h.raw(t, head)
		if resp.StatusCode/100 != 4 {
			t.Errorf("%s: got %s, want a refusal", target, resp.Status)
		}
	}
	if n := u.conns.Load(); n != 0 {
		t.Errorf("the upstream got %d connections", n)
	}
}
