package e2b_test

// Hostile probes of the E2B API: one valid key (and its sandboxes), or
// none, on loopback. Each test names the hole it closes or the defence it
// pins.

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/e2b/internal/envd/filesystem"
	"github.com/moatsandbox/moat/server"
)

// A sandbox lives at most its creation plus the operator's
// max_session_ttl, as a session of moat's own API: setTimeout and connect
// used to set its end to now plus the timeout each time, so that a key
// could keep one alive for ever by calling either in a loop.
func TestLifetimeCappedAtMaxTTL(t *testing.T) {
	max := 4 * time.Second
	ts := startServer(t, moat.Limits{}, func(c *server.Config, _ *e2b.Config) {
		c.MaxSessionTTL, c.SessionTTL, c.IdleTimeout = moat.Duration(max), moat.Duration(max), moat.Duration(max)
	})
	c := ts.create(t, keyA, map[string]any{"timeout": 4})
	time.Sleep(1500 * time.Millisecond)
	var e struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
	}
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/timeout", map[string]any{"timeout": 4}, &e); resp.StatusCode != 400 || e.Code != 400 {
		t.Errorf("setTimeout past creation plus the maximum ttl: %d %+v, want 400", resp.StatusCode, e)
	}
	capEnd := func() time.Duration {
		info, err := ts.srv.Session("a", c.SandboxID)
		if err != nil {
			t.Fatal(err)
		}
		return info.ExpiresAt.Sub(info.CreatedAt)
	}
	if d := capEnd(); d > max {
		t.Errorf("after setTimeout the sandbox ends %v after its creation, past the maximum %v", d, max)
	}
	// Connect never fails for it (the SDK sends its default timeout), and
	// extends the life only up to the cap.
	if resp := ts.do(t, keyA, "POST", "/v2/sandboxes/"+c.SandboxID+"/connect", map[string]any{"timeout": 4}, nil); resp.StatusCode != 200 {
		t.Errorf("connect: %d %s, want 200", resp.StatusCode, readAll(t, resp))
	}
	if d := capEnd(); d > max {
		t.Errorf("after connect the sandbox ends %v after its creation, past the maximum %v", d, max)
	}
	// Within the cap, setTimeout still works.
	if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/timeout", map[string]any{"timeout": 1}, nil); resp.StatusCode != 204 {
		t.Errorf("setTimeout within the cap: %d %s, want 204", resp.StatusCode, readAll(t, resp))
	}
}

// A timeout in seconds so large that it wraps around in nanoseconds is
// refused, not taken for the small duration it wraps to.
func TestTimeoutOverflow(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	// 18446744074s is 2^64ns plus 290ms.
	for _, secs := range []int64{18446744074, 9223372037, -1, 0} {
		if resp := ts.do(t, keyA, "POST", "/v2/sandboxes", map[string]any{"timeout": secs}, nil); resp.StatusCode != 400 {
			t.Errorf("create with timeout %d: %d, want 400", secs, resp.StatusCode)
		}
		if resp := ts.do(t, keyA, "POST", "/sandboxes/"+c.SandboxID+"/timeout", map[string]any{"timeout": secs}, nil); resp.StatusCode != 400 {
			t.Errorf("setTimeout %d: %d, want 400", secs, resp.StatusCode)
		}
		if resp := ts.do(t, keyA, "POST", "/v2/sandboxes/"+c.SandboxID+"/connect", map[string]any{"timeout": secs}, nil); resp.StatusCode != 400 {
			t.Errorf("connect with timeout %d: %d, want 400", secs, resp.StatusCode)
		}
	}
	if n := len(ts.srv.Sessions("a")); n != 1 {
		t.Errorf("%d sessions, want the one", n)
	}
}

// A compressed Connect message over the message cap is refused after the
// cap, not inflated to its end: connect-go's own gzip went on decompressing
// an oversized message into the void to learn its size, so that 800KiB of
// compressed zeros cost 800MiB of inflating on the host, per request, for
// anyone with a sandbox's access token. Judged as a ratio: such a bomb
// costs about what a plain request of the same size on the wire costs.
func TestCompressedMessageBomb(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	hc := sandboxClient(c.SandboxID, c.EnvdAccessToken)
	// gzip members concatenated are one stream: 100 of 8MiB of zeros.
	var member bytes.Buffer
	zw := gzip.NewWriter(&member)
	zw.Write(make([]byte, 8<<20))
	zw.Close()
	bomb := bytes.Repeat(member.Bytes(), 100)
	plain := []byte(`{"path":"` + strings.Repeat("a", len(bomb)) + `"}`)
	send := func(body []byte, gz bool) (time.Duration, int, string) {
		req, _ := http.NewRequest("POST", ts.URL+"/filesystem.Filesystem/Stat", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if gz {
			req.Header.Set("Content-Encoding", "gzip")
		}
		start := time.Now()
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(t, resp)
		return time.Since(start), resp.StatusCode, b
	}
	best := func(body []byte, gz bool) time.Duration {
		var min time.Duration
		for i := range 3 {
			d, st, b := send(body, gz)
			if st/100 == 2 || st/100 == 5 {
				t.Fatalf("a request of %d bytes (gzip %v): %d %.200s, want a refusal", len(body), gz, st, b)
			}
			if i == 0 || d < min {
				min = d
			}
		}
		return min
	}
	p, b := best(plain, false), best(bomb, true)
	t.Logf("%d bytes on the wire: plain %v, gzip of %dMiB of zeros %v", len(bomb), p, 100*8, b)
	if b > 5*p {
		t.Errorf("the bomb took %v, %.0f times the plain request's %v: it was inflated past the cap", b, float64(b)/float64(p), p)
	}
	// A compressed message within the cap is still read.
	var small bytes.Buffer
	zw = gzip.NewWriter(&small)
	zw.Write([]byte(`{"path":"/home/user"}`))
	zw.Close()
	if _, st, body := send(small.Bytes(), true); st != 200 || !strings.Contains(body, `"/home/user"`) {
		t.Errorf("a small compressed Stat: %d %s", st, body)
	}
}

// What a create keeps for the sandbox's life is capped: metadata, which
// every list answers, used to be up to the 1MiB body, and a list of 16
// sandboxes with 1MiB of "<" each (six bytes each in JSON) was a ~100MB
// answer, built whole in memory for each of any number of concurrent
// lists. envVars are capped too, and their names checked at the create
// rather than failing every command after.
func TestCreateKeepsBoundedMetadata(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	post := func(body string) int {
		req, _ := http.NewRequest("POST", ts.URL+"/v2/sandboxes", strings.NewReader(body))
		req.Header.Set("X-API-KEY", keyA)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp)
		return resp.StatusCode
	}
	big := strings.Repeat("<", 1<<20-100)
	for name, body := range map[string]string{
		"1MiB of metadata":        `{"metadata":{"k":"` + big + `"}}`,
		"1MiB of envVars":         `{"envVars":{"K":"` + big + `"}}`,
		"an env name with =":      `{"envVars":{"A=B":"x"}}`,
		"an empty env name":       `{"envVars":{"":"x"}}`,
		"a NUL in an env value":   `{"envVars":{"A":"x\u0000y"}}`,
		"a NUL in a metadata key": `{"metadata":{"a\u0000":"x"}}`,
	} {
		if st := post(body); st != 400 {
			t.Errorf("create with %s: %d, want 400", name, st)
		}
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("%d sessions made by refused creates", n)
	}
	md := map[string]string{"user": "alice", "run": strings.Repeat("x", 8<<10)}
	c := ts.create(t, keyA, map[string]any{"metadata": md, "envVars": map[string]string{"A": strings.Repeat("y", 32<<10)}})
	if c.Metadata["run"] != md["run"] {
		t.Errorf("metadata within the cap: %d bytes kept", len(c.Metadata["run"]))
	}
}

// No error answer echoes more than about a kilobyte of the request: the
// messages quote the sandbox id, the path, the template named, and JSON's
// escapes make a "<" six bytes, so that a 1MB E2b-Sandbox-Id header, sent
// with no key and no token, was a 6MB answer built whole in memory (and
// held for the write timeout by a client that does not read).
func TestErrorsEchoBounded(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, nil)
	long := strings.Repeat("<", 900<<10)
	const most = 8 << 10
	check := func(name string, req *http.Request, client *http.Client) {
		t.Helper()
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body := readAll(t, resp)
		if resp.StatusCode/100 == 2 || len(body) > most || !strings.Contains(body, "(cut)") {
			t.Errorf("%s: %d, an answer of %d bytes (at most %d, cut): %.100s", name, resp.StatusCode, len(body), most, body)
		}
	}
	req, _ := http.NewRequest("GET", ts.URL+"/health", nil)
	req.Header.Set("E2b-Sandbox-Id", long)
	check("an unknown sandbox id, no token", req, http.DefaultClient)
	req, _ = http.NewRequest("POST", ts.URL+"/v2/sandboxes", strings.NewReader(`{"templateID":"`+long+`"}`))
	req.Header.Set("X-API-KEY", keyA)
	check("an unknown template", req, http.DefaultClient)
	hc := sandboxClient(c.SandboxID, c.EnvdAccessToken)
	req, _ = http.NewRequest("GET", ts.URL+"/files?path=/"+long, nil)
	check("GET /files outside /home/user", req, hc)
	req, _ = http.NewRequest("POST", ts.URL+"/filesystem.Filesystem/Stat", strings.NewReader(`{"path":"/`+long+`"}`))
	req.Header.Set("Content-Type", "application/json")
	check("Connect Stat outside /home/user", req, hc)
	msg := `{"process":{"cmd":"/bin/true","cwd":"/` + long + `"}}`
	body := append([]byte{0, byte(len(msg) >> 24), byte(len(msg) >> 16), byte(len(msg) >> 8), byte(len(msg))}, msg...)
	req, _ = http.NewRequest("POST", ts.URL+"/process.Process/Start", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/connect+json")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if b := readAll(t, resp); len(b) > most || !strings.Contains(b, "(cut)") {
		t.Errorf("Connect Start with a cwd outside /home/user: an answer of %d bytes: %.100s", len(b), b)
	}
}

// countingSandbox counts the file operations of its sessions that remove.
type countingSandbox struct {
	moat.Sandbox
	removes *atomic.Int64
}

func (c countingSandbox) NewSession(ctx context.Context, o moat.SessionOptions) (moat.Session, error) {
	sess, err := c.Sandbox.(moat.Sessioner).NewSession(ctx, o)
	if err != nil {
		return nil, err
	}
	return countingSession{sess, c.removes}, nil
}

type countingSession struct {
	moat.Session
	removes *atomic.Int64
}

func (s countingSession) RemoveFile(ctx context.Context, name string) error {
	s.removes.Add(1)
	return s.Session.RemoveFile(ctx, name)
}

// Removing a directory costs a bounded number of file operations, whatever
// it holds: it was one per entry (up to a listing's 100000), and each is
// an exec into the sandbox at the container and microvm levels, so that
// one request of one key was hours of the host's work. A large directory
// is removed by one run of the session; a symbolic link in it is removed,
// never followed.
func TestRemoveLargeDirectoryBounded(t *testing.T) {
	for _, interp := range []bool{false, true} {
		t.Run(fmt.Sprintf("interpreter=%v", interp), func(t *testing.T) { testRemoveLarge(t, interp) })
	}
}

func testRemoveLarge(t *testing.T, interp bool) {
	removes := new(atomic.Int64)
	ts := startServer(t, moat.Limits{}, func(c *server.Config, _ *e2b.Config) {
		c.Sandboxes[moat.LevelSubprocess] = countingSandbox{c.Sandboxes[moat.LevelSubprocess], removes}
	})
	tpl := "base"
	if interp {
		tpl = "code-interpreter-v1"
	}
	c := ts.create(t, keyA, map[string]any{"templateID": tpl})
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	keep := t.TempDir()
	if r, err := run(t, cl, bash("mkdir -p big/sub small && cd big && for i in $(seq 1500); do : > f$i; done && : > sub/x && ln -s "+keep+" out && cd ../small && : > a && : > b && echo ok")); err != nil || r.stdout != "ok\n" {
		t.Fatalf("making the files: %+v, %v", r, err)
	}
	ctx := context.Background()
	for _, dir := range []string{"/home/user/big", "small"} {
		removes.Store(0)
		if _, err := cl.fs.Remove(ctx, connect.NewRequest(&filesystem.RemoveRequest{Path: dir})); err != nil {
			t.Fatalf("interpreter %v: remove %s: %v", interp, dir, err)
		}
		if n := removes.Load(); n > 256 {
			t.Errorf("interpreter %v: remove %s took %d file operations", interp, dir, n)
		}
		if _, err := cl.fs.Stat(ctx, connect.NewRequest(&filesystem.StatRequest{Path: dir})); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("interpreter %v: %s after its remove: %v, want not found", interp, dir, err)
		}
	}
	if _, err := os.Stat(keep); err != nil {
		t.Errorf("interpreter %v: the directory a link in the removed one pointed at: %v", interp, err)
	}
}

// A NUL in an environment variable's value is refused before anything
// runs. In a cell it used to fail halfway through setting the cell's
// variables, outside the runner's try, so that those set before it stayed
// in the live interpreter's environment for every later cell and command
// ("envs hold for that cell only").
func TestEnvNULRefused(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	c := ts.create(t, keyA, map[string]any{"templateID": "code-interpreter-v1"})
	if st, objs := execute(t, ts, c, map[string]any{"code": "1", "env_vars": map[string]string{"A": "kept", "B": "x\x00y"}}); st != 400 {
		t.Errorf("a cell with a NUL in a variable's value: %d %v, want 400", st, objs)
	}
	_, objs := execute(t, ts, c, map[string]any{"code": "import os\nos.environ.get('A')"})
	if r, _ := of(objs, "result"); len(r) != 0 {
		t.Errorf("a variable of the refused cell is in the next one's environment: %v", r)
	}
	cl := ts.clients(c.SandboxID, c.EnvdAccessToken)
	cfg := bash("true")
	cfg.Envs = map[string]string{"B": "x\x00y"}
	if r, err := run(t, cl, cfg); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("a command with a NUL in a variable's value: %+v, %v, want invalid_argument", r.end, err)
	}
}

// New checks the keys it is given as the server checks its tokens file:
// the keys may come from another list than the server's own, and a key
// of a malformed form, one given to two tokens (whose holders would then
// be one owner), or one of a token the server does not know (sandboxes of
// an owner no cap is counted for) is refused.
func TestNewChecksKeys(t *testing.T) {
	ts := startServer(t, moat.Limits{}, nil)
	a := server.Token{Name: "a", Token: "token-a-0123456789abcdef", E2BKey: keyA}
	b := server.Token{Name: "b", Token: "token-b-0123456789abcdef", E2BKey: keyB}
	for name, tokens := range map[string][]server.Token{
		"a short key":         {{Name: "a", Token: a.Token, E2BKey: "e2b_00"}},
		"an upper-case key":   {{Name: "a", Token: a.Token, E2BKey: strings.ToUpper(keyA)}},
		"one key, two tokens": {a, {Name: "b", Token: b.Token, E2BKey: keyA}},
		"an unknown token":    {a, {Name: "c", Token: "token-c-0123456789abcdef", E2BKey: keyB}},
		"another's name":      {{Name: "b", Token: a.Token, E2BKey: keyA}},
	} {
		if _, err := e2b.New(e2b.Config{Sessions: ts.srv, Tokens: tokens}); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("%s: %v, want an error wrapping moat.ErrInvalid", name, err)
		}
	}
	if _, err := e2b.New(e2b.Config{Sessions: ts.srv, Tokens: []server.Token{a, b}}); err != nil {
		t.Errorf("the server's own tokens: %v", err)
	}
}

// A multipart upload's part header is capped: mime/multipart holds one
// whole in memory, up to 10MiB, for each upload in progress (30 uploads
// holding a 9MiB header held 270MB of the host's heap). Files of many parts,
// and a file larger than the cap, are still written.
func TestMultipartHeaderCapped(t *testing.T) {
	ts := startServer(t, moat.Limits{}, func(_ *server.Config, c *e2b.Config) { c.MaxFileBytes = moat.MiB })
	c := ts.create(t, keyA, nil)
	hc := sandboxClient(c.SandboxID, c.EnvdAccessToken)
	post := func(body string) (int, string) {
		resp, err := hc.Post(ts.URL+"/files", "multipart/form-data; boundary=B", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(t, resp)
		return resp.StatusCode, b
	}
	part := func(name, pad, data string) string {
		return "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name + "\"\r\nX-Pad: " + pad + "\r\n\r\n" + data + "\r\n"
	}
	if st, b := post(part("big-header", strings.Repeat("a", 1<<20), "x") + "--B--\r\n"); st != 413 {
		t.Errorf("a part with a 1MiB header: %d %.200s, want 413", st, b)
	}
	skipped := "--B\r\nContent-Disposition: form-data; name=\"other\"\r\n\r\n" + strings.Repeat("z", 1<<20) + "\r\n"
	if st, b := post(skipped + part("after", "", "x") + "--B--\r\n"); st != 413 {
		t.Errorf("a 1MiB part not named file: %d %.200s, want 413", st, b)
	}
	// Within the caps: 200KiB of contents (over the overhead cap, under
	// the file cap) in each of many parts.
	var body strings.Builder
	data := strings.Repeat("d", 200<<10)
	for i := range 10 {
		body.WriteString(part(fmt.Sprintf("many/f%d", i), strings.Repeat("p", 1000), data))
	}
	body.WriteString("--B--\r\n")
	if st, b := post(body.String()); st != 200 {
		t.Fatalf("10 files of 200KiB: %d %.200s", st, b)
	}
	resp, err := hc.Get(ts.URL + "/files?path=many/f9")
	if err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, resp); got != data {
		t.Errorf("many/f9: %d bytes, want %d", len(got), len(data))
	}
}

// Nothing of moat's own environment reaches a command or a cell, whatever
// the template: a variable set in the server's process is in neither's
// environment, nor in their parents'.
func TestNoServerEnvironmentInSandbox(t *testing.T) {
	canary := "moat-canary-" + strings.Repeat("7", 20)
	t.Setenv("MOAT_E2B_CANARY", canary)
	ts := startServer(t, moat.Limits{}, nil)
	for _, tpl := range []string{"base", "code-interpreter-v1"} {
		c := ts.create(t, keyA, map[string]any{"templateID": tpl})
		r, err := run(t, ts.clients(c.SandboxID, c.EnvdAccessToken), bash(`env; for p in /proc/[0-9]*; do tr '\0' '\n' < $p/environ; done 2>/dev/null`))
		if err != nil || !strings.Contains(r.stdout, "PATH=") || strings.Contains(r.stdout+r.stderr, canary) {
			t.Errorf("%s: a command's environment: %v, canary seen %v", tpl, err, strings.Contains(r.stdout+r.stderr, canary))
		}
		_, objs := execute(t, ts, c, map[string]any{"code": "import os\nrepr(dict(os.environ))"})
		res, _ := of(objs, "result")
		if len(res) != 1 || !strings.Contains(fmt.Sprint(res[0]["text"]), "PATH") || strings.Contains(fmt.Sprint(objs), canary) {
			t.Errorf("%s: a cell's environment: %v", tpl, objs)
		}
	}
}
