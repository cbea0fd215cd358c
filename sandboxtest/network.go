package sandboxtest

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
)

// NetworkFactory returns a new sandbox of the level whose code reaches the
// network through p only (the level's Config.Egress = p), or has no network
// at all when p is nil. The suite closes the sandbox, then p. The sandbox's
// runs need a wall time of about a minute (one of them is a pip install)
// and the default memory; a factory that cannot build the sandbox calls
// t.Fatal.
type NetworkFactory func(t *testing.T, p *egress.Proxy) moat.Sandbox

// NetworkOptions say where a level's sandbox sees things. The zero value
// fits a level whose sandbox has its own network namespace holding only
// loopback (subprocess, container, gvisor).
type NetworkOptions struct {
	// ProxyURL is the proxy as the code sees it in HTTP_PROXY and the
	// other variables. Zero means "http://127.0.0.1:3128" (egress.Port on
	// the sandbox's own loopback); microvm's is its guestfwd address,
	// "http://10.0.2.100:3128".
	ProxyURL string
	// HostAddrs are addresses at which the sandbox would reach the host's
	// loopback if its confinement failed, besides 127.0.0.1 (microvm:
	// "10.0.2.2", the host of QEMU's user network). The suite aims its
	// direct connections and UDP at the upstreams' ports there too.
	HostAddrs []string
	// DNS are the name servers the level's network would offer if it were
	// not restricted (microvm: "10.0.2.3", QEMU's user-network DNS). The
	// suite always queries 127.0.0.53 and 127.0.0.1 as well. The suite
	// aims only at loopback and at the addresses given here, so that a
	// sandbox that fails to confine its traffic sends nothing off the
	// machine.
	DNS []string
}

// TestNetwork is the conformance suite of the egress proxy at one level:
// a level calls it from its own test with a factory that builds the level
// with Egress set,
//
//	func TestNetwork(t *testing.T) {
//		sandboxtest.TestNetwork(t, func(t *testing.T, p *egress.Proxy) moat.Sandbox {
//			sb, err := subprocess.New(subprocess.Config{Egress: p, Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}})
//			if err != nil {
//				t.Fatal(err)
//			}
//			return sb
//		}, sandboxtest.NetworkOptions{})
//	}
//
// It stands up the internet on 127.0.0.1: an HTTP and an HTTPS server
// (with a certificate of a CA of its own, given to the proxy as
// egress.Config.Roots and not trusted by the sandbox) that record every
// connection, ClientHello and request, a PEP 503 package index serving a
// wheel it builds, and a UDP listener. The names api.test, other.test,
// pypi.test and unlisted.test are pinned to 127.0.0.1 with
// Network.Resolve; api.test, other.test and pypi.test are allowed at the
// servers' ports, and so are localhost, rebind.test and rebind6.test,
// which Resolve does not pin and the suite's own name server (the proxy's
// egress.Config.Resolver) answers with loopback addresses, so that the
// proxy must refuse them. The secret API_KEY goes to api.test.
//
// Then, one subtest each, judged by what the upstreams recorded and by the
// proxy's notes in Result.Notes, the code's own report only where the host
// cannot see (a lookup that failed inside):
//
//   - Env: HTTP_PROXY, HTTPS_PROXY and their lower-case forms are
//     ProxyURL, there is no NO_PROXY or ALL_PROXY, and SSL_CERT_FILE,
//     REQUESTS_CA_BUNDLE and PIP_CERT name a file holding exactly the
//     proxy's CABundle.
//   - Allowed: http and https to api.test and other.test (urllib through
//     the environment's proxy; the default SSL context, which honours
//     SSL_CERT_FILE) arrive at the upstreams, and the notes say allowed.
//   - Refused/Unlisted, Refused/DirectIP, Refused/LoopbackName: a name not
//     allowed (though pinned), 127.0.0.1 and ::1 themselves, and names
//     allowed but not pinned that the proxy's resolver answers with
//     loopback (localhost, rebind.test: 127.0.0.1; rebind6.test:
//     ::ffff:127.0.0.1): refused, the notes say denied, and the upstreams
//     saw no connection at all.
//   - Refused/DNS: getaddrinfo of the allowed names fails; DNS queries over
//     UDP and TCP to 127.0.0.53, 127.0.0.1 and DNS get no answer; UDP to
//     the suite's listener (at 127.0.0.1 and HostAddrs) never arrives.
//   - Refused/Direct: TCP straight to the upstreams' ports, bypassing the
//     proxy, fails, and the upstreams saw nothing.
//   - Refused/SNI: a CONNECT to one allowed name whose ClientHello names
//     another (or none) is refused: no request arrives and the TLS
//     upstream never sees a ClientHello.
//   - Secret/ToItsHost: the placeholder (moat-secret-...) the code holds
//     in API_KEY, sent in Authorization and X-Api-Key to api.test over
//     https, arrives as the real value; in the URL (the secret is
//     headers-only) it stays the placeholder; over plain http it is
//     refused (403) and reaches nothing (moat puts secrets only into TLS);
//     the real value is nowhere in the run's environment, output or notes.
//   - Secret/Elsewhere: the placeholder sent to other.test (allowed, not
//     the secret's host) never arrives there as the real value.
//   - Pip: python3 -m pip install --index-url http://pypi.test:PORT/simple/
//     --target DIR of the suite's wheel succeeds and the module imports,
//     printing a value that is only in the wheel; the index saw the
//     wheel fetched. A missing pip is a failure.
//   - Refused/Lookups: the proxy's resolver was asked only for names the
//     policy allows and Resolve does not pin.
//   - NoNetwork: a sandbox built with a nil proxy has no proxy variables,
//     cannot connect to ProxyURL's address, the upstreams' ports or the
//     UDP listener, and the upstreams saw nothing.
//
// Finally, the real value of the secret is nowhere in the proxy's logs or
// metrics, and no child process or goroutine is left. Like Run, it must
// not be called from a parallel test.
func TestNetwork(t *testing.T, factory NetworkFactory, opts NetworkOptions) {
	t.Helper()
	if opts.ProxyURL == "" {
		opts.ProxyURL = "http://127.0.0.1:" + strconv.Itoa(egress.Port)
	}
	s := &suite{}
	s.goroutinesBefore = goroutineIDs()
	kids, err := childrenOf(procRoot, os.Getpid())
	if err != nil {
		t.Fatalf("sandboxtest: list the test process's children: %v", err)
	}
	s.childrenBefore = make(map[int]bool)
	for _, p := range kids {
		s.childrenBefore[p.PID] = true
	}

	// Everything the suite starts is stopped in t.Run("NoLeaks") below,
	// before the goroutines are counted; the cleanups are for a suite that
	// ended early.
	lab := newNetLab(t, opts)
	sb := factory(t, lab.proxy)
	if sb == nil {
		t.Fatal("the network factory returned a nil sandbox")
	}
	closeSandbox := sync.OnceFunc(func() {
		if err := closeWithin(sb, 2*time.Minute); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	t.Cleanup(closeSandbox)
	lab.sb = sb

	// The subtests share one sandbox, which may keep processes ready
	// between runs: what is left is checked once, after it is closed.
	for _, c := range networkCases {
		t.Run(c.name, func(t *testing.T) { c.fn(t, lab) })
	}
	t.Run("NoNetwork", func(t *testing.T) { testNoNetwork(t, lab, factory) })
	t.Run("NoLeaks", func(t *testing.T) {
		closeSandbox()
		lab.close()
		lab.checkSecretKept(t)
		s.noLeaks(t)
	})
}

// closeWithin closes sb, giving up after d.
func closeWithin(sb moat.Sandbox, d time.Duration) error {
	done := make(chan error, 1)
	go func() { done <- sb.Close() }()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		return fmt.Errorf("did not return within %v; abandoned", d)
	}
}

// netLab is the state of one TestNetwork: the upstreams, the proxy and the
// sandbox under test.
type netLab struct {
	opts     NetworkOptions
	up       *upstreams
	dns      *nameServer // the proxy's resolver
	proxy    *egress.Proxy
	sb       moat.Sandbox
	secret   string // the real value of API_KEY, which no run may see
	logs     *syncBuffer
	registry *prometheus.Registry
	close    func() // stops the proxy and the upstreams; idempotent
}

// rebinding are the names the proxy's name server answers: allowed, not
// pinned by Resolve, and resolving to loopback, which the proxy must
// refuse. Every other name it is asked does not exist.
var rebinding = map[string]netip.Addr{
	"localhost":    netip.MustParseAddr("127.0.0.1"),
	"rebind.test":  netip.MustParseAddr("127.0.0.1"),
	"rebind6.test": netip.MustParseAddr("::ffff:127.0.0.1"),
}

// The secret the suite configures.
const (
	secretName = "API_KEY"
	secretEnv  = "MOAT_SANDBOXTEST_API_KEY"
)

func newNetLab(t *testing.T, opts NetworkOptions) *netLab {
	t.Helper()
	up := newUpstreams(t)
	hp, tp := strconv.Itoa(port(up.http)), strconv.Itoa(port(up.https))
	n := &netLab{opts: opts, up: up, secret: token("real-secret-"), logs: &syncBuffer{}, registry: prometheus.NewRegistry()}
	n.dns = newNameServer(t, rebinding)
	env := map[string]string{secretEnv: n.secret}
	e := moat.Egress{
		Network: &moat.Network{
			Allow: []string{
				"api.test:" + hp, "api.test:" + tp,
				"other.test:" + hp, "other.test:" + tp,
				"pypi.test:" + hp,
				"localhost:" + hp, "localhost:" + tp,
				"rebind.test:" + hp, "rebind.test:" + tp,
				"rebind6.test:" + hp, "rebind6.test:" + tp,
			},
			Resolve: map[string]string{
				"api.test": "127.0.0.1", "other.test": "127.0.0.1",
				"pypi.test": "127.0.0.1", "unlisted.test": "127.0.0.1",
			},
		},
		Secrets: map[string]moat.Secret{
			secretName: {FromEnv: secretEnv, Hosts: []string{"api.test:" + hp, "api.test:" + tp}},
		},
	}
	if err := e.Validate(); err != nil {
		t.Fatalf("sandboxtest: the suite's policy: %v", err)
	}
	p, err := egress.New(egress.Config{
		Egress:     e,
		Getenv:     func(k string) string { return env[k] },
		CADir:      t.TempDir(),
		Roots:      up.roots,
		Resolver:   n.dns.resolver(),
		Logger:     slog.New(slog.NewTextHandler(n.logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Registerer: n.registry,
	})
	if err != nil {
		t.Fatalf("sandboxtest: egress.New: %v", err)
	}
	n.proxy = p
	n.close = sync.OnceFunc(func() {
		if err := p.Close(); err != nil {
			t.Errorf("egress proxy Close: %v", err)
		}
		up.http.Close()
		up.https.Close()
		up.udp.Close()
		n.dns.conn.Close()
	})
	t.Cleanup(n.close)
	return n
}

// config is what the code of every probe gets as CFG.
func (n *netLab) config() map[string]any {
	return map[string]any{
		"http":      port(n.up.http),
		"https":     port(n.up.https),
		"udp":       n.up.udpPort(),
		"ca":        string(n.up.caPEM),
		"proxy":     n.opts.ProxyURL,
		"hostAddrs": append([]string{"127.0.0.1"}, n.opts.HostAddrs...),
		"dns":       append([]string{"127.0.0.53", "127.0.0.1"}, n.opts.DNS...),
		"pkg":       n.up.pkg.Name,
		"secret":    secretName,
	}
}

// probe runs the prelude and body in sb and returns the Result and the
// JSON object the code printed on its last line (nil if none parsed).
// It fails t if Run errors or the code did not finish.
func (n *netLab) probe(t *testing.T, sb moat.Sandbox, body string) (*moat.Result, map[string]any) {
	t.Helper()
	cfg, err := json.Marshal(n.config())
	if err != nil {
		t.Fatal(err)
	}
	code := fmt.Sprintf("CFG = __import__('json').loads(%q)\n%s\n%s\n", cfg, pyPrelude, body)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	res, err := sb.Run(ctx, moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run returned an error, want a Result: %v", err)
	}
	if res.Level != sb.Level() {
		t.Errorf("Result.Level = %q, want %q", res.Level, sb.Level())
	}
	if bytes.Contains(res.Stdout, []byte(n.secret)) || bytes.Contains(res.Stderr, []byte(n.secret)) {
		t.Errorf("the secret's real value is in the run's output")
	}
	for _, note := range res.Notes {
		if strings.Contains(note, n.secret) {
			t.Errorf("the secret's real value is in the run's notes")
		}
	}
	var out map[string]any
	if res.ExitCode != 0 || res.Reason != moat.ReasonNone ||
		json.Unmarshal([]byte(lastLine(res.Stdout)), &out) != nil {
		t.Fatalf("the probe did not finish: %s", describe(res))
	}
	t.Logf("notes: %q", res.Notes)
	return res, out
}

// decided reports whether the run's notes record decision ("allowed" or
// "denied") for host: one "; "-separated part of a "network:" note names
// both.
func decided(res *moat.Result, decision, host string) bool {
	for _, note := range res.Notes {
		rest, ok := strings.CutPrefix(note, "network:")
		if !ok {
			continue
		}
		for _, part := range strings.Split(rest, ";") {
			if strings.Contains(part, decision) && strings.Contains(part, host) {
				return true
			}
		}
	}
	return false
}

// pyPrelude holds the helpers of the probes. Each returns a dict saying
// what happened; none raises.
const pyPrelude = `
import json, os, socket, ssl, struct, sys, urllib.parse, urllib.request, urllib.error

def err(e):
    return "%s: %s" % (type(e).__name__, e)

def test_ctx():
    # The default context (SSL_CERT_FILE) plus the upstreams' own CA, for a
    # host the proxy tunnels untouched.
    c = ssl.create_default_context()
    c.load_verify_locations(cadata=CFG["ca"])
    return c

def fetch(url, headers=None, ctx=None):
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
            return {"status": r.status, "body": r.read(200).decode("latin-1")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": err(e)}
    except Exception as e:
        return {"status": 0, "error": err(e)}

def tcp(host, port):
    try:
        s = socket.create_connection((host, port), timeout=3)
        s.close()
        return "connected"
    except Exception as e:
        return err(e)

def dns_query(name):
    q = struct.pack(">HHHHHH", 0x6d74, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode()
    return q + b"\x00" + struct.pack(">HH", 1, 1)

def udp(host, port, payload):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(1)
        s.connect((host, port))
        s.send(payload)
        try:
            data = s.recv(512)
            return "reply of %d bytes" % len(data)
        except Exception as e:
            return "no reply: " + err(e)
        finally:
            s.close()
    except Exception as e:
        return "not sent: " + err(e)

def dns_tcp(host):
    try:
        s = socket.create_connection((host, 53), timeout=2)
    except Exception as e:
        return "not connected: " + err(e)
    try:
        q = dns_query("api.test")
        s.sendall(struct.pack(">H", len(q)) + q)
        s.settimeout(2)
        return "reply of %d bytes" % len(s.recv(512))
    except Exception as e:
        return "connected, no reply: " + err(e)
    finally:
        s.close()

def front(connect_host, sni, path):
    # CONNECT connect_host, then a ClientHello naming sni (None: no SNI).
    pu = urllib.parse.urlsplit(os.environ.get("HTTPS_PROXY") or CFG["proxy"])
    out = {"connect": connect_host, "sni": sni}
    try:
        s = socket.create_connection((pu.hostname, pu.port), timeout=10)
    except Exception as e:
        out["error"] = "proxy: " + err(e)
        return out
    try:
        s.sendall(("CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (connect_host, connect_host)).encode())
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 8192:
            c = s.recv(1)
            if not c:
                break
            head += c
        out["status_line"] = head.split(b"\r\n")[0].decode("latin-1")
        if out["status_line"].split(" ")[1:2] != ["200"]:
            return out
        c = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        c.check_hostname = False
        c.verify_mode = ssl.CERT_NONE
        t = c.wrap_socket(s, server_hostname=sni)
        out["handshake"] = True
        host = sni or connect_host.split(":")[0]
        t.sendall(("GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (path, host)).encode())
        out["response"] = t.recv(200).decode("latin-1")
    except Exception as e:
        out["error"] = err(e)
    finally:
        s.close()
    return out
`

// A netCase is one subtest of TestNetwork run against the sandbox with the
// proxy.
type netCase struct {
	name string
	fn   func(t *testing.T, n *netLab)
}

var networkCases = []netCase{
	{"Env", testNetEnv},
	{"Allowed", testNetAllowed},
	{"Refused/Unlisted", testNetUnlisted},
	{"Refused/DirectIP", testNetDirectIP},
	{"Refused/LoopbackName", testNetLoopbackName},
	{"Refused/DNS", testNetDNS},
	{"Refused/Direct", testNetDirect},
	{"Refused/SNI", testNetSNI},
	{"Secret/ToItsHost", testNetSecret},
	{"Secret/Elsewhere", testNetSecretElsewhere},
	{"Pip", testNetPip},
	{"Refused/Lookups", testNetLookups},
}

func testNetEnv(t *testing.T, n *netLab) {
	_, out := n.probe(t, n.sb, `
import hashlib
env = dict(os.environ)
files = {}
for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT"):
    try:
        files[k] = hashlib.sha256(open(env.get(k, ""), "rb").read()).hexdigest()
    except Exception as e:
        files[k] = err(e)
print(json.dumps({"env": env, "files": files}))
`)
	env, _ := out["env"].(map[string]any)
	for _, k := range []string{"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"} {
		if got, _ := env[k].(string); got != n.opts.ProxyURL {
			t.Errorf("%s = %q, want %q", k, got, n.opts.ProxyURL)
		}
	}
	for _, k := range []string{"NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"} {
		if v, ok := env[k]; ok {
			t.Errorf("%s = %q, want it unset: every request goes through the proxy", k, v)
		}
	}
	bundle := n.proxy.CABundle()
	if len(bundle) == 0 || !bytes.Contains(bundle, []byte("BEGIN CERTIFICATE")) {
		t.Errorf("the proxy's CABundle is empty or holds no certificate (%d bytes)", len(bundle))
	}
	sum := sha256.Sum256(bundle)
	files, _ := out["files"].(map[string]any)
	for _, k := range []string{"SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT"} {
		if got := files[k]; got != hex.EncodeToString(sum[:]) {
			t.Errorf("the file %s names (%q) is not the proxy's CABundle: %v", k, env[k], got)
		}
	}
	if ph, _ := env[secretName].(string); !strings.HasPrefix(ph, "moat-secret-") {
		t.Errorf("%s = %q in the run, want a moat-secret- placeholder", secretName, ph)
	}
}

func testNetAllowed(t *testing.T, n *netLab) {
	path := "/" + token("allowed")
	m := n.up.mark()
	res, out := n.probe(t, n.sb, fmt.Sprintf(`
h, s, p = CFG["http"], CFG["https"], %q
print(json.dumps({
    "api_http": fetch("http://api.test:%%d%%s" %% (h, p)),
    "api_https": fetch("https://api.test:%%d%%s" %% (s, p)),
    "other_http": fetch("http://other.test:%%d%%s" %% (h, p)),
    "other_https": fetch("https://other.test:%%d%%s" %% (s, p), ctx=test_ctx()),
}))
`, path))
	got := n.up.since(m)
	for _, want := range []struct{ key, server, host string }{
		{"api_http", "http", "api.test"},
		{"api_https", "https", "api.test"},
		{"other_http", "http", "other.test"},
		{"other_https", "https", "other.test"},
	} {
		hp := want.host + ":" + strconv.Itoa(port(n.up.http))
		if want.server == "https" {
			hp = want.host + ":" + strconv.Itoa(port(n.up.https))
		}
		if !slices.ContainsFunc(got.requests, func(r request) bool {
			return r.Server == want.server && r.Host == hp && r.URI == path
		}) {
			t.Errorf("%s: the %s upstream did not get GET %s from %s (the code saw %v); the upstreams saw %s",
				want.key, want.server, path, hp, out[want.key], got)
		}
		if r, _ := out[want.key].(map[string]any); r["status"] != float64(200) {
			t.Errorf("%s: the code got %v, want status 200", want.key, r)
		}
		if !decided(res, "allowed", want.host) {
			t.Errorf("%s: the notes do not say %s was allowed: %q", want.key, want.host, res.Notes)
		}
	}
	// The proxy terminated TLS for api.test (the secret's host), so the
	// code trusted it through SSL_CERT_FILE alone; it tunnelled
	// other.test, whose own certificate reached the code.
	if !slices.Contains(got.hellos, "other.test") {
		t.Errorf("the TLS upstream never got a ClientHello for other.test: %q", got.hellos)
	}
}

// refused runs body, which fetches things that must be refused, and checks
// that the code got no 200, the upstreams saw nothing and the notes say
// denied for each host of deniedHosts.
func (n *netLab) refused(t *testing.T, body string, deniedHosts ...string) {
	t.Helper()
	m := n.up.mark()
	res, out := n.probe(t, n.sb, body)
	got := n.up.since(m)
	if !got.nothing() {
		t.Errorf("the upstreams saw %s, want nothing", got)
	}
	for k, v := range out {
		if r, ok := v.(map[string]any); ok && r["status"] == float64(200) {
			t.Errorf("%s: the code got through: %v", k, r)
		}
	}
	for _, h := range deniedHosts {
		if !decided(res, "denied", h) {
			t.Errorf("the notes do not say %s was denied: %q", h, res.Notes)
		}
	}
}

func testNetUnlisted(t *testing.T, n *netLab) {
	n.refused(t, `
print(json.dumps({
    "http": fetch("http://unlisted.test:%d/unlisted" % CFG["http"]),
    "https": fetch("https://unlisted.test:%d/unlisted" % CFG["https"], ctx=test_ctx()),
}))
`, "unlisted.test")
}

func testNetDirectIP(t *testing.T, n *netLab) {
	n.refused(t, `
print(json.dumps({
    "http": fetch("http://127.0.0.1:%d/ip" % CFG["http"]),
    "https": fetch("https://127.0.0.1:%d/ip" % CFG["https"], ctx=test_ctx()),
    "http6": fetch("http://[::1]:%d/ip" % CFG["http"]),
}))
`, "127.0.0.1")
}

func testNetLoopbackName(t *testing.T, n *netLab) {
	n.refused(t, `
res = {}
for name in ("localhost", "rebind.test", "rebind6.test"):
    res[name + " http"] = fetch("http://%s:%d/rebind" % (name, CFG["http"]))
    res[name + " https"] = fetch("https://%s:%d/rebind" % (name, CFG["https"]), ctx=test_ctx())
print(json.dumps(res))
`, "localhost", "rebind.test", "rebind6.test")
	if asked := n.dns.names(); !slices.Contains(asked, "rebind.test") {
		t.Errorf("the proxy never asked its resolver (egress.Config.Resolver) for rebind.test: it asked %q", asked)
	}
}

// testNetLookups checks, after every probe, that the proxy looked up only
// names the policy allows and Resolve does not pin: never unlisted.test,
// the names the code gave its own resolver, or a pinned name.
func testNetLookups(t *testing.T, n *netLab) {
	for _, name := range n.dns.names() {
		if _, ok := rebinding[name]; !ok {
			t.Errorf("the proxy looked up %q, which the policy does not allow or Resolve pins", name)
		}
	}
}

func testNetDNS(t *testing.T, n *netLab) {
	m := n.up.mark()
	_, out := n.probe(t, n.sb, `
res = {"getaddrinfo": {}, "udp53": {}, "tcp53": {}, "udp": {}}
for name in ("api.test", "pypi.test", "other.test"):
    try:
        res["getaddrinfo"][name] = "resolved: %s" % socket.getaddrinfo(name, 80)
    except Exception as e:
        res["getaddrinfo"][name] = "failed: " + err(e)
for a in CFG["dns"]:
    res["udp53"][a] = udp(a, 53, dns_query("api.test"))
    res["tcp53"][a] = dns_tcp(a)
for a in CFG["hostAddrs"]:
    res["udp"][a] = udp(a, CFG["udp"], dns_query("api.test"))
print(json.dumps(res))
`)
	if got := n.up.since(m); !got.nothing() {
		t.Errorf("the upstreams saw %s, want nothing (the UDP listener at 127.0.0.1:%d must hear nothing)", got, n.up.udpPort())
	}
	for name, v := range asMap(out["getaddrinfo"]) {
		if s, _ := v.(string); !strings.HasPrefix(s, "failed") {
			t.Errorf("getaddrinfo(%q) in the sandbox: %s, want a failure", name, s)
		}
	}
	for _, k := range []string{"udp53", "tcp53", "udp"} {
		for a, v := range asMap(out[k]) {
			if s, _ := v.(string); strings.HasPrefix(s, "reply") {
				t.Errorf("%s to %s: %s, want no answer", k, a, s)
			}
		}
	}
}

func asMap(v any) map[string]any {
	m, _ := v.(map[string]any)
	return m
}

func testNetDirect(t *testing.T, n *netLab) {
	m := n.up.mark()
	_, out := n.probe(t, n.sb, `
res = {}
for a in CFG["hostAddrs"]:
    for p in (CFG["http"], CFG["https"]):
        res["%s:%d" % (a, p)] = tcp(a, p)
print(json.dumps(res))
`)
	if got := n.up.since(m); !got.nothing() {
		t.Errorf("the upstreams saw %s, want nothing: the code reached them around the proxy", got)
	}
	for a, v := range out {
		if v == "connected" {
			t.Errorf("a direct TCP connection to %s succeeded", a)
		}
	}
}

func testNetSNI(t *testing.T, n *netLab) {
	path := "/" + token("fronted")
	tp := strconv.Itoa(port(n.up.https))
	m := n.up.mark()
	_, out := n.probe(t, n.sb, fmt.Sprintf(`
p = %q
print(json.dumps({
    "tunnel_as_api": front("other.test:%%d" %% CFG["https"], "api.test", p),
    "intercept_as_other": front("api.test:%%d" %% CFG["https"], "other.test", p),
    "tunnel_no_sni": front("other.test:%%d" %% CFG["https"], None, p),
    "intercept_no_sni": front("api.test:%%d" %% CFG["https"], None, p),
}))
`, path))
	got := n.up.since(m)
	if len(got.hellos) > 0 || len(got.requests) > 0 {
		t.Errorf("a CONNECT whose ClientHello named another host (or none) reached the TLS upstream on port %s: %s", tp, got)
	}
	for k, v := range out {
		r := asMap(v)
		if resp, _ := r["response"].(string); strings.HasPrefix(resp, "HTTP/1.1 200") || strings.HasPrefix(resp, "HTTP/1.0 200") {
			t.Errorf("%s: the fronted request got through: %v", k, r)
		}
	}
}

func testNetSecret(t *testing.T, n *netLab) {
	path := "/" + token("secret")
	m := n.up.mark()
	res, out := n.probe(t, n.sb, fmt.Sprintf(`
ph = os.environ.get(CFG["secret"], "")
hd = {"Authorization": "Bearer " + ph, "X-Api-Key": ph}
p = %q
print(json.dumps({
    "placeholder": ph,
    "env": dict(os.environ),
    "http": fetch("http://api.test:%%d%%s" %% (CFG["http"], p), hd),
    "https": fetch("https://api.test:%%d%%s" %% (CFG["https"], p), hd),
    "in_url": fetch("https://api.test:%%d%%s?key=%%s" %% (CFG["https"], p, urllib.parse.quote(ph)), hd),
}))
`, path))
	got := n.up.since(m)
	ph, _ := out["placeholder"].(string)
	if !strings.HasPrefix(ph, "moat-secret-") {
		t.Fatalf("%s in the run is %q, want a moat-secret- placeholder", secretName, ph)
	}
	for k, v := range asMap(out["env"]) {
		if s, _ := v.(string); strings.Contains(s, n.secret) {
			t.Errorf("the run's environment holds the real value in %s", k)
		}
	}
	// moat puts secrets only into TLS: the plain-http request that
	// carries the placeholder is refused, and reaches nothing.
	if r := asMap(out["http"]); fmt.Sprint(r["status"]) != "403" {
		t.Errorf("http: the placeholder over plain http got %v, want 403", r)
	}
	for _, r := range got.requests {
		if r.Host == "api.test:"+strconv.Itoa(port(n.up.http)) {
			t.Errorf("http: api.test's plain upstream got %s, though the request carried a secret's placeholder", r)
		}
	}
	want := map[string]string{
		"https":  "api.test:" + strconv.Itoa(port(n.up.https)) + path,
		"in_url": "api.test:" + strconv.Itoa(port(n.up.https)) + path + "?key=" + url.QueryEscape(ph),
	}
	for k, hostURI := range want {
		i := slices.IndexFunc(got.requests, func(r request) bool { return r.Host+r.URI == hostURI })
		if i < 0 {
			t.Errorf("%s: api.test's upstream did not get %s (the code saw %v); the upstreams saw %s", k, hostURI, out[k], got)
			continue
		}
		r := got.requests[i]
		if a := r.Header.Get("Authorization"); a != "Bearer "+n.secret {
			t.Errorf("%s: Authorization at api.test's upstream is %s, want the real value", k, which(a, n.secret, ph))
		}
		if a := r.Header.Get("X-Api-Key"); a != n.secret {
			t.Errorf("%s: X-Api-Key at api.test's upstream is %s, want the real value", k, which(a, n.secret, ph))
		}
	}
	// The secret is headers only (InURL false): the URL goes as sent.
	for _, r := range got.requests {
		if strings.Contains(r.URI, n.secret) {
			t.Errorf("the real value was put in the URL %s, though the secret is not InURL", r)
		}
	}
	if !decided(res, "allowed", "api.test") {
		t.Errorf("the notes do not say api.test was allowed: %q", res.Notes)
	}
}

// which names a header's value for a failure message without printing a
// real secret.
func which(v, secret, placeholder string) string {
	switch {
	case v == "":
		return "missing"
	case strings.Contains(v, secret):
		return "a value holding the real one, but not as sent"
	case strings.Contains(v, placeholder):
		return fmt.Sprintf("%q (the placeholder)", v)
	}
	return fmt.Sprintf("%q", v)
}

func testNetSecretElsewhere(t *testing.T, n *netLab) {
	path := "/" + token("elsewhere")
	m := n.up.mark()
	n.probe(t, n.sb, fmt.Sprintf(`
ph = os.environ.get(CFG["secret"], "")
hd = {"Authorization": "Bearer " + ph, "X-Api-Key": ph}
p = %q + "?key=" + urllib.parse.quote(ph)
print(json.dumps({
    "http": fetch("http://other.test:%%d%%s" %% (CFG["http"], p), hd),
    "https": fetch("https://other.test:%%d%%s" %% (CFG["https"], p), hd, ctx=test_ctx()),
}))
`, path))
	got := n.up.since(m)
	for _, r := range got.requests {
		if strings.Contains(r.URI, n.secret) {
			t.Errorf("the real value reached %s in the URL", r)
		}
		for k, vs := range r.Header {
			for _, v := range vs {
				if strings.Contains(v, n.secret) {
					t.Errorf("the real value reached %s in %s", r, k)
				}
			}
		}
	}
	// The request may go as sent or be refused; if it went, it went to
	// other.test only.
	for _, r := range got.requests {
		if !strings.HasPrefix(r.Host, "other.test:") {
			t.Errorf("a request meant for other.test arrived for %s", r)
		}
	}
	t.Logf("other.test's upstream saw %s", got)
}

func testNetPip(t *testing.T, n *netLab) {
	m := n.up.mark()
	res, out := n.probe(t, n.sb, `
import importlib.util, subprocess
if importlib.util.find_spec("pip") is None:
    print(json.dumps({"nopip": sys.executable}))
    sys.exit(0)
target = os.path.join(os.getcwd(), "site-" + str(os.getpid()))
cmd = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
       "--no-input", "--index-url", "http://pypi.test:%d/simple/" % CFG["http"],
       "--trusted-host", "pypi.test", "--target", target, CFG["pkg"]]
p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
res = {"rc": p.returncode, "out": p.stdout[-2000:], "err": p.stderr[-2000:]}
if p.returncode == 0:
    sys.path.insert(0, target)
    try:
        res["value"] = importlib.import_module(CFG["pkg"]).VALUE
    except Exception as e:
        res["import"] = err(e)
print(json.dumps(res))
`)
	if py, ok := out["nopip"]; ok {
		t.Fatalf("pip is not installed for the sandbox's python3 (%v): the level's image must have python3-pip (image.DefaultPackages; the subprocess level uses the host's, which scripts/setup.sh installs)", py)
	}
	got := n.up.since(m)
	if rc := out["rc"]; rc != float64(0) {
		t.Fatalf("pip install exited %v; the index saw %s\nstdout: %s\nstderr: %s", rc, got, out["out"], out["err"])
	}
	if out["value"] != n.up.pkg.Value {
		t.Errorf("after pip install, %s.VALUE = %v (import: %v), want the value built into the wheel", n.up.pkg.Name, out["value"], out["import"])
	}
	wheel := "/packages/" + n.up.pkg.WheelName()
	if !slices.ContainsFunc(got.requests, func(r request) bool {
		return r.Host == "pypi.test:"+strconv.Itoa(port(n.up.http)) && r.URI == wheel
	}) {
		t.Errorf("the index never served %s to pypi.test: it saw %s", wheel, got)
	}
	if !decided(res, "allowed", "pypi.test") {
		t.Errorf("the notes do not say pypi.test was allowed: %q", res.Notes)
	}
}

func testNoNetwork(t *testing.T, n *netLab, factory NetworkFactory) {
	sb := factory(t, nil)
	if sb == nil {
		t.Fatal("the network factory returned a nil sandbox")
	}
	defer func() {
		if err := closeWithin(sb, 2*time.Minute); err != nil {
			t.Errorf("Close: %v", err)
		}
	}()
	pu, err := url.Parse(n.opts.ProxyURL)
	if err != nil {
		t.Fatalf("sandboxtest: NetworkOptions.ProxyURL: %v", err)
	}
	proxyPort, _ := strconv.Atoi(pu.Port())
	// Where the proxy's address is the host's loopback, stand in for it:
	// a sandbox that shares the host's network would reach this listener.
	var standIn *net.TCPListener
	var standInConns int
	var mu sync.Mutex
	if ip := net.ParseIP(pu.Hostname()); ip != nil && ip.IsLoopback() {
		if l, err := net.ListenTCP("tcp4", &net.TCPAddr{IP: ip, Port: proxyPort}); err == nil {
			standIn = l
			done := make(chan struct{})
			go func() {
				defer close(done)
				for {
					c, err := l.AcceptTCP()
					if err != nil {
						return
					}
					mu.Lock()
					standInConns++
					mu.Unlock()
					c.Close()
				}
			}()
			defer func() { l.Close(); <-done }()
		} else {
			t.Logf("the host's %s is taken (%v): judging by the upstreams and the code's report", pu.Host, err)
		}
	}
	m := n.up.mark()
	_, out := n.probe(t, sb, fmt.Sprintf(`
res = {"env": {k: v for k, v in os.environ.items() if "proxy" in k.lower() or k == CFG["secret"]}}
res["proxy"] = tcp(%q, %d)
for a in CFG["hostAddrs"]:
    res["tcp " + a] = tcp(a, CFG["http"])
    res["udp " + a] = udp(a, CFG["udp"], b"moat")
res["fetch"] = fetch("http://api.test:%%d/nonet" %% CFG["http"])
print(json.dumps(res))
`, pu.Hostname(), proxyPort))
	if got := n.up.since(m); !got.nothing() {
		t.Errorf("without a proxy the upstreams saw %s, want nothing", got)
	}
	if standIn != nil {
		mu.Lock()
		c := standInConns
		mu.Unlock()
		if c > 0 {
			t.Errorf("without a proxy the code connected %d times to the host's %s", c, pu.Host)
		}
	}
	if env := asMap(out["env"]); len(env) > 0 {
		t.Errorf("without a proxy the run's environment holds %v", env)
	}
	if out["proxy"] == "connected" {
		t.Errorf("without a proxy the code connected to %s", pu.Host)
	}
	for k, v := range out {
		if s, ok := v.(string); ok && (s == "connected" || strings.HasPrefix(s, "reply")) {
			t.Errorf("without a proxy, %s: %s", k, s)
		}
	}
	if r := asMap(out["fetch"]); r["status"] == float64(200) {
		t.Errorf("without a proxy a fetch of api.test got through: %v", r)
	}
}

// checkSecretKept fails t if the secret's real value is in the proxy's logs
// or metrics. Call it once the proxy is closed.
func (n *netLab) checkSecretKept(t *testing.T) {
	if strings.Contains(n.logs.String(), n.secret) {
		t.Errorf("the secret's real value is in the proxy's logs")
	}
	mfs, err := n.registry.Gather()
	if err != nil {
		t.Errorf("gather the proxy's metrics: %v", err)
	}
	for _, mf := range mfs {
		if strings.Contains(mf.String(), n.secret) {
			t.Errorf("the secret's real value is in the proxy's metric %s", mf.GetName())
		}
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent writes, for a logger.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
