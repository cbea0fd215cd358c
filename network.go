package moat

import (
	"fmt"
	"net/netip"
	"regexp"
	"sort"
	"strconv"
	"strings"
)

// Network is the operator's egress policy for a sandbox: which hosts its
// code may reach, through moat's egress proxy and nothing else. The code
// and the model that wrote it never choose it. A nil *Network means no
// network at all, as without the setting: no proxy, no route, no name.
//
// The sandbox gets HTTP_PROXY and HTTPS_PROXY (both cases) pointing at the
// proxy, no DNS and no other route. The proxy resolves names itself, and
// only names that Allow lists; it refuses an address that is loopback,
// private, link-local, unspecified, multicast or a cloud metadata address
// unless Resolve maps the name to it, and it connects to the address it
// checked (no DNS rebinding).
type Network struct {
	// Allow lists the hosts the code may reach: a host name
	// ("pypi.org") or a wildcard of its subdomains ("*.example.com",
	// which matches a.example.com and a.b.example.com but not
	// example.com), each with an optional port ("*.example.com:443").
	// Without a port an entry allows 80 and 443. An IP address is not a
	// host name: the code cannot ask for an address directly. Empty
	// means nothing is reached (the proxy refuses every request), which
	// is different from no Network at all only in that the sandbox has
	// the proxy's address.
	Allow []string `json:"allow"`
	// Resolve pins host names to addresses the operator chose (a private
	// mirror, a test's loopback server): "mirror.internal": "10.1.2.3".
	// A name here is used with its address even when that address is
	// loopback or private; it is reached only if Allow lists it too.
	Resolve map[string]string `json:"resolve,omitempty"`
}

// Secret is a credential that the code uses but never holds. The sandbox
// sees an environment variable of the secret's name holding a placeholder
// unique to the run; moat's egress proxy puts the real value in its place
// in the request headers of requests to Hosts, and only there.
type Secret struct {
	// FromEnv names the environment variable of moat's own process that
	// holds the real value. Required; it must be set and not empty when
	// the sandbox opens.
	FromEnv string `json:"from_env"`
	// Hosts are the hosts (as in Network.Allow, with an optional port)
	// whose requests get the real value. Required. Each must also be
	// allowed by the Network.
	Hosts []string `json:"hosts"`
	// InURL also replaces the placeholder in the request's URL (its path
	// and query), for APIs that take a key as a query parameter. False
	// means headers only.
	InURL bool `json:"in_url,omitempty"`
}

// Egress is what a sandbox's code may reach and with which credentials:
// the Network and the Secrets together. The zero value is no network.
type Egress struct {
	// Network is the policy; nil means no network.
	Network *Network `json:"network,omitempty"`
	// Secrets are keyed by the environment variable the code sees. They
	// need a Network.
	Secrets map[string]Secret `json:"secrets,omitempty"`
}

// Enabled reports whether e gives the code any network.
func (e Egress) Enabled() bool { return e.Network != nil }

// envName is what a secret's name (an environment variable) may be.
var envName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// reservedEnv are variables moat sets in a sandbox with a network; a
// secret may not take their names.
var reservedEnv = map[string]bool{
	"HTTP_PROXY": true, "HTTPS_PROXY": true, "http_proxy": true, "https_proxy": true,
	"NO_PROXY": true, "no_proxy": true, "ALL_PROXY": true, "all_proxy": true,
	"SSL_CERT_FILE": true, "REQUESTS_CA_BUNDLE": true, "PIP_CERT": true, "CURL_CA_BUNDLE": true,
	"PATH": true, "HOME": true, "LANG": true, "PYTHONPATH": true, "PYTHONHOME": true, "TMPDIR": true,
}

// Validate checks e; the error names the setting and wraps [ErrInvalid].
// It does not look up FromEnv: see the egress proxy for that.
func (e Egress) Validate() error {
	if e.Network == nil {
		if len(e.Secrets) > 0 {
			return fmt.Errorf("moat: secrets need a network section (the proxy is what puts them in): %w", ErrInvalid)
		}
		return nil
	}
	for _, a := range e.Network.Allow {
		if _, err := ParseHostPattern(a); err != nil {
			return fmt.Errorf("moat: network.allow: %w", err)
		}
	}
	for name, addr := range e.Network.Resolve {
		if _, err := normalHost(name); err != nil || strings.HasPrefix(name, "*.") {
			return fmt.Errorf("moat: network.resolve: %q is not a host name: %w", name, ErrInvalid)
		}
		if _, err := netip.ParseAddr(addr); err != nil {
			return fmt.Errorf("moat: network.resolve: %q: %q is not an IP address: %w", name, addr, ErrInvalid)
		}
	}
	names := make([]string, 0, len(e.Secrets))
	for name := range e.Secrets {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		s := e.Secrets[name]
		switch {
		case !envName.MatchString(name):
			return fmt.Errorf("moat: secrets: %q is not an environment variable name: %w", name, ErrInvalid)
		case reservedEnv[name]:
			return fmt.Errorf("moat: secrets: %q is a variable moat sets itself: %w", name, ErrInvalid)
		case !envName.MatchString(s.FromEnv):
			return fmt.Errorf("moat: secrets.%s.from_env: %q is not an environment variable name: %w", name, s.FromEnv, ErrInvalid)
		case len(s.Hosts) == 0:
			return fmt.Errorf("moat: secrets.%s.hosts: empty: a secret goes to the hosts listed, so list at least one: %w", name, ErrInvalid)
		}
		for _, h := range s.Hosts {
			p, err := ParseHostPattern(h)
			if err != nil {
				return fmt.Errorf("moat: secrets.%s.hosts: %w", name, err)
			}
			if !e.Network.allowsPattern(p) {
				return fmt.Errorf("moat: secrets.%s.hosts: %q is not allowed by network.allow: %w", name, h, ErrInvalid)
			}
		}
	}
	return nil
}

// AllowsAll reports whether the policy lets the code reach every host and
// port that pattern (as in Allow) matches. A pattern that does not parse
// is allowed by no policy.
func (n *Network) AllowsAll(pattern string) bool {
	p, err := ParseHostPattern(pattern)
	return err == nil && n != nil && n.allowsPattern(p)
}

// allowsPattern reports whether every host and port p matches is allowed.
func (n *Network) allowsPattern(p HostPattern) bool {
	for _, a := range n.Allow {
		ap, err := ParseHostPattern(a)
		if err != nil {
			continue
		}
		if ap.covers(p) {
			return true
		}
	}
	return false
}

// HostPattern is one parsed entry of Network.Allow or Secret.Hosts.
type HostPattern struct {
	// Host is the lower-case host name, without a trailing dot; for a
	// wildcard, the suffix after "*." ("example.com").
	Host string
	// Wildcard says the pattern is "*.Host": subdomains of Host at any
	// depth, not Host itself.
	Wildcard bool
	// Ports are the ports matched: the one given, or 80 and 443.
	Ports []int
}

// ParseHostPattern parses "host", "*.domain", "host:port" or
// "*.domain:port". Errors wrap ErrInvalid.
func ParseHostPattern(s string) (HostPattern, error) {
	var p HostPattern
	host, port := s, ""
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		host, port = s[:i], s[i+1:]
		n, err := strconv.Atoi(port)
		if err != nil || n < 1 || n > 65535 || port != strconv.Itoa(n) {
			return p, fmt.Errorf("%q: the port %q is not a number from 1 to 65535: %w", s, port, ErrInvalid)
		}
		p.Ports = []int{n}
	} else {
		p.Ports = []int{80, 443}
	}
	if strings.HasPrefix(host, "*.") {
		p.Wildcard = true
		host = host[2:]
	}
	h, err := normalHost(host)
	if err != nil {
		if host != s {
			return p, fmt.Errorf("%q: %w", s, err)
		}
		return p, err
	}
	if p.Wildcard && !strings.Contains(h, ".") {
		return p, fmt.Errorf("%q: a wildcard needs a domain with a dot (\"*.example.com\"), not a top-level domain: %w", s, ErrInvalid)
	}
	p.Host = h
	return p, nil
}

// normalHost checks that s is a DNS host name (not an IP address) and
// returns it in lower case without a trailing dot.
func normalHost(s string) (string, error) {
	h := strings.ToLower(strings.TrimSuffix(s, "."))
	if _, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		return "", fmt.Errorf("%q is an IP address: allow a host name, and pin it with network.resolve: %w", s, ErrInvalid)
	}
	if h == "" || len(h) > 253 {
		return "", fmt.Errorf("%q is not a host name: %w", s, ErrInvalid)
	}
	for _, label := range strings.Split(h, ".") {
		if label == "" || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return "", fmt.Errorf("%q is not a host name: %w", s, ErrInvalid)
		}
		for _, c := range label {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return "", fmt.Errorf("%q is not a host name: %w", s, ErrInvalid)
			}
		}
	}
	return h, nil
}

// Match reports whether host (any case, an optional trailing dot) and port
// are matched by p. An IP address never matches.
func (p HostPattern) Match(host string, port int) bool {
	h, err := normalHost(host)
	if err != nil {
		return false
	}
	if p.Wildcard {
		if !strings.HasSuffix(h, "."+p.Host) {
			return false
		}
	} else if h != p.Host {
		return false
	}
	for _, q := range p.Ports {
		if q == port {
			return true
		}
	}
	return false
}

// covers reports whether every host and port that q matches, p matches.
func (p HostPattern) covers(q HostPattern) bool {
	switch {
	case p.Wildcard && q.Wildcard:
		if q.Host != p.Host && !strings.HasSuffix(q.Host, "."+p.Host) {
			return false
		}
	case p.Wildcard:
		if !strings.HasSuffix(q.Host, "."+p.Host) {
			return false
		}
	case q.Wildcard:
		return false
	default:
		if p.Host != q.Host {
			return false
		}
	}
	for _, qp := range q.Ports {
		found := false
		for _, pp := range p.Ports {
			found = found || pp == qp
		}
		if !found {
			return false
		}
	}
	return true
}

// Allows reports whether the policy lets the code reach host:port.
func (n *Network) Allows(host string, port int) bool {
	if n == nil {
		return false
	}
	for _, a := range n.Allow {
		p, err := ParseHostPattern(a)
		if err == nil && p.Match(host, port) {
			return true
		}
	}
	return false
}
