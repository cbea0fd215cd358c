package container_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/internal/egress"
)

// fakeRuns stands in for the egress proxy's runs: each serves its
// listeners by writing a token of its own and reading one line back, so
// that the test sees from the host which connections reached moat's
// listener, and counts its notes and closes.
type fakeRuns struct {
	mu   sync.Mutex
	runs []*fakeRun
}

func (f *fakeRuns) new(*egress.Proxy) moatcontainer.EgressRun {
	r := &fakeRun{token: rand.Text()}
	f.mu.Lock()
	f.runs = append(f.runs, r)
	f.mu.Unlock()
	return r
}

func (f *fakeRuns) all() []*fakeRun {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*fakeRun(nil), f.runs...)
}

// byToken finds the run whose token is tok.
func (f *fakeRuns) byToken(tok string) *fakeRun {
	for _, r := range f.all() {
		if r.token == tok {
			return r
		}
	}
	return nil
}

type fakeRun struct {
	token  string
	notes  atomic.Int64
	closed atomic.Bool
	served atomic.Int64 // listeners given to Serve

	mu    sync.Mutex
	lines []string // what the code sent on each connection
	ls    []net.Listener
	wg    sync.WaitGroup
}

func (r *fakeRun) Env(proxyURL, caFile string) []string {
	return []string{"HTTP_PROXY=" + proxyURL, "MOAT_TEST_CA=" + caFile, "MOAT_TEST_TOKEN=" + r.token}
}

func (r *fakeRun) Serve(l net.Listener) error {
	r.served.Add(1)
	r.mu.Lock()
	r.ls = append(r.ls, l)
	r.wg.Add(1)
	r.mu.Unlock()
	defer r.wg.Done()
	defer l.Close()
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(c, "%s\n", r.token)
		line, _ := bufio.NewReader(c).ReadString('\n')
		c.Close()
		r.mu.Lock()
		r.lines = append(r.lines, strings.TrimSpace(line))
		r.mu.Unlock()
	}
}

func (r *fakeRun) Notes() []string {
	n := r.notes.Add(1)
	return []string{fmt.Sprintf("network: fake note %d of %s", n, r.token)}
}

func (r *fakeRun) Close() {
	r.closed.Store(true)
	r.mu.Lock()
	for _, l := range r.ls {
		l.Close()
	}
	r.mu.Unlock()
	r.wg.Wait()
}

func (r *fakeRun) sent() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.lines...)
}

// netProbe is Python that tries every way out of the container a network
// could give and prints one JSON object. hello is sent on the connection
// to 127.0.0.1:3128, after the line read from it.
func netProbe(hello string) string {
	return `import errno, json, os, socket, hashlib
r = {}
def name(e):
    if isinstance(e, socket.timeout):
        return "timeout"
    if isinstance(e, socket.gaierror):
        return "gaierror"
    return errno.errorcode.get(e.errno, str(e.errno))
def probe(key, f):
    try:
        v = f()
        r[key] = "ok" if v is None else v
    except OSError as e:
        r[key] = name(e)
def connect(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    try:
        s.connect(addr)
    finally:
        s.close()
def proxy():
    s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
    f = s.makefile("rwb")
    line = f.readline().decode().strip()
    f.write(b"` + hello + `\n")
    f.flush()
    s.close()
    return "read " + line
DNS_QUERY = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03com\x00\x00\x01\x00\x01"
ECHO_REQUEST = b"\x08\x00\x00\x00\x00\x00\x00\x01moat"
def udp(addr, proto=0, payload=DNS_QUERY):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, proto)
    s.settimeout(1)
    try:
        s.sendto(payload, addr)
        s.recvfrom(512)
        return "reply"
    finally:
        s.close()
def sock(*a):
    socket.socket(*a).close()
def ca():
    b = open(os.environ.get("MOAT_TEST_CA", "/etc/moat/ca.pem"), "rb").read()
    return hashlib.sha256(b).hexdigest()
def ca_write(path):
    open(path, "ab").close()
r["env"] = {k: os.environ.get(k, "") for k in ("HTTP_PROXY", "MOAT_TEST_CA", "MOAT_TEST_TOKEN")}
probe("proxy", proxy)
probe("loopback_other_port", lambda: connect(socket.AF_INET, ("127.0.0.1", 3129)))
probe("loopback_6", lambda: connect(socket.AF_INET6, ("::1", 3128)))
probe("other_addr", lambda: connect(socket.AF_INET, ("192.0.2.1", 80)))
probe("other_addr_6", lambda: connect(socket.AF_INET6, ("2001:db8::1", 80)))
probe("any_addr", lambda: connect(socket.AF_INET, ("0.0.0.0", 3129)))
probe("dns", lambda: socket.getaddrinfo("example.com", 80) and None)
probe("udp_dns_loopback", lambda: udp(("127.0.0.1", 53)))
probe("udp_other_addr", lambda: udp(("192.0.2.1", 53)))
probe("udp_proxy_port", lambda: udp(("127.0.0.1", 3128)))
probe("icmp_other_addr", lambda: udp(("192.0.2.1", 0), proto=socket.IPPROTO_ICMP, payload=ECHO_REQUEST))
probe("icmp_loopback", lambda: udp(("127.0.0.1", 0), proto=socket.IPPROTO_ICMP, payload=ECHO_REQUEST))
probe("raw", lambda: sock(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
probe("vsock", lambda: sock(40, socket.SOCK_STREAM))
probe("netlink", lambda: sock(16, socket.SOCK_RAW, 0))
probe("packet", lambda: sock(17, socket.SOCK_RAW, 0))
probe("interfaces", lambda: ",".join(sorted(os.listdir("/sys/class/net"))))
probe("routes", lambda: str(len(open("/proc/net/route").read().splitlines()) - 1))
probe("resolv_conf", lambda: open("/etc/resolv.conf").read())
probe("ca", ca)
probe("ca_write", lambda: ca_write("/etc/moat/ca.pem"))
probe("trust_store_write", lambda: ca_write("/etc/ssl/certs/ca-certificates.crt"))
print(json.dumps(r))
`
}

// netResult is what netProbe printed.
type netResult map[string]any

func (r netResult) s(k string) string { v, _ := r[k].(string); return v }

func parseNet(t *testing.T, where string, res *moat.Result, err error) netResult {
	t.Helper()
	if err != nil {
		t.Fatalf("%s: %v", where, err)
	}
	var r netResult
	if res.ExitCode != 0 || json.Unmarshal(res.Stdout, &r) != nil {
		t.Fatalf("%s: the probe failed (exit %d, %s): stdout %q stderr %q", where, res.ExitCode, res.Reason, res.Stdout, res.Stderr)
	}
	return r
}

// checkConfined checks that a probe with moat's listener in place reached
// it and nothing else.
func checkConfined(t *testing.T, where string, r netResult, bundle []byte) {
	t.Helper()
	want := map[string][]string{
		"loopback_other_port": {"ECONNREFUSED"},
		"loopback_6":          {"ECONNREFUSED", "EADDRNOTAVAIL", "ENETUNREACH"},
		"other_addr":          {"ENETUNREACH"},
		"other_addr_6":        {"ENETUNREACH", "EADDRNOTAVAIL"},
		"any_addr":            {"ECONNREFUSED"}, // 0.0.0.0 is the container's own loopback
		"dns":                 {"gaierror"},
		"udp_dns_loopback":    {"ECONNREFUSED", "timeout"},
		"udp_other_addr":      {"ENETUNREACH"},
		"udp_proxy_port":      {"ECONNREFUSED", "timeout"},
		"icmp_other_addr":     {"ENETUNREACH"},
		"icmp_loopback":       {"reply"}, // the positive control: ICMP works, on the loopback
		"raw":                 {"EPERM"},
		"vsock":               {"EAFNOSUPPORT"},
		"netlink":             {"EAFNOSUPPORT"},
		"packet":              {"EAFNOSUPPORT"},
		"interfaces":          {"lo"},
		"routes":              {"0"},
		"resolv_conf":         {"ENOENT", ""}, // no name server: glibc's fallback is 127.0.0.1:53
		"ca_write":            {"EROFS", "EACCES"},
		"trust_store_write":   {"EROFS", "EACCES"},
	}
	for k, vs := range want {
		if got := r.s(k); !contains(vs, got) {
			t.Errorf("%s: %s: %q, want one of %q", where, k, got, vs)
		}
	}
	sum := sha256.Sum256(bundle)
	if got := r.s("ca"); got != hex.EncodeToString(sum[:]) {
		t.Errorf("%s: the CA bundle in the container has digest %s, want the proxy's %x", where, got, sum)
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

// newProxy is an egress proxy for an allowlist no test reaches.
func newProxy(t *testing.T) *egress.Proxy {
	t.Helper()
	p, err := egress.New(egress.Config{
		Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}, Resolve: map[string]string{"pypi.test": "127.0.0.1"}}},
		CADir:  t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// TestNetworkPlacement runs the network probe in runs of a Sandbox with an
// egress proxy: each run's code reaches moat's listener at 127.0.0.1:3128
// (the host sees its connection and what it sent) and nothing else (no
// other address, no other port, no DNS, no UDP reply, no raw, vsock,
// netlink or packet socket, only the loopback); each run has a run of the
// proxy of its own, whose environment it gets, whose notes are in its
// result, and which is closed once the run is over. A Sandbox without a
// proxy has no network at all: the same probe cannot even make an inet
// socket.
func TestNetworkPlacement(t *testing.T) {
	needEngine(t)
	fakes := &fakeRuns{}
	restore := moatcontainer.SetEgressRuns(fakes.new)
	defer restore()
	p := newProxy(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Egress: p, Warm: 1})
	if err != nil {
		t.Fatalf("New with an egress proxy: %v", err)
	}
	if d := sb.Describe(); !strings.Contains(d, "egress proxy") || !strings.Contains(d, "127.0.0.1:3128") {
		t.Errorf("Describe with an egress proxy: %q", d)
	}
	seen := map[string]bool{}
	for i := range 2 {
		hello := "hello-" + rand.Text()
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(netProbe(hello))})
		where := fmt.Sprintf("run %d", i)
		r := parseNet(t, where, res, err)
		t.Logf("%s: %v; notes %q", where, r, res.Notes)
		env, _ := r["env"].(map[string]any)
		tok, _ := env["MOAT_TEST_TOKEN"].(string)
		fr := fakes.byToken(tok)
		if fr == nil || seen[tok] {
			t.Fatalf("%s: the code's environment %v names no egress run of its own", where, env)
		}
		seen[tok] = true
		if env["HTTP_PROXY"] != "http://127.0.0.1:3128" || env["MOAT_TEST_CA"] != "/etc/moat/ca.pem" {
			t.Errorf("%s: the proxy's environment: %v", where, env)
		}
		// Judged from the host: the listener moat placed got the code's
		// line, and the code read the run's token from it.
		if sent := fr.sent(); len(sent) != 1 || sent[0] != hello {
			t.Errorf("%s: moat's listener got %q, want the code's %q", where, sent, hello)
		}
		if got := r.s("proxy"); got != "read "+tok {
			t.Errorf("%s: the code's connection to 127.0.0.1:3128: %q, want it to read the run's token", where, got)
		}
		checkConfined(t, where, r, p.CABundle())
		note := fmt.Sprintf("network: fake note 1 of %s", tok)
		if !contains(res.Notes, note) {
			t.Errorf("%s: the result's notes %q lack the run's egress notes %q", where, res.Notes, note)
		}
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	// Every run of the proxy (the warm containers' too) is closed once its
	// container is discarded.
	for _, fr := range fakes.all() {
		if !fr.closed.Load() {
			t.Errorf("an egress run (token %s, served %d) is not closed after Close", fr.token, fr.served.Load())
		}
	}
	if left := leftovers(); len(left) > 0 {
		t.Errorf("containers left: %v", left)
	}

	// Without a proxy, nothing changes: no egress run, no inet socket.
	before := len(fakes.all())
	plain, err := moatcontainer.New(moatcontainer.Config{Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if d := plain.Describe(); !strings.Contains(d, "network: none") {
		t.Errorf("Describe without a proxy: %q", d)
	}
	res, err := plain.Run(context.Background(), moat.Request{Code: []byte(netProbe("x"))})
	r := parseNet(t, "no proxy", res, err)
	t.Logf("no proxy: %v", r)
	for _, k := range []string{"proxy", "loopback_other_port", "other_addr", "udp_dns_loopback", "vsock"} {
		if got := r.s(k); got != "EAFNOSUPPORT" {
			t.Errorf("no proxy: %s: %q, want EAFNOSUPPORT (no inet socket at all)", k, got)
		}
	}
	if got := r.s("interfaces"); got != "lo" {
		t.Errorf("no proxy: interfaces %q", got)
	}
	if got := r.s("ca"); got != "ENOENT" {
		t.Errorf("no proxy: a CA bundle is mounted: %q", got)
	}
	if n := len(fakes.all()); n != before {
		t.Errorf("a Sandbox without a proxy made %d egress runs", n-before)
	}
}

// TestNetworkSession runs the network probe twice in a session with an
// egress proxy, with and without a live interpreter: one egress run for
// the session's life, reached by each run and nothing else, its notes in
// each run's result, closed with the session.
func TestNetworkSession(t *testing.T) {
	needEngine(t)
	fakes := &fakeRuns{}
	restore := moatcontainer.SetEgressRuns(fakes.new)
	defer restore()
	p := newProxy(t)
	sb, err := moatcontainer.New(moatcontainer.Config{Egress: p, Warm: -1})
	if err != nil {
		t.Fatalf("New with an egress proxy: %v", err)
	}
	defer sb.Close()
	for _, interp := range []bool{false, true} {
		before := len(fakes.all())
		ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: interp})
		if err != nil {
			t.Fatalf("NewSession: %v", err)
		}
		runs := fakes.all()[before:]
		if len(runs) != 1 {
			t.Fatalf("interpreter %v: the session made %d egress runs, want 1", interp, len(runs))
		}
		fr := runs[0]
		var hellos []string
		for i := range 2 {
			where := fmt.Sprintf("interpreter %v, run %d", interp, i)
			hello := "hello-" + rand.Text()
			hellos = append(hellos, hello)
			res, err := ss.Run(context.Background(), moat.Request{Code: []byte(netProbe(hello))})
			r := parseNet(t, where, res, err)
			if env, _ := r["env"].(map[string]any); env["MOAT_TEST_TOKEN"] != fr.token || env["HTTP_PROXY"] != "http://127.0.0.1:3128" {
				t.Errorf("%s: the code's environment %v is not the session's egress run's", where, env)
			}
			if got := r.s("proxy"); got != "read "+fr.token {
				t.Errorf("%s: the code's connection to 127.0.0.1:3128: %q", where, got)
			}
			checkConfined(t, where, r, p.CABundle())
			note := fmt.Sprintf("network: fake note %d of %s", i+1, fr.token)
			if !contains(res.Notes, note) {
				t.Errorf("%s: the result's notes %q lack %q", where, res.Notes, note)
			}
		}
		if sent := fr.sent(); strings.Join(sent, ",") != strings.Join(hellos, ",") {
			t.Errorf("interpreter %v: moat's listener got %q, want %q", interp, sent, hellos)
		}
		if fr.closed.Load() {
			t.Errorf("interpreter %v: the egress run is closed before the session", interp)
		}
		if err := ss.Close(); err != nil {
			t.Fatal(err)
		}
		if !fr.closed.Load() {
			t.Errorf("interpreter %v: the egress run is not closed with the session", interp)
		}
	}
}

// TestNetworkCLIRefused: the docker CLI's path cannot place moat's
// listener, so it refuses a Config with a proxy.
func TestNetworkCLIRefused(t *testing.T) {
	needEngine(t)
	_, err := moatcontainer.CLIArgs(context.Background(), moatcontainer.Config{Egress: newProxy(t)})
	if err == nil || !strings.Contains(err.Error(), "egress") {
		t.Errorf("CLIArgs with an egress proxy: %v, want a refusal", err)
	}
}

// TestNetworkCheck: the doctor's details say how a Sandbox with a proxy
// confines its network, and the probe passes with the inet profile.
func TestNetworkCheck(t *testing.T) {
	needEngine(t)
	a := moatcontainer.Check(context.Background(), moatcontainer.Config{Egress: newProxy(t)})
	joined := strings.Join(a.Details, "\n")
	if !a.Available || !strings.Contains(joined, "network: only moat's egress proxy") || !strings.Contains(joined, "socket(AF_INET) ok") {
		t.Errorf("Check with an egress proxy: %+v", a)
	}
	a = moatcontainer.Check(context.Background(), moatcontainer.Config{})
	joined = strings.Join(a.Details, "\n")
	if !a.Available || !strings.Contains(joined, "network: none") || !strings.Contains(joined, "socket(AF_INET) EAFNOSUPPORT") {
		t.Errorf("Check without a proxy: %+v", a)
	}
}

// BenchmarkRunEgress times print(1) through the level with an egress
// proxy (its listener placed in each container), against BenchmarkRun.
func BenchmarkRunEgress(b *testing.B) {
	if err := prepareEngine(); err != nil {
		b.Skip(err)
	}
	p, err := egress.New(egress.Config{Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}}, CADir: b.TempDir()})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	sb, err := moatcontainer.New(moatcontainer.Config{Egress: p})
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	for b.Loop() {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)")})
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatal(res, err)
		}
	}
}
