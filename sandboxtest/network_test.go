package sandboxtest

import (
	"archive/zip"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// hostPython is the interpreter the subprocess level runs, whose pip
// scripts/setup.sh installs.
const hostPython = "/usr/bin/python3"

func TestWheelLayout(t *testing.T) {
	p := newPyPackage("moatprobe", "1.0", "v123")
	z, err := zip.NewReader(bytes.NewReader(p.Wheel), int64(len(p.Wheel)))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range z.File {
		names = append(names, f.Name)
	}
	for _, want := range []string{"moatprobe/__init__.py", "moatprobe-1.0.dist-info/METADATA", "moatprobe-1.0.dist-info/WHEEL", "moatprobe-1.0.dist-info/RECORD"} {
		if !strings.Contains(strings.Join(names, "\n")+"\n", want+"\n") {
			t.Errorf("the wheel lacks %s: %v", want, names)
		}
	}
	if p.WheelName() != "moatprobe-1.0-py3-none-any.whl" {
		t.Errorf("WheelName = %q", p.WheelName())
	}
}

// TestIndexWithPip installs the suite's wheel from the suite's index with
// the host's pip, straight (no proxy, no sandbox): the index and the wheel
// are what the suite's Pip check needs, checked apart from any level.
func TestIndexWithPip(t *testing.T) {
	if err := exec.Command(hostPython, "-m", "pip", "--version").Run(); err != nil {
		t.Fatalf("%s has no pip (%v): apt-get install python3-pip (scripts/setup.sh does)", hostPython, err)
	}
	value := token("value")
	p := newPyPackage("moatprobe", "1.0", value)
	var seen []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen = append(seen, r.URL.Path)
		p.index().ServeHTTP(w, r)
	}))
	defer srv.Close()
	dir := t.TempDir()
	cmd := exec.Command(hostPython, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check",
		"--no-input", "--index-url", srv.URL+"/simple/", "--target", dir, "moatprobe")
	cmd.Env = []string{"PATH=/usr/bin:/bin", "HOME=" + t.TempDir()}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("pip install: %v\n%s", err, out)
	}
	out, err := exec.Command(hostPython, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import moatprobe; print(moatprobe.VALUE)", dir).CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != value {
		t.Fatalf("import after install: %v: %s", err, out)
	}
	if _, err := os.Stat(filepath.Join(dir, "moatprobe-1.0.dist-info", "RECORD")); err != nil {
		t.Errorf("pip did not install the dist-info: %v", err)
	}
	want := "/packages/" + p.WheelName()
	if !strings.Contains(strings.Join(seen, " "), want) {
		t.Errorf("the index never served %s: %v", want, seen)
	}
}

// TestIndexRefusesOthers checks the index serves its one project only.
func TestIndexRefusesOthers(t *testing.T) {
	p := newPyPackage("moatprobe", "1.0", "v")
	srv := httptest.NewServer(p.index())
	defer srv.Close()
	for path, want := range map[string]int{
		"/simple/":                             200,
		"/simple/moatprobe/":                   200,
		"/packages/" + p.WheelName():           200,
		"/simple/other/":                       404,
		"/packages/other-1.0-py3-none-any.whl": 404,
	} {
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			t.Errorf("GET %s: %d, want %d", path, resp.StatusCode, want)
		}
	}
}

// TestUpstreamsRecord checks what the suite's judgements rest on: the
// upstreams count connections, ClientHellos (with their SNI) and requests,
// and their certificate verifies for the test names under the suite's CA
// only.
func TestUpstreamsRecord(t *testing.T) {
	u := newUpstreams(t)
	m := u.mark()
	if s := u.since(m); !s.nothing() {
		t.Fatalf("fresh upstreams saw %s", s)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: u.roots, ServerName: "api.test"}}
	defer tr.CloseIdleConnections()
	c := &http.Client{Transport: tr}
	resp, err := c.Get(fmt.Sprintf("https://127.0.0.1:%d/x?y=1", port(u.https)))
	if err != nil {
		t.Fatalf("https with the suite's CA and SNI api.test: %v", err)
	}
	resp.Body.Close()
	req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d/z", port(u.http)), nil)
	req.Host = "other.test:1"
	req.Header.Set("Authorization", "Bearer b")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	s := u.since(m)
	if s.conns != 2 || len(s.hellos) != 1 || s.hellos[0] != "api.test" || len(s.requests) != 2 {
		t.Fatalf("saw %s, want 2 connections, one ClientHello for api.test, 2 requests", s)
	}
	r := s.requests[1]
	if r.Server != "http" || r.Host != "other.test:1" || r.URI != "/z" || r.Header.Get("Authorization") != "Bearer b" {
		t.Errorf("recorded %s with Authorization %q", r, r.Header.Get("Authorization"))
	}
	// The system roots do not trust the upstreams: a tunnel the proxy does
	// not terminate verifies only with the CA the code adds itself.
	sys, err := x509.SystemCertPool()
	if err != nil {
		t.Fatal(err)
	}
	tr2 := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: sys, ServerName: "api.test"}}
	defer tr2.CloseIdleConnections()
	if _, err := (&http.Client{Transport: tr2}).Get(fmt.Sprintf("https://127.0.0.1:%d/", port(u.https))); err == nil {
		t.Errorf("the upstream's certificate verified with the system roots")
	}
	// UDP is counted.
	conn, err := net.Dial("udp4", fmt.Sprintf("127.0.0.1:%d", u.udpPort()))
	if err != nil {
		t.Fatal(err)
	}
	conn.Write([]byte("x"))
	conn.Close()
	if s := u.since(m); s.packets != 1 {
		t.Errorf("UDP datagrams counted: %d, want 1", s.packets)
	}
}

// TestPreludeCompiles compiles the probes' Python helpers with the host's
// python3, so that a syntax error shows here rather than as a failing
// level.
func TestPreludeCompiles(t *testing.T) {
	code := "CFG = {}\n" + pyPrelude + "\nprint(dns_query('api.test').hex())\n"
	out, err := exec.Command(hostPython, "-c", code).CombinedOutput()
	if err != nil {
		t.Fatalf("the prelude does not run: %v\n%s", err, out)
	}
	// id 0x6d74, RD, one question, "api" "test", A, IN.
	if want := "6d74010000010000000000000361706904746573740000010001"; strings.TrimSpace(string(out)) != want {
		t.Errorf("dns_query = %s", out)
	}
}
