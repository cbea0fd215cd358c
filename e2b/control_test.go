package e2b_test

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/server"
)

func TestControlPlaneKeys(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	for _, key := range []string{"", "e2b_0000000000000000000000000000000000000000", "token-a-0123456789abcdef"} {
		var body struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		resp := ts.do(t, key, "POST", "/v2/sandboxes", map[string]any{"templateID": "base"}, &body)
		if resp.StatusCode != http.StatusUnauthorized || body.Code != 401 || body.Message == "" {
			t.Errorf("key %q: %d %+v, want 401 with {code, message}", key, resp.StatusCode, body)
		}
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("a refused create made %d sessions", n)
	}
	// The rest of E2B's API is 501 with a message, after the key check.
	if resp := ts.do(t, "", "POST", "/sandboxes/x/fork", nil, nil); resp.StatusCode != 401 {
		t.Errorf("fork without a key: %d, want 401", resp.StatusCode)
	}
	var body struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if resp := ts.do(t, keyA, "POST", "/sandboxes/x/fork", nil, &body); resp.StatusCode != 501 || body.Code != 501 || body.Message == "" {
		t.Errorf("fork: %d %+v, want 501", resp.StatusCode, body)
	}
}

func TestCreateAndGet(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, map[string]any{"templateID": "base", "timeout": 60, "metadata": map[string]string{"k": "v"}})
	if c.SandboxID == "" || c.EnvdAccessToken == "" || c.EnvdVersion != e2b.EnvdVersion || c.TemplateID != "base" {
		t.Fatalf("create answered %+v", c)
	}
	// The sandbox is a session of a's token, at the default level, living
	// as long as the timeout says.
	info, err := ts.srv.Session("a", c.SandboxID)
	if err != nil {
		t.Fatalf("the sandbox is not a session of a: %v", err)
	}
	if info.Level != moat.LevelSubprocess {
		t.Errorf("level %s", info.Level)
	}
	if d := info.ExpiresAt.Sub(info.CreatedAt); d != time.Minute {
		t.Errorf("session ttl %v, want the 60s timeout", d)
	}
	var got created
	if resp := ts.do(t, keyA, "GET", "/sandboxes/"+c.SandboxID, nil, &got); resp.StatusCode != 200 {
		t.Fatalf("get: %d", resp.StatusCode)
	}
	if got.SandboxID != c.SandboxID || got.State != "running" || got.Metadata["k"] != "v" || !got.EndAt.Equal(info.ExpiresAt) {
		t.Errorf("get answered %+v, session %+v", got, info)
	}
}

func TestCreateRefusals(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	for _, tc := range []struct {
		name string
		body map[string]any
	}{
		{"unknown template", map[string]any{"templateID": "no-such-template"}},
		{"network rules (E2B's own header transforms)", map[string]any{"templateID": "base", "network": map[string]any{"rules": map[string]any{"api.example.com": []any{map[string]any{}}}}}},
		{"a network field moat does not know", map[string]any{"templateID": "base", "network": map[string]any{"allowOutt": []string{"x.org"}}}},
		{"pause on timeout", map[string]any{"templateID": "base", "autoPause": true}},
		{"timeout over the maximum", map[string]any{"templateID": "base", "timeout": 9 * 3600}},
		{"negative timeout", map[string]any{"templateID": "base", "timeout": -1}},
	} {
		var body struct {
			Code    int    `json:"code"`
			Message string `json:"message"`
		}
		if resp := ts.do(t, keyA, "POST", "/v2/sandboxes", tc.body, &body); resp.StatusCode != 400 || body.Code != 400 || body.Message == "" {
			t.Errorf("%s: %d %+v, want 400", tc.name, resp.StatusCode, body)
		}
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("refused creates made %d sessions", n)
	}
	// allow_internet_access false matches a template without network;
	// true (older SDKs always send it) gets the template's: none.
	ts.create(t, keyA, map[string]any{"templateID": "base", "allow_internet_access": false})
	c := ts.create(t, keyA, map[string]any{"templateID": "base", "allow_internet_access": true})
	if info, _ := ts.srv.Session("a", c.SandboxID); info.Network != "" {
		t.Errorf("allow_internet_access true gave network profile %q", info.Network)
	}
}

func TestTemplatesFromConfig(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(_ *server.Config, c *e2b.Config) {
		c.Templates = map[string]e2b.Template{"python": {Level: moat.LevelSubprocess}}
	})
	if resp := ts.do(t, keyA, "POST", "/v2/sandboxes", map[string]any{"templateID": "base"}, nil); resp.StatusCode != 400 {
		t.Errorf("base, not in the operator's templates: %d, want 400", resp.StatusCode)
	}
	if c := ts.create(t, keyA, map[string]any{"templateID": "python"}); c.TemplateID != "python" {
		t.Errorf("template %q", c.TemplateID)
	}
}

// A template's network profile must be granted to the key's token.
func TestTemplateNetworkGrant(t *testing.T) {
	ts2 := startServer(t, moat.Limits{}, func(sc *server.Config, c *e2b.Config) {
		sc.Profiles = map[string]map[moat.Level]moat.Sandbox{"pypi": {moat.LevelSubprocess: sc.Sandboxes[moat.LevelSubprocess]}}
		sc.ProfilePolicies = map[string]moat.Egress{"pypi": {Network: &moat.Network{Allow: []string{"pypi.org"}}}}
		sc.Tokens[0].NetworkProfiles = []string{"pypi"}
		c.Templates = map[string]e2b.Template{"net": {Network: "pypi"}}
	})
	if resp := ts2.do(t, keyB, "POST", "/v2/sandboxes", map[string]any{"templateID": "net"}, nil); resp.StatusCode != http.StatusForbidden {
		t.Errorf("b, not granted pypi: %d, want 403", resp.StatusCode)
	}
	// Whatever b asks of the network: the answer says nothing of the
	// profile's hosts.
	var refused struct {
		Message string `json:"message"`
	}
	if resp := ts2.do(t, keyB, "POST", "/v2/sandboxes", map[string]any{"templateID": "net", "network": map[string]any{"denyOut": []string{"0.0.0.0/0"}}}, &refused); resp.StatusCode != http.StatusForbidden || strings.Contains(refused.Message, "pypi.org") {
		t.Errorf("b, not granted pypi, denying all: %d %q, want 403 without the profile's hosts", resp.StatusCode, refused.Message)
	}
	if resp := ts2.do(t, keyA, "POST", "/v2/sandboxes", map[string]any{"templateID": "net", "allow_internet_access": true}, nil); resp.StatusCode != 201 {
		t.Errorf("a, granted pypi: %d, want 201", resp.StatusCode)
	}
	// No network asked of a template with some: refused, not ignored.
	if resp := ts2.do(t, keyA, "POST", "/v2/sandboxes", map[string]any{"templateID": "net", "allow_internet_access": false}, nil); resp.StatusCode != 400 {
		t.Errorf("allow_internet_access false on a networked template: %d, want 400", resp.StatusCode)
	}
	if n := len(ts2.srv.Sessions("a")); n != 1 {
		t.Errorf("a has %d sessions, want the one created", n)
	}
}

// E2B's network rules map onto the template's network profile: a request
// may ask for less than the profile allows where the template has no
// network, or where its allowOut covers every host of the profile; one
// that moat would give more than it asked is refused, naming why.
func TestCreateNetwork(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(sc *server.Config, c *e2b.Config) {
		sb := sc.Sandboxes[moat.LevelSubprocess]
		sc.Profiles = map[string]map[moat.Level]moat.Sandbox{"pypi": {moat.LevelSubprocess: sb}, "bare": {moat.LevelSubprocess: sb}}
		sc.ProfilePolicies = map[string]moat.Egress{"pypi": {Network: &moat.Network{Allow: []string{"pypi.org", "files.pythonhosted.org"}}}}
		sc.Tokens[0].NetworkProfiles = []string{"pypi", "bare"}
		c.Templates = map[string]e2b.Template{"net": {Network: "pypi"}, "bare": {Network: "bare"}, "base": {}}
	})
	all := []string{"0.0.0.0/0"}
	for _, tc := range []struct {
		name    string
		body    any
		status  int
		profile string
		says    string
	}{
		{"only the profile's hosts", map[string]any{"templateID": "net", "network": map[string]any{"denyOut": all, "allowOut": []string{"pypi.org", "files.pythonhosted.org"}}}, 201, "pypi", ""},
		{"a wildcard and a host cover them", map[string]any{"templateID": "net", "network": map[string]any{"denyOut": all, "allowOut": []string{"pypi.org", "*.pythonhosted.org", "10.0.0.1"}}}, 201, "pypi", ""},
		{"allowInternetAccess false with allowOut", map[string]any{"templateID": "net", "allow_internet_access": false, "network": map[string]any{"allowOut": []string{"pypi.org", "files.pythonhosted.org"}}}, 201, "pypi", ""},
		{"open, with hosts added", map[string]any{"templateID": "net", "network": map[string]any{"allowOut": []string{"example.com"}, "allowPublicTraffic": false}}, 201, "pypi", ""},
		{"no network asked of a template without", map[string]any{"templateID": "base", "network": map[string]any{"denyOut": all}}, 201, "", ""},
		{"a host the request does not allow", map[string]any{"templateID": "net", "network": map[string]any{"denyOut": all, "allowOut": []string{"pypi.org"}}}, 400, "", "files.pythonhosted.org"},
		{"a port the request does not allow", map[string]any{"templateID": "net", "network": map[string]any{"denyOut": all, "allowOut": []string{"pypi.org:443", "files.pythonhosted.org"}}}, 400, "", "pypi.org"},
		{"no network asked of a template with some", map[string]any{"templateID": "net", "allow_internet_access": false}, 400, "", "pypi.org"},
		{"addresses denied, the rest allowed", map[string]any{"templateID": "net", "network": map[string]any{"denyOut": []string{"10.0.0.0/8"}}}, 400, "", "denyOut"},
		{"a profile without a policy to compare", map[string]any{"templateID": "bare", "network": map[string]any{"denyOut": all}}, 400, "", "no policy"},
		{"maskRequestHost", map[string]any{"templateID": "net", "network": map[string]any{"maskRequestHost": "x"}}, 400, "", "maskRequestHost"},
		// A spelling that encoding/json would not match, and so ignore.
		{"allowInternetAccess false, camel-cased", map[string]any{"templateID": "net", "allowInternetAccess": false}, 400, "", "allow_internet_access"},
		{"ALLOW_INTERNET_ACCESS false", map[string]any{"templateID": "net", "ALLOW_INTERNET_ACCESS": false}, 400, "", "pypi.org"},
		{"a field moat has no use for", map[string]any{"templateID": "net", "autoPauseMemory": false}, 201, "pypi", ""},
		// A name given twice, where readers disagree on which holds.
		{"allow_internet_access twice", json.RawMessage(`{"templateID": "net", "allow_internet_access": false, "Allow_Internet_Access": true}`), 400, "", "twice"},
		{"network twice", json.RawMessage(`{"templateID": "net", "network": {"denyOut": ["0.0.0.0/0"]}, "network": null}`), 400, "", "twice"},
		{"denyOut twice", json.RawMessage(`{"templateID": "net", "network": {"denyOut": ["0.0.0.0/0"], "DENYOUT": []}}`), 400, "", "twice"},
	} {
		var body struct {
			SandboxID string `json:"sandboxID"`
			Message   string `json:"message"`
		}
		resp := ts.do(t, keyA, "POST", "/v2/sandboxes", tc.body, &body)
		if resp.StatusCode != tc.status || !strings.Contains(body.Message, tc.says) {
			t.Errorf("%s: %d %q, want %d saying %q", tc.name, resp.StatusCode, body.Message, tc.status, tc.says)
			continue
		}
		if tc.status != 201 {
			continue
		}
		if info, _ := ts.srv.Session("a", body.SandboxID); info.Network != tc.profile {
			t.Errorf("%s: network profile %q, want %q", tc.name, info.Network, tc.profile)
		}
		ts.do(t, keyA, "DELETE", "/sandboxes/"+body.SandboxID, nil, nil)
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("%d sessions left", n)
	}
}

// A template without a network profile runs in the server's sandboxes
// without one, which have the operator's top-level network when it gave
// them one (Config.Policy): a create that asks for no network, or only
// for hosts that policy exceeds, is refused there as for a profile.
func TestCreateNetworkNoProfile(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(sc *server.Config, c *e2b.Config) {
		c.Policy = moat.Egress{Network: &moat.Network{Allow: []string{"pypi.org"}}}
	})
	all := []string{"0.0.0.0/0"}
	for _, tc := range []struct {
		name   string
		body   map[string]any
		status int
		says   string
	}{
		{"allowInternetAccess false", map[string]any{"templateID": "base", "allow_internet_access": false}, 400, "pypi.org"},
		{"ALL_TRAFFIC denied", map[string]any{"templateID": "code-interpreter-v1", "network": map[string]any{"denyOut": all}}, 400, "pypi.org"},
		{"addresses denied, the rest allowed", map[string]any{"templateID": "base", "network": map[string]any{"denyOut": []string{"10.0.0.0/8"}}}, 400, "denyOut"},
		{"only the policy's host", map[string]any{"templateID": "base", "network": map[string]any{"denyOut": all, "allowOut": []string{"PyPI.org."}}}, 201, ""},
		{"nothing asked", map[string]any{"templateID": "base"}, 201, ""},
	} {
		var body struct {
			SandboxID string `json:"sandboxID"`
			Message   string `json:"message"`
		}
		resp := ts.do(t, keyA, "POST", "/v2/sandboxes", tc.body, &body)
		if resp.StatusCode != tc.status || !strings.Contains(body.Message, tc.says) {
			t.Errorf("%s: %d %q, want %d saying %q", tc.name, resp.StatusCode, body.Message, tc.status, tc.says)
		}
		if resp.StatusCode == 201 {
			ts.do(t, keyA, "DELETE", "/sandboxes/"+body.SandboxID, nil, nil)
		}
	}
}

// Another key's sandbox is not found, on every route, and stays as it was.
func TestOwnership(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	for _, rt := range []struct{ method, path string }{
		{"GET", "/sandboxes/" + c.SandboxID},
		{"DELETE", "/sandboxes/" + c.SandboxID},
		{"POST", "/sandboxes/" + c.SandboxID + "/timeout"},
		{"POST", "/sandboxes/" + c.SandboxID + "/pause"},
		{"POST", "/v2/sandboxes/" + c.SandboxID + "/connect"},
	} {
		if resp := ts.do(t, keyB, rt.method, rt.path, map[string]any{"timeout": 1}, nil); resp.StatusCode != 404 {
			t.Errorf("b: %s %s: %d, want 404", rt.method, rt.path, resp.StatusCode)
		}
	}
	var list []created
	ts.do(t, keyB, "GET", "/v2/sandboxes", nil, &list)
	if len(list) != 0 {
		t.Errorf("b lists %d sandboxes of a's", len(list))
	}
	info, err := ts.srv.Session("a", c.SandboxID)
	if err != nil || info.State != "running" || info.ExpiresAt.Sub(info.CreatedAt) != 300*time.Second {
		t.Errorf("a's sandbox after b's calls: %+v, %v", info, err)
	}
}

func TestListPaging(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	var ids []string
	for i := range 5 {
		md := map[string]string{"n": "odd"}
		if i%2 == 0 {
			md["n"] = "even"
		}
		ids = append(ids, ts.create(t, keyA, map[string]any{"metadata": md}).SandboxID)
	}
	var seen []string
	next, pages := "", 0
	for {
		path := "/v2/sandboxes?limit=2"
		if next != "" {
			path += "&nextToken=" + next
		}
		var page []created
		resp := ts.do(t, keyA, "GET", path, nil, &page)
		if resp.StatusCode != 200 || len(page) > 2 {
			t.Fatalf("page %d: %d, %d items", pages, resp.StatusCode, len(page))
		}
		for _, p := range page {
			seen = append(seen, p.SandboxID)
		}
		pages++
		if next = resp.Header.Get("X-Next-Token"); next == "" {
			break
		}
		if pages == 1 {
			// A sandbox killed between pages does not break the cursor.
			ts.do(t, keyA, "DELETE", "/sandboxes/"+page[1].SandboxID, nil, nil)
		}
	}
	if pages != 3 || len(seen) != 5 || !slices.Equal(seen, ids) {
		t.Errorf("paged %d pages: %v, want %v", pages, seen, ids)
	}
	// ids[1], killed above, was odd: the three even ones are left.
	var even []created
	ts.do(t, keyA, "GET", "/v2/sandboxes?metadata=n%3Deven&state=running,paused", nil, &even)
	var got []string
	for _, e := range even {
		got = append(got, e.SandboxID)
	}
	if want := []string{ids[0], ids[2], ids[4]}; !slices.Equal(got, want) {
		t.Errorf("metadata filter n=even: %v, want %v", got, want)
	}
	var paused []created
	ts.do(t, keyA, "GET", "/v2/sandboxes?state=paused", nil, &paused)
	if len(paused) != 0 {
		t.Errorf("state=paused lists %d running sandboxes", len(paused))
	}
	if resp := ts.do(t, keyA, "GET", "/v2/sandboxes?nextToken=garbage", nil, nil); resp.StatusCode != 400 {
		t.Errorf("a forged nextToken: %d, want 400", resp.StatusCode)
	}
}

func TestTimeoutPauseConnectKill(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, map[string]any{"timeout": 30})
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/timeout", map[string]any{"timeout": 120}, nil); resp.StatusCode != 204 {
		t.Fatalf("timeout: %d %s", resp.StatusCode, readAll(t, resp))
	}
	info, _ := ts.srv.Session("a", c.SandboxID)
	if left := time.Until(info.ExpiresAt); left < 100*time.Second || left > 120*time.Second {
		t.Errorf("after setTimeout(120s) the session ends in %v", left)
	}
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/timeout", map[string]any{"timeout": 9 * 3600}, nil); resp.StatusCode != 400 {
		t.Errorf("a timeout past the maximum: %d, want 400", resp.StatusCode)
	}
	// Files survive a pause and the connect that resumes it.
	hc := sandboxClient(c.SandboxID, c.EnvdAccessToken)
	resp, err := hc.Post(ts.URL+"/files?path=/home/user/kept.txt", "application/octet-stream", stringsReader("kept"))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("write: %v %v", resp, err)
	}
	resp.Body.Close()
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/pause", nil, nil); resp.StatusCode != 204 {
		t.Fatalf("pause: %d %s", resp.StatusCode, readAll(t, resp))
	}
	var got created
	ts.do(t, keyA, "GET", "/sandboxes/"+c.SandboxID, nil, &got)
	if got.State != "paused" {
		t.Errorf("state after pause: %q", got.State)
	}
	var body struct {
		Code int `json:"code"`
	}
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/pause", nil, &body); resp.StatusCode != 409 || body.Code != 409 {
		t.Errorf("second pause: %d, want 409", resp.StatusCode)
	}
	var conn created
	if resp := ts.do(t, keyA, "POST", "/v2/sandboxes/"+c.SandboxID+"/connect", map[string]any{"timeout": 60}, &conn); resp.StatusCode != 201 {
		t.Fatalf("connect of a paused sandbox: %d, want 201", resp.StatusCode)
	}
	if conn.State != "running" || conn.EnvdAccessToken != c.EnvdAccessToken {
		t.Errorf("connect answered %+v", conn)
	}
	if resp := ts.do(t, keyA, "POST", "/v2/sandboxes/"+c.SandboxID+"/connect", nil, nil); resp.StatusCode != 200 {
		t.Errorf("connect of a running sandbox: %d, want 200", resp.StatusCode)
	}
	r2, err := hc.Get(ts.URL + "/files?path=kept.txt")
	if err != nil {
		t.Fatal(err)
	}
	if s := readAll(t, r2); r2.StatusCode != 200 || s != "kept" {
		t.Errorf("after pause and connect: %d %q", r2.StatusCode, s)
	}
	if resp := ts.do(t, keyA, "DELETE", "/sandboxes/"+c.SandboxID, nil, nil); resp.StatusCode != 204 {
		t.Errorf("kill: %d", resp.StatusCode)
	}
	if resp := ts.do(t, keyA, "DELETE", "/sandboxes/"+c.SandboxID, nil, nil); resp.StatusCode != 404 {
		t.Errorf("second kill: %d, want 404", resp.StatusCode)
	}
	if _, err := ts.srv.Session("a", c.SandboxID); err == nil {
		t.Error("the session outlived its kill")
	}
	// The sandbox side of a killed sandbox is 502, as E2B's proxy answers.
	r3, err := hc.Get(ts.URL + "/health")
	if err != nil {
		t.Fatal(err)
	}
	var e struct {
		Code int `json:"code"`
	}
	json.Unmarshal([]byte(readAll(t, r3)), &e)
	if r3.StatusCode != 502 || e.Code != 502 {
		t.Errorf("health of a killed sandbox: %d, want 502", r3.StatusCode)
	}
}

// A sandbox ends at its timeout, as the session it is: the control plane
// then says 404, the sandbox side 502.
func TestTimeoutEnds(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, map[string]any{"timeout": 1})
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp := ts.do(t, keyA, "GET", "/sandboxes/"+c.SandboxID, nil, nil)
		if resp.StatusCode == 404 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the sandbox outlived its 1s timeout by 20s: %d", resp.StatusCode)
		}
		time.Sleep(100 * time.Millisecond)
	}
	resp, err := sandboxClient(c.SandboxID, c.EnvdAccessToken).Get(ts.URL + "/files?path=x")
	if err != nil {
		t.Fatal(err)
	}
	if readAll(t, resp); resp.StatusCode != 502 {
		t.Errorf("the sandbox side after the timeout: %d, want 502", resp.StatusCode)
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("%d sessions left", n)
	}
}
