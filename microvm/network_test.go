package microvm

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
)

// The egress proxy's conformance suite, through the VM's guestfwd. Under
// TCG pip is slow: the runs get three minutes of wall and CPU time.
func TestNetwork(t *testing.T) {
	cfg := requireVMs(t)
	sandboxtest.TestNetwork(t, func(t *testing.T, p *egress.Proxy) moat.Sandbox {
		c := cfg
		c.Egress = p
		c.Limits = moat.Limits{WallTime: moat.Duration(3 * time.Minute), CPUTime: moat.Duration(3 * time.Minute)}
		sb, err := New(c)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		return sb
	}, sandboxtest.NetworkOptions{ProxyURL: proxyURL, HostAddrs: []string{"10.0.2.2"}, DNS: []string{"10.0.2.3"}})
}

// The other network tests put a handler of their own in the proxy's place (the
// proxy is tested in its package): it answers a line with "proxy:" and the
// line, and counts the connections of each egress run.

const testBundle = "-----BEGIN CERTIFICATE-----\nbW9hdCB0ZXN0IENB\n-----END CERTIFICATE-----\n"

type testProxy struct {
	mu    sync.Mutex
	conns map[*egress.Run]int
}

// fakeProxy installs the test handler until t ends and returns a sandbox
// configuration with Egress set.
func fakeProxy(t *testing.T) (Config, *testProxy) {
	t.Helper()
	cfg := requireVMs(t)
	p, err := egress.New(egress.Config{Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}}, CADir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	tp := &testProxy{conns: map[*egress.Run]int{}}
	saved := proxyHooks
	proxyHooks.serve = func(r *egress.Run, c net.Conn) {
		tp.mu.Lock()
		tp.conns[r]++
		tp.mu.Unlock()
		c.SetDeadline(time.Now().Add(30 * time.Second))
		line, err := bufio.NewReader(c).ReadString('\n')
		if err == nil {
			fmt.Fprintf(c, "proxy:%s", line)
		}
		c.Close()
	}
	proxyHooks.env = func(r *egress.Run, url, ca string) []string {
		return []string{"HTTP_PROXY=" + url, "SSL_CERT_FILE=" + ca, "MOAT_TEST_SECRET=moat-secret-test"}
	}
	proxyHooks.bundle = func(*egress.Proxy) []byte { return []byte(testBundle) }
	proxyHooks.notes = func(*egress.Run) []string { return []string{"network: test note"} }
	t.Cleanup(func() { proxyHooks = saved })
	cfg.Egress = p
	return cfg, tp
}

func (tp *testProxy) runs() map[*egress.Run]int {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return maps.Clone(tp.conns)
}

// probeCode tries every way out it can think of, at once (each blocked TCP
// attempt waits for its timeout), and prints what each gave as JSON.
// hostTCP and hostUDP are ports of the host's loopback, which QEMU's user
// network would reach as 10.0.2.2 without restrict=on.
func probeCode(hostTCP, hostUDP int) string {
	return fmt.Sprintf(`
import json, os, socket, subprocess, sys, threading
out = {}
def err(e):
    return type(e).__name__ + ':' + str(getattr(e, 'errno', ''))
def tcp(name, host, port):
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        out[name] = 'connected'
    except OSError as e:
        out[name] = err(e)
    finally:
        s.close()
def udp(name, host, port, payload):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    try:
        s.sendto(payload, (host, port))
        s.recvfrom(512)
        out[name] = 'reply'
    except OSError as e:
        out[name] = err(e)
    finally:
        s.close()
def proxy():
    try:
        s = socket.create_connection(('10.0.2.100', 3128), timeout=10)
        s.sendall(b'hello\n')
        out['proxy'] = s.makefile('rb').readline().decode()
        s.close()
    except OSError as e:
        out['proxy'] = err(e)
def resolve():
    try:
        out['resolve'] = str(socket.getaddrinfo('pypi.test', 443))
    except OSError as e:
        out['resolve'] = err(e)
def icmp(name, kind):
    try:
        socket.socket(socket.AF_INET, kind, socket.IPPROTO_ICMP).close()
        out[name] = 'opened'
    except OSError as e:
        out[name] = err(e)
dns = bytes.fromhex('123401000001000000000000047079706904746573740000010001')
jobs = [
    (proxy, ()), (resolve, ()),
    (tcp, ('tcp_host', '10.0.2.2', %[1]d)), (tcp, ('tcp_dns', '10.0.2.3', 53)),
    (tcp, ('tcp_fwd_other_port', '10.0.2.100', 80)), (tcp, ('tcp_other_addr', '10.0.2.50', 3128)),
    (tcp, ('tcp_loopback', '127.0.0.1', 3128)),
    (udp, ('udp_dns', '10.0.2.3', 53, dns)), (udp, ('udp_host', '10.0.2.2', %[2]d, b'moat-udp')),
    (udp, ('udp_fwd', '10.0.2.100', 3128, b'moat-udp')),
    (icmp, ('icmp_dgram', socket.SOCK_DGRAM)), (icmp, ('icmp_raw', socket.SOCK_RAW)),
]
ts = [threading.Thread(target=f, args=a) for f, a in jobs]
for t in ts: t.start()
for t in ts: t.join()
out['routes'] = [l.split()[:2] for l in open('/proc/net/route').read().splitlines()[1:]]
out['ifs'] = sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:])
out['env'] = {k: os.environ.get(k) for k in ('HTTP_PROXY', 'SSL_CERT_FILE', 'MOAT_TEST_SECRET')}
out['child_env'] = subprocess.run([sys.executable, '-c', 'import os; print(os.environ.get("HTTP_PROXY"))'],
                                  capture_output=True, text=True).stdout.strip()
ca = os.environ.get('SSL_CERT_FILE') or '/etc/moat/ca.pem'
out['ca'] = open(ca).read()
try:
    open(ca, 'a').close()
    out['ca_write'] = 'opened'
except OSError as e:
    out['ca_write'] = err(e)
try:
    os.chmod(ca, 0o666)
    out['ca_chmod'] = 'done'
except OSError as e:
    out['ca_chmod'] = err(e)
print(json.dumps(out))
`, hostTCP, hostUDP)
}

// hostListeners are a TCP and a UDP listener on the host's loopback that
// count what reaches them.
type hostListeners struct {
	tcp     net.Listener
	udp     net.PacketConn
	mu      sync.Mutex
	tcpHits int
	udpHits int
}

func listenHost(t *testing.T) *hostListeners {
	t.Helper()
	h := &hostListeners{}
	var err error
	if h.tcp, err = net.Listen("tcp4", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	if h.udp, err = net.ListenPacket("udp4", "127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.tcp.Close(); h.udp.Close() })
	go func() {
		for {
			c, err := h.tcp.Accept()
			if err != nil {
				return
			}
			h.mu.Lock()
			h.tcpHits++
			h.mu.Unlock()
			c.Close()
		}
	}()
	go func() {
		buf := make([]byte, 512)
		for {
			if _, _, err := h.udp.ReadFrom(buf); err != nil {
				return
			}
			h.mu.Lock()
			h.udpHits++
			h.mu.Unlock()
		}
	}()
	return h
}

func (h *hostListeners) ports() (int, int) {
	return h.tcp.Addr().(*net.TCPAddr).Port, h.udp.LocalAddr().(*net.UDPAddr).Port
}

func (h *hostListeners) hits() (int, int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.tcpHits, h.udpHits
}

type probeResult struct {
	Proxy           string            `json:"proxy"`
	Resolve         string            `json:"resolve"`
	TCPHost         string            `json:"tcp_host"`
	TCPDNS          string            `json:"tcp_dns"`
	TCPFwdOtherPort string            `json:"tcp_fwd_other_port"`
	TCPOtherAddr    string            `json:"tcp_other_addr"`
	TCPLoopback     string            `json:"tcp_loopback"`
	UDPDNS          string            `json:"udp_dns"`
	UDPHost         string            `json:"udp_host"`
	UDPFwd          string            `json:"udp_fwd"`
	ICMPDgram       string            `json:"icmp_dgram"`
	ICMPRaw         string            `json:"icmp_raw"`
	Routes          [][]string        `json:"routes"`
	Ifs             []string          `json:"ifs"`
	Env             map[string]string `json:"env"`
	ChildEnv        string            `json:"child_env"`
	CA              string            `json:"ca"`
	CAWrite         string            `json:"ca_write"`
	CAChmod         string            `json:"ca_chmod"`
}

// checkProbe asserts that the code reached the proxy and nothing else.
func checkProbe(t *testing.T, res *moat.Result, h *hostListeners) {
	t.Helper()
	var p probeResult
	if err := json.Unmarshal(res.Stdout, &p); err != nil {
		t.Fatalf("the probe's output does not parse: %v: %q (stderr %q)", err, res.Stdout, res.Stderr)
	}
	t.Logf("probe: %s", res.Stdout)
	if p.Proxy != "proxy:hello\n" {
		t.Errorf("the connection to 10.0.2.100:3128 got %q, want the proxy's answer", p.Proxy)
	}
	for name, got := range map[string]string{
		"tcp to the host (10.0.2.2)":               p.TCPHost,
		"tcp to slirp's DNS (10.0.2.3:53)":         p.TCPDNS,
		"tcp to the proxy's address, another port": p.TCPFwdOtherPort,
		"tcp to another address of the subnet":     p.TCPOtherAddr,
		"tcp to the guest's loopback":              p.TCPLoopback,
	} {
		if got == "connected" || got == "" {
			t.Errorf("%s: %q, want a failure", name, got)
		}
	}
	for name, got := range map[string]string{
		"a DNS query to 10.0.2.3:53":            p.UDPDNS,
		"udp to the host (10.0.2.2)":            p.UDPHost,
		"udp to the proxy's address and port":   p.UDPFwd,
		"an ICMP datagram socket (ping socket)": p.ICMPDgram,
		"a raw ICMP socket":                     p.ICMPRaw,
	} {
		if got == "reply" || got == "opened" || got == "" {
			t.Errorf("%s: %q, want a failure", name, got)
		}
	}
	if strings.Contains(p.Resolve, "(") || p.Resolve == "" {
		t.Errorf("a name resolved in the guest: %s", p.Resolve)
	}
	if !slices.Equal(p.Ifs, []string{"eth0", "lo"}) {
		t.Errorf("the guest's interfaces are %q, want eth0 and lo", p.Ifs)
	}
	if len(p.Routes) != 1 || p.Routes[0][0] != "eth0" || p.Routes[0][1] != "0002000A" {
		t.Errorf("the guest's routes are %q, want only 10.0.2.0/24 on eth0 (no default route)", p.Routes)
	}
	wantEnv := map[string]string{"HTTP_PROXY": "http://10.0.2.100:3128", "SSL_CERT_FILE": "/etc/moat/ca.pem", "MOAT_TEST_SECRET": "moat-secret-test"}
	for k, v := range wantEnv {
		if p.Env[k] != v {
			t.Errorf("the code's %s is %q, want %q", k, p.Env[k], v)
		}
	}
	if p.ChildEnv != wantEnv["HTTP_PROXY"] {
		t.Errorf("a child of the code has HTTP_PROXY %q, want %q", p.ChildEnv, wantEnv["HTTP_PROXY"])
	}
	if p.CA != testBundle {
		t.Errorf("the CA file holds %q, want the proxy's bundle", p.CA)
	}
	if p.CAWrite == "opened" || p.CAChmod == "done" {
		t.Errorf("the code could change the CA file: open for append %q, chmod %q", p.CAWrite, p.CAChmod)
	}
	if !slices.Contains(res.Notes, "network: test note") {
		t.Errorf("the result's notes %q lack the proxy's", res.Notes)
	}
	// Judged on the host too: nothing reached its loopback.
	time.Sleep(200 * time.Millisecond)
	if tcpHits, udpHits := h.hits(); tcpHits != 0 || udpHits != 0 {
		t.Errorf("the guest reached the host's loopback: %d tcp connections, %d udp datagrams", tcpHits, udpHits)
	}
}

// A one-shot run with Egress reaches the proxy's address and nothing else:
// no DNS, no UDP, no ICMP, no other TCP address or port, not the host; and
// each run has a proxy run of its own, closed with its VM.
func TestNetworkOneShot(t *testing.T) {
	cfg, tp := fakeProxy(t)
	h := listenHost(t)
	sb := open(t, cfg, moat.Limits{WallTime: moat.Duration(30 * time.Second)})
	tcpPort, udpPort := h.ports()
	res := run(t, sb, probeCode(tcpPort, udpPort))
	checkProbe(t, res, h)
	// QEMU of a VM with a network may spawn (its pipes), but keeps its
	// seccomp filter and no_new_privs, which the pipes inherit.
	for _, vm := range listVMs() {
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", vm.pid))
		if err != nil {
			continue
		}
		if !strings.Contains(string(st), "\nNoNewPrivs:\t1\n") || !strings.Contains(string(st), "\nSeccomp:\t2\n") {
			t.Errorf("QEMU (pid %d) runs without no_new_privs or its seccomp filter:\n%s", vm.pid, st)
		}
	}
	res = run(t, sb, `
import socket
s = socket.create_connection(('10.0.2.100', 3128), timeout=10)
s.sendall(b'again\n')
print(s.makefile('rb').readline().decode(), end='')
`)
	if string(res.Stdout) != "proxy:again\n" {
		t.Errorf("the second run got %q from the proxy", res.Stdout)
	}
	runs := tp.runs()
	if len(runs) != 2 {
		t.Errorf("two one-shot runs were served by %d proxy runs, want 2 (one each): %v", len(runs), runs)
	}
	// The warm VM's socket may be there; the used ones must not. Only
	// this process's count (other moats may share the directory), and
	// a discard finishes after its run has returned.
	me, err := owner.Self(ownersDir)
	if err != nil {
		t.Fatal(err)
	}
	var left []string
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		left, _ = filepath.Glob(filepath.Join(socketDir, me+"-*"))
		if len(left) <= 1 || time.Now().After(deadline) {
			break
		}
	}
	if len(left) > 1 {
		t.Errorf("sockets of this process left in %s: %q", socketDir, left)
	}
	if !strings.Contains(sb.Describe(), "network: "+netDesc) {
		t.Errorf("Describe() = %q, want it to name the network", sb.Describe())
	}
}

// A session has one proxy run for its life, and each of its runs the
// network.
func TestNetworkSession(t *testing.T) {
	cfg, tp := fakeProxy(t)
	sb := open(t, cfg, moat.Limits{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	for _, interp := range []bool{false, true} {
		t.Run(fmt.Sprintf("interpreter=%v", interp), func(t *testing.T) { testNetworkSession(t, ctx, sb, tp, interp) })
	}
}

func testNetworkSession(t *testing.T, ctx context.Context, sb *Sandbox, tp *testProxy, interp bool) {
	before := tp.runs()
	sess, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: interp})
	if err != nil {
		t.Fatal(err)
	}
	defer sess.Close()
	for i := range 2 {
		res, err := sess.Run(ctx, moat.Request{Code: []byte(fmt.Sprintf(`
import os, socket
s = socket.create_connection(('10.0.2.100', 3128), timeout=10)
s.sendall(b'run%d\n')
print(s.makefile('rb').readline().decode(), end='')
print(os.environ['MOAT_TEST_SECRET'], open(os.environ['SSL_CERT_FILE']).read() == %q)
`, i, testBundle))})
		if err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("proxy:run%d\nmoat-secret-test True\n", i)
		if string(res.Stdout) != want || res.ExitCode != 0 {
			t.Errorf("run %d: exit %d, stdout %q, stderr %q; want %q", i, res.ExitCode, res.Stdout, res.Stderr, want)
		}
		if !slices.Contains(res.Notes, "network: test note") {
			t.Errorf("run %d: the notes %q lack the proxy's", i, res.Notes)
		}
	}
	runs := tp.runs()
	for r := range before {
		delete(runs, r)
	}
	if len(runs) != 1 {
		t.Errorf("a session's two runs were served by %d proxy runs, want 1", len(runs))
	}
	for _, n := range runs {
		if n != 2 {
			t.Errorf("the session's proxy run served %d connections, want 2", n)
		}
	}
}

// killUID kills every process of the uid it is given and nothing else.
func TestNetworkKillUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to start processes as other uids")
	}
	cfg := Config{}.withDefaults()
	victim, bystander := cfg.UIDFirst+cfg.UIDCount-1, cfg.UIDFirst+cfg.UIDCount-2
	start := func(uid int) *exec.Cmd {
		cmd := exec.Command("/bin/sleep", "60")
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}, Setsid: true}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		return cmd
	}
	a, b, c := start(victim), start(victim), start(bystander)
	defer c.Process.Kill()
	killUID(victim)
	for _, cmd := range []*exec.Cmd{a, b} {
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			cmd.Process.Kill()
			t.Errorf("a process of uid %d outlived killUID", victim)
		}
	}
	if err := c.Process.Signal(syscall.Signal(0)); err != nil {
		t.Errorf("killUID(%d) killed a process of uid %d: %v", victim, bystander, err)
	}
}

// The command line of a VM with a network: the user network restricted,
// one guestfwd and no hostfwd, the virtio-net device; spawning allowed only
// there. Without a network nothing of it, as before.
func TestNetworkArgs(t *testing.T) {
	q := &QEMU{Binary: "/usr/bin/qemu-system-x86_64", Version: "7.2"}
	base := VMSpec{Kernel: "/k", Initrd: "/i", Disk: "/d", Cmdline: "c", MemoryMiB: 512, VCPUs: 1, Accel: AccelTCG}
	join := func(spec VMSpec) string { return strings.Join(q.args(spec, "tag"), " ") }

	none := join(base)
	for _, want := range []string{"-nic none", "spawn=deny", "elevateprivileges=deny"} {
		if !strings.Contains(none, want) {
			t.Errorf("without a network the command line lacks %q: %s", want, none)
		}
	}
	if strings.Contains(none, "-netdev") || strings.Contains(none, "virtio-net") {
		t.Errorf("without a network the command line has a network: %s", none)
	}

	withNet := base
	withNet.Net = &NetSpec{Socket: "/run/moat/microvm-egress/x,y.sock", Pipe: "/var/lib/moat/agent"}
	a := q.args(withNet, "tag")
	var netdev []string
	for i, arg := range a {
		if arg == "-netdev" {
			netdev = append(netdev, a[i+1])
		}
	}
	if len(netdev) != 1 {
		t.Fatalf("want one -netdev, got %q", netdev)
	}
	nd := netdev[0]
	for _, want := range []string{"user,id=n0,", ",restrict=on,", ",ipv6=off,",
		"guestfwd=tcp:10.0.2.100:3128-cmd:'/var/lib/moat/agent' egress-pipe '/run/moat/microvm-egress/x,,y.sock'"} {
		if !strings.Contains(nd, want) {
			t.Errorf("the netdev %q lacks %q", nd, want)
		}
	}
	if strings.Count(nd, "guestfwd=") != 1 || strings.Contains(nd, "hostfwd") || strings.Contains(nd, "smb") || strings.Contains(nd, "tftp") {
		t.Errorf("the netdev %q is more than one guestfwd", nd)
	}
	s := strings.Join(a, " ")
	for _, want := range []string{"-device virtio-net-device,netdev=n0", "spawn=allow", "elevateprivileges=allow", "obsolete=deny", "resourcecontrol=deny"} {
		if !strings.Contains(s, want) {
			t.Errorf("with a network the command line lacks %q: %s", want, s)
		}
	}
	if strings.Contains(s, "-nic none") {
		t.Errorf("with a network the command line still says -nic none: %s", s)
	}
}

// A template with the network device is another template than one
// without; the VMs' sockets do not change it.
func TestNetworkTemplateKey(t *testing.T) {
	dir := t.TempDir()
	var files []string
	for _, n := range []string{"k", "i", "d"} {
		p := filepath.Join(dir, n)
		os.WriteFile(p, []byte(n), 0o644)
		files = append(files, p)
	}
	q := &QEMU{Binary: "/usr/bin/qemu-system-x86_64", Version: "7.2"}
	base := VMSpec{Kernel: files[0], Initrd: files[1], Disk: files[2], Cmdline: "c", MemoryMiB: 512, VCPUs: 1, Accel: AccelTCG}
	key := func(spec VMSpec) string {
		k, err := templateKey(q, spec)
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	a, b, c := base, base, base
	b.Net = &NetSpec{Pipe: "/agent"}
	c.Net = &NetSpec{Pipe: "/agent", Socket: "/run/moat/microvm-egress/one.sock"}
	if key(a) == key(b) {
		t.Errorf("the templates with and without a network share the key %s", key(a))
	}
	if key(b) != key(c) {
		t.Errorf("a VM's socket changes its template's key: %s, %s", key(b), key(c))
	}
}
