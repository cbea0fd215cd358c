package egress

import (
	"errors"
	"net"
)

// STUB: the API the levels code against; the proxy itself is being built.

// Proxy enforces one Config for every run of a sandbox. It is safe for
// concurrent use.
type Proxy struct {
	cfg Config
}

// New checks cfg (the policy, each secret's variable, moat's CA, made on
// first use) and returns its proxy. Errors wrap moat.ErrInvalid for a bad
// policy or a missing secret.
func New(cfg Config) (*Proxy, error) { return &Proxy{cfg: cfg}, nil }

// CABundle is the PEM trust bundle a sandbox's code gets at the path its
// Env names: the host's system roots and moat's CA. It is the same for
// every run.
func (p *Proxy) CABundle() []byte { return nil }

// Describe says in one line what the proxy enforces, for doctor and bench.
func (p *Proxy) Describe() string { return "egress: stub" }

// Close ends every run's connections; later runs fail.
func (p *Proxy) Close() error { return nil }

// NewRun returns the proxy's state for one run or one session: the
// placeholders of the secrets (unique to it) and the tally of decisions.
func (p *Proxy) NewRun() *Run { return &Run{p: p} }

// Run is the proxy for one run or session.
type Run struct {
	p *Proxy
}

// Env is the environment the sandbox's code gets: HTTP_PROXY, HTTPS_PROXY
// and their lower-case forms set to proxyURL (http://127.0.0.1:3128), no
// NO_PROXY; SSL_CERT_FILE, REQUESTS_CA_BUNDLE, PIP_CERT and CURL_CA_BUNDLE
// set to caFile, the path inside the sandbox where the level put CABundle;
// and each secret's variable set to its placeholder for this run.
func (r *Run) Env(proxyURL, caFile string) []string { return nil }

// Serve serves the connections l accepts until l is closed or r is; it
// closes l on return.
func (r *Run) Serve(l net.Listener) error { return errors.New("egress: stub") }

// ServeConn serves one connection from the sandbox and returns when it is
// done; it closes c.
func (r *Run) ServeConn(c net.Conn) { c.Close() }

// Notes returns the decisions since the last call, for the run's result:
// "network: allowed pypi.org:443 (3 connections); denied evil.example:443
// (unlisted)". Nil when there were none.
func (r *Run) Notes() []string { return nil }

// Close ends the run's listeners and connections and waits for them.
func (r *Run) Close() {}
