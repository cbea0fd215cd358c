package sandboxtest

import (
	"archive/zip"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// The loopback "internet" of the network suite: upstream servers on
// 127.0.0.1 that record everything they see, a PEP 503 package index
// serving a wheel built here, and a UDP listener that must hear nothing.

// request is what an upstream recorded of one request.
type request struct {
	Server string // "http" or "https": which upstream took it
	Host   string // the Host header (name:port as the client wrote it)
	URI    string // the request URI: path and query
	Header http.Header
}

// String describes r without its headers' values, which may hold a secret.
func (r request) String() string {
	names := make([]string, 0, len(r.Header))
	for k := range r.Header {
		names = append(names, k)
	}
	return fmt.Sprintf("%s %s%s (headers %s)", r.Server, r.Host, r.URI, strings.Join(names, ","))
}

// upstreams are the test's servers and what they saw.
type upstreams struct {
	http  *httptest.Server // plain HTTP: api.test, other.test, pypi.test (the index)
	https *httptest.Server // TLS with a certificate of caPEM for every test name
	udp   *net.UDPConn     // must receive nothing

	caPEM []byte         // the upstreams' CA, which the sandbox does not trust by default
	roots *x509.CertPool // caPEM as a pool, for the proxy's egress.Config.Roots

	pkg pyPackage // the wheel the index serves

	mu       sync.Mutex
	conns    int // TCP connections accepted by either server
	requests []request
	hellos   []string // SNI of every ClientHello the TLS server got ("" for none)
	packets  int      // UDP datagrams received
}

// testNames are the names the suite's certificate covers.
var testNames = []string{"api.test", "other.test", "pypi.test", "unlisted.test", "localhost", "rebind.test", "rebind6.test"}

// newUpstreams starts the servers on 127.0.0.1; t's cleanup stops them.
func newUpstreams(t *testing.T) *upstreams {
	t.Helper()
	u := &upstreams{pkg: newPyPackage("moatprobe", "1.0", token("value"))}
	ca, leaf, err := testCerts(testNames)
	if err != nil {
		t.Fatalf("sandboxtest: make the upstreams' certificates: %v", err)
	}
	u.caPEM = ca
	u.roots = x509.NewCertPool()
	u.roots.AppendCertsFromPEM(ca)

	u.http = httptest.NewUnstartedServer(u.handler("http"))
	u.http.Config.ConnState = u.connState
	u.http.Start()
	t.Cleanup(u.http.Close)

	u.https = httptest.NewUnstartedServer(u.handler("https"))
	u.https.Config.ConnState = u.connState
	// A refused handshake is a finding of the checks, not noise in the log.
	u.https.Config.ErrorLog = log.New(io.Discard, "", 0)
	u.https.TLS = &tls.Config{
		Certificates: []tls.Certificate{leaf},
		GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
			u.mu.Lock()
			u.hellos = append(u.hellos, h.ServerName)
			u.mu.Unlock()
			return nil, nil
		},
	}
	u.https.StartTLS()
	t.Cleanup(u.https.Close)

	udp, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatalf("sandboxtest: UDP listener: %v", err)
	}
	u.udp = udp
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			if _, _, err := udp.ReadFrom(buf); err != nil {
				return
			}
			u.mu.Lock()
			u.packets++
			u.mu.Unlock()
		}
	}()
	t.Cleanup(func() { udp.Close(); <-done })
	return u
}

func (u *upstreams) connState(_ net.Conn, s http.ConnState) {
	if s == http.StateNew {
		u.mu.Lock()
		u.conns++
		u.mu.Unlock()
	}
}

// handler records every request and answers it: the package index under
// /simple/ and /packages/, "ok" elsewhere. It never echoes what it got, so
// that a secret it receives cannot come back into the run's output.
func (u *upstreams) handler(server string) http.Handler {
	index := u.pkg.index()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		u.requests = append(u.requests, request{Server: server, Host: r.Host, URI: r.RequestURI, Header: r.Header.Clone()})
		u.mu.Unlock()
		if strings.HasPrefix(r.URL.Path, "/simple/") || strings.HasPrefix(r.URL.Path, "/packages/") {
			index.ServeHTTP(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/plain")
		fmt.Fprint(w, "ok")
	})
}

// port returns the port of an upstream.
func port(s *httptest.Server) int { return s.Listener.Addr().(*net.TCPAddr).Port }

// udpPort is the UDP listener's port.
func (u *upstreams) udpPort() int { return u.udp.LocalAddr().(*net.UDPAddr).Port }

// mark is a point in what the upstreams saw, for seen.
type mark struct{ conns, requests, hellos, packets int }

func (u *upstreams) mark() mark {
	u.mu.Lock()
	defer u.mu.Unlock()
	return mark{u.conns, len(u.requests), len(u.hellos), u.packets}
}

// seen is what the upstreams saw since m.
type seen struct {
	conns    int
	requests []request
	hellos   []string
	packets  int
}

func (s seen) nothing() bool {
	return s.conns == 0 && len(s.requests) == 0 && len(s.hellos) == 0 && s.packets == 0
}

func (s seen) String() string {
	var rs []string
	for _, r := range s.requests {
		rs = append(rs, r.String())
	}
	return fmt.Sprintf("%d TCP connections, %d UDP datagrams, ClientHellos with SNI %q, requests [%s]",
		s.conns, s.packets, s.hellos, strings.Join(rs, "; "))
}

// since returns what the upstreams saw after m, once a moment has passed
// for what was in flight to land.
func (u *upstreams) since(m mark) seen {
	time.Sleep(100 * time.Millisecond)
	u.mu.Lock()
	defer u.mu.Unlock()
	return seen{
		conns:    u.conns - m.conns,
		requests: append([]request(nil), u.requests[m.requests:]...),
		hellos:   append([]string(nil), u.hellos[m.hellos:]...),
		packets:  u.packets - m.packets,
	}
}

// testCerts makes a CA and a leaf certificate it signs for names (and
// 127.0.0.1), returning the CA as PEM and the leaf with its key.
func testCerts(names []string) (caPEM []byte, leaf tls.Certificate, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, leaf, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "moat sandboxtest upstream CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, leaf, err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, leaf, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, leaf, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: names[0]},
		DNSNames:     names,
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		return nil, leaf, err
	}
	leaf = tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), leaf, nil
}

// pyPackage is a pure-Python distribution of one module, Name, whose VALUE
// is Value: a wheel built here, so that the value a run prints after
// installing it proves the wheel came through (the value appears in no
// code the run is given).
type pyPackage struct {
	Name, Version, Value string
	Wheel                []byte
}

// WheelName is the wheel's file name (PEP 427).
func (p pyPackage) WheelName() string {
	return fmt.Sprintf("%s-%s-py3-none-any.whl", p.Name, p.Version)
}

func newPyPackage(name, version, value string) pyPackage {
	p := pyPackage{Name: name, Version: version, Value: value}
	p.Wheel = buildWheel(name, version, map[string]string{
		name + "/__init__.py": fmt.Sprintf("VALUE = %q\n", value),
	})
	return p
}

// buildWheel returns a py3-none-any wheel of name and version holding
// files (path in the wheel -> content) and its .dist-info: METADATA,
// WHEEL and a RECORD with the sha256 and size of each file.
func buildWheel(name, version string, files map[string]string) []byte {
	info := fmt.Sprintf("%s-%s.dist-info/", name, version)
	type file struct{ name, body string }
	var all []file
	for n, b := range files {
		all = append(all, file{n, b})
	}
	all = append(all,
		file{info + "METADATA", fmt.Sprintf("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: moat sandboxtest probe\n", name, version)},
		file{info + "WHEEL", "Wheel-Version: 1.0\nGenerator: moat-sandboxtest\nRoot-Is-Purelib: true\nTag: py3-none-any\n"},
	)
	var record strings.Builder
	var buf bytes.Buffer
	z := zip.NewWriter(&buf)
	add := func(n, body string) {
		w, err := z.CreateHeader(&zip.FileHeader{Name: n, Method: zip.Deflate, Modified: time.Unix(315532800, 0)})
		if err == nil {
			_, err = w.Write([]byte(body))
		}
		if err != nil {
			panic(err) // writing to a bytes.Buffer does not fail
		}
	}
	for _, f := range all {
		sum := sha256.Sum256([]byte(f.body))
		fmt.Fprintf(&record, "%s,sha256=%s,%d\n", f.name, base64.RawURLEncoding.EncodeToString(sum[:]), len(f.body))
		add(f.name, f.body)
	}
	fmt.Fprintf(&record, "%sRECORD,,\n", info)
	add(info+"RECORD", record.String())
	if err := z.Close(); err != nil {
		panic(err)
	}
	return buf.Bytes()
}

// index serves p as a PEP 503 "simple" repository: /simple/ lists the
// project, /simple/NAME/ links its wheel (with its sha256, which pip
// checks), /packages/WHEEL is the wheel.
func (p pyPackage) index() http.Handler {
	sum := sha256.Sum256(p.Wheel)
	mux := http.NewServeMux()
	html := func(w http.ResponseWriter, body string) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, "<!DOCTYPE html>\n<html><head><meta name=\"pypi:repository-version\" content=\"1.0\"></head><body>\n%s\n</body></html>\n", body)
	}
	mux.HandleFunc("GET /simple/{$}", func(w http.ResponseWriter, r *http.Request) {
		html(w, fmt.Sprintf("<a href=\"/simple/%s/\">%s</a>", p.Name, p.Name))
	})
	mux.HandleFunc("GET /simple/"+p.Name+"/{$}", func(w http.ResponseWriter, r *http.Request) {
		html(w, fmt.Sprintf("<a href=\"/packages/%s#sha256=%s\">%s</a>", p.WheelName(), hex.EncodeToString(sum[:]), p.WheelName()))
	})
	mux.HandleFunc("GET /packages/"+p.WheelName(), func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Write(p.Wheel)
	})
	return mux
}

// nameServer is the DNS server the proxy's resolver asks (the suite sets
// egress.Config.Resolver to it): it answers the names of answers, which
// are allowed but not pinned by Resolve and resolve to loopback (a
// rebinding), says every other name does not exist, and records every
// name asked, so that the suite can check the proxy resolves allowed names
// only.
type nameServer struct {
	conn    *net.UDPConn
	answers map[string]netip.Addr // lower-case name without the dot -> its one address

	mu    sync.Mutex
	asked []string
}

func newNameServer(t *testing.T, answers map[string]netip.Addr) *nameServer {
	t.Helper()
	c, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatalf("sandboxtest: the proxy's name server: %v", err)
	}
	ns := &nameServer{conn: c, answers: answers}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			n, from, err := c.ReadFromUDP(buf)
			if err != nil {
				return
			}
			if reply := ns.answer(buf[:n]); reply != nil {
				c.WriteToUDP(reply, from)
			}
		}
	}()
	t.Cleanup(func() { c.Close(); <-done })
	return ns
}

// resolver is a *net.Resolver that asks ns and nothing else.
func (ns *nameServer) resolver() *net.Resolver {
	addr := ns.conn.LocalAddr().String()
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp4", addr)
	}}
}

// names returns the names asked so far.
func (ns *nameServer) names() []string {
	ns.mu.Lock()
	defer ns.mu.Unlock()
	return slices.Clone(ns.asked)
}

// answer builds the reply to one query, or nil for a packet that is not
// one: the header, the question as asked, and an A or AAAA record when the
// name has an address of that family.
func (ns *nameServer) answer(q []byte) []byte {
	if len(q) < 12 || q[2]&0x80 != 0 || binary.BigEndian.Uint16(q[4:]) != 1 {
		return nil
	}
	var labels []string
	i := 12
	for {
		if i >= len(q) {
			return nil
		}
		l := int(q[i])
		i++
		if l == 0 {
			break
		}
		if l > 63 || i+l > len(q) {
			return nil
		}
		labels = append(labels, string(q[i:i+l]))
		i += l
	}
	if i+4 > len(q) {
		return nil
	}
	qtype := binary.BigEndian.Uint16(q[i:])
	question := q[12 : i+4]
	name := strings.ToLower(strings.Join(labels, "."))
	ns.mu.Lock()
	ns.asked = append(ns.asked, name)
	ns.mu.Unlock()

	addr, known := ns.answers[name]
	var rdata []byte
	switch {
	case known && qtype == 1 && addr.Is4():
		rdata = addr.AsSlice()
	case known && qtype == 28 && addr.Is6():
		rdata = addr.AsSlice()
	}
	r := make([]byte, 12, 12+len(question)+16+len(rdata))
	copy(r, q[:2])
	flags := uint16(0x8180) // a response, recursion desired and available
	if !known {
		flags |= 3 // NXDOMAIN
	}
	binary.BigEndian.PutUint16(r[2:], flags)
	binary.BigEndian.PutUint16(r[4:], 1)
	if rdata != nil {
		binary.BigEndian.PutUint16(r[6:], 1)
	}
	r = append(r, question...)
	if rdata != nil {
		r = append(r, 0xc0, 12) // the name: a pointer to the question's
		r = binary.BigEndian.AppendUint16(r, qtype)
		r = binary.BigEndian.AppendUint16(r, 1) // IN
		r = binary.BigEndian.AppendUint32(r, 5) // TTL
		r = binary.BigEndian.AppendUint16(r, uint16(len(rdata)))
		r = append(r, rdata...)
	}
	return r
}
