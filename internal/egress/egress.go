// Package egress is moat's egress proxy: the one way out of a sandbox that
// has a network. A level places a listener where its sandbox can reach it
// and nothing else (a loopback listener inside the run's own network
// namespace, a single guestfwd of a VM's user network) and hands the
// connections to a [Run], which serves HTTP forward requests and CONNECT
// tunnels under the operator's [moat.Network] policy and puts the real
// values of the operator's secrets in place of their placeholders on the
// way to the secrets' hosts.
//
// The proxy resolves names itself, only names the policy allows, refuses
// loopback, private, link-local and metadata addresses unless the policy's
// Resolve pins the name, and connects to the address it checked. A CONNECT
// tunnel's TLS ClientHello must name the CONNECT host (no domain fronting).
// For a secret's host it terminates TLS with a certificate of moat's CA,
// which the sandbox trusts through the bundle [Run.CABundle] returns; other
// hosts are tunnelled untouched.
package egress

import (
	"crypto/x509"
	"log/slog"
	"net"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moatsandbox/moat"
)

// Port is the port the proxy listens on inside a sandbox's own network
// namespace (127.0.0.1:Port); nothing else listens there.
const Port = 3128

// Config is one egress policy and what the proxy needs to enforce it.
type Config struct {
	// Egress is the operator's policy and secrets. Its Network must not be
	// nil: a sandbox without a network has no proxy.
	Egress moat.Egress
	// Getenv looks up a secret's FromEnv. Nil means os.Getenv. A secret
	// whose variable is unset or empty makes New fail.
	Getenv func(string) string
	// CADir holds moat's CA (ca.pem, ca-key.pem), made on first use and
	// kept: one per install. Empty means /var/lib/moat/egress.
	CADir string
	// Roots verify the upstream servers of a secret's host, whose TLS the
	// proxy terminates. Nil means the host's system roots. (Tests give the
	// roots of their loopback servers.)
	Roots *x509.CertPool
	// Resolver resolves the allowed names that Resolve does not pin. Nil
	// means net.DefaultResolver.
	Resolver *net.Resolver
	// Logger gets one line per decision. Nil means discard.
	Logger *slog.Logger
	// Registerer gets the proxy's counters
	// (moat_egress_requests_total{decision,host}). Nil means none.
	Registerer prometheus.Registerer
}
