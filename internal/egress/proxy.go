package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/moatsandbox/moat"
)

// Limits of one run's proxy.
const (
	// maxConns is how many connections a run serves at once; one more is
	// answered 503 and closed.
	maxConns = 64
	// maxHead bounds a request's line and headers (431 past it).
	maxHead = 64 << 10
	// headTimeout bounds reading a request's line and headers.
	headTimeout = 10 * time.Second
	// maxLogLines is how many lines a run logs between two calls of Notes
	// (one run of a session each); one more says the rest are counted,
	// not logged. A sandbox that makes a million connections does not
	// flood moat's log: the metrics and the notes still count them all.
	maxLogLines = 100
)

// Proxy enforces one Config for every run of a sandbox. It is safe for
// concurrent use.
type Proxy struct {
	cfg      Config
	allow    []moat.HostPattern    // cfg.Egress.Network.Allow, parsed, same order
	resolve  map[string]netip.Addr // cfg.Egress.Network.Resolve, names normalized
	resolver *net.Resolver
	log      *slog.Logger
	secrets  *secretSet
	ca       *authority
	bundle   []byte
	roots    *x509.CertPool
	metrics  *metrics

	mu     sync.Mutex
	closed bool
	runs   map[*Run]struct{} // guarded by mu
}

// New checks cfg (the policy, each secret's variable, moat's CA, made on
// first use) and returns its proxy. Errors wrap moat.ErrInvalid for a bad
// policy or a missing secret.
func New(cfg Config) (*Proxy, error) {
	n := cfg.Egress.Network
	if n == nil {
		return nil, fmt.Errorf("egress: no network section: a sandbox without a network has no proxy: %w", moat.ErrInvalid)
	}
	if err := cfg.Egress.Validate(); err != nil {
		return nil, fmt.Errorf("egress: %w", err)
	}
	p := &Proxy{cfg: cfg, resolver: cfg.Resolver, log: cfg.Logger, roots: cfg.Roots, runs: map[*Run]struct{}{}}
	var err error
	if p.allow, err = parseAllow(n); err != nil {
		return nil, err
	}
	p.resolve = make(map[string]netip.Addr, len(n.Resolve))
	for name, addr := range n.Resolve {
		a, err := netip.ParseAddr(addr)
		if err != nil {
			return nil, fmt.Errorf("egress: network.resolve: %q: %w", name, moat.ErrInvalid)
		}
		p.resolve[strings.ToLower(strings.TrimSuffix(name, "."))] = a.Unmap()
	}
	if p.resolver == nil {
		p.resolver = net.DefaultResolver
	}
	if p.log == nil {
		p.log = slog.New(slog.DiscardHandler)
	}
	getenv := cfg.Getenv
	if getenv == nil {
		getenv = os.Getenv
	}
	if p.secrets, err = newSecretSet(cfg.Egress, getenv); err != nil {
		return nil, err
	}
	dir := cfg.CADir
	if dir == "" {
		dir = "/var/lib/moat/egress"
	}
	if p.ca, err = loadCA(dir); err != nil {
		return nil, err
	}
	if p.bundle, err = p.ca.bundle(); err != nil {
		return nil, err
	}
	if p.roots == nil {
		if p.roots, err = x509.SystemCertPool(); err != nil {
			return nil, fmt.Errorf("egress: the system's roots: %w: %w", err, moat.ErrUnavailable)
		}
	}
	if p.metrics, err = newMetrics(cfg.Registerer); err != nil {
		return nil, err
	}
	return p, nil
}

// CABundle is the PEM trust bundle a sandbox's code gets at the path its
// Env names: the host's system roots and moat's CA. It is the same for
// every run.
func (p *Proxy) CABundle() []byte { return append([]byte(nil), p.bundle...) }

// Describe says in one line what the proxy enforces, for doctor and bench:
// "egress: proxy allowing pypi.org, *.example.com:443; 1 secret".
func (p *Proxy) Describe() string {
	n := p.cfg.Egress.Network
	s := "egress: proxy allowing "
	if len(n.Allow) == 0 {
		s += "nothing"
	} else {
		s += strings.Join(n.Allow, ", ")
	}
	if len(n.Resolve) > 0 {
		s += "; " + plural(len(n.Resolve), "pinned name")
	}
	if k := len(p.cfg.Egress.Secrets); k > 0 {
		s += "; " + plural(k, "secret")
	}
	return s
}

// Close ends every run's connections; later runs fail. It may be called
// more than once.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	runs := make([]*Run, 0, len(p.runs))
	for r := range p.runs {
		runs = append(runs, r)
	}
	p.mu.Unlock()
	for _, r := range runs {
		r.Close()
	}
	return nil
}

// NewRun returns the proxy's state for one run or one session: the
// placeholders of the secrets (unique to it) and the tally of decisions.
// After the proxy's Close it returns a run that is already closed.
func (p *Proxy) NewRun() *Run {
	r := &Run{
		p:         p,
		secrets:   p.secrets.forRun(),
		done:      make(chan struct{}),
		listeners: map[net.Listener]struct{}{},
		conns:     map[net.Conn]struct{}{},
	}
	p.mu.Lock()
	closed := p.closed
	if !closed {
		p.runs[r] = struct{}{}
	}
	p.mu.Unlock()
	if closed {
		r.Close()
	}
	return r
}

// Run is the proxy for one run or session. It is safe for concurrent use.
//
// A forwarded http:// request is served one per connection: the response
// says Connection: close. A CONNECT tunnel carries TLS only: its first
// bytes must be a ClientHello whose server name is the CONNECT host.
type Run struct {
	p       *Proxy
	secrets *runSecrets
	tally   tally
	logged  atomic.Int64  // lines logged since the last Notes
	done    chan struct{} // closed by Close

	mu        sync.Mutex
	closed    bool                      // guarded by mu
	clients   int                       // connections from the sandbox being served; guarded by mu
	listeners map[net.Listener]struct{} // guarded by mu
	conns     map[net.Conn]struct{}     // both sides; guarded by mu
	wg        sync.WaitGroup            // Serve and ServeConn calls
}

// Env is the environment the sandbox's code gets: HTTP_PROXY, HTTPS_PROXY
// and their lower-case forms set to proxyURL (http://127.0.0.1:3128), no
// NO_PROXY; SSL_CERT_FILE, REQUESTS_CA_BUNDLE, PIP_CERT and CURL_CA_BUNDLE
// set to caFile, the path inside the sandbox where the level put CABundle;
// and each secret's variable set to its placeholder for this run.
func (r *Run) Env(proxyURL, caFile string) []string {
	env := []string{
		"HTTP_PROXY=" + proxyURL, "HTTPS_PROXY=" + proxyURL,
		"http_proxy=" + proxyURL, "https_proxy=" + proxyURL,
		"SSL_CERT_FILE=" + caFile, "REQUESTS_CA_BUNDLE=" + caFile,
		"PIP_CERT=" + caFile, "CURL_CA_BUNDLE=" + caFile,
	}
	return append(env, r.secrets.env()...)
}

// Serve serves the connections l accepts until l is closed or r is; it
// closes l on return. It returns nil when r was closed.
func (r *Run) Serve(l net.Listener) error {
	r.mu.Lock()
	if r.closed {
		r.mu.Unlock()
		l.Close()
		return fmt.Errorf("egress: serve: %w", moat.ErrClosed)
	}
	r.listeners[l] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	defer r.wg.Done()
	defer func() {
		r.mu.Lock()
		delete(r.listeners, l)
		r.mu.Unlock()
		l.Close()
	}()
	var backoff time.Duration
	for {
		c, err := l.Accept()
		if err != nil {
			if r.isClosed() {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				select {
				case <-time.After(backoff):
					continue
				case <-r.done:
					return nil
				}
			}
			return fmt.Errorf("egress: accept: %w", err)
		}
		backoff = 0
		go r.ServeConn(c)
	}
}

// ServeConn serves one connection from the sandbox and returns when it is
// done; it closes c. Past maxConns connections at once, c gets 503.
func (r *Run) ServeConn(c net.Conn) {
	r.mu.Lock()
	switch {
	case r.closed:
		r.mu.Unlock()
		c.Close()
		return
	case r.clients >= maxConns:
		r.mu.Unlock()
		r.tally.refused()
		r.log(slog.LevelWarn, "egress: connection refused: too many at once", "max", maxConns)
		c.SetDeadline(time.Now().Add(time.Second))
		refuse(c, http.StatusServiceUnavailable, fmt.Sprintf("too many connections at once (%d)", maxConns))
		c.Close()
		return
	}
	r.clients++
	r.conns[c] = struct{}{}
	r.wg.Add(1)
	r.mu.Unlock()
	defer func() {
		r.untrack(c)
		c.Close()
		r.mu.Lock()
		r.clients--
		r.mu.Unlock()
		r.wg.Done()
	}()
	r.serve(c)
}

// Notes returns the decisions since the last call, for the run's result:
// "network: allowed pypi.org:443 (3 connections); denied evil.example:443
// (not allowed)". Nil when there were none.
func (r *Run) Notes() []string {
	r.logged.Store(0)
	return r.tally.notes()
}

// log writes one line to the proxy's log unless the run already logged
// maxLogLines since the last Notes: the line past them says so, and later
// ones are dropped (the metrics and the notes still count them).
func (r *Run) log(level slog.Level, msg string, attrs ...any) {
	switch n := r.logged.Add(1); {
	case n <= maxLogLines:
		r.p.log.Log(context.Background(), level, msg, attrs...)
	case n == maxLogLines+1:
		r.p.log.Warn("egress: further decisions of this run are counted, not logged", "logged", maxLogLines)
	}
}

// Close ends the run's listeners and connections and waits for them. It
// may be called more than once.
func (r *Run) Close() {
	r.mu.Lock()
	if !r.closed {
		r.closed = true
		close(r.done)
	}
	for l := range r.listeners {
		l.Close()
	}
	for c := range r.conns {
		c.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
	r.p.mu.Lock()
	delete(r.p.runs, r)
	r.p.mu.Unlock()
}

func (r *Run) isClosed() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.closed
}

// track adds an upstream connection to those Close ends; false if r is
// closed.
func (r *Run) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *Run) untrack(c net.Conn) {
	r.mu.Lock()
	delete(r.conns, c)
	r.mu.Unlock()
}

// context is a context for one operation of at most timeout that ends
// early when r is closed.
func (r *Run) context(timeout time.Duration) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	go func() {
		select {
		case <-r.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	return ctx, cancel
}

// record logs, counts and tallies one decision. The log line names the
// destination, the decision and why: never a header, never a secret.
func (r *Run) record(d decision) {
	attrs := []any{"host", clean(d.host), "port", d.port}
	switch {
	case !d.allowed:
		attrs = append(attrs, "decision", "denied", "why", d.why)
	case d.failed != "":
		attrs = append(attrs, "decision", "allowed", "failed", d.failed)
	default:
		attrs = append(attrs, "decision", "allowed")
	}
	if d.pinned {
		attrs = append(attrs, "pinned", true)
	}
	r.log(slog.LevelInfo, "egress", attrs...)
	r.p.metrics.count(d)
	r.tally.add(d)
}

// serve reads one request from c and serves it: a CONNECT tunnel or one
// forwarded http:// request.
func (r *Run) serve(c net.Conn) {
	lr := &io.LimitedReader{R: c, N: maxHead}
	br := bufio.NewReader(lr)
	c.SetReadDeadline(time.Now().Add(headTimeout))
	req, err := http.ReadRequest(br)
	if err != nil {
		switch {
		case lr.N == 0:
			refuse(c, http.StatusRequestHeaderFieldsTooLarge, fmt.Sprintf("the request's head is over %d bytes", maxHead))
		case errors.Is(err, io.EOF) && br.Buffered() == 0:
			// Closed before a request: nothing to answer.
		default:
			refuse(c, http.StatusBadRequest, "not an HTTP/1.1 proxy request")
		}
		return
	}
	lr.N = 1 << 62
	c.SetReadDeadline(time.Time{})
	if req.Method == http.MethodConnect {
		r.connect(c, br, req)
		return
	}
	r.forward(c, req)
}

// forward serves one absolute-form http:// request: the policy's decision,
// the hop-by-hop and Proxy-* headers removed, the Host header set to the
// URL's host, no secret's value put in (checkPlain: a placeholder is
// refused), and the response streamed back with the secrets' values hidden
// in its status, header and trailer, and for a secret's host (asked for an
// unencoded response) in its body too.
func (r *Run) forward(c net.Conn, req *http.Request) {
	defer req.Body.Close()
	switch {
	case req.URL.Scheme == "https":
		refuse(c, http.StatusBadRequest, "https:// goes through CONNECT (set HTTPS_PROXY)")
		return
	case req.URL.Scheme != "http" || req.URL.Host == "":
		refuse(c, http.StatusBadRequest, "this is a proxy: ask for an absolute http:// URL or CONNECT host:port")
		return
	}
	host, port, err := splitHostPort(req.URL.Host, 80)
	if err != nil {
		refuse(c, http.StatusBadRequest, err.Error())
		return
	}
	d, ok := r.decideOrRefuse(c, host, port)
	if !ok {
		return
	}
	removeHopByHop(req.Header)
	req.Host = req.URL.Host
	req.URL.User = nil
	req.RequestURI = ""
	if refusal := r.secrets.checkPlain(req, d.host, port); refusal != "" {
		d.deny(refusal)
		r.record(d)
		refuse(c, http.StatusForbidden, "denied "+clean(d.String())+" ("+refusal+")")
		return
	}
	secretHost := r.secrets.intercepts(d.host, port)
	if secretHost {
		askIdentity(req.Header)
	}
	var up net.Conn
	if d.failed == "" {
		up, err = r.dial(d)
		if err != nil {
			d.failed = "unreachable"
		}
	}
	r.record(d)
	if d.failed != "" {
		refuse(c, http.StatusBadGateway, clean(d.String())+": "+d.failed)
		return
	}
	defer up.Close()
	req.Close = true // one request per upstream connection
	wrote := make(chan error, 1)
	go func() { wrote <- req.Write(up) }()
	defer func() {
		up.Close()
		c.Close()
		<-wrote
	}()
	ur := bufio.NewReader(up)
	for {
		resp, err := http.ReadResponse(ur, req)
		if err != nil {
			refuse(c, http.StatusBadGateway, clean(d.String())+": no response")
			return
		}
		r.secrets.hideResponse(resp) // a secret's host may echo the value
		if resp.StatusCode >= 100 && resp.StatusCode < 200 && resp.StatusCode != http.StatusSwitchingProtocols {
			resp.Write(c) // 100 Continue and the like: the final response follows
			continue
		}
		removeHopByHop(resp.Header)
		resp.ProtoMajor, resp.ProtoMinor, resp.Proto = 1, 1, "HTTP/1.1"
		resp.Close = true // one request per connection from the sandbox
		if secretHost {
			// No value went there over plain http, but the host may hold
			// one from a TLS request: its body is hidden as there.
			if refusal := r.secrets.hideBody(resp, req); refusal != "" {
				d.deny(refusal)
				r.record(d)
				refuse(c, http.StatusBadGateway, "denied "+clean(d.String())+" ("+refusal+")")
				return
			}
		}
		resp.Write(c)
		resp.Body.Close()
		return
	}
}

// decideOrRefuse is the policy's decision on host:port; a denial is
// recorded and answered with 403, and ok is false.
func (r *Run) decideOrRefuse(c net.Conn, host string, port int) (d decision, ok bool) {
	ctx, cancel := r.context(resolveTimeout)
	d = r.p.decide(ctx, host, port)
	cancel()
	if !d.allowed {
		r.record(d)
		refuse(c, http.StatusForbidden, "denied "+clean(d.String())+" ("+d.why+")")
		return d, false
	}
	return d, true
}

// connect serves a CONNECT tunnel: the policy's decision, 200, then the
// client's TLS ClientHello, whose server name must be the CONNECT host,
// then either a plain tunnel to the checked address or, for a secret's
// host, moat's TLS termination. br holds what the client sent after the
// request's head.
func (r *Run) connect(c net.Conn, br *bufio.Reader, req *http.Request) {
	host, port, err := splitHostPort(req.URL.Host, 0)
	if err != nil {
		refuse(c, http.StatusBadRequest, err.Error())
		return
	}
	d, ok := r.decideOrRefuse(c, host, port)
	if !ok {
		return
	}
	if d.failed != "" {
		r.record(d)
		refuse(c, http.StatusBadGateway, clean(d.String())+": "+d.failed)
		return
	}
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection Established\r\n\r\n"); err != nil {
		return
	}
	c.SetReadDeadline(time.Now().Add(helloTimeout))
	sni, hello, err := readClientHello(br)
	c.SetReadDeadline(time.Time{})
	switch {
	case err != nil:
		d.deny("not a TLS ClientHello")
	case sni == "":
		d.deny("no SNI")
	case !sameHost(sni, d.host):
		d.deny("SNI " + clean(sni))
	}
	if !d.allowed {
		r.record(d)
		return
	}
	if r.secrets.intercepts(d.host, port) {
		client := &replayConn{Conn: c, r: io.MultiReader(bytes.NewReader(hello), br)}
		r.record(d)
		dial := func() (net.Conn, error) { return r.dial(d) }
		decide := func(in *http.Request) string { return r.decideInner(d, in) }
		denied := func(why string) {
			d := d
			d.deny(why)
			r.record(d)
		}
		if err := r.secrets.serveMITM(client, d.host, port, dial, r.p.ca, r.p.roots, decide, denied); err != nil {
			r.log(slog.LevelInfo, "egress: intercepted tunnel ended", "host", d.host, "port", port, "err", err)
		}
		return
	}
	up, err := r.dial(d)
	if err != nil {
		d.failed = "unreachable"
	}
	r.record(d)
	if err != nil {
		return
	}
	defer up.Close()
	if _, err := up.Write(hello); err != nil {
		return
	}
	splice(&replayConn{Conn: c, r: br}, up)
}

// decideInner decides one request inside an intercepted tunnel to d (serveMITM
// rewrites again after it, which finds nothing left to replace): its
// Host must be the tunnel's host, and the secrets' rewrite (which puts the
// real values in for this host, and refuses a placeholder of another
// host's secret) must not refuse it. A refusal is recorded as a denial.
func (r *Run) decideInner(d decision, req *http.Request) string {
	why := ""
	host, port, err := splitHostPort(req.Host, d.port)
	if err != nil || !sameHost(host, d.host) || port != d.port {
		why = "Host " + clean(req.Host) + " in a tunnel to " + clean(d.String())
	} else {
		why = r.secrets.rewrite(req, d.host, d.port)
	}
	if why != "" {
		d.deny(why)
		r.record(d)
	}
	return why
}

// splice copies both ways between the sandbox's client and the upstream
// until both directions end, half-closing each side as the other ends.
func splice(client, up net.Conn) {
	done := make(chan struct{})
	go func() {
		io.Copy(up, client)
		closeWrite(up)
		close(done)
	}()
	io.Copy(client, up)
	closeWrite(client)
	<-done
}

// closeWrite half-closes c, or closes it when it cannot.
func closeWrite(c net.Conn) error {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return c.Close()
}

// replayConn is the sandbox's connection with the bytes the proxy already
// read (the ClientHello) put back in front.
type replayConn struct {
	net.Conn
	r io.Reader
}

func (c *replayConn) Read(p []byte) (int, error) { return c.r.Read(p) }
func (c *replayConn) CloseWrite() error          { return closeWrite(c.Conn) }

// hopByHop are the headers that belong to one connection, not the request.
var hopByHop = []string{"Connection", "Keep-Alive", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// removeHopByHop removes the hop-by-hop headers, those the Connection
// header names, and every Proxy-* header (Proxy-Authorization among them).
func removeHopByHop(h http.Header) {
	for _, v := range h["Connection"] {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				h.Del(name)
			}
		}
	}
	for _, name := range hopByHop {
		h.Del(name)
	}
	for name := range h {
		if strings.HasPrefix(name, "Proxy-") {
			delete(h, name)
		}
	}
}

// refuse answers the sandbox with status and a one-line reason, and the
// connection closes.
func refuse(c net.Conn, status int, why string) {
	body := "moat egress: " + why + "\n"
	fmt.Fprintf(c, "HTTP/1.1 %d %s\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s",
		status, http.StatusText(status), len(body), body)
}
