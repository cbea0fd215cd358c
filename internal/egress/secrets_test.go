package egress

import (
	"errors"
	"net/http"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// Real values of the tests' secrets: no error, log line, refusal or
// response the sandbox sees may hold them.
const (
	realAPI   = "sk-REAL-api-value-7f3c"
	realOther = "REAL other/value&x=1 9e1d"
)

func testEnv(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

// testSecrets: API_KEY goes to example.com (443 and 80), OTHER_KEY (in the
// URL too) to other.test:8443 and *.other.test.
func testSecrets(t testing.TB) *secretSet {
	t.Helper()
	s, err := newSecretSet(moat.Egress{
		Network: &moat.Network{Allow: []string{"example.com", "other.test:8443", "*.other.test"}},
		Secrets: map[string]moat.Secret{
			"API_KEY":   {FromEnv: "MOAT_TEST_API", Hosts: []string{"example.com"}},
			"OTHER_KEY": {FromEnv: "MOAT_TEST_OTHER", Hosts: []string{"other.test:8443", "*.other.test"}, InURL: true},
		},
	}, testEnv(map[string]string{"MOAT_TEST_API": realAPI, "MOAT_TEST_OTHER": realOther}))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// assertNoValue fails if text holds a real value.
func assertNoValue(t *testing.T, what, text string) {
	t.Helper()
	for _, v := range []string{realAPI, realOther, url.QueryEscape(realOther), url.PathEscape(realOther)} {
		if strings.Contains(text, v) {
			t.Errorf("%s holds a real value: %q", what, text)
		}
	}
}

func TestSecretSetMissingVariable(t *testing.T) {
	e := moat.Egress{
		Network: &moat.Network{Allow: []string{"example.com"}},
		Secrets: map[string]moat.Secret{
			"A_KEY": {FromEnv: "MOAT_TEST_A", Hosts: []string{"example.com"}},
			"B_KEY": {FromEnv: "MOAT_TEST_B", Hosts: []string{"example.com"}},
		},
	}
	for _, tc := range []struct {
		name string
		env  map[string]string
		want []string // in the error
	}{
		{"unset", map[string]string{"MOAT_TEST_A": realAPI}, []string{"B_KEY", "MOAT_TEST_B", "unset or empty"}},
		{"empty", map[string]string{"MOAT_TEST_A": realAPI, "MOAT_TEST_B": ""}, []string{"B_KEY", "MOAT_TEST_B", "unset or empty"}},
		{"newline", map[string]string{"MOAT_TEST_A": realAPI, "MOAT_TEST_B": realAPI + "\r\nX-Evil: 1"}, []string{"B_KEY", "MOAT_TEST_B", "control character"}},
		{"placeholder", map[string]string{"MOAT_TEST_A": realAPI, "MOAT_TEST_B": "x" + placeholderPrefix + "y"}, []string{"B_KEY", "MOAT_TEST_B"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := newSecretSet(e, testEnv(tc.env))
			if !errors.Is(err, moat.ErrInvalid) {
				t.Fatalf("newSecretSet = %v, %v; want an error wrapping ErrInvalid", s, err)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not name %q", err, w)
				}
			}
			assertNoValue(t, "error", err.Error())
		})
	}
	if _, err := newSecretSet(e, testEnv(map[string]string{"MOAT_TEST_A": "a", "MOAT_TEST_B": "b"})); err != nil {
		t.Errorf("both set: %v", err)
	}
}

func TestSecretPlaceholders(t *testing.T) {
	s := testSecrets(t)
	re := regexp.MustCompile(`^moat-secret-[0-9a-f]{32}$`)
	seen := map[string]bool{}
	for range 50 {
		r := s.forRun()
		env := r.env()
		if !sort.StringsAreSorted(env) || len(env) != 2 {
			t.Fatalf("env %q: want 2 entries, sorted", env)
		}
		for i, kv := range env {
			name, ph, _ := strings.Cut(kv, "=")
			if want := []string{"API_KEY", "OTHER_KEY"}[i]; name != want {
				t.Errorf("env[%d] = %q, want %s=...", i, kv, want)
			}
			if !re.MatchString(ph) {
				t.Errorf("placeholder %q is not moat-secret-<32 hex>", ph)
			}
			if seen[ph] {
				t.Errorf("placeholder %q seen twice", ph)
			}
			seen[ph] = true
		}
		assertNoValue(t, "env", strings.Join(env, "\n"))
	}
}

func TestSecretIntercepts(t *testing.T) {
	r := testSecrets(t).forRun()
	for _, tc := range []struct {
		host string
		port int
		want bool
	}{
		{"example.com", 443, true},
		{"EXAMPLE.com.", 443, true},
		{"example.com", 80, true},
		{"example.com", 8443, false},
		{"www.example.com", 443, false},
		{"other.test", 8443, true},
		{"other.test", 443, false},
		{"a.b.other.test", 443, true},
		{"127.0.0.1", 443, false},
	} {
		if got := r.intercepts(tc.host, tc.port); got != tc.want {
			t.Errorf("intercepts(%s, %d) = %v, want %v", tc.host, tc.port, got, tc.want)
		}
	}
	if empty, _ := newSecretSet(moat.Egress{Network: &moat.Network{}}, nil); empty.forRun().intercepts("example.com", 443) {
		t.Error("no secrets: intercepts example.com")
	}
}

// placeholders returns the run's placeholders by secret name.
func placeholders(r *runSecrets) map[string]string {
	m := map[string]string{}
	for _, kv := range r.env() {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}

func TestSecretRewrite(t *testing.T) {
	r := testSecrets(t).forRun()
	ph := placeholders(r)
	api, other := ph["API_KEY"], ph["OTHER_KEY"]
	for _, tc := range []struct {
		name       string
		host       string
		port       int
		target     string
		header     http.Header
		refused    string // in the refusal; "" means not refused
		wantHeader http.Header
		wantURI    string
	}{
		{
			name: "header", host: "example.com", port: 443, target: "/v1?q=" + api,
			header:     http.Header{"Authorization": {"Bearer " + api}, "X-Two": {"a", api + api}},
			wantHeader: http.Header{"Authorization": {"Bearer " + realAPI}, "X-Two": {"a", realAPI + realAPI}},
			wantURI:    "/v1?q=" + api, // API_KEY is not InURL
		},
		{
			name: "in url", host: "x.other.test", port: 443, target: "/p/" + other + "?key=" + other + "&k2=v",
			header:     http.Header{"X-Key": {other}},
			wantHeader: http.Header{"X-Key": {realOther}},
			wantURI:    "/p/" + url.PathEscape(realOther) + "?key=" + url.QueryEscape(realOther) + "&k2=v",
		},
		{
			name: "other's placeholder in a header", host: "example.com", port: 443, target: "/",
			header: http.Header{"Authorization": {"Bearer " + api}, "X-Leak": {other}}, refused: "secret OTHER_KEY was sent to example.com:443",
		},
		{
			name: "in a header name", host: "example.com", port: 443, target: "/",
			header: http.Header{"X-" + other: {"1"}}, refused: "secret OTHER_KEY",
		},
		{
			name: "in the url", host: "example.com", port: 443, target: "/?k=" + other,
			header: http.Header{}, refused: "secret OTHER_KEY",
		},
		{
			name: "right host, wrong port", host: "example.com", port: 8443, target: "/",
			header: http.Header{"Authorization": {api}}, refused: "secret API_KEY was sent to example.com:8443",
		},
		{
			name: "no placeholders", host: "elsewhere.test", port: 443, target: "/a?b=c",
			header: http.Header{"Accept": {"*/*"}}, wantHeader: http.Header{"Accept": {"*/*"}}, wantURI: "/a?b=c",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u, err := url.ParseRequestURI(tc.target)
			if err != nil {
				t.Fatal(err)
			}
			req := &http.Request{Method: "GET", URL: u, RequestURI: tc.target, Host: tc.host, Header: tc.header.Clone()}
			got := r.rewrite(req, tc.host, tc.port)
			assertNoValue(t, "refusal", got)
			if tc.refused != "" {
				if !strings.Contains(got, tc.refused) {
					t.Fatalf("rewrite = %q, want a refusal with %q", got, tc.refused)
				}
				if !equalHeader(req.Header, tc.header) || req.URL.RequestURI() != tc.target {
					t.Errorf("a refused request was changed: %v %s", req.Header, req.URL.RequestURI())
				}
				return
			}
			if got != "" {
				t.Fatalf("rewrite refused: %q", got)
			}
			if !equalHeader(req.Header, tc.wantHeader) {
				t.Errorf("header = %v, want %v", req.Header, tc.wantHeader)
			}
			if uri := req.URL.RequestURI(); uri != tc.wantURI {
				t.Errorf("URI = %q, want %q", uri, tc.wantURI)
			}
		})
	}
}

func TestSecretRewriteOtherRun(t *testing.T) {
	s := testSecrets(t)
	old := placeholders(s.forRun())["API_KEY"]
	r := s.forRun()
	req := &http.Request{Method: "GET", URL: &url.URL{Path: "/"}, RequestURI: "/", Host: "example.com", Header: http.Header{"Authorization": {old}}}
	if refusal := r.rewrite(req, "example.com", 443); refusal != "" || req.Header.Get("Authorization") != old {
		t.Errorf("another run's placeholder: refusal %q, header %q; want it left as sent", refusal, req.Header.Get("Authorization"))
	}
}

func TestSecretScrub(t *testing.T) {
	r := testSecrets(t).forRun()
	h := http.Header{"X-Echo": {"Bearer " + realAPI}}
	r.scrub(h)
	if got, want := h.Get("X-Echo"), "Bearer "+placeholders(r)["API_KEY"]; got != want {
		t.Errorf("scrubbed header = %q, want %q", got, want)
	}
}

func equalHeader(a, b http.Header) bool {
	if len(a) != len(b) {
		return false
	}
	for k, va := range a {
		vb := b[k]
		if len(va) != len(vb) {
			return false
		}
		for i := range va {
			if va[i] != vb[i] {
				return false
			}
		}
	}
	return true
}
