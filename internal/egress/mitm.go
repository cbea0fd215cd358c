package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// Bounds of an intercepted tunnel.
const (
	// maxRequestHead bounds a request's line and header (as net/http's
	// server does by default).
	maxRequestHead = 1 << 20
	// tlsHandshakeTimeout bounds each TLS handshake, the sandbox's and
	// the upstream's.
	tlsHandshakeTimeout = 10 * time.Second
)

// mitmIdle is how long a read or write on either side of an intercepted
// tunnel may wait for progress before the tunnel ends. A variable for
// tests.
var mitmIdle = 2 * time.Minute

// errRefused is wrapped by serveMITM's error when it refused a request
// (and told the sandbox so with a 403); the error's text says why, with no
// secret value in it.
var errRefused = errors.New("refused")

// serveMITM serves the sandbox's side of a CONNECT tunnel to host:port (a
// secret's host), after the proxy sent its 200; the sandbox's ClientHello
// may already be buffered in client. It terminates TLS as host with a leaf
// of a (ALPN http/1.1 only; a ClientHello naming another server fails),
// then serves HTTP/1.1 requests in a loop, keeping the connection alive as
// the sandbox and the upstream do. Each request must name host in its Host
// (no fronting inside the tunnel) and is refused when decide (which may be
// nil) or r.rewrite gives a reason; otherwise the placeholders of host's
// secrets become their real values and the request goes upstream over one
// TLS connection made with dial (the address the proxy checked), verified
// for host against roots (nil means the system's), opened at the first
// request that is not refused, asking for an unencoded response. The
// response comes back with the secrets' real values turned back into
// placeholders in its status line, header, trailer and body (hideBody);
// an encoded body (Content-Encoding other than identity) is refused with a
// 502 and the reason goes to denied (which may be nil).
//
// A refusal is a 403 (a request) or 502 (a response) to the sandbox and the
// end of the tunnel, and the returned error wraps errRefused. serveMITM returns nil when the sandbox
// or the upstream ended the exchange cleanly, and closes client and the
// upstream connection on return. No error it returns holds a real value.
func (r *runSecrets) serveMITM(client net.Conn, host string, port int, dial func() (net.Conn, error), a *authority, roots *x509.CertPool, decide func(req *http.Request) (refusal string), denied func(why string)) (err error) {
	defer client.Close()
	defer func() { err = r.hideErr(err) }() // an error may quote what the upstream sent
	where := hostPort(host, port)
	cert, err := a.leaf(host)
	if err != nil {
		return err
	}
	tc := tls.Server(&idleConn{Conn: client, idle: mitmIdle}, &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
		GetCertificate: func(hello *tls.ClientHelloInfo) (*tls.Certificate, error) {
			if hello.ServerName != "" && !sameHost(hello.ServerName, host) {
				return nil, fmt.Errorf("egress: the TLS ClientHello names %q inside the tunnel to %s", hello.ServerName, where)
			}
			return cert, nil
		},
	})
	defer tc.Close()
	if err := handshake(tc); err != nil {
		return fmt.Errorf("egress: tls with the sandbox for %s: %w", where, err)
	}

	var up *upstreamConn
	defer func() {
		if up != nil {
			up.conn.Close()
		}
	}()
	lr := &io.LimitedReader{R: tc, N: maxRequestHead}
	br := bufio.NewReader(lr)
	bw := bufio.NewWriterSize(tc, 16<<10) // empty between responses
	for {
		lr.N = maxRequestHead
		if _, err := br.Peek(1); err != nil {
			return nil // the sandbox ended the connection, or left it idle, between requests
		}
		req, err := http.ReadRequest(br)
		if err != nil {
			switch {
			case lr.N == 0:
				writeStatus(tc, http.StatusRequestHeaderFieldsTooLarge, "moat egress: the request's header is too large")
				return fmt.Errorf("egress: %s: a request header over %d bytes: %w", where, maxRequestHead, errRefused)
			default:
				writeStatus(tc, http.StatusBadRequest, "moat egress: malformed request")
				return fmt.Errorf("egress: %s: reading a request: %w", where, err)
			}
		}
		lr.N = math.MaxInt64

		refusal := checkInTunnel(req, host, port)
		if refusal == "" && decide != nil {
			refusal = decide(req)
		}
		if refusal == "" {
			refusal = r.rewrite(req, host, port)
		}
		if refusal != "" {
			writeStatus(tc, http.StatusForbidden, "moat egress: refused: "+refusal)
			return fmt.Errorf("egress: %s: %w: %s", where, errRefused, refusal)
		}
		askIdentity(req.Header)

		if up == nil {
			if up, err = dialUpstream(dial, host, roots); err != nil {
				writeStatus(tc, http.StatusBadGateway, "moat egress: cannot reach "+where)
				return fmt.Errorf("egress: %s: %w", where, err)
			}
		}
		if strings.EqualFold(req.Header.Get("Expect"), "100-continue") {
			// Say go on ourselves: the request goes upstream whole.
			req.Header.Del("Expect")
			if _, err := io.WriteString(tc, "HTTP/1.1 100 Continue\r\n\r\n"); err != nil {
				return fmt.Errorf("egress: %s: %w", where, err)
			}
		}
		if err := req.Write(up.conn); err != nil {
			return fmt.Errorf("egress: %s: sending the request upstream: %w", where, err)
		}
		req.Header = nil // the real values: drop them as soon as they are sent

		resp, err := r.readResponse(up.br, req, bw)
		if err != nil {
			writeStatus(tc, http.StatusBadGateway, "moat egress: bad response from "+where)
			return fmt.Errorf("egress: %s: reading the response: %w", where, err)
		}
		r.hideResponse(resp)
		if refusal := r.hideBody(resp, req); refusal != "" {
			resp.Body.Close()
			writeStatus(tc, http.StatusBadGateway, "moat egress: refused: "+refusal)
			if denied != nil {
				denied(refusal)
			}
			return fmt.Errorf("egress: %s: %w: %s", where, errRefused, refusal)
		}
		body := resp.Body
		resp.Body = &flushingBody{ReadCloser: body, upstream: up.br, sandbox: bw}
		err = resp.Write(bw)
		if err == nil {
			err = bw.Flush()
		}
		body.Close()
		if err != nil {
			return fmt.Errorf("egress: %s: sending the response to the sandbox: %w", where, err)
		}
		if req.Close || resp.Close {
			return nil
		}
	}
}

// checkInTunnel refuses what a request inside an intercepted tunnel may
// not do: name another host (fronting), CONNECT again, or switch protocols
// (which would carry bytes the proxy no longer reads as requests). It
// strips the Upgrade header of an h2c upgrade offer (the request itself is
// fine) and blocks Go's default User-Agent being added.
func checkInTunnel(req *http.Request, host string, port int) string {
	where := hostPort(host, port)
	if req.Method == http.MethodConnect {
		return "a CONNECT inside the tunnel to " + where
	}
	// An absolute target's host is req.Host too (net/http puts it there).
	if !hostHeaderNames(req.Host, host, port) {
		return fmt.Sprintf("the Host %q inside the tunnel to %s is another host", req.Host, where)
	}
	if req.URL.Host != "" && !hostHeaderNames(req.URL.Host, host, port) {
		return fmt.Sprintf("the request target %q inside the tunnel to %s is another host", req.URL.Host, where)
	}
	if up := req.Header.Get("Upgrade"); up != "" {
		if !strings.EqualFold(up, "h2c") {
			return fmt.Sprintf("a protocol upgrade (%q) inside the tunnel to %s", up, where)
		}
		req.Header.Del("Upgrade")
		req.Header.Del("HTTP2-Settings")
	}
	req.URL.Scheme, req.URL.Host = "", "" // written upstream as origin-form
	if _, ok := req.Header["User-Agent"]; !ok {
		req.Header["User-Agent"] = []string{""} // Request.Write adds none then
	}
	return ""
}

// hostHeaderNames reports whether hh (a Host header: host or host:port)
// names host:port.
func hostHeaderNames(hh, host string, port int) bool {
	h, p := hh, ""
	if i := strings.LastIndexByte(hh, ':'); i >= 0 && !strings.Contains(hh[i:], "]") {
		h, p = hh[:i], hh[i+1:]
	}
	if !sameHost(h, host) {
		return false
	}
	if p == "" {
		return port == 443 // the default port of https, which the tunnel carries
	}
	return p == strconv.Itoa(port)
}

// sameHost compares two host names as DNS does (any case, an optional
// trailing dot).
func sameHost(a, b string) bool {
	return a != "" && strings.EqualFold(strings.TrimSuffix(a, "."), strings.TrimSuffix(b, "."))
}

// upstreamConn is the one TLS connection to a tunnel's upstream.
type upstreamConn struct {
	conn *tls.Conn
	br   *bufio.Reader
}

// dialUpstream connects with dial and verifies the upstream's certificate
// for host against roots.
func dialUpstream(dial func() (net.Conn, error), host string, roots *x509.CertPool) (*upstreamConn, error) {
	c, err := dial()
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	tc := tls.Client(&idleConn{Conn: c, idle: mitmIdle}, &tls.Config{
		ServerName: strings.TrimSuffix(host, "."),
		RootCAs:    roots,
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"http/1.1"},
	})
	if err := handshake(tc); err != nil {
		tc.Close()
		return nil, fmt.Errorf("tls with the upstream: %w", err)
	}
	return &upstreamConn{conn: tc, br: bufio.NewReader(tc)}, nil
}

// readResponse reads the upstream's response to req, passing any
// informational (1xx) responses before it to the sandbox with the secrets'
// values hidden. A 101 is an error: checkInTunnel let no upgrade through.
func (r *runSecrets) readResponse(br *bufio.Reader, req *http.Request, sandbox *bufio.Writer) (*http.Response, error) {
	for {
		resp, err := http.ReadResponse(br, req)
		if err != nil {
			return nil, err
		}
		switch {
		case resp.StatusCode == http.StatusSwitchingProtocols:
			return nil, errors.New("the upstream switched protocols unasked")
		case resp.StatusCode >= 100 && resp.StatusCode < 200:
			r.hideResponse(resp)
			if err := resp.Write(sandbox); err != nil {
				return nil, err
			}
			if err := sandbox.Flush(); err != nil {
				return nil, err
			}
		default:
			return resp, nil
		}
	}
}

// flushingBody is a response's body on its way to the sandbox through a
// buffer: what is buffered goes out before each read that would wait for
// the upstream, so a streamed response (server-sent events) streams, and
// a response that is all there goes out in few TLS records.
type flushingBody struct {
	io.ReadCloser
	upstream *bufio.Reader
	sandbox  *bufio.Writer
}

func (b *flushingBody) Read(p []byte) (int, error) {
	if b.upstream.Buffered() == 0 {
		if err := b.sandbox.Flush(); err != nil {
			return 0, err
		}
	}
	return b.ReadCloser.Read(p)
}

// handshake runs c's TLS handshake within tlsHandshakeTimeout.
func handshake(c *tls.Conn) error {
	ctx, cancel := context.WithTimeout(context.Background(), tlsHandshakeTimeout)
	defer cancel()
	return c.HandshakeContext(ctx)
}

// writeStatus writes a short text response that ends the connection.
func writeStatus(w io.Writer, code int, msg string) {
	msg += "\n"
	fmt.Fprintf(w, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		code, http.StatusText(code), len(msg), msg)
}

// idleConn is a net.Conn whose every Read and Write must make progress
// within idle.
type idleConn struct {
	net.Conn
	idle time.Duration
}

func (c *idleConn) Read(b []byte) (int, error) {
	c.Conn.SetReadDeadline(time.Now().Add(c.idle))
	return c.Conn.Read(b)
}

func (c *idleConn) Write(b []byte) (int, error) {
	c.Conn.SetWriteDeadline(time.Now().Add(c.idle))
	return c.Conn.Write(b)
}
