package egress

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moatsandbox/moat"
)

func TestForwardAllowed(t *testing.T) {
	u := newUpstream(t, false)
	h := newHarness(t, &moat.Network{
		Allow:   []string{fmt.Sprintf("pypi.test:%d", u.port)},
		Resolve: map[string]string{"pypi.test": "127.0.0.1"},
	}, nil)
	req, _ := http.NewRequest("POST", fmt.Sprintf("http://pypi.test:%d/simple/", u.port), strings.NewReader("body"))
	req.Header.Set("Proxy-Authorization", "Basic c2VrcmV0")
	req.Header.Set("X-Hop", "hop-value")
	req.Header.Set("Connection", "X-Hop")
	resp, err := h.client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "hello from upstream POST /simple/ body" {
		t.Fatalf("got %s %q", resp.Status, body)
	}
	got := u.lastRequest()
	if got.Host != fmt.Sprintf("pypi.test:%d", u.port) {
		t.Errorf("upstream saw Host %q", got.Host)
	}
	for _, name := range []string{"Proxy-Authorization", "X-Hop"} {
		if v := got.Header.Get(name); v != "" {
			t.Errorf("upstream got %s: %q; hop-by-hop headers must go", name, v)
		}
	}
	if !resp.Close {
		t.Errorf("the response does not say Connection: close; the proxy serves one request per connection")
	}
	want := fmt.Sprintf("network: allowed pypi.test:%d (1 connection)", u.port)
	if n := h.r.Notes(); len(n) != 1 || n[0] != want {
		t.Errorf("notes %q, want %q", n, want)
	}
	if n := h.r.Notes(); n != nil {
		t.Errorf("notes again: %q, want none", n)
	}
	if logs := h.logs.String(); strings.Contains(logs, "c2VrcmV0") || strings.Contains(logs, "hop-value") {
		t.Errorf("a header value reached the log:\n%s", logs)
	}
}

func TestConnectAllowed(t *testing.T) {
	u := newUpstream(t, true)
	h := newHarness(t, &moat.Network{
		Allow:   []string{fmt.Sprintf("pypi.test:%d", u.port)},
		Resolve: map[string]string{"pypi.test": "127.0.0.1"},
	}, nil)
	for i := 0; i < 3; i++ {
		resp, err := h.client().Get(fmt.Sprintf("https://pypi.test:%d/x", u.port))
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != "hello from upstream GET /x " {
			t.Fatalf("got %q", body)
		}
	}
	if got := u.lastRequest().TLS.ServerName; got != "pypi.test" {
		t.Errorf("upstream saw SNI %q", got)
	}
	want := fmt.Sprintf("network: allowed pypi.test:%d (3 connections)", u.port)
	if n := h.r.Notes(); len(n) != 1 || n[0] != want {
		t.Errorf("notes %q, want %q", n, want)
	}
}

// TestDenied: each request is refused with its status, reaches no
// upstream, and is noted with its reason.
func TestDenied(t *testing.T) {
	u := newUpstream(t, false)
	ut := newUpstream(t, true)
	allowed := fmt.Sprintf("pypi.test:%d", u.port)
	h := newHarness(t, &moat.Network{
		Allow:   []string{allowed, fmt.Sprintf("pypi.test:%d", ut.port)},
		Resolve: map[string]string{"pypi.test": "127.0.0.1", "evil.test": "127.0.0.1"},
	}, nil)
	other := u.port + 1
	if other == ut.port {
		other++
	}
	for _, tc := range []struct {
		name, head string
		status     int
		note       string
	}{
		{"unlisted name", fmt.Sprintf("GET http://evil.test:%d/ HTTP/1.1\r\nHost: evil.test\r\n\r\n", u.port), 403, fmt.Sprintf("evil.test:%d (not allowed)", u.port)},
		{"unlisted name CONNECT", fmt.Sprintf("CONNECT evil.test:%d HTTP/1.1\r\n\r\n", ut.port), 403, fmt.Sprintf("evil.test:%d (not allowed)", ut.port)},
		{"IP literal", fmt.Sprintf("GET http://127.0.0.1:%d/ HTTP/1.1\r\nHost: pypi.test\r\n\r\n", u.port), 403, fmt.Sprintf("127.0.0.1:%d (an IP address)", u.port)},
		{"IP literal CONNECT", fmt.Sprintf("CONNECT 127.0.0.1:%d HTTP/1.1\r\n\r\n", ut.port), 403, fmt.Sprintf("127.0.0.1:%d (an IP address)", ut.port)},
		{"IPv6 literal", fmt.Sprintf("CONNECT [::1]:%d HTTP/1.1\r\n\r\n", ut.port), 403, fmt.Sprintf("[::1]:%d (an IP address)", ut.port)},
		{"wrong port", fmt.Sprintf("GET http://pypi.test:%d/ HTTP/1.1\r\nHost: pypi.test\r\n\r\n", other), 403, fmt.Sprintf("pypi.test:%d (not allowed)", other)},
		{"wrong port CONNECT", fmt.Sprintf("CONNECT pypi.test:%d HTTP/1.1\r\n\r\n", other), 403, fmt.Sprintf("pypi.test:%d (not allowed)", other)},
		{"Host header fronting", fmt.Sprintf("GET http://evil.test:%d/ HTTP/1.1\r\nHost: %s\r\n\r\n", u.port, allowed), 403, fmt.Sprintf("evil.test:%d (not allowed)", u.port)},
		{"origin form", "GET / HTTP/1.1\r\nHost: " + allowed + "\r\n\r\n", 400, ""},
		{"https absolute", fmt.Sprintf("GET https://pypi.test:%d/ HTTP/1.1\r\nHost: pypi.test\r\n\r\n", ut.port), 400, ""},
		{"CONNECT without port", "CONNECT pypi.test HTTP/1.1\r\n\r\n", 400, ""},
		{"not HTTP", "\x16\x03\x01 hello\r\n\r\n", 400, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, resp := h.raw(t, tc.head)
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != tc.status {
				t.Fatalf("got %s %q, want %d", resp.Status, body, tc.status)
			}
			if n := u.conns.Load() + ut.conns.Load(); n != 0 {
				t.Fatalf("an upstream got %d connections", n)
			}
			notes := strings.Join(h.r.Notes(), "")
			if tc.note != "" && notes != "network: denied "+tc.note {
				t.Errorf("notes %q, want %q", notes, "network: denied "+tc.note)
			}
			if tc.note == "" && notes != "" {
				t.Errorf("notes %q for a request that is not one", notes)
			}
		})
	}
}

// TestResolvedLoopbackDenied: an allowed name that the resolver maps to
// loopback is refused; the same address pinned by Resolve is reached.
func TestResolvedLoopbackDenied(t *testing.T) {
	u := newUpstream(t, false)
	dns, res := newFakeDNS(t, map[string][]netip.Addr{
		"rebind.egress.test": {netip.MustParseAddr("127.0.0.1")},
		"mapped.egress.test": {netip.MustParseAddr("::ffff:127.0.0.1")},
		"pinned.egress.test": {netip.MustParseAddr("192.0.2.1")}, // never asked: Resolve pins it
	})
	h := newHarness(t, &moat.Network{
		Allow:   []string{fmt.Sprintf("*.egress.test:%d", u.port)},
		Resolve: map[string]string{"pinned.egress.test": "127.0.0.1"},
	}, res)
	for _, name := range []string{"rebind.egress.test", "mapped.egress.test"} {
		_, _, resp := h.raw(t, fmt.Sprintf("GET http://%s:%d/ HTTP/1.1\r\nHost: x\r\n\r\n", name, u.port))
		if resp.StatusCode != 403 {
			t.Fatalf("%s: got %s, want 403", name, resp.Status)
		}
	}
	if n := u.conns.Load(); n != 0 {
		t.Fatalf("the upstream got %d connections from names resolving to loopback", n)
	}
	if dns.queries.Load() == 0 {
		t.Fatal("the resolver was not asked")
	}
	q := dns.queries.Load()
	resp, err := h.client().Get(fmt.Sprintf("http://pinned.egress.test:%d/", u.port))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || u.conns.Load() != 1 {
		t.Fatalf("pinned.test: %s, %d connections", resp.Status, u.conns.Load())
	}
	if dns.queries.Load() != q {
		t.Errorf("a pinned name was looked up")
	}
	notes := strings.Join(h.r.Notes(), "")
	want := fmt.Sprintf("network: allowed pinned.egress.test:%d (1 connection); denied rebind.egress.test:%[1]d (resolves to 127.0.0.1, a loopback address), mapped.egress.test:%[1]d (resolves to 127.0.0.1, a loopback address)", u.port)
	if notes != want {
		t.Errorf("notes %q\nwant %q", notes, want)
	}
}

func TestConnectSNI(t *testing.T) {
	u := newUpstream(t, true)
	target := fmt.Sprintf("pypi.test:%d", u.port)
	h := newHarness(t, &moat.Network{
		Allow:   []string{target},
		Resolve: map[string]string{"pypi.test": "127.0.0.1"},
	}, nil)
	for _, tc := range []struct {
		name, sni string
		raw       string // sent instead of a ClientHello
		note      string
	}{
		{name: "mismatch", sni: "evil.test", note: "SNI evil.test"},
		{name: "suffix", sni: "pypi.test.evil.test", note: "SNI pypi.test.evil.test"},
		{name: "missing", sni: "", note: "no SNI"},
		{name: "not TLS", raw: "GET / HTTP/1.1\r\nHost: pypi.test\r\n\r\n", note: "not a TLS ClientHello"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := h.connect(t, target)
			if tc.raw != "" {
				io.WriteString(c, tc.raw)
				if n, err := c.Read(make([]byte, 1)); err == nil {
					t.Fatalf("read %d bytes from a tunnel that must close", n)
				}
			} else {
				tc := tls.Client(c, &tls.Config{ServerName: tc.sni, InsecureSkipVerify: true})
				if err := tc.Handshake(); err == nil {
					t.Fatal("the handshake went through")
				}
			}
			if n := u.conns.Load(); n != 0 {
				t.Fatalf("the upstream got %d connections", n)
			}
			want := fmt.Sprintf("network: denied %s (%s)", target, tc.note)
			if n := strings.Join(h.r.Notes(), ""); n != want {
				t.Errorf("notes %q, want %q", n, want)
			}
		})
	}
	// The SNI's case and a trailing dot do not matter.
	c := h.connect(t, target)
	tc := tls.Client(c, &tls.Config{ServerName: "PyPI.test.", InsecureSkipVerify: true})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("SNI PyPI.test.: %v", err)
	}
}

func TestMetrics(t *testing.T) {
	u := newUpstream(t, false)
	pattern := fmt.Sprintf("*.egress.test:%d", u.port)
	h := newHarness(t, &moat.Network{
		Allow:   []string{pattern},
		Resolve: map[string]string{"pypi.egress.test": "127.0.0.1"},
	}, nil)
	for _, path := range []string{"/a", "/b"} {
		resp, err := h.client().Get(fmt.Sprintf("http://pypi.egress.test:%d%s", u.port, path))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	h.raw(t, "CONNECT evil.example:443 HTTP/1.1\r\n\r\n")
	h.raw(t, "CONNECT 10.0.0.1:443 HTTP/1.1\r\n\r\n")
	c := h.p.metrics.requests
	got := gathered(t, h.reg)
	want := map[string]float64{"allowed " + pattern: 2, "denied other": 2}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("moat_egress_requests_total %v, want %v", got, want)
	}
	// A second proxy on the same registry shares the counter.
	p2, err := New(Config{Egress: moat.Egress{Network: &moat.Network{}}, CADir: t.TempDir(), Registerer: h.reg})
	if err != nil {
		t.Fatal(err)
	}
	if p2.metrics.requests != c {
		t.Errorf("a second proxy on the registry got a counter of its own")
	}
}

// TestClose: Close ends an idle tunnel, a connection still sending its
// request head, and Serve, and returns.
func TestClose(t *testing.T) {
	u := newUpstream(t, true)
	target := fmt.Sprintf("pypi.test:%d", u.port)
	h := newHarness(t, &moat.Network{
		Allow:   []string{target},
		Resolve: map[string]string{"pypi.test": "127.0.0.1"},
	}, nil)
	tunnel := h.connect(t, target)
	tc := tls.Client(tunnel, &tls.Config{ServerName: "pypi.test", InsecureSkipVerify: true})
	if err := tc.Handshake(); err != nil {
		t.Fatal(err)
	}
	half, err := net.Dial("tcp4", h.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer half.Close()
	io.WriteString(half, "GET http://pypi.test/ HTTP/1.1\r\n")
	// Let the proxy take both connections in hand.
	deadline := time.Now().Add(10 * time.Second)
	for {
		h.r.mu.Lock()
		n := h.r.clients
		h.r.mu.Unlock()
		if n == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections served, want 2", n)
		}
		time.Sleep(time.Millisecond)
	}
	closed := make(chan struct{})
	go func() { h.r.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	if err := <-h.done; err != nil {
		t.Errorf("Serve: %v", err)
	}
	for name, c := range map[string]net.Conn{"tunnel": tunnel, "half": half} {
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err := io.ReadAll(c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Errorf("%s: still open after Close", name)
		}
	}
	if _, err := net.Dial("tcp4", h.addr); err == nil {
		// The listener is closed: nothing accepts. (A dial may still be
		// refused only; it must not be served.)
		t.Errorf("the listener still accepts after Close")
	}
	if err := h.r.Serve(newPipeListener()); err == nil || !errors.Is(err, moat.ErrClosed) {
		t.Errorf("Serve after Close: %v", err)
	}
}

// TestProxyClose: the proxy's Close closes its runs, and later runs are
// closed from the start.
func TestProxyClose(t *testing.T) {
	h := newHarness(t, &moat.Network{Allow: []string{"pypi.test"}}, nil)
	waitFor(t, func() bool {
		h.r.mu.Lock()
		defer h.r.mu.Unlock()
		return len(h.r.listeners) == 1
	})
	h.p.Close()
	select {
	case err := <-h.done:
		if err != nil {
			t.Errorf("Serve: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the run still serves after the proxy's Close")
	}
	r := h.p.NewRun()
	a, b := net.Pipe()
	go r.ServeConn(a)
	b.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(b, "GET http://pypi.test/ HTTP/1.1\r\n\r\n")
	if n, err := b.Read(make([]byte, 1)); err != io.EOF && !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("a run made after Close served a connection: read %d, %v", n, err)
	}
}

// TestLimits: a request head past maxHead gets 431; past maxConns at
// once, a connection gets 503.
func TestLimits(t *testing.T) {
	h := newHarness(t, &moat.Network{Allow: []string{"pypi.test"}}, nil)
	_, _, resp := h.raw(t, "GET http://pypi.test/ HTTP/1.1\r\nX: "+strings.Repeat("a", maxHead)+"\r\n\r\n")
	if resp.StatusCode != 431 {
		t.Errorf("a huge head: %s, want 431", resp.Status)
	}
	for i := 0; i < maxConns; i++ {
		c, err := net.Dial("tcp4", h.addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		h.r.mu.Lock()
		n := h.r.clients
		h.r.mu.Unlock()
		if n == maxConns {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d connections served, want %d", n, maxConns)
		}
		time.Sleep(time.Millisecond)
	}
	_, _, resp = h.raw(t, "GET http://pypi.test/ HTTP/1.1\r\n\r\n")
	if resp.StatusCode != 503 {
		t.Errorf("connection %d: %s, want 503", maxConns+1, resp.Status)
	}
	if n := strings.Join(h.r.Notes(), ""); !strings.Contains(n, "refused 1 connection over the cap of 64") {
		t.Errorf("notes %q", n)
	}
}

func TestEnvAndDescribe(t *testing.T) {
	h := newHarness(t, &moat.Network{
		Allow:   []string{"pypi.org", "*.example.com:443"},
		Resolve: map[string]string{"pypi.org": "127.0.0.1"},
	}, nil)
	if got, want := h.p.Describe(), "egress: proxy allowing pypi.org, *.example.com:443; 1 pinned name"; got != want {
		t.Errorf("Describe %q, want %q", got, want)
	}
	env := strings.Join(h.r.Env("http://127.0.0.1:3128", "/etc/moat-ca.pem"), "\n")
	for _, want := range []string{"HTTP_PROXY=http://127.0.0.1:3128", "https_proxy=http://127.0.0.1:3128", "SSL_CERT_FILE=/etc/moat-ca.pem", "PIP_CERT=/etc/moat-ca.pem"} {
		if !strings.Contains(env, want+"\n") && !strings.HasSuffix(env, want) {
			t.Errorf("Env lacks %s:\n%s", want, env)
		}
	}
	if strings.Contains(strings.ToUpper(env), "NO_PROXY") {
		t.Errorf("Env sets NO_PROXY:\n%s", env)
	}
	if _, err := New(Config{CADir: t.TempDir()}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("New without a network: %v", err)
	}
	if _, err := New(Config{Egress: moat.Egress{Network: &moat.Network{Allow: []string{"10.0.0.1"}}}, CADir: t.TempDir()}); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("New with an IP in allow: %v", err)
	}
}

// pipeListener is a listener that accepts nothing until closed.
type pipeListener struct{ done chan struct{} }

func newPipeListener() *pipeListener { return &pipeListener{done: make(chan struct{})} }

func (l *pipeListener) Accept() (net.Conn, error) { <-l.done; return nil, net.ErrClosed }
func (l *pipeListener) Close() error {
	select {
	case <-l.done:
	default:
		close(l.done)
	}
	return nil
}
func (l *pipeListener) Addr() net.Addr { return &net.TCPAddr{} }

// gathered returns reg's moat_egress_requests_total by "decision host".
func gathered(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != "moat_egress_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			out[labels["decision"]+" "+labels["host"]] = m.GetCounter().GetValue()
		}
	}
	return out
}

// waitFor polls cond for up to 10 seconds.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out")
		}
		time.Sleep(time.Millisecond)
	}
}
