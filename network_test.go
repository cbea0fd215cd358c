package moat_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

func TestHostPattern(t *testing.T) {
	for _, c := range []struct {
		pattern string
		host    string
		port    int
		want    bool
	}{
		{"pypi.org", "pypi.org", 443, true},
		{"pypi.org", "PyPI.org.", 80, true},
		{"pypi.org", "pypi.org", 8080, false},
		{"pypi.org", "files.pypi.org", 443, false},
		{"pypi.org", "evilpypi.org", 443, false},
		{"*.example.com", "a.example.com", 443, true},
		{"*.example.com", "a.b.example.com", 80, true},
		{"*.example.com", "example.com", 443, false},
		{"*.example.com", "aexample.com", 443, false},
		{"*.example.com:8443", "a.example.com", 8443, true},
		{"*.example.com:8443", "a.example.com", 443, false},
		{"pypi.org", "1.2.3.4", 443, false},
		{"pypi.org", "pypi.org\x00.evil", 443, false},
	} {
		p, err := moat.ParseHostPattern(c.pattern)
		if err != nil {
			t.Fatalf("ParseHostPattern(%q): %v", c.pattern, err)
		}
		if got := p.Match(c.host, c.port); got != c.want {
			t.Errorf("%q matches %q:%d = %v, want %v", c.pattern, c.host, c.port, got, c.want)
		}
	}
}

func TestHostPatternInvalid(t *testing.T) {
	for _, s := range []string{"", "1.2.3.4", "[::1]", "::1", "*.com", "*", "a..b", "-a.com", "a.com:0", "a.com:65536",
		"a.com:08", "a.com:", "a b.com", "http://a.com", "a.com/x", "*.*.a.com", "xn--.com:x"} {
		if _, err := moat.ParseHostPattern(s); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("ParseHostPattern(%q) = %v, want an error wrapping ErrInvalid", s, err)
		}
	}
}

func TestEgressValidate(t *testing.T) {
	net := &moat.Network{Allow: []string{"pypi.test", "*.example.com:443"}, Resolve: map[string]string{"pypi.test": "127.0.0.1"}}
	ok := moat.Egress{Network: net, Secrets: map[string]moat.Secret{
		"API_KEY": {FromEnv: "REAL_KEY", Hosts: []string{"api.example.com:443"}},
	}}
	if err := ok.Validate(); err != nil {
		t.Fatalf("Validate: %v", err)
	}
	if err := (moat.Egress{}).Validate(); err != nil || (moat.Egress{}).Enabled() {
		t.Fatalf("the zero Egress: %v, enabled %v; want valid and no network", err, moat.Egress{}.Enabled())
	}
	for _, c := range []struct {
		name string
		e    moat.Egress
		want string
	}{
		{"secrets without a network", moat.Egress{Secrets: ok.Secrets}, "need a network"},
		{"a bad allow entry", moat.Egress{Network: &moat.Network{Allow: []string{"10.0.0.1"}}}, "IP address"},
		{"resolve to a non-address", moat.Egress{Network: &moat.Network{Resolve: map[string]string{"a.test": "a.test"}}}, "not an IP"},
		{"resolve of a wildcard", moat.Egress{Network: &moat.Network{Resolve: map[string]string{"*.a.test": "127.0.0.1"}}}, "not a host name"},
		{"a secret for a host not allowed", moat.Egress{Network: net, Secrets: map[string]moat.Secret{
			"K": {FromEnv: "K", Hosts: []string{"api.other.com"}}}}, "not allowed"},
		{"a secret for a port not allowed", moat.Egress{Network: net, Secrets: map[string]moat.Secret{
			"K": {FromEnv: "K", Hosts: []string{"api.example.com"}}}}, "not allowed"}, // 80 is not allowed
		{"a wildcard secret wider than allowed", moat.Egress{Network: &moat.Network{Allow: []string{"*.a.example.com"}}, Secrets: map[string]moat.Secret{
			"K": {FromEnv: "K", Hosts: []string{"*.example.com"}}}}, "not allowed"},
		{"a secret without hosts", moat.Egress{Network: net, Secrets: map[string]moat.Secret{"K": {FromEnv: "K"}}}, "hosts"},
		{"a secret named like a proxy variable", moat.Egress{Network: net, Secrets: map[string]moat.Secret{
			"HTTPS_PROXY": {FromEnv: "K", Hosts: []string{"pypi.test"}}}}, "moat sets"},
		{"a secret name that is no variable", moat.Egress{Network: net, Secrets: map[string]moat.Secret{
			"A=B": {FromEnv: "K", Hosts: []string{"pypi.test"}}}}, "not an environment variable"},
		{"from_env missing", moat.Egress{Network: net, Secrets: map[string]moat.Secret{
			"K": {Hosts: []string{"pypi.test"}}}}, "from_env"},
	} {
		err := c.e.Validate()
		if !errors.Is(err, moat.ErrInvalid) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Validate = %v, want an error wrapping ErrInvalid saying %q", c.name, err, c.want)
		}
	}
}

func TestNetworkAllows(t *testing.T) {
	var none *moat.Network
	if none.Allows("pypi.org", 443) {
		t.Fatal("a nil Network allows a host")
	}
	n := &moat.Network{Allow: []string{"pypi.org", "*.pythonhosted.org:443"}}
	for host, want := range map[string]bool{"pypi.org:443": true, "pypi.org:80": true, "files.pythonhosted.org:443": true,
		"files.pythonhosted.org:80": false, "evil.org:443": false} {
		h, p, _ := strings.Cut(host, ":")
		port := 443
		if p == "80" {
			port = 80
		}
		if got := n.Allows(h, port); got != want {
			t.Errorf("Allows(%s) = %v, want %v", host, got, want)
		}
	}
}
