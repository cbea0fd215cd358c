package egress

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// seenRequest is what the upstream got.
type seenRequest struct {
	header     http.Header
	uri, host  string
	remoteAddr string
	body       string
}

// testUpstream is a loopback HTTPS server for "example.com" (the name
// httptest's certificate carries) that records its requests, echoes the
// X-Echo header back in X-Echoed and answers "ok".
type testUpstream struct {
	srv   *httptest.Server
	roots *x509.CertPool
	mu    sync.Mutex
	seen  []seenRequest
	// release lets /stream send its second event.
	release chan struct{}
}

func newMITMUpstream(t testing.TB) *testUpstream {
	t.Helper()
	u := &testUpstream{release: make(chan struct{})}
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		u.mu.Lock()
		u.seen = append(u.seen, seenRequest{r.Header.Clone(), r.RequestURI, r.Host, r.RemoteAddr, string(body)})
		u.mu.Unlock()
		e := r.Header.Get("X-Echo")
		switch r.URL.Path {
		case "/stream": // the first event, then the second once the client saw it
			fmt.Fprint(w, "event one\n")
			w.(http.Flusher).Flush()
			<-u.release
			fmt.Fprint(w, "event two\n")
			return
		case "/echo-more": // X-Echo in a 103's header and in the trailer
			w.Header().Set("Link", e)
			w.WriteHeader(http.StatusEarlyHints)
			w.Header().Del("Link")
			w.Header().Set("Trailer", "X-Trailer")
			fmt.Fprint(w, "ok")
			w.(http.Flusher).Flush()
			w.Header().Set("X-Trailer", e)
			return
		case "/echo-body": // X-Echo and a value it knows, in many forms, in the body
			echoBody(w, e)
			return
		case "/204", "/304": // no body
			code, _ := strconv.Atoi(r.URL.Path[1:])
			w.WriteHeader(code)
			return
		case "/gzip": // an encoded body
			w.Header().Set("Content-Encoding", "gzip")
			fmt.Fprint(w, e)
			return
		case "/echo-status", "/echo-garbage": // a hostile or broken upstream
			c, bw, _ := w.(http.Hijacker).Hijack()
			defer c.Close()
			if r.URL.Path == "/echo-status" {
				fmt.Fprintf(bw, "HTTP/1.1 200 %s\r\nContent-Length: 2\r\n\r\nok", e)
			} else {
				fmt.Fprintf(bw, "garbage%s\r\n\r\n", e)
			}
			bw.Flush()
			return
		}
		if e != "" {
			w.Header().Set("X-Echoed", e)
		}
		fmt.Fprint(w, "ok")
	}))
	u.srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the refused handshakes
	u.srv.StartTLS()
	t.Cleanup(u.srv.Close)
	u.roots = x509.NewCertPool()
	u.roots.AddCert(u.srv.Certificate())
	return u
}

func (u *testUpstream) requests() []seenRequest {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]seenRequest(nil), u.seen...)
}

func (u *testUpstream) dial() (net.Conn, error) {
	return net.Dial("tcp", u.srv.Listener.Addr().String())
}

// tunnel is the sandbox's end of an intercepted CONNECT tunnel: a TLS
// client that trusts only the bundle moat hands the sandbox.
type tunnel struct {
	conn *tls.Conn
	br   *bufio.Reader
	done chan error // serveMITM's result
}

type mitmOptions struct {
	host       string // the CONNECT host; "example.com" when empty
	port       int    // 443 when 0
	serverName string // the client's SNI; host when empty
	insecure   bool   // the client skips verifying moat's leaf
	roots      *x509.CertPool
	decide     func(*http.Request) string
	denied     func(why string)
}

// openTunnel runs serveMITM on one end of a loopback TCP pair and
// returns the other end, after the TLS handshake, or with handshakeErr.
func openTunnel(t testing.TB, r *runSecrets, up *testUpstream, o mitmOptions) (tn *tunnel, handshakeErr error) {
	t.Helper()
	if o.host == "" {
		o.host = "example.com"
	}
	if o.port == 0 {
		o.port = 443
	}
	if o.serverName == "" {
		o.serverName = o.host
	}
	if o.roots == nil {
		o.roots = up.roots
	}
	a, err := loadCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	bundle, err := a.bundle()
	if err != nil {
		t.Fatal(err)
	}
	trust := x509.NewCertPool()
	if !trust.AppendCertsFromPEM(bundle) {
		t.Fatal("the bundle holds no certificate")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	client, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	server, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	tn = &tunnel{done: make(chan error, 1)}
	go func() { tn.done <- r.serveMITM(server, o.host, o.port, up.dial, a, o.roots, o.decide, o.denied) }()
	tn.conn = tls.Client(client, &tls.Config{RootCAs: trust, ServerName: o.serverName, InsecureSkipVerify: o.insecure, NextProtos: []string{"http/1.1"}})
	t.Cleanup(func() { tn.conn.Close() })
	tn.br = bufio.NewReader(tn.conn)
	tn.conn.SetDeadline(time.Now().Add(30 * time.Second))
	return tn, tn.conn.Handshake()
}

// send writes raw (a request as bytes) and reads the response and its body.
func (tn *tunnel) send(t *testing.T, raw string) (*http.Response, string) {
	t.Helper()
	if _, err := io.WriteString(tn.conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(tn.br, nil)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(body)
}

// end closes the sandbox's side and returns serveMITM's result.
func (tn *tunnel) end(t *testing.T) error {
	t.Helper()
	tn.conn.Close()
	select {
	case err := <-tn.done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("serveMITM did not return")
		return nil
	}
}

func TestMITMSecretReachesUpstream(t *testing.T) {
	up := newMITMUpstream(t)
	r := testSecrets(t).forRun()
	api := placeholders(r)["API_KEY"]
	tn, err := openTunnel(t, r, up, mitmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if p := tn.conn.ConnectionState().NegotiatedProtocol; p != "http/1.1" {
		t.Errorf("ALPN %q, want http/1.1", p)
	}
	resp, body := tn.send(t, "GET /v1/models?q="+api+" HTTP/1.1\r\nHost: example.com\r\nAuthorization: Bearer "+api+"\r\nX-Echo: "+api+"\r\n\r\n")
	if resp.StatusCode != 200 || body != "ok" {
		t.Fatalf("response %s %q", resp.Status, body)
	}
	if got := resp.Header.Get("X-Echoed"); got != api {
		t.Errorf("the echoed header came back as %q, want the placeholder", got)
	}
	// A second request on the same tunnel, with a body and Expect.
	resp, _ = tn.send(t, "POST /upload HTTP/1.1\r\nHost: example.com:443\r\nAuthorization: Bearer "+api+"\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\nhello")
	if resp.StatusCode != 100 {
		t.Fatalf("Expect: 100-continue got %s first", resp.Status)
	}
	if resp, err = http.ReadResponse(tn.br, nil); err != nil || resp.StatusCode != 200 {
		t.Fatalf("after 100: %v %v", resp, err)
	}
	if b, _ := io.ReadAll(resp.Body); string(b) != "ok" {
		t.Errorf("body after 100: %q", b)
	}
	if err := tn.end(t); err != nil {
		t.Errorf("serveMITM: %v", err)
	}

	seen := up.requests()
	if len(seen) != 2 {
		t.Fatalf("upstream got %d requests, want 2", len(seen))
	}
	for i, s := range seen {
		if got := s.header.Get("Authorization"); got != "Bearer "+realAPI {
			t.Errorf("request %d: upstream got Authorization %q, want the real value", i, got)
		}
		if s.host != "example.com" && s.host != "example.com:443" {
			t.Errorf("request %d: upstream got Host %q", i, s.host)
		}
		if ua, ok := s.header["User-Agent"]; ok {
			t.Errorf("request %d: a User-Agent %q the sandbox did not send", i, ua)
		}
		if s.header.Get("Expect") != "" {
			t.Errorf("request %d: Expect went upstream", i)
		}
	}
	if seen[0].uri != "/v1/models?q="+api {
		t.Errorf("URI %q: API_KEY is not InURL, so its placeholder stays", seen[0].uri)
	}
	if seen[0].header.Get("X-Echo") != realAPI {
		t.Errorf("X-Echo %q: want the real value (every header)", seen[0].header.Get("X-Echo"))
	}
	if seen[1].body != "hello" {
		t.Errorf("body %q", seen[1].body)
	}
	if seen[0].remoteAddr != seen[1].remoteAddr {
		t.Errorf("two upstream connections (%s, %s) for one tunnel", seen[0].remoteAddr, seen[1].remoteAddr)
	}
}

func TestMITMInURL(t *testing.T) {
	up := newMITMUpstream(t)
	set, err := newSecretSet(moat.Egress{
		Network: &moat.Network{Allow: []string{"example.com"}},
		Secrets: map[string]moat.Secret{"URL_KEY": {FromEnv: "V", Hosts: []string{"example.com"}, InURL: true}},
	}, testEnv(map[string]string{"V": realOther}))
	if err != nil {
		t.Fatal(err)
	}
	r := set.forRun()
	ph := placeholders(r)["URL_KEY"]
	tn, err := openTunnel(t, r, up, mitmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if resp, _ := tn.send(t, "GET /k/"+ph+"/x?key="+ph+"&a=b HTTP/1.1\r\nHost: example.com\r\n\r\n"); resp.StatusCode != 200 {
		t.Fatalf("response %s", resp.Status)
	}
	tn.end(t)
	seen := up.requests()
	if len(seen) != 1 {
		t.Fatalf("upstream got %d requests", len(seen))
	}
	u, err := url.ParseRequestURI(seen[0].uri)
	if err != nil {
		t.Fatal(err)
	}
	if q := u.Query(); q.Get("key") != realOther || q.Get("a") != "b" {
		t.Errorf("query %q: want key=<real value>, a=b", u.RawQuery)
	}
	if want := "/k/" + realOther + "/x"; u.Path != want || !strings.HasPrefix(u.EscapedPath(), "/k/REAL%20other%2F") {
		t.Errorf("path %q (%s), want %q with the value one segment", u.Path, u.EscapedPath(), want)
	}
}

// TestMITMRefused: a request the tunnel must not carry gets a 403, the
// tunnel ends with an error wrapping errRefused, and the upstream sees
// nothing; no refusal holds a real value.
func TestMITMRefused(t *testing.T) {
	r := testSecrets(t).forRun()
	ph := placeholders(r)
	for _, tc := range []struct {
		name   string
		raw    string
		decide func(*http.Request) string
		want   string // in the 403's body and the error
	}{
		{"other secret's placeholder", "GET / HTTP/1.1\r\nHost: example.com\r\nAuthorization: Bearer " + ph["API_KEY"] + "\r\nX-Other: " + ph["OTHER_KEY"] + "\r\n\r\n", nil, "secret OTHER_KEY was sent to example.com:443"},
		{"other host in Host", "GET / HTTP/1.1\r\nHost: other.test:8443\r\nAuthorization: " + ph["API_KEY"] + "\r\n\r\n", nil, `Host "other.test:8443"`},
		{"other port in Host", "GET / HTTP/1.1\r\nHost: example.com:8443\r\n\r\n", nil, "another host"},
		{"other host in the target", "GET https://other.test/ HTTP/1.1\r\nHost: example.com\r\n\r\n", nil, `"other.test" inside the tunnel to example.com:443 is another host`},
		{"connect", "CONNECT other.test:443 HTTP/1.1\r\nHost: example.com\r\n\r\n", nil, "CONNECT inside"},
		{"websocket", "GET / HTTP/1.1\r\nHost: example.com\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", nil, "protocol upgrade"},
		{"decide", "GET /blocked HTTP/1.1\r\nHost: example.com\r\nAuthorization: " + ph["API_KEY"] + "\r\n\r\n", func(req *http.Request) string {
			if strings.Contains(req.Header.Get("Authorization"), realAPI) {
				return "decide saw the real value"
			}
			return "the core said no"
		}, "the core said no"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := newMITMUpstream(t)
			tn, err := openTunnel(t, r, up, mitmOptions{decide: tc.decide})
			if err != nil {
				t.Fatal(err)
			}
			resp, body := tn.send(t, tc.raw)
			if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, tc.want) {
				t.Errorf("response %s %q, want 403 with %q", resp.Status, body, tc.want)
			}
			assertNoValue(t, "403 body", body)
			err = tn.end(t)
			if !errors.Is(err, errRefused) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("serveMITM = %v, want errRefused with %q", err, tc.want)
			}
			if err != nil {
				assertNoValue(t, "error", err.Error())
			}
			if n := len(up.requests()); n != 0 {
				t.Errorf("upstream got %d requests", n)
			}
		})
	}
}

func TestMITMRequestHeadBounded(t *testing.T) {
	up := newMITMUpstream(t)
	tn, err := openTunnel(t, testSecrets(t).forRun(), up, mitmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		io.WriteString(tn.conn, "GET / HTTP/1.1\r\nHost: example.com\r\n")
		line := "X-Pad: " + strings.Repeat("a", 8000) + "\r\n"
		for range 2 * maxRequestHead / len(line) {
			if _, err := io.WriteString(tn.conn, line); err != nil {
				return
			}
		}
	}()
	resp, err := http.ReadResponse(tn.br, nil)
	if err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Fatalf("response %v %v, want 431", resp, err)
	}
	if err := tn.end(t); !errors.Is(err, errRefused) {
		t.Errorf("serveMITM = %v", err)
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream got %d requests", n)
	}
}

func TestMITMClientHelloNamesAnother(t *testing.T) {
	up := newMITMUpstream(t)
	// The client would take any certificate: the refusal is serveMITM's.
	tn, err := openTunnel(t, testSecrets(t).forRun(), up, mitmOptions{serverName: "other.test", insecure: true})
	if err == nil {
		t.Fatal("a ClientHello naming other.test inside the tunnel to example.com was served")
	}
	if err := tn.end(t); err == nil || !strings.Contains(err.Error(), `names "other.test"`) {
		t.Errorf("serveMITM = %v", err)
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream got %d requests", n)
	}
}

func TestMITMUpstreamVerified(t *testing.T) {
	up := newMITMUpstream(t)
	r := testSecrets(t).forRun()
	api := placeholders(r)["API_KEY"]
	tn, err := openTunnel(t, r, up, mitmOptions{roots: x509.NewCertPool()}) // trusts nothing
	if err != nil {
		t.Fatal(err)
	}
	resp, _ := tn.send(t, "GET / HTTP/1.1\r\nHost: example.com\r\nAuthorization: "+api+"\r\n\r\n")
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("an upstream the roots do not vouch for: %s, want 502", resp.Status)
	}
	err = tn.end(t)
	var uerr x509.UnknownAuthorityError
	if !errors.As(err, &uerr) {
		t.Errorf("serveMITM = %v, want an unknown authority", err)
	}
	if n := len(up.requests()); n != 0 {
		t.Errorf("upstream got %d requests", n)
	}
}

// TestMITMUpstreamEchoHidden: what a hostile upstream echoes of a real
// value in a status line reaches neither the sandbox nor serveMITM's
// error (which the proxy logs).
func TestMITMUpstreamEchoHidden(t *testing.T) {
	r := testSecrets(t).forRun()
	api := placeholders(r)["API_KEY"]
	for _, path := range []string{"/echo-status", "/echo-garbage"} {
		t.Run(path, func(t *testing.T) {
			up := newMITMUpstream(t)
			tn, err := openTunnel(t, r, up, mitmOptions{})
			if err != nil {
				t.Fatal(err)
			}
			resp, body := tn.send(t, "GET "+path+" HTTP/1.1\r\nHost: example.com\r\nX-Echo: "+api+"\r\n\r\n")
			assertNoValue(t, "status", resp.Status)
			assertNoValue(t, "body", body)
			err = tn.end(t)
			if path == "/echo-status" {
				if !strings.Contains(resp.Status, api) {
					t.Errorf("status %q: want the value turned back into the placeholder", resp.Status)
				}
				return
			}
			if resp.StatusCode != http.StatusBadGateway || err == nil {
				t.Fatalf("garbage from the upstream: %s, %v; want 502 and an error", resp.Status, err)
			}
			assertNoValue(t, "error", err.Error())
			if !strings.Contains(err.Error(), "garbage"+api) {
				t.Errorf("error %q: want what the upstream sent, with the placeholder", err)
			}
		})
	}
}

// BenchmarkMITMRequest is one keep-alive request with a secret through an
// intercepted tunnel; BenchmarkDirectRequest the same request straight to
// the upstream. Their ratio is serveMITM's added cost per request.
func BenchmarkMITMRequest(b *testing.B) {
	up := newMITMUpstream(b)
	r := testSecrets(b).forRun()
	tn, err := openTunnel(b, r, up, mitmOptions{})
	if err != nil {
		b.Fatal(err)
	}
	defer tn.conn.Close()
	req := "GET / HTTP/1.1\r\nHost: example.com\r\nAuthorization: Bearer " + placeholders(r)["API_KEY"] + "\r\n\r\n"
	benchRequests(b, tn.conn, tn.br, req)
}

func BenchmarkDirectRequest(b *testing.B) {
	up := newMITMUpstream(b)
	c, err := tls.Dial("tcp", up.srv.Listener.Addr().String(), &tls.Config{RootCAs: up.roots, ServerName: "example.com"})
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	benchRequests(b, c, bufio.NewReader(c), "GET / HTTP/1.1\r\nHost: example.com\r\nAuthorization: Bearer "+realAPI+"\r\n\r\n")
}

func benchRequests(b *testing.B, c net.Conn, br *bufio.Reader, req string) {
	c.SetDeadline(time.Time{})
	for b.Loop() {
		if _, err := io.WriteString(c, req); err != nil {
			b.Fatal(err)
		}
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			b.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// TestMITMStreams: a streamed response reaches the sandbox as it comes,
// not when it ends (the upstream sends its second event only after the
// sandbox got the first).
func TestMITMStreams(t *testing.T) {
	up := newMITMUpstream(t)
	tn, err := openTunnel(t, testSecrets(t).forRun(), up, mitmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	io.WriteString(tn.conn, "GET /stream HTTP/1.1\r\nHost: example.com\r\n\r\n")
	resp, err := http.ReadResponse(tn.br, nil)
	if err != nil {
		close(up.release)
		t.Fatal(err)
	}
	first := bufio.NewReader(resp.Body)
	line, err := first.ReadString('\n')
	close(up.release)
	if err != nil || line != "event one\n" {
		t.Fatalf("first event %q, %v", line, err)
	}
	if rest, _ := io.ReadAll(first); string(rest) != "event two\n" {
		t.Errorf("second event %q", rest)
	}
	tn.end(t)
}
