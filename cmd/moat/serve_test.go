package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// lockedBuffer is a bytes.Buffer safe for the server's logger and the test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func writeTokens(t *testing.T, content string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, mode)
	return p
}

func TestServeBadInput(t *testing.T) {
	good := writeTokens(t, "alice s3cret-token-0123456789\n", 0o600)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"no tokens file", []string{"--addr", "127.0.0.1:0"}},
		{"missing tokens file", []string{"--tokens-file", "/nonexistent/tokens"}},
		{"world-readable tokens", []string{"--tokens-file", writeTokens(t, "alice s3cret-token-0123456789\n", 0o644)}},
		{"short token", []string{"--tokens-file", writeTokens(t, "alice short\n", 0o600)}},
		{"malformed line", []string{"--tokens-file", writeTokens(t, "alice\n", 0o600)}},
		{"bad address", []string{"--tokens-file", good, "--addr", "127.0.0.1:notaport"}},
		{"unknown level", []string{"--tokens-file", good, "--levels", "vm9000"}},
		{"bad duration", []string{"--tokens-file", good, "--session-ttl", "soon"}},
		{"ttl over max", []string{"--tokens-file", good, "--session-ttl", "9h"}},
		{"stray argument", []string{"--tokens-file", good, "extra"}},
		{"negative connection cap", []string{"--tokens-file", good, "--max-connections", "-1"}},
		{"bad write timeout", []string{"--tokens-file", good, "--write-timeout", "soon"}},
		{"e2b without an e2b key", []string{"--tokens-file", good, "--e2b-addr", "127.0.0.1:0"}},
		{"malformed e2b key", []string{"--tokens-file", writeTokens(t, "alice s3cret-token-0123456789 e2b_XYZ\n", 0o600), "--e2b-addr", "127.0.0.1:0"}},
		{"e2b key shared by two tokens", []string{"--tokens-file", writeTokens(t, "alice s3cret-token-0123456789 e2b_00112233445566778899aabbccddeeff00112233\nbob s3cret-token-9876543210 e2b_00112233445566778899aabbccddeeff00112233\n", 0o600), "--e2b-addr", "127.0.0.1:0"}},
		{"e2b template of a level not served", []string{"--addr", "127.0.0.1:0", "--tokens-file", good, "--config", writeConfig(t, `{"server": {"e2b_templates": {"x": {"level": "gvisor"}}}}`), "--levels", "subprocess"}},
		{"e2b template of an undefined profile", []string{"--addr", "127.0.0.1:0", "--tokens-file", good, "--config", writeConfig(t, `{"server": {"e2b_templates": {"x": {"network": "nope"}}}}`)}},
		{"bad e2b address", []string{"--tokens-file", writeTokens(t, "alice s3cret-token-0123456789 e2b_00112233445566778899aabbccddeeff00112233\n", 0o600), "--e2b-addr", "127.0.0.1:notaport"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			// Bounded: a case that wrongly starts serving stops here.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			code := cmdServe(ctx, c.args, Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
			if code != exitUsage {
				t.Errorf("exit %d, want %d; stderr %q", code, exitUsage, errb.String())
			}
		})
	}
}

func TestServe(t *testing.T) {
	requireRoot(t)
	tokens := writeTokens(t, `[{"name": "alice", "token": "s3cret-token-0123456789"}]`, 0o600)
	url, errb, stop := startServe(t, "--tokens-file", tokens, "--state-dir", t.TempDir(), "--wall-time", "5s",
		"--max-runs-per-token", "2", "--queue-per-token", "4", "--stream-buffer", "4MiB", "--read-header-timeout", "5s",
		"--read-timeout", "30s", "--write-timeout", "10s", "--conn-idle-timeout", "30s", "--max-connections", "64")
	req, _ := http.NewRequest("POST", url+"/v1/runs", strings.NewReader(`{"code":"print(6*7)"}`))
	req.Header.Set("Authorization", "Bearer s3cret-token-0123456789")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var res map[string]any
	json.NewDecoder(resp.Body).Decode(&res)
	resp.Body.Close()
	if resp.StatusCode != 200 || res["stdout"] != "42\n" {
		t.Errorf("run: %d %v", resp.StatusCode, res)
	}
	if !strings.Contains(errb.String(), "msg=run ") || !strings.Contains(errb.String(), "reason=none") {
		t.Errorf("no log line for the run: %s", errb.String())
	}
	if code := stop(); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, errb.String())
	}
}

// The log lines whose url= serveWith waits for.
const (
	apiListening = `msg="serve: listening"`
	e2bListening = `msg="serve: the E2B API is listening"`
)

// served is a moat serve of the test's own, in the test's process.
type served struct {
	t       *testing.T
	log     *lockedBuffer
	done    chan int
	cancel  context.CancelFunc
	stopped bool
}

// serveWith starts moat serve with args (the caller gives its addresses),
// waits up to startWait for the url= of each log line of waitFor, and
// returns them in that order. The test's end stops it.
func serveWith(t *testing.T, startWait time.Duration, waitFor []string, args ...string) (*served, []string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &served{t: t, log: &lockedBuffer{}, done: make(chan int, 1), cancel: cancel}
	go func() {
		s.done <- cmdServe(ctx, args, Stdio{In: strings.NewReader(""), Out: io.Discard, Err: s.log})
	}()
	urls := make([]string, len(waitFor))
	for deadline := time.Now().Add(startWait); slices.Contains(urls, ""); time.Sleep(20 * time.Millisecond) {
		for i, msg := range waitFor {
			if m := regexp.MustCompile(regexp.QuoteMeta(msg) + ` url=(http://127\.0\.0\.1:\d+)`).FindStringSubmatch(s.log.String()); m != nil {
				urls[i] = m[1]
			}
		}
		select {
		case code := <-s.done:
			cancel()
			t.Fatalf("serve exited %d: %s", code, s.log.String())
		default:
		}
		if time.Now().After(deadline) {
			cancel()
			t.Fatalf("serve did not start within %v: %s", startWait, s.log.String())
		}
	}
	t.Cleanup(func() { s.stop(30 * time.Second) })
	return s, urls
}

// stop ends serve as SIGTERM does through main's context and returns its
// exit status; serve not gone within d fails the test.
func (s *served) stop(d time.Duration) int {
	s.t.Helper()
	if s.stopped {
		return exitOK
	}
	s.stopped = true
	s.cancel()
	select {
	case code := <-s.done:
		return code
	case <-time.After(d):
		s.t.Fatalf("serve still stopping after %v: %s", d, s.log.String())
		return exitInternal
	}
}

// startServe starts moat serve on a loopback port with args and returns
// its URL, its log, and stop, which ends it as SIGTERM does and returns
// its exit status.
func startServe(t *testing.T, args ...string) (url string, errb *lockedBuffer, stop func() int) {
	t.Helper()
	s, urls := serveWith(t, 20*time.Second, []string{apiListening}, append([]string{"--addr", "127.0.0.1:0"}, args...)...)
	return urls[0], s.log, func() int { return s.stop(30 * time.Second) }
}

// TestServeProfileErrors checks that tokens and network profiles that do
// not fit together stop moat serve at startup with exit status 2, before
// it listens or opens any level: each case also gives a bad address, which
// is checked later, and the error must be the profile's.
func TestServeProfileErrors(t *testing.T) {
	conf := filepath.Join(t.TempDir(), "moat.json")
	if err := os.WriteFile(conf, []byte(`{"network_profiles": {"pypi": {"network": {"allow": ["pypi.test"]}}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		tokens string
		config bool
		want   string // in the error line
	}{
		{"line names an undefined profile", "alice s3cret-token-0123456789 pypi\n", false, `token "alice" may use network profile "pypi", which the config file's network_profiles does not define`},
		{"line names one of two undefined", "alice s3cret-token-0123456789 pypi,github\n", true, `network profile "github", which`},
		{"JSON names an undefined profile", `[{"name": "alice", "token": "s3cret-token-0123456789", "network_profiles": ["github"]}]`, true, `network profile "github", which`},
		{"empty profile name", "alice s3cret-token-0123456789 pypi,,github\n", true, `an empty name in the network profiles`},
		{"too many fields", "alice s3cret-token-0123456789 pypi github\n", true, `want "NAME TOKEN [PROFILE,...] [e2b_KEY]"`},
		// The control: with the profile defined, startup goes on to the
		// address, which fails.
		{"defined profile", "alice s3cret-token-0123456789 pypi\n", true, `notaport`},
	} {
		t.Run(c.name, func(t *testing.T) {
			args := []string{"--tokens-file", writeTokens(t, c.tokens, 0o600), "--addr", "127.0.0.1:notaport", "--state-dir", t.TempDir()}
			if c.config {
				args = append(args, "--config", conf)
			}
			var errb bytes.Buffer
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			code := cmdServe(ctx, args, Stdio{In: strings.NewReader(""), Out: io.Discard, Err: &errb})
			if code != exitUsage || !strings.Contains(errb.String(), c.want) {
				t.Errorf("exit %d, stderr %q; want %d and %q", code, errb.String(), exitUsage, c.want)
			}
		})
	}
}

// TestReadTokensProfiles checks both forms of the tokens file with and
// without network profiles.
func TestReadTokensProfiles(t *testing.T) {
	for _, c := range []struct {
		name, content string
		want          string // the tokens as JSON
	}{
		{"old line", "alice s3cret-token-0123456789\n", `[{"name":"alice","token":"s3cret-token-0123456789"}]`},
		{"old colon line", "alice:s3cret-token-0123456789\n", `[{"name":"alice","token":"s3cret-token-0123456789"}]`},
		{"line with profiles", "# c\nalice s3cret-token-0123456789 pypi,github\nbob:s3cret-token-9876543210 pypi\n",
			`[{"name":"alice","token":"s3cret-token-0123456789","network_profiles":["pypi","github"]},{"name":"bob","token":"s3cret-token-9876543210","network_profiles":["pypi"]}]`},
		{"JSON with profiles", `[{"name":"alice","token":"s3cret-token-0123456789","network_profiles":["pypi"]}]`,
			`[{"name":"alice","token":"s3cret-token-0123456789","network_profiles":["pypi"]}]`},
		{"line with an e2b key", "alice s3cret-token-0123456789 e2b_00112233445566778899aabbccddeeff00112233\nbob s3cret-token-9876543210 pypi e2b_ffeeddccbbaa99887766554433221100ffeeddcc\n",
			`[{"name":"alice","token":"s3cret-token-0123456789","e2b_key":"e2b_00112233445566778899aabbccddeeff00112233"},{"name":"bob","token":"s3cret-token-9876543210","network_profiles":["pypi"],"e2b_key":"e2b_ffeeddccbbaa99887766554433221100ffeeddcc"}]`},
		{"JSON with an e2b key", `[{"name":"alice","token":"s3cret-token-0123456789","e2b_key":"e2b_00112233445566778899aabbccddeeff00112233"}]`,
			`[{"name":"alice","token":"s3cret-token-0123456789","e2b_key":"e2b_00112233445566778899aabbccddeeff00112233"}]`},
	} {
		t.Run(c.name, func(t *testing.T) {
			tokens, err := readTokens(writeTokens(t, c.content, 0o600))
			if err != nil {
				t.Fatal(err)
			}
			got, _ := json.Marshal(tokens)
			if string(got) != c.want {
				t.Errorf("got %s\nwant %s", got, c.want)
			}
		})
	}
}

// TestServeProfiles serves a network profile granted to one token of two:
// the holder sees it and runs under it, the other gets 403, and the server
// shuts down cleanly, closing the profile's sandboxes.
func TestServeProfiles(t *testing.T) {
	requireRoot(t)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "from upstream") }))
	defer up.Close()
	upPort := up.Listener.Addr().(*net.TCPAddr).Port
	conf := filepath.Join(t.TempDir(), "moat.json")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(`{"network_profiles": {
		"pypi": {"network": {"allow": ["pypi.test:%d"], "resolve": {"pypi.test": "127.0.0.1"}}},
		"unused": {"network": {"allow": ["unused.test"]}}}}`, upPort)), 0o600); err != nil {
		t.Fatal(err)
	}
	tokens := writeTokens(t, "alice s3cret-token-0123456789 pypi\nbob s3cret-token-9876543210\n", 0o600)
	srv, urls := serveWith(t, 20*time.Second, []string{apiListening}, "--config", conf, "--addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", t.TempDir(), "--levels", "subprocess")
	errb := srv.log
	url := urls[0]
	call := func(method, path, token, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, url+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	if code, body := call("GET", "/v1/network_profiles", "s3cret-token-0123456789", ""); code != 200 ||
		!strings.Contains(body, fmt.Sprintf(`{"name":"pypi","levels":["subprocess"],"allow":["pypi.test:%d"]}`, upPort)) || strings.Contains(body, "unused") {
		t.Errorf("alice's profiles: %d %s", code, body)
	}
	fetch := fmt.Sprintf(`{"code":"import urllib.request\ntry:\n print(urllib.request.urlopen('http://pypi.test:%d/', timeout=5).read().decode())\nexcept Exception as e:\n print('failed', e)","network":%%s}`, upPort)
	if code, body := call("POST", "/v1/runs", "s3cret-token-0123456789", fmt.Sprintf(fetch, `"pypi"`)); code != 200 ||
		!strings.Contains(body, `"stdout":"from upstream\n"`) || !strings.Contains(body, "network: allowed pypi.test") {
		t.Errorf("alice's fetch under pypi: %d %s", code, body)
	}
	if code, body := call("POST", "/v1/runs", "s3cret-token-0123456789", fmt.Sprintf(fetch, `null`)); code != 200 ||
		!strings.Contains(body, `"stdout":"failed`) {
		t.Errorf("alice's fetch without a profile: %d %s", code, body)
	}
	if code, body := call("GET", "/metrics", "s3cret-token-0123456789", ""); code != 200 ||
		!strings.Contains(body, fmt.Sprintf(`moat_egress_requests_total{decision="allowed",host="pypi.test:%d"} 1`, upPort)) {
		t.Errorf("/metrics lacks the proxy's counter: %d %s", code, body)
	}
	if code, body := call("POST", "/v1/runs", "s3cret-token-9876543210", `{"code":"print(6*7)","network":"pypi"}`); code != 403 || !strings.Contains(body, "network_profile_forbidden") {
		t.Errorf("bob's run under pypi: %d %s", code, body)
	}
	logs := errb.String()
	for _, want := range []string{"network_profiles=pypi ", "network=pypi", `no token may use this network profile: not opened" network=unused`} {
		if !strings.Contains(logs, want) {
			t.Errorf("the log lacks %q:\n%s", want, logs)
		}
	}
	if code := srv.stop(30 * time.Second); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, errb.String())
	}
}

// TestServeE2B serves the E2B API beside moat's: a sandbox made with the
// token's e2b key is a session of that token on moat's own API.
func TestServeE2B(t *testing.T) {
	requireRoot(t)
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	srv, urls := serveWith(t, 20*time.Second, []string{apiListening, e2bListening}, "--addr", "127.0.0.1:0", "--e2b-addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", t.TempDir())
	errb := srv.log
	api := urls[0]
	e2bURL := urls[1]
	req, _ := http.NewRequest("POST", e2bURL+"/v2/sandboxes", strings.NewReader(`{"templateID":"base"}`))
	req.Header.Set("X-API-KEY", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sb map[string]any
	json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	if resp.StatusCode != 201 || sb["sandboxID"] == nil {
		t.Fatalf("create: %d %v", resp.StatusCode, sb)
	}
	req, _ = http.NewRequest("GET", api+"/v1/sessions/"+sb["sandboxID"].(string), nil)
	req.Header.Set("Authorization", "Bearer s3cret-token-0123456789")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Errorf("the sandbox on moat's API: %d, want 200 (the same token's session)", resp.StatusCode)
	}
	if code := srv.stop(30 * time.Second); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, errb.String())
	}
}

// TestServeE2BTopLevelNetwork serves the E2B API where the config's
// top-level network gives the sandboxes without a profile some hosts: a
// create of a template without a profile that asks for no network is
// refused, not given those hosts.
func TestServeE2BTopLevelNetwork(t *testing.T) {
	requireRoot(t)
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	conf := writeConfig(t, `{"network": {"allow": ["pypi.test"]}}`)
	srv, urls := serveWith(t, 20*time.Second, []string{apiListening, e2bListening}, "--config", conf, "--addr", "127.0.0.1:0", "--e2b-addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", t.TempDir(), "--levels", "subprocess")
	req, _ := http.NewRequest("POST", urls[1]+"/v2/sandboxes", strings.NewReader(`{"templateID":"base","allow_internet_access":false}`))
	req.Header.Set("X-API-KEY", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(b), "pypi.test") {
		t.Errorf("create asking for no network where the sandboxes reach pypi.test: %d %s, want 400 naming it", resp.StatusCode, b)
	}
	if code := srv.stop(30 * time.Second); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, srv.log.String())
	}
}

// TestServeE2BEveryLevel drives moat serve --levels all with E2B's JS SDK,
// unchanged, once per level served here, each through a template of the
// config file's server.e2b_templates. It skips only where node is absent
// (CI has it, from scripts/setup.sh).
func TestServeE2BEveryLevel(t *testing.T) {
	requireRoot(t)
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must have node (scripts/setup.sh installs it)")
		}
		t.Skip("node is not installed: the E2B SDK test needs it (scripts/setup.sh installs it)")
	}
	sdk := filepath.Join("..", "..", "e2b", "testdata", "sdk-2.51")
	scripts := filepath.Join("..", "..", "e2b", "testdata", "scripts")
	if _, err := os.Stat(filepath.Join(sdk, "node_modules", "e2b")); err != nil {
		t.Fatalf("the SDK harness is not installed: run scripts/setup.sh: %v", err)
	}
	// The scripts run from a directory whose node_modules is the
	// harness's (as e2b's tests run them).
	dir := t.TempDir()
	mods, _ := filepath.Abs(filepath.Join(sdk, "node_modules"))
	if err := os.Symlink(mods, filepath.Join(dir, "node_modules")); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"smoke.mjs", "interp.mjs", "contexts.mjs", "watch.mjs"} {
		src, err := os.ReadFile(filepath.Join(scripts, name))
		if err != nil {
			t.Fatal(err)
		}
		os.WriteFile(filepath.Join(dir, name), src, 0o600)
	}
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	templates := map[string]any{}
	for _, l := range moat.Levels {
		templates[string(l)] = map[string]any{"level": string(l)}
		templates[string(l)+"-interpreter"] = map[string]any{"level": string(l), "interpreter": true}
	}
	conf, _ := json.Marshal(map[string]any{"server": map[string]any{"e2b_templates": templates}})
	confPath := filepath.Join(t.TempDir(), "moat.json")
	os.WriteFile(confPath, conf, 0o600)
	srv, urls := serveWith(t, 5*time.Minute, []string{apiListening, e2bListening}, "--config", confPath, "--levels", "all", "--addr", "127.0.0.1:0", "--e2b-addr", "127.0.0.1:0",
		"--tokens-file", tokens, "--state-dir", t.TempDir(), "--wall-time", "60s")
	errb := srv.log
	api := urls[0]
	e2bURL := urls[1]
	req, _ := http.NewRequest("GET", api+"/v1/levels", nil)
	req.Header.Set("Authorization", "Bearer s3cret-token-0123456789")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var lv struct {
		Levels []struct {
			Level    string `json:"level"`
			Sessions bool   `json:"sessions"`
		} `json:"levels"`
	}
	json.NewDecoder(resp.Body).Decode(&lv)
	resp.Body.Close()
	if len(lv.Levels) == 0 {
		t.Fatalf("no level served: %s", errb.String())
	}
	for _, l := range lv.Levels {
		if !l.Sessions {
			continue
		}
		t.Run(l.Level, func(t *testing.T) {
			sctx, scancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer scancel()
			cmd := exec.CommandContext(sctx, node, "smoke.mjs")
			cmd.Dir = dir
			cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(), "E2B_API_KEY=" + key,
				"E2B_API_URL=" + e2bURL, "E2B_SANDBOX_URL=" + e2bURL, "E2B_DOMAIN=moat.invalid", "MOAT_TEMPLATE=" + l.Level}
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("node smoke.mjs: %v\n%s\n%s", err, out, stderr.Bytes())
			}
			// The code interpreter, with a live interpreter.
			icmd := exec.CommandContext(sctx, node, "interp.mjs")
			icmd.Dir, icmd.Env = dir, append(cmd.Env[:len(cmd.Env):len(cmd.Env)], "MOAT_TEMPLATE="+l.Level+"-interpreter")
			iout, err := icmd.Output()
			if err != nil {
				t.Fatalf("node interp.mjs: %v\n%s", err, iout)
			}
			for _, want := range []string{`{"step":"first","text":"42","stdout":["printed\n"],"stderr":[],"error":null}`,
				`{"step":"kept","text":"43"}`, `{"step":"after","text":"42"}`, `"name":"ZeroDivisionError"`} {
				if !strings.Contains(string(iout), want) {
					t.Errorf("no %s in:\n%s", want, iout)
				}
			}
			// The code interpreter's contexts.
			ccmd := exec.CommandContext(sctx, node, "contexts.mjs")
			ccmd.Dir, ccmd.Env = dir, icmd.Env
			cout, err := ccmd.Output()
			if err != nil {
				t.Fatalf("node contexts.mjs: %v\n%s", err, cout)
			}
			for _, want := range []string{`{"step":"names","ctx":"'in the context'","def":"'in the default'"}`,
				`{"step":"cwd","cwd":"/home/user/sub","read":"'in sub'","shared":"'in sub'","back":"True"}`,
				`{"step":"restarted","error":"NameError","def":"'in the default'"}`} {
				if !strings.Contains(string(cout), want) {
					t.Errorf("no %s in:\n%s", want, cout)
				}
			}
			// files.watchDir, by polling the level's files.
			wcmd := exec.CommandContext(sctx, node, "watch.mjs")
			wcmd.Dir, wcmd.Env = dir, cmd.Env
			wout, err := wcmd.Output()
			if err != nil {
				t.Fatalf("node watch.mjs: %v\n%s", err, wout)
			}
			if want := `{"step":"events","want":["create new.txt","create sub","create sub/by-bash.txt","remove old.txt"],"outside":[]}`; !strings.Contains(string(wout), want) {
				t.Errorf("no %s in:\n%s", want, wout)
			}
			for _, want := range []string{
				`{"step":"run","stdout":"hi\n","stderr":"","exitCode":0}`,
				`{"step":"exit","exitCode":3,"name":"CommandExitError"}`,
				`{"step":"cat","stdout":"hello from the sdk"}`,
				`{"step":"readback","text":"made by bash\n"}`,
				`{"step":"outside","error":"InvalidArgumentError"}`,
				`{"step":"stdin","stdout":"got one\ngot two\neof\n","exitCode":0}`,
				`"stdout":"started\n","end":"CommandExitError -1"}`,
				`{"step":"after","stdout":"after\n"}`,
				`{"step":"kill","killed":true}`,
				`{"step":"running","running":false}`,
			} {
				if !strings.Contains(string(out), want) {
					t.Errorf("no %s in:\n%s", want, out)
				}
			}
		})
	}
	if code := srv.stop(time.Minute); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, errb.String())
	}
}

// TestServeE2BShutdownCommand stops moat serve (on_idle suspend) while an
// E2B command runs: the command gets the shutdown wait, then it is
// cancelled and its session suspended, long before the command would end.
func TestServeE2BShutdownCommand(t *testing.T) {
	requireRoot(t)
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	const sleep = 50 * time.Second
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	srv, urls := serveWith(t, 20*time.Second, []string{e2bListening}, "--addr", "127.0.0.1:0", "--e2b-addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", t.TempDir(),
		"--on-idle", "suspend", "--shutdown-timeout", "1s", "--wall-time", "60s")
	errb := srv.log
	e2bURL := urls[0]
	req, _ := http.NewRequest("POST", e2bURL+"/v2/sandboxes", strings.NewReader(`{}`))
	req.Header.Set("X-API-KEY", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sb struct{ SandboxID, EnvdAccessToken string }
	json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	msg := []byte(fmt.Sprintf(`{"process":{"cmd":"/bin/bash","args":["-c","echo started; sleep %d"]}}`, int(sleep.Seconds())))
	req, _ = http.NewRequest("POST", e2bURL+"/process.Process/Start", bytes.NewReader(append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)))
	req.Header.Set("Content-Type", "application/connect+json")
	req.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
	req.Header.Set("X-Access-Token", sb.EnvdAccessToken)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	// Wait for its output, then stop the server as SIGTERM does.
	buf := make([]byte, 4096)
	var got []byte
	for !bytes.Contains(got, []byte(`"stdout"`)) {
		n, err := resp.Body.Read(buf)
		got = append(got, buf[:n]...)
		if err != nil {
			t.Fatalf("the command's stream: %v: %q", err, got)
		}
	}
	start := time.Now()
	if code := srv.stop(sleep / 2); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, errb.String())
	}
	if !strings.Contains(errb.String(), `msg="session suspended"`) {
		t.Errorf("the session was not suspended at shutdown: %s", errb.String())
	}
	t.Logf("stopped in %v", time.Since(start))
}

// serveProcess is moat serve in a child process (the test binary standing
// in for moat), so that the test can kill it with SIGKILL.
type serveProcess struct {
	cmd  *exec.Cmd
	api  string // moat's API's URL
	e2b  string // the E2B API's URL
	log  string
	done chan struct{}
}

func startServeProcess(t *testing.T, args ...string) *serveProcess {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	logPath := filepath.Join(t.TempDir(), "log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close()
	cmd := exec.Command(self, append([]string{"serve", "--addr", "127.0.0.1:0", "--e2b-addr", "127.0.0.1:0"}, args...)...)
	cmd.Env = append(os.Environ(), envMain+"=1")
	cmd.Stderr = logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &serveProcess{cmd: cmd, log: logPath, done: make(chan struct{})}
	go func() { cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-p.done
	})
	re := regexp.MustCompile(`msg="serve: the E2B API is listening" url=(http://127\.0\.0\.1:\d+)`)
	reAPI := regexp.MustCompile(`msg="serve: listening" url=(http://127\.0\.0\.1:\d+)`)
	for deadline := time.Now().Add(5 * time.Minute); p.e2b == "" || p.api == ""; time.Sleep(20 * time.Millisecond) {
		b, _ := os.ReadFile(logPath)
		if m := re.FindSubmatch(b); m != nil {
			p.e2b = string(m[1])
		}
		if m := reAPI.FindSubmatch(b); m != nil {
			p.api = string(m[1])
		}
		select {
		case <-p.done:
			t.Fatalf("serve exited: %s", b)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("serve did not start: %s", b)
		}
	}
	return p
}

// TestServeE2BKillRestart: after moat serve is killed with SIGKILL, the
// next one on the same state directory keeps the sandbox that was paused
// (connect resumes it, with its files), and not the one that was running,
// whose session the crash lost; a graceful restart with on_idle suspend
// keeps the running ones too.
func TestServeE2BKillRestart(t *testing.T) {
	requireRoot(t)
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	args := []string{"--tokens-file", tokens, "--state-dir", t.TempDir(), "--on-idle", "suspend", "--level", "subprocess"}
	call := func(p *serveProcess, method, path, body string, hdr map[string]string) (int, map[string]any) {
		t.Helper()
		req, _ := http.NewRequest(method, p.e2b+path, strings.NewReader(body))
		req.Header.Set("X-API-KEY", key)
		req.Header.Set("Content-Type", "application/json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var m map[string]any
		json.NewDecoder(resp.Body).Decode(&m)
		return resp.StatusCode, m
	}
	p := startServeProcess(t, args...)
	st, paused := call(p, "POST", "/v2/sandboxes", `{"templateID":"base"}`, nil)
	if st != 201 {
		t.Fatalf("create: %d %v", st, paused)
	}
	pid, _ := paused["sandboxID"].(string)
	files := map[string]string{"E2b-Sandbox-Id": pid, "X-Access-Token": paused["envdAccessToken"].(string), "Content-Type": "application/octet-stream"}
	if st, m := call(p, "POST", "/files?path=/home/user/kept.txt", "kept", files); st != 200 {
		t.Fatalf("write: %d %v", st, m)
	}
	if st, _ := call(p, "POST", "/sandboxes/"+pid+"/pause", "", nil); st != 204 {
		t.Fatalf("pause: %d", st)
	}
	_, running := call(p, "POST", "/v2/sandboxes", `{"templateID":"base"}`, nil)
	rid, _ := running["sandboxID"].(string)
	p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done

	p = startServeProcess(t, args...)
	if st, m := call(p, "GET", "/sandboxes/"+pid, "", nil); st != 200 || m["state"] != "paused" {
		t.Errorf("the paused sandbox after SIGKILL: %d %v", st, m)
	}
	if st, _ := call(p, "GET", "/sandboxes/"+rid, "", nil); st != 404 {
		t.Errorf("the running sandbox after SIGKILL: %d, want 404 (its session was lost)", st)
	}
	st, m := call(p, "POST", "/v2/sandboxes/"+pid+"/connect", `{"timeout":60}`, nil)
	if st != 201 || m["envdAccessToken"] != paused["envdAccessToken"] {
		t.Errorf("connect: %d %v, want 201 and the same access token", st, m)
	}
	req, _ := http.NewRequest("GET", p.e2b+"/files?path=kept.txt", nil)
	req.Header.Set("E2b-Sandbox-Id", pid)
	req.Header.Set("X-Access-Token", paused["envdAccessToken"].(string))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(b) != "kept" {
		t.Errorf("its file after the restart: %d %q", resp.StatusCode, b)
	}
	// A graceful restart (SIGTERM, on_idle suspend) keeps the running one.
	p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
	if p.cmd.ProcessState.ExitCode() != 0 {
		log, _ := os.ReadFile(p.log)
		t.Errorf("exit %d after SIGTERM: %s", p.cmd.ProcessState.ExitCode(), log)
	}
	p = startServeProcess(t, args...)
	if st, m := call(p, "GET", "/sandboxes/"+pid, "", nil); st != 200 || m["state"] != "paused" {
		t.Errorf("the sandbox after a graceful restart: %d %v, want it paused", st, m)
	}
	if st, _ := call(p, "DELETE", "/sandboxes/"+pid, "", nil); st != 204 {
		t.Errorf("kill: %d", st)
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
}

// TestServeE2BShutdownWatch stops moat serve (on_idle suspend) while a
// files.watchDir stream is open: the watch ends at once, and the shutdown
// does not wait the shutdown timeout for it as it does for a command (the
// watch of a suspended sandbox would wait on).
func TestServeE2BShutdownWatch(t *testing.T) {
	requireRoot(t)
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	const wait = 30 * time.Second
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	srv, urls := serveWith(t, 20*time.Second, []string{e2bListening}, "--addr", "127.0.0.1:0", "--e2b-addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", t.TempDir(),
		"--on-idle", "suspend", "--shutdown-timeout", wait.String())
	errb := srv.log
	e2bURL := urls[0]
	req, _ := http.NewRequest("POST", e2bURL+"/v2/sandboxes", strings.NewReader(`{}`))
	req.Header.Set("X-API-KEY", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sb struct{ SandboxID, EnvdAccessToken string }
	json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	msg := []byte(`{"path":"/home/user"}`)
	req, _ = http.NewRequest("POST", e2bURL+"/filesystem.Filesystem/WatchDir", bytes.NewReader(append([]byte{0, 0, 0, 0, byte(len(msg))}, msg...)))
	req.Header.Set("Content-Type", "application/connect+json")
	req.Header.Set("E2b-Sandbox-Id", sb.SandboxID)
	req.Header.Set("X-Access-Token", sb.EnvdAccessToken)
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	// The start event, then stop the server as SIGTERM does.
	buf := make([]byte, 4096)
	if n, err := resp.Body.Read(buf); err != nil || !bytes.Contains(buf[:n], []byte(`"start"`)) {
		t.Fatalf("the watch's stream: %v: %q", err, buf[:n])
	}
	start := time.Now()
	if code := srv.stop(wait / 3); code != exitOK {
		t.Errorf("exit %d after shutdown: %s", code, errb.String())
	}
	t.Logf("stopped in %v", time.Since(start))
}

// TestServeE2BRestartKeepsMemory: at each level whose sessions suspend
// with their memory, a graceful restart of moat serve (on_idle suspend)
// keeps a code interpreter sandbox's variables, those of its default
// context and of a context of its own, and its contexts.
func TestServeE2BRestartKeepsMemory(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root: the levels need it")
		}
		t.Skip("the levels need root (CI runs this as root)")
	}
	const key = "e2b_00112233445566778899aabbccddeeff00112233"
	tokens := writeTokens(t, "alice s3cret-token-0123456789 "+key+"\n", 0o600)
	templates := map[string]any{}
	for _, l := range moat.Levels {
		templates[string(l)] = map[string]any{"level": string(l), "interpreter": true}
	}
	conf, _ := json.Marshal(map[string]any{"server": map[string]any{"e2b_templates": templates}})
	confPath := filepath.Join(t.TempDir(), "moat.json")
	os.WriteFile(confPath, conf, 0o600)
	args := []string{"--config", confPath, "--levels", "all", "--tokens-file", tokens, "--state-dir", t.TempDir(), "--on-idle", "suspend", "--wall-time", "60s"}
	p := startServeProcess(t, args...)
	req, _ := http.NewRequest("GET", p.api+"/v1/levels", nil)
	req.Header.Set("Authorization", "Bearer s3cret-token-0123456789")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var lv struct {
		Levels []struct {
			Level         string `json:"level"`
			SuspendMemory bool   `json:"suspend_memory"`
		} `json:"levels"`
	}
	json.NewDecoder(resp.Body).Decode(&lv)
	resp.Body.Close()
	send := func(p *serveProcess, method, path, body string, hdr map[string]string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, p.e2b+path, strings.NewReader(body))
		req.Header.Set("X-API-KEY", key)
		req.Header.Set("Content-Type", "application/json")
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	type kept struct{ level, id, token, ctx string }
	var sandboxes []kept
	for _, l := range lv.Levels {
		if !l.SuspendMemory {
			continue
		}
		st, body := send(p, "POST", "/v2/sandboxes", `{"templateID":"`+l.Level+`","timeout":600}`, nil)
		var sb struct{ SandboxID, EnvdAccessToken string }
		if json.Unmarshal([]byte(body), &sb); st != 201 {
			t.Fatalf("%s: create: %d %s", l.Level, st, body)
		}
		hdr := map[string]string{"E2b-Sandbox-Id": sb.SandboxID, "E2b-Sandbox-Port": "49999", "X-Access-Token": sb.EnvdAccessToken}
		st, body = send(p, "POST", "/contexts", `{}`, hdr)
		var ctx struct{ ID string }
		if json.Unmarshal([]byte(body), &ctx); st != 200 {
			t.Fatalf("%s: a context: %d %s", l.Level, st, body)
		}
		for _, cell := range []string{`{"code":"x = 41"}`, `{"code":"y = 'in the context'","context_id":"` + ctx.ID + `"}`} {
			if st, body := send(p, "POST", "/execute", cell, hdr); st != 200 || strings.Contains(body, `"error"`) {
				t.Fatalf("%s: %s: %d %s", l.Level, cell, st, body)
			}
		}
		sandboxes = append(sandboxes, kept{l.Level, sb.SandboxID, sb.EnvdAccessToken, ctx.ID})
	}
	if len(sandboxes) == 0 {
		t.Logf("no level here suspends with its memory: %+v", lv.Levels)
		return
	}
	t.Logf("levels that keep memory: %+v", sandboxes)
	p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
	p = startServeProcess(t, args...)
	for _, k := range sandboxes {
		hdr := map[string]string{"E2b-Sandbox-Id": k.id, "E2b-Sandbox-Port": "49999", "X-Access-Token": k.token}
		if st, body := send(p, "POST", "/v2/sandboxes/"+k.id+"/connect", `{}`, nil); st != 201 {
			t.Errorf("%s: connect after the restart: %d %s, want 201 (resumed)", k.level, st, body)
		}
		for cell, want := range map[string]string{
			`{"code":"x + 1"}`:                          `"text": "42"`,
			`{"code":"y","context_id":"` + k.ctx + `"}`: `"text": "'in the context'"`,
		} {
			st, body := send(p, "POST", "/execute", cell, hdr)
			if st != 200 || !strings.Contains(strings.ReplaceAll(body, `":"`, `": "`), want) {
				t.Errorf("%s: %s after the restart: %d %s, want %s", k.level, cell, st, body, want)
			}
		}
		send(p, "DELETE", "/sandboxes/"+k.id, "", nil)
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	<-p.done
}
