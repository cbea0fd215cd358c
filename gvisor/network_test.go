package gvisor_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/sandboxtest"
)

// newProxy returns an egress proxy whose policy allows one name, which the
// tests never resolve: what these tests check is where the sandbox's
// traffic can go, not the proxy's decisions.
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

// service is a TCP and a UDP service on a loopback address of the host,
// each answering "host-secret".
type service struct {
	Addr string `json:"addr"`
	TCP  int    `json:"tcp"`
	UDP  int    `json:"udp"`
}

// hostServices starts a service on 127.0.0.1 and one on ::1, and checks
// that the host reaches both.
func hostServices(t *testing.T) []service {
	t.Helper()
	var out []service
	for _, a := range []string{"127.0.0.1", "::1"} {
		ln, err := net.Listen("tcp", net.JoinHostPort(a, "0"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				c.Write([]byte("host-secret"))
				c.Close()
			}
		}()
		pc, err := net.ListenPacket("udp", net.JoinHostPort(a, "0"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { pc.Close() })
		go func() {
			buf := make([]byte, 64)
			for {
				_, from, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				pc.WriteTo([]byte("host-secret"), from)
			}
		}()
		s := service{a, ln.Addr().(*net.TCPAddr).Port, pc.LocalAddr().(*net.UDPAddr).Port}
		// The probe works: the host reaches both.
		c, err := net.DialTimeout("tcp", ln.Addr().String(), time.Second)
		if err != nil {
			t.Fatalf("the host cannot reach its own service on %s: %v", a, err)
		}
		c.Close()
		u, err := net.Dial("udp", pc.LocalAddr().String())
		if err != nil {
			t.Fatal(err)
		}
		u.SetDeadline(time.Now().Add(time.Second))
		u.Write([]byte("x"))
		buf := make([]byte, 64)
		if n, err := u.Read(buf); err != nil || string(buf[:n]) != "host-secret" {
			t.Fatalf("the host's UDP service on %s does not answer the host: %q, %v", a, buf[:n], err)
		}
		u.Close()
		out = append(out, s)
	}
	return out
}

// netProbe is the code that reports, as one JSON object, what it can
// reach: each TCP address it connects to (and what it reads there), each
// UDP address that answers, whether a name resolves, which socket families
// it may create, its network devices, its environment and the CA file.
const netProbe = `
import json, os, socket
SERVICES, CA = %s, %q
out = {"tcp": {}, "udp": {}, "sockets": {}}
def fam(a): return socket.AF_INET6 if ':' in a else socket.AF_INET
def tcp(a, port):
    try:
        s = socket.socket(fam(a), socket.SOCK_STREAM); s.settimeout(2)
        s.connect((a, port))
        try:
            s.settimeout(0.5); data = s.recv(64).decode(errors='replace')
        except OSError:
            data = ''
        s.close()
        return 'connected ' + data
    except OSError as e:
        return type(e).__name__
def udp(a, port):
    try:
        s = socket.socket(fam(a), socket.SOCK_DGRAM); s.settimeout(1)
        s.sendto(b'x', (a, port))
        return 'answered ' + s.recv(64).decode(errors='replace')
    except OSError as e:
        return type(e).__name__
out["tcp"]["127.0.0.1:3128"] = tcp('127.0.0.1', 3128)
out["tcp"]["::1:3128"] = tcp('::1', 3128)
for sv in SERVICES:
    for a in [sv['addr']] + (['0.0.0.0', '127.0.0.2'] if sv['addr'] == '127.0.0.1' else []):
        out["tcp"][f"{a}:{sv['tcp']}"] = tcp(a, sv['tcp'])
        out["udp"][f"{a}:{sv['udp']}"] = udp(a, sv['udp'])
for a in ['127.0.0.1', '127.0.0.53', '::1']:
    out["udp"][a + ':53'] = udp(a, 53)
try:
    out["dns"] = str(socket.getaddrinfo('pypi.test', 443))
except OSError as e:
    out["dns"] = type(e).__name__
for name, args in {"vsock": (40, socket.SOCK_STREAM, 0), "raw": (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP),
                   "raw6": (socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6), "packet": (17, socket.SOCK_RAW, 0),
                   "ping": (socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)}.items():
    try:
        socket.socket(*args).close(); out["sockets"][name] = 'created'
    except OSError as e:
        out["sockets"][name] = type(e).__name__
out["devices"] = sorted(l.split(':')[0].strip() for l in list(open('/proc/net/dev'))[2:])
out["env"] = sorted(os.environ)
try:
    out["ca"] = open(CA).read()
    open(CA, 'a')
    out["ca_writable"] = True
except OSError as e:
    out["ca_writable"] = type(e).__name__
print(json.dumps(out))
`

type netReport struct {
	TCP        map[string]string `json:"tcp"`
	UDP        map[string]string `json:"udp"`
	Sockets    map[string]string `json:"sockets"`
	DNS        string            `json:"dns"`
	Devices    []string          `json:"devices"`
	Env        []string          `json:"env"`
	CA         *string           `json:"ca"`
	CAWritable any               `json:"ca_writable"`
}

// probe runs netProbe with run and decodes its report.
func probe(t *testing.T, run func(context.Context, moat.Request) (*moat.Result, error), services []service) netReport {
	t.Helper()
	list, _ := json.Marshal(services)
	res, err := run(context.Background(), moat.Request{Code: fmt.Appendf(nil, netProbe, list, "/mnt/moat-ca.pem")})
	if err != nil {
		t.Fatal(err)
	}
	var rep netReport
	if err := json.Unmarshal(res.Stdout, &rep); err != nil || res.ExitCode != 0 {
		t.Fatalf("probe: exit %d, %v; stdout %q, stderr %q", res.ExitCode, err, res.Stdout, res.Stderr)
	}
	t.Logf("probe: %+v", rep)
	return rep
}

// checkNothingElse checks that nothing but the proxy's port answered: no
// host service over TCP or UDP on the host's loopback, no DNS, no
// socket family that routes elsewhere; but the sockets named in allowed.
func checkNothingElse(t *testing.T, rep netReport, allowed ...string) {
	t.Helper()
	for a, got := range rep.TCP {
		if a != "127.0.0.1:3128" && strings.HasPrefix(got, "connected") {
			t.Errorf("the code connected to %s: %s", a, got)
		}
	}
	for a, got := range rep.UDP {
		if strings.HasPrefix(got, "answered") {
			t.Errorf("UDP to %s was answered: %s", a, got)
		}
	}
	if rep.DNS != "gaierror" {
		t.Errorf("a name resolved: %s", rep.DNS)
	}
	for name, got := range rep.Sockets {
		if got == "created" && !slices.Contains(allowed, name) {
			t.Errorf("the code created a %s socket", name)
		}
	}
	if !slices.Equal(rep.Devices, []string{"lo"}) {
		t.Errorf("network devices %v, want lo only", rep.Devices)
	}
}

// TestNetworkEgressOnly checks where a sandbox with an egress proxy can
// go, in a one-shot run, a session and a session with a live interpreter:
// to 127.0.0.1:3128, where the proxy listens, and nowhere else; no host
// service on any of the host's addresses, no UDP answer, no name resolved,
// no vsock, raw or packet socket. The code's environment has what the
// proxy's Env gives, and the CA bundle is at /mnt/moat-ca.pem, readable
// and read-only. From the host: the sentry is in a network namespace that
// is not the host's and holds loopback only.
func TestNetworkEgressOnly(t *testing.T) {
	need(t, gvisor.Config{})
	p := newProxy(t)
	services := hostServices(t)
	state := t.TempDir()
	sb := newSandbox(t, gvisor.Config{Egress: p, StateDir: state})
	defer sb.Close()
	if d := sb.Describe(); !strings.Contains(d, "egress proxy only") {
		t.Errorf("Describe() = %q: want how the network is confined", d)
	}
	wantEnv := map[string]bool{}
	for _, kv := range p.NewRun().Env("http://127.0.0.1:3128", "/mnt/moat-ca.pem") {
		k, _, _ := strings.Cut(kv, "=")
		wantEnv[k] = true
	}
	check := func(t *testing.T, rep netReport) {
		if got := rep.TCP["127.0.0.1:3128"]; !strings.HasPrefix(got, "connected") {
			t.Errorf("the code cannot reach the proxy at 127.0.0.1:3128: %s", got)
		}
		checkNothingElse(t, rep)
		for k := range wantEnv {
			if !slices.Contains(rep.Env, k) {
				t.Errorf("the code's environment %v lacks %s", rep.Env, k)
			}
		}
		if rep.CA == nil || *rep.CA != string(p.CABundle()) {
			t.Errorf("the CA file holds %v, want the proxy's bundle (%d bytes)", rep.CA, len(p.CABundle()))
		}
		if rep.CAWritable != "OSError" && rep.CAWritable != "PermissionError" {
			t.Errorf("the CA file: writable %v, want it read-only", rep.CAWritable)
		}
	}

	// From the host, the sandbox booted ahead: the sentry's namespace.
	s := eventually(t, func() []sentry { return sentries(filepath.Join(state, "runsc")) }, 1)[0]
	own, _ := os.Readlink("/proc/self/ns/net")
	theirs, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/net", s.pid))
	if err != nil || theirs == own {
		t.Errorf("the sentry's network namespace %q (%v) is the host's %q", theirs, err, own)
	}
	dev, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/dev", s.pid))
	if lines := strings.Split(strings.TrimSpace(string(dev)), "\n"); err != nil || len(lines) != 3 || !strings.HasPrefix(strings.TrimSpace(lines[2]), "lo:") {
		t.Errorf("the sentry's network namespace has devices %q (%v), want lo only", dev, err)
	}
	if !strings.Contains(s.cmdline, "--network=host") {
		t.Errorf("the sentry runs %q, want --network=host", s.cmdline)
	}

	t.Run("run", func(t *testing.T) { check(t, probe(t, sb.Run, services)) })
	for _, opts := range []moat.SessionOptions{{}, {Interpreter: true}} {
		t.Run(fmt.Sprintf("session interpreter=%v", opts.Interpreter), func(t *testing.T) {
			ss, err := sb.NewSession(context.Background(), opts)
			if err != nil {
				t.Fatal(err)
			}
			defer ss.Close()
			// Twice: the session's one proxy run serves every run of it.
			check(t, probe(t, ss.Run, services))
			check(t, probe(t, ss.Run, services))
		})
	}
}

// TestNetworkNone checks that a sandbox without an egress proxy has no
// network, as before: nothing answers on 127.0.0.1:3128 or anywhere else,
// and no proxy's variables or CA file are there.
func TestNetworkNone(t *testing.T) {
	need(t, gvisor.Config{})
	services := hostServices(t)
	sb := newSandbox(t, gvisor.Config{})
	defer sb.Close()
	if d := sb.Describe(); !strings.Contains(d, "network: none") {
		t.Errorf("Describe() = %q: want how the network is confined", d)
	}
	rep := probe(t, sb.Run, services)
	if got := rep.TCP["127.0.0.1:3128"]; strings.HasPrefix(got, "connected") {
		t.Errorf("the code reached 127.0.0.1:3128 without a proxy: %s", got)
	}
	// gVisor's own stack has ICMP echo sockets, which reach its loopback
	// and nothing else (no other device); the host's refuses them.
	checkNothingElse(t, rep, "ping")
	if !slices.Equal(rep.Env, []string{"HOME", "LANG", "PATH"}) || rep.CA != nil {
		t.Errorf("environment %v, CA file %v: want neither the proxy's variables nor its CA", rep.Env, rep.CA)
	}
}

// TestNetworkCheckRootFS checks that a sandbox with an egress proxy is
// refused, with the reason, when the root filesystem has no /mnt to mount
// the CA bundle on (runsc would create it in the image), and accepted when
// it has one.
func TestNetworkCheckRootFS(t *testing.T) {
	need(t, gvisor.Config{})
	p := newProxy(t)
	root := t.TempDir()
	for _, d := range []string{"usr/bin", "work"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "usr/bin/python3"), nil, 0o755); err != nil {
		t.Fatal(err)
	}
	if a := gvisor.Check(context.Background(), gvisor.Config{RootFS: root}); !a.Available {
		t.Fatalf("without a proxy the fake root is refused: %s", a.Reason)
	}
	if a := gvisor.Check(context.Background(), gvisor.Config{RootFS: root, Egress: p}); a.Available || !strings.Contains(a.Reason, "CA bundle") {
		t.Errorf("with a proxy and no /mnt: available %v, reason %q; want refused, saying why", a.Available, a.Reason)
	}
	if err := os.Mkdir(filepath.Join(root, "mnt"), 0o755); err != nil {
		t.Fatal(err)
	}
	if a := gvisor.Check(context.Background(), gvisor.Config{RootFS: root, Egress: p}); !a.Available {
		t.Errorf("with a proxy and /mnt: refused: %s", a.Reason)
	}
}

// The egress conformance suite, with the real proxy, at this level.
func TestNetworkSuite(t *testing.T) {
	need(t, gvisor.Config{})
	sandboxtest.TestNetwork(t, func(t *testing.T, p *egress.Proxy) moat.Sandbox {
		return newSandbox(t, gvisor.Config{Egress: p,
			Limits: moat.Limits{WallTime: moat.Duration(time.Minute), CPUTime: moat.Duration(time.Minute)}})
	}, sandboxtest.NetworkOptions{})
}
