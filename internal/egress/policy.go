package egress

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"strings"

	"github.com/moatsandbox/moat"
)

// decision is what the proxy made of one request for host:port: allowed
// (with the addresses it checked, to connect to and nothing else) or
// denied with the reason. The reason never holds a header or a secret.
type decision struct {
	host    string // lower case, no trailing dot (as the sandbox sent it when it is not a name)
	port    int
	allowed bool
	why     string       // denied: the reason ("not allowed", "an IP address", ...)
	pattern string       // the Allow entry that matched, "" if none: the metric's host label
	pinned  bool         // the address came from the policy's Resolve
	addrs   []netip.Addr // allowed: the checked addresses, in the order to try
	failed  string       // allowed, but the upstream could not be reached: why
}

func (d decision) String() string { return hostPort(d.host, d.port) }

func (d *decision) deny(why string) {
	d.allowed = false
	d.why = why
	d.addrs = nil
}

// label is the metric's host label: the Allow entry that matched, or
// "other" for a host no entry allows, which bounds its values by the
// policy's size whatever the sandbox asks for.
func (d decision) label() string {
	if d.pattern == "" {
		return "other"
	}
	return d.pattern
}

// decide applies the policy to host:port: the host must be a name (not an
// IP literal) that an Allow entry matches, and every address it resolves
// to must be one the sandbox may reach (see refusedAddr) unless Resolve
// pins it. Only the addresses checked here are ever dialled.
func (p *Proxy) decide(ctx context.Context, host string, port int) decision {
	h := strings.ToLower(strings.TrimSuffix(host, "."))
	d := decision{host: h, port: port}
	if _, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		d.deny("an IP address")
		return d
	}
	for i, pat := range p.allow {
		if pat.Match(h, port) {
			d.pattern = p.cfg.Egress.Network.Allow[i]
			break
		}
	}
	if d.pattern == "" {
		d.deny("not allowed")
		return d
	}
	d.allowed = true
	if a, ok := p.resolve[h]; ok {
		d.pinned = true
		d.addrs = []netip.Addr{a}
		return d
	}
	addrs, err := p.lookup(ctx, h)
	if err != nil {
		d.failed = "no address: " + lookupReason(err)
		return d
	}
	for _, a := range addrs {
		if why := refusedAddr(a); why != "" {
			d.deny(fmt.Sprintf("resolves to %s, %s", a, why))
			return d
		}
	}
	d.addrs = addrs
	return d
}

// Address ranges the sandbox never reaches through a name it did not have
// pinned, beyond what netip's predicates cover.
var refusedPrefixes = []struct {
	prefix netip.Prefix
	why    string
}{
	{netip.MustParsePrefix("0.0.0.0/8"), "a reserved address (this network)"},
	{netip.MustParsePrefix("100.64.0.0/10"), "a shared (carrier-grade NAT) address"},
	{netip.MustParsePrefix("192.0.0.0/24"), "a reserved address (IETF protocol assignments)"},
	{netip.MustParsePrefix("198.18.0.0/15"), "a reserved address (benchmarking)"},
	{netip.MustParsePrefix("240.0.0.0/4"), "a reserved address (or broadcast)"},
	{netip.MustParsePrefix("168.63.129.16/32"), "a cloud metadata address"},
	{netip.MustParsePrefix("fec0::/10"), "a site-local address"},
	{netip.MustParsePrefix("100::/64"), "a discard address"},
	{netip.MustParsePrefix("::/96"), "an IPv4-compatible address"},
}

// Prefixes of IPv6 addresses that embed an IPv4 address a translator or
// relay may reach: the embedded address is checked too.
var embedding = []struct {
	prefix netip.Prefix
	offset int // byte offset of the IPv4 address in the IPv6 one
}{
	{netip.MustParsePrefix("64:ff9b::/96"), 12},    // NAT64
	{netip.MustParsePrefix("64:ff9b:1::/48"), 12},  // local-use NAT64
	{netip.MustParsePrefix("2002::/16"), 2},        // 6to4
	{netip.MustParsePrefix("::ffff:0:0:0/96"), 12}, // SIIT's IPv4-translated (RFC 6145)
}

// refusedAddr says why the sandbox may not reach a (as "a private
// address"), or "" if it may: loopback, private, link-local (the
// 169.254.169.254 metadata address among them), unspecified, multicast,
// broadcast and reserved addresses, in IPv4, IPv6, IPv4-mapped IPv6 and
// the IPv6 forms that embed an IPv4 address.
func refusedAddr(a netip.Addr) string {
	a = a.Unmap().WithZone("")
	switch {
	case !a.IsValid():
		return "not an address"
	case a.IsUnspecified():
		return "an unspecified address"
	case a.IsLoopback():
		return "a loopback address"
	case a.IsPrivate():
		return "a private address"
	case a.IsLinkLocalUnicast():
		return "a link-local (or metadata) address"
	case a.IsMulticast(), a.IsLinkLocalMulticast(), a.IsInterfaceLocalMulticast():
		return "a multicast address"
	}
	for _, r := range refusedPrefixes {
		if r.prefix.Contains(a) {
			return r.why
		}
	}
	for _, e := range embedding {
		if e.prefix.Contains(a) {
			b := a.As16()
			v4 := netip.AddrFrom4([4]byte(b[e.offset : e.offset+4]))
			if why := refusedAddr(v4); why != "" {
				return fmt.Sprintf("a translated address embedding %s, %s", v4, why)
			}
		}
	}
	return ""
}

// splitHostPort splits "host:port" or "[v6]:port" (or "host" when
// defaultPort is not 0) into the host and a port from 1 to 65535.
func splitHostPort(hostport string, defaultPort int) (string, int, error) {
	host, portStr, err := net.SplitHostPort(hostport)
	if err != nil {
		if defaultPort == 0 || strings.Contains(strings.Trim(hostport, "[]"), ":") && !strings.HasPrefix(hostport, "[") {
			return "", 0, fmt.Errorf("egress: %q is not host:port", clean(hostport))
		}
		host, portStr = strings.Trim(hostport, "[]"), strconv.Itoa(defaultPort)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 1 || port > 65535 || host == "" {
		return "", 0, fmt.Errorf("egress: %q is not host:port with a port from 1 to 65535", clean(hostport))
	}
	return host, port, nil
}

// hostPort joins host and port, bracketing an IPv6 literal.
func hostPort(host string, port int) string {
	return net.JoinHostPort(strings.Trim(host, "[]"), strconv.Itoa(port))
}

// clean makes text the sandbox sent fit for a log line or a note: at most
// 100 bytes, and only the characters of host names, addresses and ports
// (anything else becomes '?').
func clean(s string) string {
	const max = 100
	cut := len(s) > max
	if cut {
		s = s[:max]
	}
	b := []byte(s)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte(".-_:[]%", c) >= 0) {
			b[i] = '?'
		}
	}
	if cut {
		return string(b) + "..."
	}
	return string(b)
}

// parseAllow parses the policy's Allow entries (already validated).
func parseAllow(n *moat.Network) ([]moat.HostPattern, error) {
	out := make([]moat.HostPattern, 0, len(n.Allow))
	for _, a := range n.Allow {
		p, err := moat.ParseHostPattern(a)
		if err != nil {
			return nil, fmt.Errorf("egress: network.allow: %w", err)
		}
		out = append(out, p)
	}
	return out, nil
}
