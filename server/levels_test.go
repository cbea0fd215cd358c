package server_test

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/microvm"
	"github.com/moatsandbox/moat/server"
	"github.com/moatsandbox/moat/subprocess"
)

// openLevel opens a sandbox at level l with lim. A level that cannot run
// here skips the test outside CI and fails it in CI, where every level is
// set up.
func openLevel(t *testing.T, l moat.Level, lim moat.Limits) moat.Sandbox {
	t.Helper()
	requireRoot(t)
	var sb moat.Sandbox
	var err error
	switch l {
	case moat.LevelSubprocess:
		sb, err = subprocess.New(subprocess.Config{Limits: lim})
	case moat.LevelContainer:
		sb, err = container.New(container.Config{Limits: lim})
	case moat.LevelGVisor:
		sb, err = gvisor.New(gvisor.Config{Limits: lim})
	case moat.LevelMicroVM:
		sb, err = microvm.New(microvm.Config{Limits: lim})
	}
	if errors.Is(err, moat.ErrUnavailable) && os.Getenv("CI") != "true" {
		t.Skipf("%s: %v", l, err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return sb
}

// TestSessionsAtEveryLevel runs a session through the API at every level:
// the level says it keeps sessions, and a session keeps its files (and,
// with an interpreter, its variables) between runs, outlives a run that
// times out, and leaves nothing once deleted.
func TestSessionsAtEveryLevel(t *testing.T) {
	for _, l := range moat.Levels {
		t.Run(string(l), func(t *testing.T) {
			lim := moat.Limits{WallTime: moat.Duration(20 * time.Second)}
			sb := openLevel(t, l, lim)
			defer sb.Close()
			srv, err := server.New(server.Config{
				Sandboxes:    map[moat.Level]moat.Sandbox{l: sb},
				DefaultLevel: l,
				Tokens:       []server.Token{{Name: "a", Token: tokenA}},
				StateDir:     t.TempDir(),
			})
			if err != nil {
				t.Fatal(err)
			}
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			go srv.Serve(ln)
			defer func() {
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				srv.Shutdown(ctx)
			}()
			url := "http://" + ln.Addr().String()
			r := must(t, call(t, "GET", url+"/v1/levels", tokenA, nil), 200)
			// The microvm and gvisor levels keep a session's memory across
			// a suspend.
			if want := fmt.Sprintf(`{"level":%q,"default":true,"sessions":true,"suspend":true,"suspend_memory":%v}`, l, l == moat.LevelMicroVM || l == moat.LevelGVisor); !strings.Contains(string(r.Body), want) {
				t.Fatalf("levels: %s, want %s", r.Body, want)
			}
			for _, interp := range []bool{false, true} {
				r := call(t, "POST", url+"/v1/sessions", tokenA, map[string]any{"interpreter": interp})
				if r.Status != http.StatusCreated {
					t.Fatalf("interpreter=%v: create: %d %s", interp, r.Status, r.Body)
				}
				base := url + "/v1/sessions/" + r.JSON(t)["id"].(string)
				run := func(code string) map[string]any {
					t.Helper()
					return must(t, call(t, "POST", base+"/runs", tokenA, map[string]any{"code": code}), 200).JSON(t)
				}
				must(t, call(t, "PUT", base+"/files/in/data.txt", tokenA, []byte("uploaded")), 201)
				run("v = 41\nopen('made.txt', 'w').write(open('in/data.txt').read() + ' and made')")
				got := run("print(open('made.txt').read(), globals().get('v', 0) + 1)")
				want := map[bool]string{false: "uploaded and made 1\n", true: "uploaded and made 42\n"}[interp]
				if got["stdout"] != want {
					t.Errorf("interpreter=%v: run 2 printed %q, want %q (%v)", interp, got["stdout"], want, got)
				}
				if r := must(t, call(t, "GET", base+"/files/made.txt", tokenA, nil), 200); string(r.Body) != "uploaded and made" {
					t.Errorf("interpreter=%v: download: %q", interp, r.Body)
				}
				// Whatever the level's own words for it, a directory's
				// download is is_a_directory, and a listing gives kinds
				// and octal modes.
				if r := call(t, "GET", base+"/files/in", tokenA, nil); r.Status != http.StatusConflict || r.ErrorCode(t) != "is_a_directory" {
					t.Errorf("interpreter=%v: download of a directory: %d %s", interp, r.Status, r.Body)
				}
				listing := string(must(t, call(t, "GET", base+"/files", tokenA, nil), 200).Body)
				if !regexp.MustCompile(`\{"name":"in","type":"dir","mode":"0[0-7]{3}"`).MatchString(listing) ||
					!regexp.MustCompile(`\{"name":"made.txt","type":"file","mode":"0[0-7]{3}"`).MatchString(listing) {
					t.Errorf("interpreter=%v: listing %s", interp, listing)
				}
				// Output that is not UTF-8 comes back exactly.
				if got := run(allBytes); got["stdout_b64"] != base64.StdEncoding.EncodeToString(every(false)) || got["stderr_b64"] != base64.StdEncoding.EncodeToString(every(true)) {
					t.Errorf("interpreter=%v: binary output: %v", interp, got)
				}
				must(t, call(t, "DELETE", base, tokenA, nil), 204)
			}
		})
	}
}
