package egress

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"testing/iotest"
	"time"

	"github.com/moatsandbox/moat"
)

// valueForms is every form of v that a response's body must not carry to
// the sandbox, computed here apart from bodyNeedles.
func valueForms(v string) []string {
	j, _ := json.Marshal(v)
	var nb bytes.Buffer
	e := json.NewEncoder(&nb)
	e.SetEscapeHTML(false)
	e.Encode(v)
	b := []byte(v)
	return []string{
		v, url.QueryEscape(v), url.PathEscape(v),
		strings.Trim(string(j), `"`), strings.Trim(strings.TrimSpace(nb.String()), `"`), html.EscapeString(v),
		base64.StdEncoding.EncodeToString(b), base64.RawStdEncoding.EncodeToString(b),
		base64.URLEncoding.EncodeToString(b), base64.RawURLEncoding.EncodeToString(b),
	}
}

// echoBody writes what a hostile secret's host might put in a body: the
// echoed e and the tests' real values in every form, and base64 of
// "user:" + value (the value not on a 3-byte boundary).
func echoBody(w io.Writer, e string) {
	fmt.Fprintf(w, "echo: %s\n", e)
	for _, v := range []string{realAPI, realOther} {
		for i, f := range valueForms(v) {
			fmt.Fprintf(w, "form %d: %s\n", i, f)
		}
		j, _ := json.Marshal(map[string]string{"key": v})
		fmt.Fprintf(w, "json: %s\n", j)
		fmt.Fprintf(w, "basic: %s\n", base64.StdEncoding.EncodeToString([]byte("user:"+v)))
		fmt.Fprintf(w, "basic2: %s\n", base64.URLEncoding.EncodeToString([]byte("us:"+v+"!")))
	}
}

// assertNoForm fails if body holds any form of a real value, or a base64
// line that decodes to most of one.
func assertNoForm(t *testing.T, what, body string) {
	t.Helper()
	for _, v := range []string{realAPI, realOther} {
		for _, f := range valueForms(v) {
			if strings.Contains(body, f) {
				t.Errorf("%s holds a form of a real value, %q:\n%s", what, f, body)
			}
		}
		for _, line := range strings.Split(body, "\n") {
			_, b64, ok := strings.Cut(line, ": ")
			if !ok || !strings.HasPrefix(line, "basic") {
				continue
			}
			b64 = strings.TrimRight(b64, "=")
			for _, enc := range []*base64.Encoding{base64.RawStdEncoding, base64.RawURLEncoding} {
				dec, _ := enc.DecodeString(b64) // what decodes before an error
				if inner := v[1 : len(v)-1]; bytes.Contains(dec, []byte(inner)) {
					t.Errorf("%s: %q decodes to a real value", what, line)
				}
			}
		}
	}
}

// hideAll reads body through a bodyHider of r, the body given as reads of
// the sizes in split (the rest at once).
func hideAll(t *testing.T, r *runSecrets, body io.Reader) string {
	t.Helper()
	b, err := io.ReadAll(&bodyHider{ReadCloser: io.NopCloser(body), needles: r.bodyNeedles()})
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestBodyHider: every form of every value becomes its placeholder's
// form, however the body is cut into reads; other bytes pass as they are.
func TestBodyHider(t *testing.T) {
	r := testSecrets(t).forRun()
	ph := placeholders(r)
	var body bytes.Buffer
	echoBody(&body, "plain text")
	for name, rd := range map[string]func() io.Reader{
		"whole":    func() io.Reader { return bytes.NewReader(body.Bytes()) },
		"one byte": func() io.Reader { return iotest.OneByteReader(bytes.NewReader(body.Bytes())) },
		"halves":   func() io.Reader { return iotest.HalfReader(bytes.NewReader(body.Bytes())) },
		"data+EOF": func() io.Reader { return iotest.DataErrReader(bytes.NewReader(body.Bytes())) },
	} {
		t.Run(name, func(t *testing.T) {
			got := hideAll(t, r, rd())
			assertNoForm(t, "the body", got)
			for _, want := range []string{
				"form 0: " + ph["API_KEY"] + "\n",
				"form 6: " + base64.StdEncoding.EncodeToString([]byte(ph["OTHER_KEY"])) + "\n",
				`json: {"key":"` + ph["OTHER_KEY"] + `"}`,
				"echo: plain text\n",
			} {
				if !strings.Contains(got, want) {
					t.Errorf("the body lacks %q:\n%s", want, got)
				}
			}
		})
	}
	plain := strings.Repeat("nothing secret here, sk-REAL-api but not all of it; ", 5000)
	if got := hideAll(t, r, iotest.HalfReader(strings.NewReader(plain))); got != plain {
		t.Errorf("a body without a value changed (%d bytes, want %d)", len(got), len(plain))
	}
	// The body ending inside a value's start: what is there goes out.
	if got := hideAll(t, r, strings.NewReader("x "+realAPI[:5])); got != "x "+realAPI[:5] {
		t.Errorf("a cut-short start at the end: %q", got)
	}
}

// TestBodyHiderStreams: what cannot start a value goes out at once; the
// start of one waits for the rest, which becomes the placeholder.
func TestBodyHiderStreams(t *testing.T) {
	r := testSecrets(t).forRun()
	pr, pw := io.Pipe()
	h := &bodyHider{ReadCloser: pr, needles: r.bodyNeedles()}
	br := bufio.NewReader(h)
	got := make(chan string, 1)
	read := func() string {
		go func() {
			line, _ := br.ReadString('\n')
			got <- line
		}()
		select {
		case line := <-got:
			return line
		case <-time.After(10 * time.Second):
			t.Fatal("the hider held back a line")
			return ""
		}
	}
	go func() {
		io.WriteString(pw, "event one\n")
	}()
	if line := read(); line != "event one\n" {
		t.Fatalf("first event %q", line)
	}
	go func() {
		io.WriteString(pw, "key "+realAPI[:7])
		io.WriteString(pw, realAPI[7:]+"\n")
		pw.Close()
	}()
	if line, want := read(), "key "+placeholders(r)["API_KEY"]+"\n"; line != want {
		t.Errorf("split value: %q, want %q", line, want)
	}
}

// TestMITMBodyEcho: a secret's host that echoes the real value in a body
// (with a Content-Length, which then no longer holds) hands the sandbox
// only placeholders, chunked, the tunnel still kept alive; it was asked for
// an unencoded response; HEAD and 304 keep their header as it came.
func TestMITMBodyEcho(t *testing.T) {
	up := newMITMUpstream(t)
	r := testSecrets(t).forRun()
	api := placeholders(r)["API_KEY"]
	tn, err := openTunnel(t, r, up, mitmOptions{})
	if err != nil {
		t.Fatal(err)
	}
	resp, body := tn.send(t, "GET /echo-body HTTP/1.1\r\nHost: example.com\r\nAccept-Encoding: gzip, br\r\nX-Echo: "+api+"\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("response %s", resp.Status)
	}
	assertNoForm(t, "the body", body)
	if !strings.Contains(body, "echo: "+api+"\n") {
		t.Errorf("the echo did not come back as the placeholder:\n%s", body)
	}
	if resp.ContentLength != -1 || len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked" {
		t.Errorf("Content-Length %d, Transfer-Encoding %q: want chunked", resp.ContentLength, resp.TransferEncoding)
	}
	if resp.Close {
		t.Errorf("the tunnel closes after a hidden body")
	}
	io.WriteString(tn.conn, "HEAD /echo-body HTTP/1.1\r\nHost: example.com\r\nX-Echo: "+api+"\r\n\r\n")
	if resp, err = http.ReadResponse(tn.br, &http.Request{Method: http.MethodHead}); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || resp.ContentLength <= 0 || len(resp.TransferEncoding) != 0 {
		t.Errorf("HEAD: %s, Content-Length %d, %q: want the upstream's length", resp.Status, resp.ContentLength, resp.TransferEncoding)
	}
	for _, code := range []int{204, 304} {
		resp, body = tn.send(t, fmt.Sprintf("GET /%d HTTP/1.1\r\nHost: example.com\r\n\r\n", code))
		if resp.StatusCode != code || body != "" || len(resp.TransferEncoding) != 0 || resp.Close {
			t.Errorf("%d: %s %q %q close=%v", code, resp.Status, body, resp.TransferEncoding, resp.Close)
		}
	}
	resp, body = tn.send(t, "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n")
	if resp.StatusCode != 200 || body != "ok" {
		t.Errorf("after HEAD, 204, 304: %s %q", resp.Status, body)
	}
	tn.end(t)
	for i, s := range up.requests() {
		if got := s.header.Values("Accept-Encoding"); len(got) != 1 || got[0] != "identity" {
			t.Errorf("request %d: upstream got Accept-Encoding %q, want identity", i, got)
		}
	}
}

// TestMITMEncodedRefused: a body under a Content-Encoding moat cannot read
// through is a 502, a denial, and the end of the tunnel.
func TestMITMEncodedRefused(t *testing.T) {
	up := newMITMUpstream(t)
	r := testSecrets(t).forRun()
	var denied []string
	tn, err := openTunnel(t, r, up, mitmOptions{denied: func(why string) { denied = append(denied, why) }})
	if err != nil {
		t.Fatal(err)
	}
	resp, body := tn.send(t, "GET /gzip HTTP/1.1\r\nHost: example.com\r\nX-Echo: "+placeholders(r)["API_KEY"]+"\r\n\r\n")
	assertNoForm(t, "the body", body)
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(body, "Content-Encoding gzip") || strings.Count(body, "\n") != 1 {
		t.Errorf("response %s %q, want 502 with one line naming the encoding", resp.Status, body)
	}
	err = tn.end(t)
	if !errors.Is(err, errRefused) {
		t.Errorf("serveMITM = %v, want errRefused", err)
	}
	if len(denied) != 1 || !strings.Contains(denied[0], "encoded") {
		t.Errorf("denied %q", denied)
	}
}

// TestEncodedRefusedNoted: through the whole proxy, the refused encoded
// response is logged and in the run's notes as denied.
func TestEncodedRefusedNoted(t *testing.T) {
	up := newMITMUpstream(t)
	port := up.srv.Listener.Addr().(*net.TCPAddr).Port
	allow := fmt.Sprintf("example.com:%d", port)
	h := &harness{logs: &syncBuffer{}}
	p, err := New(Config{
		Egress: moat.Egress{
			Network: &moat.Network{Allow: []string{allow}, Resolve: map[string]string{"example.com": "127.0.0.1"}},
			Secrets: map[string]moat.Secret{"API_KEY": {FromEnv: "V", Hosts: []string{allow}}},
		},
		Getenv: testEnv(map[string]string{"V": realAPI}),
		CADir:  t.TempDir(),
		Roots:  up.roots,
		Logger: newTextLogger(h.logs),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	h.p, h.r = p, p.NewRun()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.addr = l.Addr().String()
	go h.r.Serve(l)
	c := h.connect(t, allow)
	trust := x509.NewCertPool()
	trust.AppendCertsFromPEM(p.CABundle())
	tc := tls.Client(c, &tls.Config{RootCAs: trust, ServerName: "example.com"})
	io.WriteString(tc, "GET /gzip HTTP/1.1\r\nHost: "+allow+"\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("got %s, want 502", resp.Status)
	}
	tc.Close()
	waitFor(t, func() bool { return strings.Contains(h.logs.String(), "encoded") })
	notes := strings.Join(h.r.Notes(), "\n")
	if !strings.Contains(notes, "denied "+allow+" (the response is encoded (Content-Encoding gzip)") {
		t.Errorf("notes %q", notes)
	}
	assertNoForm(t, "the log", h.logs.String())
}

// TestPlainHTTPSecretRefused: a secret's placeholder sent to its own host
// over plain http:// is refused (the real value goes only into TLS), and
// the upstream gets nothing; without a placeholder the request goes.
func TestPlainHTTPSecretRefused(t *testing.T) {
	var got atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		got.Add(1)
		io.WriteString(w, "ok")
	}))
	t.Cleanup(srv.Close)
	port := srv.Listener.Addr().(*net.TCPAddr).Port
	h := secretHarness(t, port)
	env := map[string]string{}
	for _, kv := range h.r.Env("http://"+h.addr, "/ca.pem") {
		k, v, _ := strings.Cut(kv, "=")
		env[k] = v
	}
	for _, head := range []string{
		fmt.Sprintf("GET http://api.test:%d/v1 HTTP/1.1\r\nHost: api.test:%d\r\nAuthorization: Bearer %s\r\n\r\n", port, port, env["API_KEY"]),
		fmt.Sprintf("GET http://api.test:%d/v1?key=%s HTTP/1.1\r\nHost: api.test:%d\r\n\r\n", port, env["URL_KEY"], port),
	} {
		_, _, resp := h.raw(t, head)
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(string(body), "moat puts secrets only into TLS connections") {
			t.Errorf("%q: %s %q, want 403", head, resp.Status, body)
		}
	}
	if n := got.Load(); n != 0 {
		t.Errorf("the upstream got %d requests over plain http with a placeholder", n)
	}
	notes := strings.Join(h.r.Notes(), "\n")
	if strings.Count(notes, "moat puts secrets only into TLS connections") != 2 {
		t.Errorf("notes %q", notes)
	}
	if !strings.Contains(h.logs.String(), "only into TLS") {
		t.Errorf("not logged: %s", h.logs.String())
	}
	_, _, resp := h.raw(t, fmt.Sprintf("GET http://api.test:%d/v1 HTTP/1.1\r\nHost: api.test:%d\r\n\r\n", port, port))
	if body, _ := io.ReadAll(resp.Body); resp.StatusCode != 200 || string(body) != "ok" {
		t.Errorf("without a placeholder: %s %q", resp.Status, body)
	}
}

// TestLogBounded: a run that makes many decisions logs maxLogLines of them
// and one line saying the rest are counted; the metrics and the notes
// count them all; the next run of a session (after Notes) logs again.
func TestLogBounded(t *testing.T) {
	h := newHarness(t, &moat.Network{Allow: []string{"allowed.test"}}, nil)
	const n = maxLogLines + 50
	for range n {
		h.raw(t, "GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n")
	}
	logs := h.logs.String()
	if got := strings.Count(logs, "msg=egress "); got != maxLogLines {
		t.Errorf("%d decision lines logged, want %d", got, maxLogLines)
	}
	if got := strings.Count(logs, "further decisions of this run are counted, not logged"); got != 1 {
		t.Errorf("%d lines saying the rest are not logged, want 1", got)
	}
	if m := gathered(t, h.reg); m["denied other"] != n {
		t.Errorf("metrics %v, want %d denials", m, n)
	}
	if notes := strings.Join(h.r.Notes(), ""); !strings.Contains(notes, fmt.Sprintf("%d times", n)) {
		t.Errorf("notes %q, want all %d counted", notes, n)
	}
	h.raw(t, "GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n")
	if got := strings.Count(h.logs.String(), "msg=egress "); got != maxLogLines+1 {
		t.Errorf("after Notes: %d decision lines, want %d", got, maxLogLines+1)
	}
}

func newTextLogger(w io.Writer) *slog.Logger { return slog.New(slog.NewTextHandler(w, nil)) }

// BenchmarkBodyHider is the body's rewriting alone: 1 MiB of text without
// a value, read in 32 KiB pieces (MB/s is its throughput).
func BenchmarkBodyHider(b *testing.B) {
	r := testSecrets(b).forRun()
	body := bytes.Repeat([]byte("nothing secret here, sk-REAL-api but not all of it; "), 1<<20/52)
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		h := &bodyHider{ReadCloser: io.NopCloser(bytes.NewReader(body)), needles: r.bodyNeedles()}
		if _, err := io.Copy(io.Discard, h); err != nil {
			b.Fatal(err)
		}
	}
}
