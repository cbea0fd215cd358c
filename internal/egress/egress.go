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
//
// A secret's real value goes only into TLS: in the intercepted tunnel, a
// placeholder in a request header (and, for InURL, the URL) to one of the
// secret's hosts becomes the value. A plain http:// request that carries
// a secret's placeholder is refused (403) whatever its host, and one
// without goes as sent. Everything a secret's host sends back passes
// through the proxy with each secret's value turned back into its
// placeholder: the status line, the header, 1xx responses, the trailer,
// and the body, where the value is caught as it is, URL-escaped (query and
// path), JSON- and HTML-escaped, and in base64 (standard and URL-safe,
// with or without padding, at any offset in a 3-byte group). Such a body
// goes to the sandbox chunked, streamed as it comes (the proxy holds back
// only bytes that could start a value). Requests to a secret's host ask
// for an unencoded response (Accept-Encoding: identity); a body under any
// other Content-Encoding is refused (502) rather than passed unread.
//
// What remains: the operator trusts a secret's hosts with its value. A
// host that hands it back in a form not listed above (split across a
// range request or two responses, cut short, upper- or lower-cased,
// hex-encoded, hashed, encrypted, or within a compression the header does
// not declare) gives it to the code. A value shorter than a few bytes
// makes the body's rewriting hit unrelated text.
//
// Each run logs at most maxLogLines lines between two calls of
// [Run.Notes], then one line saying the rest are counted, not logged; the
// metrics and the notes count every decision.
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
	// Logger gets one line per decision, at most maxLogLines per run
	// between two calls of Run.Notes. Nil means discard.
	Logger *slog.Logger
	// Registerer gets the proxy's counters
	// (moat_egress_requests_total{decision,host}). Nil means none.
	Registerer prometheus.Registerer
}
