package egress

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/dns/dnsmessage"

	"github.com/moatsandbox/moat"
)

// upstream is a loopback server standing in for a host of the internet,
// counting the connections it accepted.
type upstream struct {
	srv   *httptest.Server
	port  int
	conns atomic.Int32
	mu    sync.Mutex
	last  *http.Request // the last request it served
}

func newUpstream(t *testing.T, tlsToo bool) *upstream {
	t.Helper()
	u := &upstream{}
	u.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		u.mu.Lock()
		u.last = req.Clone(context.Background())
		u.mu.Unlock()
		body, _ := io.ReadAll(req.Body)
		fmt.Fprintf(w, "hello from upstream %s %s %s", req.Method, req.URL.Path, body)
	}))
	u.srv.Config.ConnState = func(c net.Conn, s http.ConnState) {
		if s == http.StateNew {
			u.conns.Add(1)
		}
	}
	if tlsToo {
		u.srv.StartTLS()
	} else {
		u.srv.Start()
	}
	t.Cleanup(u.srv.Close)
	u.port = u.srv.Listener.Addr().(*net.TCPAddr).Port
	return u
}

func (u *upstream) lastRequest() *http.Request {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.last
}

// harness is a proxy on 127.0.0.1 with one run serving it.
type harness struct {
	p    *Proxy
	r    *Run
	addr string
	reg  *prometheus.Registry
	logs *syncBuffer
	done chan error // Serve's result
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func newHarness(t *testing.T, n *moat.Network, resolver *net.Resolver) *harness {
	t.Helper()
	h := &harness{reg: prometheus.NewRegistry(), logs: &syncBuffer{}, done: make(chan error, 1)}
	p, err := New(Config{
		Egress:     moat.Egress{Network: n},
		CADir:      t.TempDir(),
		Resolver:   resolver,
		Logger:     slog.New(slog.NewTextHandler(h.logs, nil)),
		Registerer: h.reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	h.p = p
	h.r = p.NewRun()
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	h.addr = l.Addr().String()
	go func() { h.done <- h.r.Serve(l) }()
	t.Cleanup(func() {
		h.r.Close()
		p.Close()
	})
	return h
}

// client is an http.Client that goes through the proxy and trusts any
// upstream certificate (the tests check the proxy, not the upstream's name).
func (h *harness) client() *http.Client {
	proxy, _ := url.Parse("http://" + h.addr)
	return &http.Client{
		Transport: &http.Transport{
			Proxy:             http.ProxyURL(proxy),
			TLSClientConfig:   &tls.Config{InsecureSkipVerify: true},
			DisableKeepAlives: true,
		},
		Timeout: 20 * time.Second,
	}
}

// raw sends head (and anything after it) to the proxy on a connection of
// its own and returns the connection and the response to the head.
func (h *harness) raw(t *testing.T, head string) (net.Conn, *bufio.Reader, *http.Response) {
	t.Helper()
	c, err := net.Dial("tcp4", h.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(c, head); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	method := strings.SplitN(head, " ", 2)[0]
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%q: no response: %v", head, err)
	}
	return c, br, resp
}

// connect opens a CONNECT tunnel to target and checks the proxy said 200.
func (h *harness) connect(t *testing.T, target string) net.Conn {
	t.Helper()
	c, br, resp := h.raw(t, "CONNECT "+target+" HTTP/1.1\r\nHost: "+target+"\r\n\r\n")
	if resp.StatusCode != 200 {
		t.Fatalf("CONNECT %s: %s", target, resp.Status)
	}
	if br.Buffered() != 0 {
		t.Fatalf("CONNECT %s: %d bytes after the 200", target, br.Buffered())
	}
	return c
}

// fakeDNS is a DNS server on 127.0.0.1 answering A and AAAA queries from
// a table (names without the trailing dot); other names get NXDOMAIN.
type fakeDNS struct {
	pc      net.PacketConn
	answers map[string][]netip.Addr
	queries atomic.Int32
}

func newFakeDNS(t *testing.T, answers map[string][]netip.Addr) (*fakeDNS, *net.Resolver) {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pc.Close() })
	f := &fakeDNS{pc: pc, answers: answers}
	go f.serve()
	addr := pc.LocalAddr().String()
	res := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp4", addr)
	}}
	return f, res
}

func (f *fakeDNS) serve() {
	buf := make([]byte, 1500)
	for {
		n, from, err := f.pc.ReadFrom(buf)
		if err != nil {
			return
		}
		f.queries.Add(1)
		var m dnsmessage.Message
		if err := m.Unpack(buf[:n]); err != nil || len(m.Questions) != 1 {
			continue
		}
		q := m.Questions[0]
		name := strings.TrimSuffix(q.Name.String(), ".")
		resp := dnsmessage.Message{Header: dnsmessage.Header{ID: m.ID, Response: true, Authoritative: true, RecursionAvailable: true}, Questions: m.Questions}
		addrs, ok := f.answers[name]
		if !ok {
			resp.RCode = dnsmessage.RCodeNameError
		}
		for _, a := range addrs {
			hdr := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 60}
			switch {
			case a.Is4() && q.Type == dnsmessage.TypeA:
				hdr.Type = dnsmessage.TypeA
				resp.Answers = append(resp.Answers, dnsmessage.Resource{Header: hdr, Body: &dnsmessage.AResource{A: a.As4()}})
			case !a.Is4() && q.Type == dnsmessage.TypeAAAA:
				hdr.Type = dnsmessage.TypeAAAA
				resp.Answers = append(resp.Answers, dnsmessage.Resource{Header: hdr, Body: &dnsmessage.AAAAResource{AAAA: a.As16()}})
			}
		}
		out, err := resp.Pack()
		if err != nil {
			continue
		}
		f.pc.WriteTo(out, from)
	}
}
