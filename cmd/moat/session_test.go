package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestSessionBadInput checks the errors moat session gives before it
// sends anything, and when nothing serves at its URL.
func TestSessionBadInput(t *testing.T) {
	t.Setenv("MOAT_URL", "")
	t.Setenv("MOAT_TOKEN", "")
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := "http://" + ln.Addr().String()
	ln.Close() // nothing listens there now
	for _, c := range []struct {
		name  string
		token string
		args  []string
		want  int
		msg   string
	}{
		{"no command", "tok", []string{"--url", dead}, exitUsage, "which command"},
		{"no token", "", []string{"--url", dead, "list"}, exitUsage, "no token"},
		{"bad url", "tok", []string{"--url", "ftp://x", "list"}, exitUsage, "not an http(s) URL"},
		{"unknown command", "tok", []string{"--url", dead, "explode"}, exitUsage, "unknown command"},
		{"missing id", "tok", []string{"--url", dead, "show"}, exitUsage, "want a session ID"},
		{"missing token file", "", []string{"--url", dead, "--token-file", "/nonexistent/t", "list"}, exitUsage, "--token-file"},
		{"nothing serves", "tok", []string{"--url", dead, "list"}, exitEnvironment, "cannot reach moat serve"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv("MOAT_TOKEN", c.token)
			var out, errb bytes.Buffer
			code := cmdSession(context.Background(), c.args, Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
			if code != c.want || !strings.Contains(errb.String(), c.msg) {
				t.Errorf("exit %d, stderr %q; want %d and %q", code, errb.String(), c.want, c.msg)
			}
		})
	}
}

// TestSession drives a session of a real moat serve (subprocess level)
// through moat session: files across a suspend, a snapshot forked, the
// code's exit status, and the server's refusals as exit status 2.
func TestSession(t *testing.T) {
	requireRoot(t)
	const token = "s3cret-token-0123456789"
	url, _, _ := startServe(t, "--tokens-file", writeTokens(t, "alice "+token+"\n", 0o600), "--state-dir", t.TempDir(), "--levels", "subprocess")
	tokenFile := filepath.Join(t.TempDir(), "token")
	os.WriteFile(tokenFile, []byte(token+"\n"), 0o600)
	t.Setenv("MOAT_URL", url)
	t.Setenv("MOAT_TOKEN", "")
	moatSession := func(stdin string, args ...string) (code int, stdout, stderr string) {
		t.Helper()
		var out, errb bytes.Buffer
		code = cmdSession(context.Background(), append([]string{"--token-file", tokenFile}, args...), Stdio{In: strings.NewReader(stdin), Out: &out, Err: &errb})
		return code, out.String(), errb.String()
	}
	mustRun := func(args ...string) string {
		t.Helper()
		code, out, errs := moatSession("", args...)
		if code != exitOK {
			t.Fatalf("moat session %v: exit %d: %s", args, code, errs)
		}
		return out
	}

	id := strings.TrimSpace(mustRun("create", "--interpreter"))
	if id == "" || strings.ContainsAny(id, " \n") {
		t.Fatalf("create printed %q, want one id", id)
	}
	local := filepath.Join(t.TempDir(), "data.txt")
	os.WriteFile(local, []byte("from the host\n"), 0o600)
	mustRun("put", id, local)
	if code, out, _ := moatSession("with open('data.txt') as f: print(f.read().upper(), end='')\nopen('made.txt','w').write('kept')\n", "run", id, "-"); code != 0 || out != "FROM THE HOST\n" {
		t.Errorf("run: exit %d, stdout %q", code, out)
	}
	if code, _, _ := moatSession("", "run", id, "-c", "import sys; sys.exit(3)"); code != 3 {
		t.Errorf("run of sys.exit(3): exit %d, want 3", code)
	}

	mustRun("suspend", id)
	var view struct{ State string }
	json.Unmarshal([]byte(mustRun("--json", "show", id)), &view)
	if view.State != "suspended" {
		t.Errorf("state after suspend = %q, want suspended", view.State)
	}
	if got := mustRun("get", id, "made.txt"); got != "kept" {
		t.Errorf("made.txt after suspend = %q, want kept", got)
	}
	if !strings.Contains(mustRun("show", id), "running") {
		t.Errorf("show after a file read does not say running")
	}

	snap := strings.Fields(mustRun("snapshot", id, "before-fork"))[0]
	if !strings.Contains(mustRun("snapshots"), "before-fork") {
		t.Errorf("snapshots does not list before-fork")
	}
	fork := strings.TrimSpace(mustRun("create", "--from-snapshot", snap))
	if fork == id {
		t.Fatalf("the fork has the parent's id")
	}
	mustRun("run", fork, "-c", "open('made.txt','w').write('fork')")
	if got := mustRun("get", id, "made.txt"); got != "kept" {
		t.Errorf("the parent sees its fork's write: %q", got)
	}
	if out := mustRun("ls", fork); !strings.Contains(out, "data.txt") || !strings.Contains(out, "made.txt") {
		t.Errorf("ls of the fork: %q", out)
	}
	if !strings.Contains(mustRun("list"), fork) {
		t.Errorf("list does not show the fork")
	}
	mustRun("delete-snapshot", snap)
	mustRun("end", fork)
	mustRun("end", id)
	if code, _, errs := moatSession("", "show", id); code != exitUsage || !strings.Contains(errs, "404") {
		t.Errorf("show of an ended session: exit %d, %q; want %d and the server's 404", code, errs, exitUsage)
	}
	if code, _, errs := moatSession("", "--token-file", "/dev/null", "list"); code != exitUsage || !strings.Contains(errs, "no token") {
		t.Errorf("empty token file: exit %d, %q", code, errs)
	}
}
