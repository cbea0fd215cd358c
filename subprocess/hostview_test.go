package subprocess_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// The tests in this file check that nothing of the host shows through to a
// run by a name: unix socket files and abstract names (reached through a
// re-aimed socketpair end, since socket() is refused), processes, network
// interfaces. Each probe runs on the host first, as an unprivileged uid,
// where it must get through, or it proves nothing.

func randomName(t *testing.T) string {
	t.Helper()
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b[:])
}

// onHost runs code under python3 on the host as the nobody user, with no
// sandbox, and returns its stdout.
func onHost(t *testing.T, code string) string {
	t.Helper()
	cmd := exec.Command("/usr/bin/python3", "-c", code)
	cmd.Env = []string{}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("the probe failed on the host: %v: %s", err, stderr.Bytes())
	}
	return string(out)
}

// dgramListener listens for unix datagrams at addr (a path, or "@name" for
// an abstract name) and sends what it receives on the channel.
func dgramListener(t *testing.T, addr string) <-chan string {
	t.Helper()
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: addr, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if !strings.HasPrefix(addr, "@") {
		os.Chmod(addr, 0o777)
	}
	got := make(chan string, 16)
	go func() {
		buf := make([]byte, 256)
		for {
			n, _, err := c.ReadFrom(buf)
			if err != nil {
				return
			}
			got <- string(buf[:n])
		}
	}()
	return got
}

// received drains ch for a moment and returns what arrived.
func received(ch <-chan string, wait time.Duration) []string {
	var out []string
	deadline := time.After(wait)
	for {
		select {
		case s := <-ch:
			out = append(out, s)
		case <-deadline:
			return out
		}
	}
}

// reaimProbe sends a token to each address in ADDRS from one end of a
// datagram socketpair, in every way the kernel allows: sendto, sendmsg's
// msg_name (which seccomp cannot see), and connect then send. A refused
// datagram socketpair counts as blocked, and the probe goes on.
const reaimProbe = `
import socket
for i, addr in enumerate(ADDRS):
    try:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    except OSError as e:
        print("socketpair", addr, e.errno)
        continue
    target = "\0" + addr[1:] if addr.startswith("@") else addr
    try:
        a.sendto(("sendto-%d" % i).encode(), target)
    except OSError as e:
        print("sendto", addr, e.errno)
    try:
        a.sendmsg([("sendmsg-%d" % i).encode()], [], 0, target)
    except OSError as e:
        print("sendmsg", addr, e.errno)
    try:
        a.connect(target)
        a.send(("connect-%d" % i).encode())
    except OSError as e:
        print("connect", addr, e.errno)
print("done")
`

// TestNoHostUnixDatagram: a socketpair end cannot be re-aimed at a datagram
// socket of the host, by path (as /dev/log and the journal's socket are) or
// by abstract name.
func TestNoHostUnixDatagram(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("", "moat-dgram-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	path := filepath.Join(dir, "log")
	abstract := "@moat-test-" + randomName(t)
	byPath := dgramListener(t, path)
	byName := dgramListener(t, abstract)
	code := fmt.Sprintf("ADDRS = [%s, %s]\n", strconv.Quote(path), strconv.Quote(abstract)) + reaimProbe

	onHost(t, code)
	if got := received(byPath, 200*time.Millisecond); len(got) != 3 {
		t.Fatalf("on the host the probe delivered %q by path, want all three datagrams: it is broken", got)
	}
	if got := received(byName, 200*time.Millisecond); len(got) != 3 {
		t.Fatalf("on the host the probe delivered %q by abstract name, want all three datagrams: it is broken", got)
	}

	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	if !strings.Contains(string(res.Stdout), "done") {
		t.Fatalf("the probe did not run to its end: %q %q", res.Stdout, res.Stderr)
	}
	if got := received(byPath, 200*time.Millisecond); len(got) > 0 {
		t.Errorf("a run delivered %q to a host socket file", got)
	}
	if got := received(byName, 200*time.Millisecond); len(got) > 0 {
		t.Errorf("a run delivered %q to a host abstract name", got)
	}
}

// hostHasAbstract reports whether the host's network namespace has a unix
// socket bound to the abstract name.
func hostHasAbstract(name string) bool {
	b, _ := os.ReadFile("/proc/self/net/unix")
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 8 && f[len(f)-1] == "@"+name {
			return true
		}
	}
	return false
}

// TestNoHostAbstractBind: a run cannot bind an abstract name in the host's
// network namespace (squatting a name a host daemon uses), from a socketpair
// end that has no address yet.
func TestNoHostAbstractBind(t *testing.T) {
	requireRoot(t)
	name := "moat-test-" + randomName(t)
	code := fmt.Sprintf(`
import socket, time
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.bind("\0" + %s)
    print("bound", flush=True)
except OSError as e:
    print("bind", e.errno, flush=True)
time.sleep(1.5)
`, strconv.Quote(name))
	probe := func(runIt func()) bool {
		done := make(chan struct{})
		go func() { runIt(); close(done) }()
		seen := false
		for {
			select {
			case <-done:
				return seen
			case <-time.After(20 * time.Millisecond):
				seen = seen || hostHasAbstract(name)
			}
		}
	}
	if !probe(func() { onHost(t, code) }) {
		t.Fatal("on the host the probe's name never showed in /proc/net/unix: it is broken")
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	var res *moat.Result
	if probe(func() { res, _ = sb.Run(context.Background(), moat.Request{Code: []byte(code)}) }) {
		t.Errorf("a run bound the abstract name @%s in the host's namespace", name)
	}
	if res == nil || !strings.Contains(string(res.Stdout), "bind") {
		t.Fatalf("the probe did not run: %+v", res)
	}
}

// TestHostProcessesHidden: a run sees no process of the host, by stat or by
// listing, not even its own helper: /proc is the run's own PID namespace's.
func TestHostProcessesHidden(t *testing.T) {
	requireRoot(t)
	token := randomName(t)
	host := exec.Command("/bin/sleep", "60", token)
	host.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	if err := host.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { host.Process.Kill(); host.Wait() }()
	code := fmt.Sprintf(`
import os
print(os.path.exists("/proc/%d"), os.path.exists("/proc/1"), os.path.exists("/proc/self/status"))
`, host.Process.Pid)
	if got := strings.TrimSpace(onHost(t, code)); got != "True True True" {
		t.Fatalf("on the host the probe got %q, want True True True: it is broken", got)
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	// The run's own process is there; the host's, and the helper (root,
	// hidden by hidepid), are not.
	if got := strings.TrimSpace(string(res.Stdout)); got != "False False True" {
		t.Errorf("in the sandbox the probe got %q (stderr %q), want False False True", got, res.Stderr)
	}
}

// TestHostInterfacesHidden: a run sees none of the host's network
// interfaces, addresses or MAC addresses, even through ioctls on a
// socketpair end.
func TestHostInterfacesHidden(t *testing.T) {
	requireRoot(t)
	iface, mac := hostInterface(t)
	code := fmt.Sprintf(`
import fcntl, socket, struct, ctypes
a, b = socket.socketpair()
try:
    r = fcntl.ioctl(a.fileno(), 0x8927, struct.pack("16s16x", %s.encode()))
    print("mac", r[18:24].hex(":"))
except OSError as e:
    print("mac", e.errno)
buf = ctypes.create_string_buffer(4096)
r = fcntl.ioctl(a.fileno(), 0x8912, struct.pack("iL", 4096, ctypes.addressof(buf)))
n = struct.unpack("iL", r)[0]
print("ifconf", [buf.raw[i:i+16].rstrip(b"\0").decode() for i in range(0, n, 40)])
`, strconv.Quote(iface))
	host := onHost(t, code)
	if !strings.Contains(host, "mac "+mac) || !strings.Contains(host, "'"+iface+"'") {
		t.Fatalf("on the host the probe got %q, want %s's MAC %s and its name: it is broken", host, iface, mac)
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	want := "mac 19\nifconf []" // ENODEV, and not even lo has an address
	if got := strings.TrimSpace(string(res.Stdout)); got != want {
		t.Errorf("in the sandbox the probe got %q (stderr %q), want %q", got, res.Stderr, want)
	}
}

// hostInterface returns the name and MAC address of a host interface that
// has an IPv4 address, other than loopback.
func hostInterface(t *testing.T) (string, string) {
	t.Helper()
	ifs, err := net.Interfaces()
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range ifs {
		addrs, _ := i.Addrs()
		if i.Flags&net.FlagLoopback != 0 || len(i.HardwareAddr) != 6 || len(addrs) == 0 {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil {
				return i.Name, i.HardwareAddr.String()
			}
		}
	}
	t.Fatal("the host has no interface with a MAC and an IPv4 address to look for")
	return "", ""
}

// TestUIDLeasesAcrossRunDirs: two moats with different run directories and
// the same uid range never hand one uid to two runs at once.
func TestUIDLeasesAcrossRunDirs(t *testing.T) {
	requireRoot(t)
	first := 2100000000 + 60000 + int(time.Now().UnixNano()%1000)
	mk := func() moat.Sandbox {
		dir, err := os.MkdirTemp("/run", "moat-rundir-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
		// No pool: a prepared run holds its uid from its preparation,
		// and the one uid is for the runs the test makes.
		sb, err := subprocess.New(subprocess.Config{RunDir: dir, UIDFirst: first, UIDCount: 1, Warm: -1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Close() })
		return sb
	}
	a, b := mk(), mk()
	started := make(chan struct{})
	done := make(chan *moat.Result)
	var out bytes.Buffer
	go func() {
		w := &notifyWriter{w: &out, first: started}
		res, err := a.Run(context.Background(), moat.Request{Code: []byte("import time\nprint('up', flush=True)\ntime.sleep(2)"), Stdout: w})
		if err != nil {
			t.Error(err)
			w.Write(nil) // let the test go on
		}
		done <- res
	}()
	<-started
	res, err := b.Run(context.Background(), moat.Request{Code: []byte("print('ran')")})
	if err == nil {
		t.Errorf("a second moat leased the uid a running run holds: %q", res.Stdout)
	}
	<-done
}

// notifyWriter closes first on the first write.
type notifyWriter struct {
	w     *bytes.Buffer
	first chan struct{}
	once  bool
}

func (n *notifyWriter) Write(p []byte) (int, error) {
	if !n.once {
		n.once = true
		close(n.first)
	}
	return n.w.Write(p)
}

// TestPythonOutsideSystemOpensOnlyItsFiles: an interpreter outside the
// system directories gets its own binary and library directories opened to
// the code, not the directory it sits in (here /tmp/x, whose prefix would
// be /tmp).
func TestPythonOutsideSystemOpensOnlyItsFiles(t *testing.T) {
	requireRoot(t)
	dir, err := os.MkdirTemp("/tmp", "moat-py-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	py := filepath.Join(dir, "python3")
	src, err := os.ReadFile("/usr/bin/python3")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(py, src, 0o755); err != nil {
		t.Fatal(err)
	}
	token := randomName(t)
	secret := filepath.Join(dir, "beside")
	if err := os.WriteFile(secret, []byte(token), 0o644); err != nil {
		t.Fatal(err)
	}
	code := fmt.Sprintf("import sys\nprint('ran', sys.executable)\ntry:\n    print(open(%s).read())\nexcept OSError as e:\n    print('denied', e.errno)\n", strconv.Quote(secret))
	if got := onHost(t, code); !strings.Contains(got, token) {
		t.Fatalf("on the host the probe got %q, want the token: it is broken", got)
	}
	sb, err := subprocess.New(subprocess.Config{Python: py})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	res := run(t, sb, code)
	if !strings.Contains(string(res.Stdout), "ran") {
		t.Fatalf("the interpreter at %s did not start in the sandbox: %q %q", py, res.Stdout, res.Stderr)
	}
	if strings.Contains(string(res.Stdout), token) {
		t.Errorf("a run read %s, beside the interpreter", secret)
	}
}

// TestHostNameHidden: a run does not learn the host's name.
func TestHostNameHidden(t *testing.T) {
	requireRoot(t)
	host, err := os.Hostname()
	if err != nil || host == "moat" {
		t.Fatalf("host name %q, %v: the probe cannot tell", host, err)
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, "import socket; print(socket.gethostname())")
	if got := strings.TrimSpace(string(res.Stdout)); got != "moat" {
		t.Errorf("a run sees the host name %q (stderr %q), want moat", got, res.Stderr)
	}
}
