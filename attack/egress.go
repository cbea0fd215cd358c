package attack

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
)

// The egress probes. Each runs in a sandbox with the harness's network
// policy in force ([Env.ProxyConfig]): a few allowed names, pinned to the
// harness's loopback servers, and one secret for one of them. They try to
// get past the policy, and the harness judges them on the host side.
const (
	// DNSExfil tries to get a name holding the run's nonce looked up: by
	// the sandbox's resolver, by a query sent to a DNS server itself, and
	// by asking the proxy for the name. The harness's DNS server (which is
	// also the proxy's resolver) seeing the name is the proof.
	DNSExfil Name = "dns_exfil"
	// DirectIP tries to reach a harness listener no policy allows: straight
	// to its address, through the proxy by address, and by an allowed name
	// on a port the policy does not allow. The listener accepting a
	// connection is the proof.
	DirectIP Name = "direct_ip"
	// SNIFronting opens a tunnel to an allowed host and sends a TLS
	// ClientHello naming another host, or none. The allowed host's server
	// receiving such a hello is the proof.
	SNIFronting Name = "sni_fronting"
	// SecretRead looks for the real value of the run's secret: in its
	// environment, in every process's environment and command line it can
	// read, in the files moat gives it, and by sending the placeholder to
	// an allowed host that echoes its request back. The value in the
	// output, or reaching the echoing host, is the proof.
	SecretRead Name = "secret_read"
)

// EgressAttacks are the probes that need a network policy in force: a run
// without a network blocks them trivially.
var EgressAttacks = []Name{DNSExfil, DirectIP, SNIFronting, SecretRead}

// IsEgress reports whether n is one of EgressAttacks.
func IsEgress(n Name) bool {
	for _, e := range EgressAttacks {
		if e == n {
			return true
		}
	}
	return false
}

// The names of the harness's policy, each pinned to 127.0.0.1.
const (
	allowedName = "allowed.attack.test" // a TLS server that records the SNI it gets
	echoName    = "echo.attack.test"    // plain HTTP, answers with the request's headers
	secretName  = "secret.attack.test"  // TLS, the secret's host; answers without echoing
	secretVar   = "MOAT_ATTACK_KEY"     // the variable the code sees
)

// egressEnv is the harness's side of the egress probes.
type egressEnv struct {
	value    string // the secret's real value: any sight of it in output proves SecretRead
	roots    *x509.CertPool
	caDir    string
	ports    map[string]int // allowed, echo, secret, ip, dns
	dns      *net.UDPConn
	netTurn  sync.Mutex // held by a run of an egress probe: the counters are the run's
	mu       sync.Mutex
	queries  []string // names the DNS server was asked for
	badHello int      // ClientHellos at the allowed server naming another host, or none
	ipConns  int      // connections to the listener no policy allows
	leaked   int      // requests at the echo server that held the real value
}

// startEgress starts the harness's servers for the egress probes.
func (e *Env) startEgress(ctx context.Context) error {
	g := &egressEnv{value: "moat-real-" + randomText(40), ports: map[string]int{}}
	e.egress = g
	dir, err := os.MkdirTemp("", "moat-attack-egress-")
	if err != nil {
		return fmt.Errorf("attack: egress: %w", err)
	}
	e.egressDir, g.caDir = dir, dir
	cert, pool, err := harnessCert(allowedName, secretName)
	if err != nil {
		return err
	}
	g.roots = pool
	var lc net.ListenConfig
	listen := func(name string) (net.Listener, error) {
		l, err := lc.Listen(ctx, "tcp4", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("attack: egress: listen: %w", err)
		}
		e.listeners = append(e.listeners, l)
		g.ports[name] = l.Addr().(*net.TCPAddr).Port
		return l, nil
	}
	// The allowed TLS server records the names its ClientHellos carry.
	al, err := listen("allowed")
	if err != nil {
		return err
	}
	tlsCfg := &tls.Config{Certificates: []tls.Certificate{cert}, GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		if !strings.EqualFold(h.ServerName, allowedName) {
			g.mu.Lock()
			g.badHello++
			g.mu.Unlock()
		}
		return nil, nil
	}}
	e.serveHTTP(tls.NewListener(al, tlsCfg), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "allowed")
	}))
	el, err := listen("echo")
	if err != nil {
		return err
	}
	e.serveHTTP(el, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b strings.Builder
		fmt.Fprintf(&b, "%s %s\n", r.Method, r.URL)
		r.Header.Write(&b)
		if strings.Contains(b.String(), g.value) {
			g.mu.Lock()
			g.leaked++
			g.mu.Unlock()
		}
		fmt.Fprint(w, b.String())
	}))
	sl, err := listen("secret")
	if err != nil {
		return err
	}
	e.serveHTTP(tls.NewListener(sl, &tls.Config{Certificates: []tls.Certificate{cert}}), http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") == "Bearer "+g.value {
			fmt.Fprintln(w, "authorized")
			return
		}
		w.WriteHeader(http.StatusUnauthorized)
		fmt.Fprintln(w, "unauthorized")
	}))
	il, err := listen("ip")
	if err != nil {
		return err
	}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			c, err := il.Accept()
			if err != nil {
				return
			}
			g.mu.Lock()
			g.ipConns++
			g.mu.Unlock()
			c.Close()
		}
	}()
	dns, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		return fmt.Errorf("attack: egress: dns: %w", err)
	}
	g.dns = dns
	g.ports["dns"] = dns.LocalAddr().(*net.UDPAddr).Port
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		buf := make([]byte, 4096)
		for {
			n, _, err := dns.ReadFromUDP(buf)
			if err != nil {
				return
			}
			g.mu.Lock()
			g.queries = append(g.queries, string(buf[:n]))
			g.mu.Unlock()
			// No answer: a query that got here has made its point.
		}
	}()
	return nil
}

// serveHTTP serves h on l until the Env closes.
func (e *Env) serveHTTP(l net.Listener, h http.Handler) {
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second, ErrorLog: nil}
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		srv.Serve(l)
	}()
}

// closeEgress stops the DNS server and removes the CA directory; Close
// closes the TCP listeners.
func (e *Env) closeEgress() []error {
	var errs []error
	if e.egress != nil && e.egress.dns != nil {
		if err := e.egress.dns.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// ProxyConfig is the egress proxy configuration of the harness's policy,
// for the sandboxes the egress probes run in: names pinned to the
// harness's loopback servers, one secret for the secret server, and the
// harness's DNS server as the proxy's resolver, so that a lookup the proxy
// should never make is seen.
func (e *Env) ProxyConfig() egress.Config {
	g := e.egress
	port := func(n string) string { return fmt.Sprint(g.ports[n]) }
	dnsAddr := "127.0.0.1:" + port("dns")
	return egress.Config{
		Egress: moat.Egress{
			Network: &moat.Network{
				Allow: []string{allowedName + ":" + port("allowed"), echoName + ":" + port("echo"), secretName + ":" + port("secret")},
				Resolve: map[string]string{
					allowedName: "127.0.0.1", echoName: "127.0.0.1", secretName: "127.0.0.1",
				},
			},
			Secrets: map[string]moat.Secret{secretVar: {FromEnv: "MOAT_ATTACK_REAL_KEY", Hosts: []string{secretName + ":" + port("secret")}}},
		},
		Getenv: func(k string) string {
			if k == "MOAT_ATTACK_REAL_KEY" {
				return g.value
			}
			return ""
		},
		CADir: g.caDir,
		Roots: g.roots,
		Resolver: &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "udp4", dnsAddr)
		}},
	}
}

// prepareEgress fills in s for the egress probe name.
func (e *Env) prepareEgress(s *setup) error {
	g := e.egress
	if g == nil {
		return errors.New("attack: the Env has no egress servers")
	}
	s.p.Ports = map[string]int{}
	for k, v := range g.ports {
		s.p.Ports[k] = v
	}
	s.p.Hosts = map[string]string{"allowed": allowedName, "echo": echoName, "secret": secretName}
	s.p.Name = secretVar
	nonce := s.p.Nonce
	watch := func(proof func() (string, string)) func() func() (string, string) {
		return func() func() (string, string) {
			g.netTurn.Lock()
			g.mu.Lock()
			q0, h0, i0, l0 := len(g.queries), g.badHello, g.ipConns, g.leaked
			g.mu.Unlock()
			return func() (string, string) {
				defer g.netTurn.Unlock()
				time.Sleep(50 * time.Millisecond) // a datagram on its way
				g.mu.Lock()
				defer g.mu.Unlock()
				switch s.name {
				case DNSExfil:
					for _, q := range g.queries[q0:] {
						if strings.Contains(strings.ToLower(dnsText(q)), strings.ToLower(nonce[:24])) {
							return "looked up", "the harness's DNS server got a query for a name holding the run's nonce"
						}
					}
				case DirectIP:
					if n := g.ipConns - i0; n > 0 {
						return "connected", fmt.Sprintf("the listener no policy allows accepted %d connection(s)", n)
					}
				case SNIFronting:
					if n := g.badHello - h0; n > 0 {
						return "fronted", fmt.Sprintf("the allowed host's server got %d ClientHello(s) naming another host, or none", n)
					}
				case SecretRead:
					if n := g.leaked - l0; n > 0 {
						return "leaked", fmt.Sprintf("the echoing host got the secret's real value in %d request(s)", n)
					}
				}
				return proof()
			}
		}
	}
	none := func() (string, string) { return "", "" }
	switch s.name {
	case DNSExfil:
		s.end = ending{noProof: "not looked up", overErrs: true}
	case DirectIP:
		s.end = ending{noProof: "not connected", overErrs: true}
	case SNIFronting:
		s.end = ending{noProof: "not fronted", overErrs: true}
	case SecretRead:
		s.tokens = []string{g.value}
		s.end = ending{noProof: "no token", overErrs: true}
	}
	s.watch = watch(none)
	return nil
}

// dnsText turns the labels of a DNS query into dotted text, so that a name
// split into labels is found whole.
func dnsText(q string) string {
	var b strings.Builder
	for i := 0; i < len(q); i++ {
		c := q[i]
		if c < 0x20 || c > 0x7e {
			b.WriteByte('.')
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}

// harnessCert makes a CA and one certificate for names, signed by it; the
// pool holds the CA, for the proxy to verify the harness's servers.
func harnessCert(names ...string) (tls.Certificate, *x509.CertPool, error) {
	fail := func(err error) (tls.Certificate, *x509.CertPool, error) {
		return tls.Certificate{}, nil, fmt.Errorf("attack: egress: certificate: %w", err)
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fail(err)
	}
	now := time.Now()
	ca := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "moat attack harness CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return fail(err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fail(err)
	}
	leaf := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), KeyUsage: x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &key.PublicKey, caKey)
	if err != nil {
		return fail(err)
	}
	pool := x509.NewCertPool()
	pool.AddCert(caCert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool, nil
}
