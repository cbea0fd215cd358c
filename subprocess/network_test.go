package subprocess_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
	"github.com/moatsandbox/moat/subprocess"
)

// The network of a run with Config.Egress (network.go), tested with a
// stand-in for the proxy behind moat's listener (subprocess.ServeEgress):
// the code reaches that listener and nothing else, and without Egress it
// reaches nothing, as before.

// fakeEgress stands behind every egress listener in place of the proxy: it
// greets each connection with a line and closes it, counts them, and looks
// from the host side at the network namespace each listener lives in.
type fakeEgress struct {
	t        *testing.T
	accepted atomic.Int64
	served   atomic.Int64  // listeners handed to it
	ended    chan struct{} // one value per listener closed
	mu       sync.Mutex
	ns       []string // what is wrong with each listener's namespace
}

const greeting = "moat-egress"

func newFakeEgress(t *testing.T) *fakeEgress {
	f := &fakeEgress{t: t, ended: make(chan struct{}, 64)}
	restore := subprocess.ServeEgress(f.handle)
	t.Cleanup(restore) // registered first: runs after the sandbox's Close
	return f
}

func (f *fakeEgress) handle(l net.Listener) {
	f.served.Add(1)
	problems := inspectNamespace(l)
	f.mu.Lock()
	f.ns = append(f.ns, problems...)
	f.mu.Unlock()
	for {
		c, err := l.Accept()
		if err != nil {
			f.ended <- struct{}{}
			return
		}
		f.accepted.Add(1)
		fmt.Fprintln(c, greeting)
		c.Close()
	}
}

// waitEnded waits for n listeners to be closed.
func (f *fakeEgress) waitEnded(t *testing.T, n int) {
	t.Helper()
	for i := range n {
		select {
		case <-f.ended:
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d egress listeners still open", n-i, n)
		}
	}
}

func (f *fakeEgress) namespaceProblems() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.ns...)
}

// inspectNamespace enters the network namespace of l's socket on a thread
// of its own (which then dies with its goroutine) and lists what in it is
// more than a loopback holding l: another interface, an address other
// than 127.0.0.1/8 and ::1, a route of the main table, a listening TCP
// socket other than 127.0.0.1:3128, any UDP or raw socket.
func inspectNamespace(l net.Listener) []string {
	var nsfd int
	var ioErr error
	rc, err := l.(*net.TCPListener).SyscallConn()
	if err != nil {
		return []string{err.Error()}
	}
	rc.Control(func(fd uintptr) { nsfd, ioErr = unix.IoctlRetInt(int(fd), unix.SIOCGSKNS) })
	if ioErr != nil {
		return []string{"SIOCGSKNS: " + ioErr.Error()}
	}
	defer unix.Close(nsfd)
	out := make(chan []string, 1)
	go func() {
		// The thread goes back to the host's namespace and is unlocked
		// after: a thread that ended would take with it (Pdeathsig) the
		// helpers the runtime happened to start from it.
		runtime.LockOSThread()
		own, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			out <- []string{"own namespace: " + err.Error()}
			return
		}
		defer unix.Close(own)
		if err := unix.Setns(nsfd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			out <- []string{"setns: " + err.Error()}
			return
		}
		bad := namespaceProblems()
		if err := unix.Setns(own, unix.CLONE_NEWNET); err != nil {
			out <- append(bad, "setns back: "+err.Error()) // the thread stays locked and ends
			return
		}
		runtime.UnlockOSThread()
		out <- bad
	}()
	return <-out
}

// namespaceProblems lists what the calling thread's network namespace
// holds beyond a loopback with moat's listener.
func namespaceProblems() []string {
	var bad []string
	ifs, err := net.Interfaces()
	if err != nil {
		bad = append(bad, "interfaces: "+err.Error())
	}
	for _, ifc := range ifs {
		if ifc.Name != "lo" {
			bad = append(bad, "interface "+ifc.Name)
			continue
		}
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if s := a.String(); s != "127.0.0.1/8" && s != "::1/128" {
				bad = append(bad, "address "+s)
			}
		}
	}
	if len(ifs) != 1 || ifs[0].Flags&net.FlagUp == 0 {
		bad = append(bad, fmt.Sprintf("interfaces %v, want lo up", ifs))
	}
	if rows := procNet("route"); len(rows) != 0 {
		bad = append(bad, fmt.Sprintf("routes %q", rows))
	}
	for _, row := range procNet("tcp") {
		// local_address st: LISTEN is 0A; 3128 is 0C38.
		if len(row) > 3 && row[3] == "0A" && row[1] != "0100007F:0C38" {
			bad = append(bad, "tcp listener "+row[1])
		}
	}
	for _, name := range []string{"tcp6", "udp", "udp6", "raw", "raw6"} {
		if rows := procNet(name); len(rows) != 0 {
			bad = append(bad, fmt.Sprintf("%s sockets %q", name, rows))
		}
	}
	return bad
}

// procNet returns the rows (fields, header skipped) of the calling
// thread's /proc/thread-self/net/<name>; a missing file has none.
func procNet(name string) [][]string {
	f, err := os.Open("/proc/thread-self/net/" + name)
	if err != nil {
		return nil
	}
	defer f.Close()
	var rows [][]string
	sc := bufio.NewScanner(f)
	for first := true; sc.Scan(); first = false {
		if !first {
			rows = append(rows, strings.Fields(sc.Text()))
		}
	}
	return rows
}

// hostListeners stand on the host's loopback for what the code must not
// reach: a TCP listener and a UDP socket, each counting what arrives.
type hostListeners struct {
	tcpPort, udpPort int
	tcpAccepted      atomic.Int64
	udpReceived      atomic.Int64
}

func newHostListeners(t *testing.T) *hostListeners {
	h := &hostListeners{}
	tl, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ul, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tl.Close(); ul.Close() })
	h.tcpPort = tl.Addr().(*net.TCPAddr).Port
	h.udpPort = ul.LocalAddr().(*net.UDPAddr).Port
	go func() {
		for {
			c, err := tl.Accept()
			if err != nil {
				return
			}
			h.tcpAccepted.Add(1)
			c.Close()
		}
	}()
	go func() {
		buf := make([]byte, 512)
		for {
			if _, _, err := ul.ReadFrom(buf); err != nil {
				return
			}
			h.udpReceived.Add(1)
		}
	}()
	return h
}

// probeCode tries every way out it knows and prints one JSON object:
// probe name -> "ok:<what came back>" or "err:<errno name or exception>".
const probeCode = `
import errno, json, socket
res = {}
def why(e):
    if isinstance(e, OSError) and e.errno:
        return "err:" + errno.errorcode.get(e.errno, str(e.errno))
    return "err:" + type(e).__name__
def tcp(host, port, fam=socket.AF_INET):
    try:
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect((host, port))
        data = s.recv(64)
        s.close()
        return "ok:" + data.decode(errors="replace").strip()
    except Exception as e:
        return why(e)
def sock(fam, typ, proto=0):
    try:
        s = socket.socket(fam, typ, proto)
        s.close()
        return "ok:socket"
    except Exception as e:
        return why(e)
res["proxy"] = tcp("127.0.0.1", 3128)
res["proxy_other_loopback"] = tcp("127.0.0.2", 3128)
res["proxy_ipv6"] = tcp("::1", 3128, socket.AF_INET6)
res["host_tcp"] = tcp("127.0.0.1", HOST_TCP)
try:
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    u.settimeout(2)
    u.sendto(b"x", ("127.0.0.1", HOST_UDP))
    u.sendto(b"x", ("127.0.0.1", 53))
    res["udp"] = "ok:" + repr(u.recvfrom(64))
except Exception as e:
    res["udp"] = why(e)
try:
    res["dns"] = "ok:" + repr(socket.getaddrinfo("pypi.org", 443))
except Exception as e:
    res["dns"] = why(e)
try:
    res["dns_localhost"] = "ok:" + repr(socket.getaddrinfo("localhost", 3128))
except Exception as e:
    res["dns_localhost"] = why(e)
try:
    b = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    b.bind(("127.0.0.1", 0))
    b.listen(1)
    res["bind"] = "ok:" + repr(b.getsockname())
except Exception as e:
    res["bind"] = why(e)
res["icmp"] = sock(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)
res["raw"] = sock(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
res["vsock"] = sock(40, socket.SOCK_STREAM)  # AF_VSOCK
res["netlink"] = sock(socket.AF_NETLINK, socket.SOCK_RAW)
res["packet"] = sock(socket.AF_PACKET, socket.SOCK_RAW)
res["unix"] = sock(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    res["ca"] = "ok:%d" % len(open("CA_PATH", "rb").read())
except Exception as e:
    res["ca"] = why(e)
import os
res["env_ca"] = os.environ.get("SSL_CERT_FILE", "")
res["env_proxy"] = os.environ.get("HTTPS_PROXY", "")
print(json.dumps(res))
`

// code is the probe for the host's listeners and the CA bundle at caPath.
func (h *hostListeners) code(caPath string) string {
	r := strings.NewReplacer("HOST_TCP", strconv.Itoa(h.tcpPort), "HOST_UDP", strconv.Itoa(h.udpPort), "CA_PATH", caPath)
	return r.Replace(probeCode)
}

// caPath returns the CA bundle of this process's one open sandbox with
// Egress, from the host side, or "/nonexistent" when there is none.
func caPath(t *testing.T) string {
	t.Helper()
	id, err := owner.Self("/run/moat/owners")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := filepath.Glob("/run/moat/runs/" + id + "-ca-*.pem")
	switch len(m) {
	case 0:
		return "/nonexistent"
	case 1:
		st, err := os.Stat(m[0])
		if err != nil || st.Mode().Perm() != 0o644 {
			t.Errorf("CA bundle %s: %v, %v; want mode 0644", m[0], st.Mode(), err)
		}
		return m[0]
	}
	t.Fatalf("CA bundles of this process: %q, want one", m)
	return ""
}

// probe runs the probe code in sb and returns its answers.
func probe(t *testing.T, run func(string) *moat.Result, h *hostListeners) map[string]string {
	t.Helper()
	res := run(h.code(caPath(t)))
	if res.ExitCode != 0 || res.Reason != moat.ReasonNone {
		t.Fatalf("probe: exit %d reason %s\nstdout: %s\nstderr: %s", res.ExitCode, res.Reason, res.Stdout, res.Stderr)
	}
	var got map[string]string
	if err := json.Unmarshal(res.Stdout, &got); err != nil {
		t.Fatalf("probe output %q: %v", res.Stdout, err)
	}
	return got
}

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

func newEgressSandbox(t *testing.T, p *egress.Proxy) *subprocess.Sandbox {
	t.Helper()
	// No pool: a prepared instance serves its listener from before its
	// run, and the tests count one listener per run.
	sb, err := subprocess.New(subprocess.Config{Egress: p, Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

// wantOnlyProxy checks the probe's answers of a run with Egress: the
// proxy's listener answers, everything else is refused, each by the
// mechanism the level promises.
func wantOnlyProxy(t *testing.T, got map[string]string, p *egress.Proxy) {
	caLen := len(p.CABundle())
	t.Helper()
	exact := map[string]string{
		"proxy":      "ok:" + greeting,
		"proxy_ipv6": "err:EAFNOSUPPORT", // seccomp: IPv4 TCP only
		"udp":        "err:EAFNOSUPPORT", // seccomp: no UDP socket
		"bind":       "err:EPERM",        // seccomp: no bind
		"icmp":       "err:EAFNOSUPPORT",
		"raw":        "err:EAFNOSUPPORT",
		"vsock":      "err:EAFNOSUPPORT",
		"netlink":    "err:EAFNOSUPPORT",
		"packet":     "err:EAFNOSUPPORT",
		"unix":       "err:EPERM",
		"ca":         fmt.Sprintf("ok:%d", caLen), // readable by the run's uid, under Landlock
	}
	if p.NewRun().Env("http://127.0.0.1:3128", "/ca.pem") != nil { // not the stub's
		exact["env_ca"] = caPath(t)
		exact["env_proxy"] = "http://127.0.0.1:3128"
	}
	for k, want := range exact {
		if got[k] != want {
			t.Errorf("%s: got %q, want %q", k, got[k], want)
		}
	}
	// Refused, however: nothing listens there, Landlock allows port 3128
	// only, and there is no resolver.
	for _, k := range []string{"proxy_other_loopback", "host_tcp", "dns", "dns_localhost"} {
		if !strings.HasPrefix(got[k], "err:") {
			t.Errorf("%s: got %q, want a refusal", k, got[k])
		}
	}
}

// TestNetworkEgressReachesOnlyTheListener: with Egress, the code's one
// way out is moat's listener in its namespace; the namespace holds nothing
// else, seen from the host; the host's loopback services get nothing.
func TestNetworkEgressReachesOnlyTheListener(t *testing.T) {
	requireRoot(t)
	f := newFakeEgress(t)
	h := newHostListeners(t)
	p := newProxy(t)
	sb := newEgressSandbox(t, p)
	runIn := func(code string) *moat.Result { return run(t, sb, code) }

	const runs = 2
	for range runs {
		got := probe(t, runIn, h)
		wantOnlyProxy(t, got, p)
	}
	// One listener per run, closed by the end of its run.
	f.waitEnded(t, runs)
	if n := f.served.Load(); n != runs {
		t.Errorf("%d listeners served, want %d (one per run)", n, runs)
	}
	if n := f.accepted.Load(); n != runs {
		t.Errorf("moat's listener accepted %d connections, want %d (one per run)", n, runs)
	}
	if n := h.tcpAccepted.Load(); n != 0 {
		t.Errorf("the host's loopback TCP listener accepted %d connections from the sandbox", n)
	}
	if n := h.udpReceived.Load(); n != 0 {
		t.Errorf("the host's loopback UDP socket received %d datagrams from the sandbox", n)
	}
	for _, pr := range f.namespaceProblems() {
		t.Errorf("the run's network namespace holds more than moat's listener: %s", pr)
	}
}

// TestNetworkWithoutEgress: without Egress nothing changes: the code
// cannot make a socket, so neither 127.0.0.1:3128 nor anything else is
// reached, and no listener is placed.
func TestNetworkWithoutEgress(t *testing.T) {
	requireRoot(t)
	f := newFakeEgress(t)
	h := newHostListeners(t)
	sb := newStrict(t, moat.Limits{})
	t.Cleanup(func() { sb.Close() })
	got := probe(t, func(code string) *moat.Result { return run(t, sb, code) }, h)
	for k, v := range got {
		if strings.HasPrefix(v, "ok:") {
			t.Errorf("%s: got %q, want a refusal", k, v)
		}
	}
	for _, k := range []string{"proxy", "host_tcp", "udp", "vsock"} {
		if got[k] != "err:EAFNOSUPPORT" {
			t.Errorf("%s: got %q, want err:EAFNOSUPPORT (seccomp refuses every socket)", k, got[k])
		}
	}
	if n := f.served.Load(); n != 0 {
		t.Errorf("%d egress listeners served without Egress", n)
	}
	if n := h.tcpAccepted.Load() + h.udpReceived.Load(); n != 0 {
		t.Errorf("the host's loopback services got %d connections or datagrams", n)
	}
}

// TestNetworkEgressSessions: a session's runs reach the listener too, each
// through its own helper's (a plain session) or the live interpreter's,
// and nothing else; a plain run's listener ends with its run, the
// interpreter's with the session.
func TestNetworkEgressSessions(t *testing.T) {
	requireRoot(t)
	for _, interp := range []bool{false, true} {
		t.Run(fmt.Sprintf("interpreter=%v", interp), func(t *testing.T) {
			f := newFakeEgress(t)
			h := newHostListeners(t)
			p := newProxy(t)
			sb := newEgressSandbox(t, p)
			ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: interp})
			if err != nil {
				t.Fatal(err)
			}
			defer ss.Close()
			runIn := func(code string) *moat.Result {
				res, err := ss.Run(context.Background(), moat.Request{Code: []byte(code)})
				if err != nil {
					t.Fatal(err)
				}
				return res
			}
			const runs = 2
			for range runs {
				wantOnlyProxy(t, probe(t, runIn, h), p)
			}
			wantListeners := int64(runs)
			if interp {
				wantListeners = 1
			} else {
				f.waitEnded(t, runs) // each with its run
			}
			if n := f.served.Load(); n != wantListeners {
				t.Errorf("%d listeners served, want %d", n, wantListeners)
			}
			if err := ss.Close(); err != nil {
				t.Fatal(err)
			}
			if interp {
				f.waitEnded(t, 1) // with the session
			}
			if n := f.accepted.Load(); n != runs {
				t.Errorf("moat's listener accepted %d connections, want %d", n, runs)
			}
			if n := h.tcpAccepted.Load() + h.udpReceived.Load(); n != 0 {
				t.Errorf("the host's loopback services got %d connections or datagrams", n)
			}
			for _, pr := range f.namespaceProblems() {
				t.Errorf("the run's network namespace holds more than moat's listener: %s", pr)
			}
		})
	}
}

// TestNetworkEgressSetup: the doctor line says how the level confines, the
// CA bundle goes with the sandbox, and a network without strict hardening
// (the host's network) is refused.
func TestNetworkEgressSetup(t *testing.T) {
	requireRoot(t)
	p := newProxy(t)
	a := subprocess.Check(context.Background(), subprocess.Config{Egress: p})
	if !a.Available {
		t.Fatalf("Check: %s", a.Reason)
	}
	const line = "network: the run's own network namespace, loopback only, with moat's egress proxy listener placed in it"
	found := false
	for _, d := range a.Details {
		found = found || strings.HasPrefix(d, line)
	}
	if !found {
		t.Errorf("Check's details %q lack %q", a.Details, line)
	}

	sb, err := subprocess.New(subprocess.Config{Egress: p})
	if err != nil {
		t.Fatal(err)
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if left := leftovers(); len(left) != 0 {
		t.Errorf("left after Close: %v", left)
	}

	tut, err := subprocess.New(subprocess.Config{Egress: p, Hardening: subprocess.HardeningTutorial})
	if err == nil {
		tut.Close()
	}
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("New with Egress and tutorial hardening: %v, want an error wrapping ErrUnavailable", err)
	}
}

// The egress conformance suite, with the real proxy, at this level.
func TestNetworkSuite(t *testing.T) {
	sandboxtest.TestNetwork(t, func(t *testing.T, p *egress.Proxy) moat.Sandbox {
		sb, err := subprocess.New(subprocess.Config{Egress: p,
			Limits: moat.Limits{WallTime: moat.Duration(time.Minute), CPUTime: moat.Duration(time.Minute)}})
		if err != nil {
			t.Fatal(err)
		}
		return sb
	}, sandboxtest.NetworkOptions{})
}
