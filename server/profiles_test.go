package server_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

// recorder is a fake level that needs no root. Every run's stdout names
// the sandbox that ran it: its name for a one-shot run, "NAME/sN" in its
// Nth session. So a test sees which sandbox (default or which profile's) a
// request reached.
type recorder struct {
	name     string
	level    moat.Level
	runs     atomic.Int64 // one-shot and session runs
	sessions atomic.Int64
}

func (r *recorder) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	r.runs.Add(1)
	return &moat.Result{Level: r.level, Stdout: []byte(r.name)}, nil
}

func (r *recorder) Level() moat.Level { return r.level }
func (r *recorder) Close() error      { return nil }

func (r *recorder) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	return &recSession{r: r, id: fmt.Sprintf("%s/s%d", r.name, r.sessions.Add(1))}, nil
}

// recSession is a recorder's session. It has no files: the tests here do
// not use them (the nil Files would panic if one did).
type recSession struct {
	moat.Files
	r  *recorder
	id string
}

func (s *recSession) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	s.r.runs.Add(1)
	return &moat.Result{Level: s.r.level, Stdout: []byte(s.id)}, nil
}

func (s *recSession) Close() error { return nil }
func (s *recSession) ID() string   { return s.id }

// syncBuffer is a bytes.Buffer safe for a server's logger and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *syncBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// profileFakes are the fake sandboxes of a server with network profiles:
// the default ones at two levels, and two profiles at one level.
type profileFakes struct {
	def, defC, pypi, other *recorder
}

func newProfileFakes() *profileFakes {
	return &profileFakes{
		def:   &recorder{name: "default", level: moat.LevelSubprocess},
		defC:  &recorder{name: "default-container", level: moat.LevelContainer},
		pypi:  &recorder{name: "pypi", level: moat.LevelSubprocess},
		other: &recorder{name: "other", level: moat.LevelSubprocess},
	}
}

// total is how many runs every fake ran.
func (f *profileFakes) total() int64 {
	return f.def.runs.Load() + f.defC.runs.Load() + f.pypi.runs.Load() + f.other.runs.Load()
}

// config serves the fakes: token "a" may use the profile pypi, token "b"
// none; the profile "other" is nobody's but a's neighbour's.
func (f *profileFakes) config(state string) server.Config {
	return server.Config{
		Sandboxes: map[moat.Level]moat.Sandbox{moat.LevelSubprocess: f.def, moat.LevelContainer: f.defC},
		Profiles: map[string]map[moat.Level]moat.Sandbox{
			"pypi":  {moat.LevelSubprocess: f.pypi},
			"other": {moat.LevelSubprocess: f.other},
		},
		ProfilePolicies: map[string]moat.Egress{
			"pypi": {
				Network: &moat.Network{Allow: []string{"pypi.test", "files.pypi.test:443"}, Resolve: map[string]string{"pypi.test": "127.0.0.1"}},
				Secrets: map[string]moat.Secret{"PYPI_TOKEN": {FromEnv: "MOAT_TEST_REAL_PYPI_TOKEN", Hosts: []string{"pypi.test"}}},
			},
			"other": {Network: &moat.Network{Allow: []string{"other.test"}}},
		},
		Tokens: []server.Token{
			{Name: "a", Token: tokenA, NetworkProfiles: []string{"pypi"}},
			{Name: "b", Token: tokenB},
			{Name: "c", Token: "token-c-0123456789abcdef", NetworkProfiles: []string{"other"}},
		},
		StateDir:      state,
		SweepInterval: moat.Duration(50 * time.Millisecond),
	}
}

// startProfileServer serves the fakes in this process; its log is in the
// returned buffer.
func startProfileServer(t *testing.T, f *profileFakes) (*testServer, *syncBuffer) {
	t.Helper()
	logs := &syncBuffer{}
	cfg := f.config(t.TempDir())
	cfg.Logger = slog.New(slog.NewTextHandler(logs, nil))
	srv, err := server.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return &testServer{URL: serveHandler(t, srv.Handler()), srv: srv, cfg: cfg}, logs
}

// TestProfileRuns checks which sandbox a one-shot run reaches: the
// profile's when its token may use it, the default one without a profile,
// and none (403) for a profile of another token's or one that does not
// exist; a policy in the request is refused.
func TestProfileRuns(t *testing.T) {
	f := newProfileFakes()
	ts, logs := startProfileServer(t, f)
	ok := 0
	for _, c := range []struct {
		name   string
		token  string
		body   string
		status int
		ran    string // stdout, or the error code
	}{
		{"no profile", tokenA, `{"code":"x"}`, 200, "default"},
		{"empty profile", tokenA, `{"code":"x","network":""}`, 200, "default"},
		{"null profile", tokenA, `{"code":"x","network":null}`, 200, "default"},
		{"no profile, other level", tokenA, `{"code":"x","level":"container"}`, 200, "default-container"},
		{"granted profile", tokenA, `{"code":"x","network":"pypi"}`, 200, "pypi"},
		{"granted profile, level it lacks", tokenA, `{"code":"x","network":"pypi","level":"container"}`, 400, "unknown_level"},
		{"granted profile, level not served", tokenA, `{"code":"x","network":"pypi","level":"microvm"}`, 400, "unknown_level"},
		{"another token's profile", tokenA, `{"code":"x","network":"other"}`, 403, "network_profile_forbidden"},
		{"undefined profile", tokenA, `{"code":"x","network":"nope"}`, 403, "network_profile_forbidden"},
		{"token without profiles", tokenB, `{"code":"x","network":"pypi"}`, 403, "network_profile_forbidden"},
		{"the other token's own", "token-c-0123456789abcdef", `{"code":"x","network":"other"}`, 200, "other"},
		{"an allowlist object", tokenA, `{"code":"x","network":{"allow":["evil.test"]}}`, 400, "bad_request"},
		{"a profile with an allowlist", tokenA, `{"code":"x","network":{"name":"pypi","allow":["evil.test"]}}`, 400, "bad_request"},
		{"a list of hosts", tokenA, `{"code":"x","network":["evil.test"]}`, 400, "bad_request"},
		{"an allow key beside", tokenA, `{"code":"x","network":"pypi","allow":["evil.test"]}`, 400, "bad_request"},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := f.total()
			r := call(t, "POST", ts.URL+"/v1/runs", c.token, c.body)
			if r.Status != c.status {
				t.Fatalf("status %d, want %d: %s", r.Status, c.status, r.Body)
			}
			if c.status == 200 {
				ok++
				if got := r.JSON(t)["stdout"]; got != c.ran {
					t.Errorf("ran in %q, want %q", got, c.ran)
				}
				return
			}
			if code := r.ErrorCode(t); code != c.ran {
				t.Errorf("code %q, want %q: %s", code, c.ran, r.Body)
			}
			if strings.Contains(c.body, `"network":{`) || strings.Contains(c.body, `"network":[`) {
				if !strings.Contains(string(r.Body), "cannot carry a policy of its own") {
					t.Errorf("the refusal of a policy in the request does not say why: %s", r.Body)
				}
			}
			if n := f.total() - before; n != 0 {
				t.Errorf("a refused request ran %d times", n)
			}
		})
	}
	if f.total() != int64(ok) {
		t.Errorf("%d runs for %d accepted requests", f.total(), ok)
	}
	// A token cannot tell a profile of another token's from one that does
	// not exist.
	forbidden := call(t, "POST", ts.URL+"/v1/runs", tokenA, `{"code":"x","network":"other"}`)
	unknown := call(t, "POST", ts.URL+"/v1/runs", tokenA, `{"code":"x","network":"nopex"}`)
	if a, b := strings.ReplaceAll(string(forbidden.Body), "other", "N"), strings.ReplaceAll(string(unknown.Body), "nopex", "N"); a != b {
		t.Errorf("the answers tell an existing profile from an undefined one:\n%s\n%s", forbidden.Body, unknown.Body)
	}
	if v := metric(t, ts, `moat_network_profile_runs_total{level="subprocess",profile="pypi"}`); v != 1 {
		t.Errorf("runs under pypi: %v, want 1", v)
	}
	if !regexp.MustCompile(`msg=run .*network=pypi`).MatchString(logs.String()) {
		t.Errorf("no log line names the run's profile:\n%s", logs)
	}
	if !regexp.MustCompile(`network profile refused.* owner=a network=nope defined=false`).MatchString(logs.String()) ||
		!regexp.MustCompile(`network profile refused.* owner=a network=other defined=true`).MatchString(logs.String()) {
		t.Errorf("the log does not tell the operator which refusal was which:\n%s", logs)
	}
}

// TestProfileSessions checks that a session made under a profile runs in
// that profile's sandbox for its life, shows its profile, and cannot be
// moved to another by a run.
func TestProfileSessions(t *testing.T) {
	f := newProfileFakes()
	ts, logs := startProfileServer(t, f)
	create := func(token, body string) response {
		return call(t, "POST", ts.URL+"/v1/sessions", token, body)
	}
	r := must(t, create(tokenA, `{"network":"pypi"}`), 201).JSON(t)
	if r["network"] != "pypi" {
		t.Fatalf("created session: %v", r)
	}
	id := r["id"].(string)
	runIn := func(id, body string) response {
		return call(t, "POST", ts.URL+"/v1/sessions/"+id+"/runs", tokenA, body)
	}
	for _, body := range []string{`{"code":"x"}`, `{"code":"x","network":"pypi"}`, `{"code":"x","network":""}`} {
		if got := must(t, runIn(id, body), 200).JSON(t)["stdout"]; got != "pypi/s1" {
			t.Errorf("%s: ran in %q, want the pypi profile's session", body, got)
		}
	}
	for _, c := range []struct{ body, code string }{
		{`{"code":"x","network":"other"}`, "invalid"},
		{`{"code":"x","network":"nope"}`, "invalid"},
		{`{"code":"x","network":{"allow":["evil.test"]}}`, "bad_request"},
	} {
		r := runIn(id, c.body)
		if r.Status != 400 || r.ErrorCode(t) != c.code {
			t.Errorf("%s in a pypi session: %d %s, want 400 %s", c.body, r.Status, r.Body, c.code)
		}
	}
	if got := must(t, call(t, "GET", ts.URL+"/v1/sessions/"+id, tokenA, nil), 200).JSON(t)["network"]; got != "pypi" {
		t.Errorf("GET: network %v", got)
	}
	list := must(t, call(t, "GET", ts.URL+"/v1/sessions", tokenA, nil), 200).JSON(t)["sessions"].([]any)
	if len(list) != 1 || list[0].(map[string]any)["network"] != "pypi" {
		t.Errorf("list: %v", list)
	}

	// A session without a profile stays without one.
	plain := must(t, create(tokenA, `{}`), 201).JSON(t)
	if _, ok := plain["network"]; ok {
		t.Errorf("a session without a profile shows one: %v", plain)
	}
	if got := must(t, runIn(plain["id"].(string), `{"code":"x"}`), 200).JSON(t)["stdout"]; got != "default/s1" {
		t.Errorf("plain session ran in %q", got)
	}
	if r := runIn(plain["id"].(string), `{"code":"x","network":"pypi"}`); r.Status != 400 || r.ErrorCode(t) != "invalid" {
		t.Errorf("a run moving a plain session to pypi: %d %s", r.Status, r.Body)
	}

	// Refused creations make no session.
	for _, c := range []struct {
		token, body string
		status      int
	}{
		{tokenA, `{"network":"other"}`, 403},
		{tokenA, `{"network":"nope"}`, 403},
		{tokenB, `{"network":"pypi"}`, 403},
		{tokenA, `{"network":{"allow":["evil.test"]}}`, 400},
		{tokenA, `{"network":"pypi","level":"container"}`, 400},
	} {
		if r := create(c.token, c.body); r.Status != c.status {
			t.Errorf("create %s: %d %s, want %d", c.body, r.Status, r.Body, c.status)
		} else if c.status == 403 && r.ErrorCode(t) != "network_profile_forbidden" {
			t.Errorf("create %s: code %s", c.body, r.ErrorCode(t))
		}
	}
	if n := f.pypi.sessions.Load() + f.other.sessions.Load() + f.def.sessions.Load() + f.defC.sessions.Load(); n != 2 {
		t.Errorf("%d sessions made, want 2", n)
	}
	if v := metric(t, ts, `moat_network_profile_sessions_active{profile="pypi"}`); v != 1 {
		t.Errorf("pypi sessions active: %v, want 1", v)
	}
	if !regexp.MustCompile(`msg=run .*network=pypi.*session=` + id).MatchString(logs.String()) {
		t.Errorf("no log line names the session run's profile:\n%s", logs)
	}
	must(t, call(t, "DELETE", ts.URL+"/v1/sessions/"+id, tokenA, nil), 204)
	if v := metric(t, ts, `moat_network_profile_sessions_active{profile="pypi"}`); v != 0 {
		t.Errorf("pypi sessions active after delete: %v, want 0", v)
	}
}

// TestProfileList checks that a token sees the profiles it may use, and
// only those, with their hosts and their secrets' names, never a secret's
// source nor another token's profile.
func TestProfileList(t *testing.T) {
	ts, _ := startProfileServer(t, newProfileFakes())
	r := must(t, call(t, "GET", ts.URL+"/v1/network_profiles", tokenA, nil), 200)
	want := `{"network_profiles":[{"name":"pypi","levels":["subprocess"],"allow":["pypi.test","files.pypi.test:443"],"secrets":[{"name":"PYPI_TOKEN","hosts":["pypi.test"]}]}]}`
	if got := strings.TrimSpace(string(r.Body)); got != want {
		t.Errorf("a's profiles:\n%s\nwant\n%s", got, want)
	}
	for _, leak := range []string{"MOAT_TEST_REAL_PYPI_TOKEN", "127.0.0.1", "other"} {
		if strings.Contains(string(r.Body), leak) {
			t.Errorf("a's profiles show %q: %s", leak, r.Body)
		}
	}
	if r := must(t, call(t, "GET", ts.URL+"/v1/network_profiles", tokenB, nil), 200); strings.TrimSpace(string(r.Body)) != `{"network_profiles":[]}` {
		t.Errorf("b's profiles: %s", r.Body)
	}
	must(t, call(t, "GET", ts.URL+"/v1/network_profiles", "", nil), 401)
}

// TestProfileConfig checks that a config whose tokens or profiles do not
// fit together is refused.
func TestProfileConfig(t *testing.T) {
	f := newProfileFakes()
	if err := f.config(t.TempDir()).Validate(); err != nil {
		t.Fatalf("the good config: %v", err)
	}
	for _, c := range []struct {
		name string
		edit func(*server.Config)
		want string
	}{
		{"token names an undefined profile", func(c *server.Config) { c.Tokens[1].NetworkProfiles = []string{"nope"} }, `token "b": network profile "nope" is not defined`},
		{"profile at a level not served", func(c *server.Config) { c.Profiles["pypi"][moat.LevelMicroVM] = f.pypi }, `network profile "pypi": level microvm is not served`},
		{"profile with a nil sandbox", func(c *server.Config) { c.Profiles["pypi"][moat.LevelContainer] = nil }, `network profile "pypi": level container has no sandbox`},
		{"profile without sandboxes", func(c *server.Config) { c.Profiles["empty"] = nil }, `network profile "empty" has no sandbox`},
		{"profile named badly", func(c *server.Config) { c.Profiles["a,b"] = c.Profiles["pypi"] }, `network profile "a,b": a name is`},
		{"policy without a profile", func(c *server.Config) { c.ProfilePolicies["ghost"] = moat.Egress{} }, `network profile "ghost" has a policy but no sandboxes`},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg := newProfileFakes().config(t.TempDir())
			c.edit(&cfg)
			err := cfg.Validate()
			if !errors.Is(err, moat.ErrInvalid) || !strings.Contains(fmt.Sprint(err), c.want) {
				t.Fatalf("Validate: %v, want an invalid config saying %q", err, c.want)
			}
			if srv, err := server.New(cfg); err == nil {
				srv.Close()
				t.Fatal("New accepted it")
			}
		})
	}
}

// TestProfileSessionRestart checks that a session's profile is in its
// record: it holds across the session's runs in a server process, and the
// next server, after the first was killed, finds it there when it removes
// the session. (Sessions never outlive their server: recovery removes
// them, whatever their profile.)
func TestProfileSessionRestart(t *testing.T) {
	state := t.TempDir()
	first := startChild(t, state, "MOAT_TEST_SERVER_FAKE=1")
	id := must(t, call(t, "POST", first.URL+"/v1/sessions", tokenA, `{"network":"pypi"}`), 201).JSON(t)["id"].(string)
	for range 2 {
		if got := must(t, call(t, "POST", first.URL+"/v1/sessions/"+id+"/runs", tokenA, `{"code":"x"}`), 200).JSON(t)["stdout"]; got != "pypi/s1" {
			t.Fatalf("ran in %q, want the pypi profile's session", got)
		}
	}
	first.cmd.Process.Signal(syscall.SIGKILL)
	<-first.done

	second := startChild(t, state, "MOAT_TEST_SERVER_FAKE=1")
	must(t, call(t, "GET", second.URL+"/healthz", "", nil), 200)
	if v := metric(t, &testServer{URL: second.URL}, "moat_sessions_recovered_total"); v != 1 {
		t.Errorf("recovered sessions: %v, want 1", v)
	}
	if r := call(t, "GET", second.URL+"/v1/sessions/"+id, tokenA, nil); r.Status != 404 {
		t.Errorf("the dead server's session: %d %s", r.Status, r.Body)
	}
	log, _ := os.ReadFile(second.log)
	if !regexp.MustCompile(`removing a session left by a server.* session=` + id + ` .*network=pypi`).Match(log) {
		t.Errorf("the recovery does not name the session's profile:\n%s", log)
	}
	// The second server serves the profile as the first did.
	id2 := must(t, call(t, "POST", second.URL+"/v1/sessions", tokenA, `{"network":"pypi"}`), 201).JSON(t)["id"].(string)
	if got := must(t, call(t, "POST", second.URL+"/v1/sessions/"+id2+"/runs", tokenA, `{"code":"x"}`), 200).JSON(t)["stdout"]; got != "pypi/s1" {
		t.Errorf("second server: ran in %q", got)
	}
}
