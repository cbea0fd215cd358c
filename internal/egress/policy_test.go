package egress

import (
	"context"
	"net/netip"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestRefusedAddr(t *testing.T) {
	for _, tc := range []struct {
		addr    string
		refused bool
	}{
		{"127.0.0.1", true},
		{"127.1.2.3", true},
		{"10.0.0.1", true},
		{"172.16.0.1", true},
		{"172.31.255.255", true},
		{"192.168.1.1", true},
		{"169.254.169.254", true},
		{"100.64.0.1", true},
		{"100.100.100.200", true},
		{"0.0.0.0", true},
		{"0.1.2.3", true},
		{"224.0.0.1", true},
		{"239.255.255.250", true},
		{"255.255.255.255", true},
		{"240.0.0.1", true},
		{"168.63.129.16", true},
		{"::1", true},
		{"::", true},
		{"fc00::1", true},
		{"fd00:ec2::254", true},
		{"fe80::1", true},
		{"fe80::1%eth0", true},
		{"ff02::1", true},
		{"::ffff:127.0.0.1", true},
		{"::ffff:10.0.0.1", true},
		{"::ffff:169.254.169.254", true},
		{"::127.0.0.1", true},
		{"::ffff:100.64.0.1", true},
		{"::ffff:0.1.2.3", true},
		{"::ffff:240.0.0.1", true},
		{"64:ff9b::a00:1", true},     // NAT64 of 10.0.0.1
		{"2002:7f00:1::1", true},     // 6to4 of 127.0.0.1
		{"::ffff:0:7f00:1", true},    // SIIT's IPv4-translated 127.0.0.1
		{"::ffff:0:a9fe:a9fe", true}, // ... and 169.254.169.254
		{"::ffff:0:808:808", false},  // ... and a public address
		{"172.32.0.1", false},        // just past 172.16/12
		{"100.128.0.1", false},       // just past 100.64/10
		{"8.8.8.8", false},           // public
		{"::ffff:8.8.8.8", false},    // public, mapped
		{"64:ff9b::808:808", false},  // NAT64 of a public address
		{"2606:4700::1111", false},   // public IPv6
	} {
		why := refusedAddr(netip.MustParseAddr(tc.addr))
		if (why != "") != tc.refused {
			t.Errorf("%s: refused %q, want refused=%v", tc.addr, why, tc.refused)
		}
	}
}

// TestDecideEveryAddress: a name is refused when any of its addresses is,
// wherever it comes in the answer; a name whose addresses are all public
// is allowed with exactly those addresses (nothing here dials them).
func TestDecideEveryAddress(t *testing.T) {
	_, res := newFakeDNS(t, map[string][]netip.Addr{
		"mixed.egress.test":  {netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("10.1.2.3")},
		"mixed6.egress.test": {netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("fe80::1")},
		"public.egress.test": {netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("2001:db8::1")},
	})
	p, err := New(Config{Egress: moat.Egress{Network: &moat.Network{Allow: []string{"*.egress.test"}}}, CADir: t.TempDir(), Resolver: res})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for _, name := range []string{"mixed.egress.test", "mixed6.egress.test"} {
		d := p.decide(ctx, name, 443)
		if d.allowed || !strings.HasPrefix(d.why, "resolves to ") || d.addrs != nil {
			t.Errorf("%s: %+v, want denied for its private address", name, d)
		}
	}
	d := p.decide(ctx, "Public.Egress.Test.", 443)
	if !d.allowed || d.host != "public.egress.test" || d.pattern != "*.egress.test" || len(d.addrs) != 2 || d.addrs[0] != netip.MustParseAddr("192.0.2.10") {
		t.Errorf("public.test: %+v", d)
	}
	d = p.decide(ctx, "gone.egress.test", 443)
	if !d.allowed || d.failed != "no address: the name does not exist" || d.addrs != nil {
		t.Errorf("gone.test: %+v", d)
	}
	d = p.decide(ctx, "public.egress.test", 8080)
	if d.allowed || d.why != "not allowed" || d.pattern != "" {
		t.Errorf("public.test:8080: %+v", d)
	}
}

func TestSplitHostPort(t *testing.T) {
	for _, tc := range []struct {
		in   string
		def  int
		host string
		port int
		ok   bool
	}{
		{"pypi.org:443", 0, "pypi.org", 443, true},
		{"pypi.org", 0, "", 0, false},
		{"pypi.org", 80, "pypi.org", 80, true},
		{"[::1]:443", 0, "::1", 443, true},
		{"[::1]", 80, "::1", 80, true},
		{"::1", 80, "", 0, false},
		{"pypi.org:0", 0, "", 0, false},
		{"pypi.org:65536", 0, "", 0, false},
		{"pypi.org:x", 0, "", 0, false},
		{":443", 0, "", 0, false},
	} {
		host, port, err := splitHostPort(tc.in, tc.def)
		if (err == nil) != tc.ok || host != tc.host || port != tc.port {
			t.Errorf("%q: %q %d %v", tc.in, host, port, err)
		}
	}
}
