package e2b_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// nodeFor returns node, skipping only where it is absent (CI has it, from
// scripts/setup.sh), and fails where the SDK harness is not installed or
// node is older than the SDK needs.
func nodeFor(t *testing.T, dir string) string {
	t.Helper()
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must have node (scripts/setup.sh installs it): the E2B SDK tests need it")
		}
		t.Skip("node is not installed: the E2B SDK tests need it (scripts/setup.sh installs it)")
	}
	out, err := exec.Command(node, "--version").Output()
	if err != nil {
		t.Fatal(err)
	}
	v := strings.Split(strings.TrimPrefix(strings.TrimSpace(string(out)), "v"), ".")
	major, _ := strconv.Atoi(v[0])
	minor := 0
	if len(v) > 1 {
		minor, _ = strconv.Atoi(v[1])
	}
	if major < 20 || (major == 20 && minor < 18) {
		t.Fatalf("node %s is older than the E2B SDK needs (>= 20.18.1)", out)
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "e2b", "package.json")); err != nil {
		t.Fatalf("the SDK harness is not installed: run scripts/setup.sh (npm ci --prefix %s): %v", dir, err)
	}
	return node
}

// TestSDK drives a real server with E2B's JS SDK, unchanged, as a user who
// switched by setting three variables would: create, commands.run, files
// write and read, list with a metadata filter, kill. E2B_DOMAIN names a
// domain that cannot resolve, so no call can leave the machine.
func TestSDK(t *testing.T) {
	for _, v := range sdkVersions {
		t.Run(v, func(t *testing.T) { testSDK(t, filepath.Join("testdata", v)) })
	}
}

// sdkVersions are the SDK harnesses under testdata, each a lockfile that
// pins e2b and @e2b/code-interpreter; the scripts in testdata/scripts run
// against each.
var sdkVersions = []string{"sdk-2.51", "sdk-2.45"}

func testSDK(t *testing.T, dir string) {
	node := nodeFor(t, dir)
	ts := startServer(t, moat.Limits{}, nil)
	out := []byte(runNode(t, node, dir, "smoke.mjs", ts.URL))
	steps := map[string]map[string]any{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("a line that is not JSON: %q", sc.Text())
		}
		steps[m["step"].(string)] = m
	}
	id, _ := steps["create"]["id"].(string)
	for _, c := range []struct {
		step, key string
		want      any
	}{
		{"run", "stdout", "hi\n"},
		{"run", "exitCode", 0.0},
		{"env", "stdout", "hello at home\n"},
		{"env", "stderr", "oops\n"},
		{"exit", "exitCode", 3.0},
		{"exit", "name", "CommandExitError"},
		{"stream", "chunks", "line1\nline2\nline3\n"},
		{"write", "path", "/home/user/notes/hello.txt"},
		{"read", "text", "hello from the sdk"},
		{"cat", "stdout", "hello from the sdk"},
		{"readback", "text", "made by bash\n"},
		{"list", "names", []any{"made.txt:file", "notes:dir"}},
		{"exists", "yes", true},
		{"exists", "no", false},
		{"outside", "error", "InvalidArgumentError"},
		{"stdin", "stdout", "got one\ngot two\neof\n"},
		{"stdin", "exitCode", 0.0},
		{"background", "stdout", "started\n"},
		{"background", "end", "CommandExitError -1"},
		{"after", "stdout", "after\n"},
		{"listed", "ids", []any{id}},
		{"kill", "killed", true},
		{"running", "running", false},
	} {
		got, _ := json.Marshal(steps[c.step][c.key])
		want, _ := json.Marshal(c.want)
		if !bytes.Equal(got, want) {
			t.Errorf("%s.%s = %s, want %s", c.step, c.key, got, want)
		}
	}
	if bg := steps["background"]; bg == nil || fmt.Sprint(bg["pids"]) != fmt.Sprintf("[%v]", bg["pid"]) {
		t.Errorf("commands.list() while a background command ran: %v", bg)
	}
	if id == "" {
		t.Fatalf("no sandbox was created:\n%s", out)
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("%d sessions left after the SDK's kill", n)
	}
}

// TestCodeInterpreterSDK drives a real server with @e2b/code-interpreter,
// unchanged: runCode's main result, output, errors and variables kept
// from one call to the next, with commands and files in the same sandbox.
func TestCodeInterpreterSDK(t *testing.T) {
	for _, v := range sdkVersions {
		t.Run(v, func(t *testing.T) { testCodeInterpreterSDK(t, filepath.Join("testdata", v)) })
	}
}

func testCodeInterpreterSDK(t *testing.T, dir string) {
	node := nodeFor(t, dir)
	ts := startServer(t, moat.Limits{}, nil)
	out := runNode(t, node, dir, "interp.mjs", ts.URL)
	for _, want := range []string{
		`{"step":"first","text":"42","stdout":["printed\n"],"stderr":[],"error":null}`,
		`{"step":"kept","text":"43"}`,
		`{"step":"error","name":"ZeroDivisionError","value":"division by zero","traceback":true,"stderr":["to stderr\n"]}`,
		`{"step":"stream","lines":["0\n","1\n","2\n"]}`,
		`{"step":"none","text":null,"results":0}`,
		`{"step":"files","text":"'from the files api'"}`,
		`{"step":"command","stdout":"from bash\ndata.txt\n"}`,
		`{"step":"after","text":"42"}`,
		`{"step":"kill","killed":true}`,
	} {
		if !strings.Contains(out, want+"\n") {
			t.Errorf("no %s in:\n%s", want, out)
		}
	}
	if n := len(ts.srv.Sessions("a")); n != 0 {
		t.Errorf("%d sessions left after the SDK's kill", n)
	}
}

// runNode runs testdata/scripts/<script> against the SDKs of the harness
// sdk (a directory of testdata), pointed at url, and returns what it
// printed. The script runs from a directory of its own whose node_modules
// is the harness's, so that one script serves every harness. Only what
// the SDK needs is in its environment: nothing of the test's own (an
// E2B_API_KEY of the developer's above all), but env.
func runNode(t *testing.T, node, sdk, script, url string, env ...string) string {
	t.Helper()
	mods, err := filepath.Abs(filepath.Join(sdk, "node_modules"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	if err := os.Symlink(mods, filepath.Join(dir, "node_modules")); err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile(filepath.Join("testdata", "scripts", script))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, script), src, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, script)
	cmd.Dir = dir
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir(),
		"E2B_API_KEY=" + keyA, "E2B_API_URL=" + url, "E2B_SANDBOX_URL=" + url,
		"E2B_DOMAIN=moat.invalid",
	}
	cmd.Env = append(cmd.Env, env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node %s: %v\nstdout:\n%s\nstderr:\n%s", script, err, out, stderr.Bytes())
	}
	return string(out)
}

// TestCodeContextsSDK drives the code interpreter's contexts with
// @e2b/code-interpreter, unchanged: a context's names are its own, its
// files the sandbox's, its cwd its cells' working directory; list,
// restart and remove.
func TestCodeContextsSDK(t *testing.T) {
	for _, v := range sdkVersions {
		t.Run(v, func(t *testing.T) {
			dir := filepath.Join("testdata", v)
			node := nodeFor(t, dir)
			ts := startServer(t, moat.Limits{}, nil)
			out := runNode(t, node, dir, "contexts.mjs", ts.URL)
			for _, want := range []string{
				`{"step":"created","language":"python","cwd":"/home/user","id":true}`,
				`{"step":"names","ctx":"'in the context'","def":"'in the default'"}`,
				`{"step":"cwd","cwd":"/home/user/sub","read":"'in sub'","shared":"'in sub'","back":"True"}`,
				`{"step":"listed","same":true,"n":2}`,
				`{"step":"restarted","error":"NameError","def":"'in the default'"}`,
				`{"step":"removed","error":"NotFoundError","n":1}`,
				`{"step":"language","error":"SandboxError"}`,
				`{"step":"kill","killed":true}`,
			} {
				if !strings.Contains(out, want+"\n") {
					t.Errorf("no %s in:\n%s", want, out)
				}
			}
		})
	}
}

// TestWatchDirSDK drives files.watchDir with the unchanged SDK: the
// events of files written through files and by commands, and removed, in
// the directory watched and below it, none of elsewhere; a missing
// directory is the SDK's FileNotFoundError.
func TestWatchDirSDK(t *testing.T) {
	for _, v := range sdkVersions {
		t.Run(v, func(t *testing.T) {
			dir := filepath.Join("testdata", v)
			node := nodeFor(t, dir)
			ts := startServer(t, moat.Limits{}, nil)
			out := runNode(t, node, dir, "watch.mjs", ts.URL)
			for _, want := range []string{
				`{"step":"events","want":["create new.txt","create sub","create sub/by-bash.txt","remove old.txt"],"outside":[]}`,
				`{"step":"missing","error":"FileNotFoundError"}`,
				`{"step":"kill","killed":true}`,
			} {
				if !strings.Contains(out, want+"\n") {
					t.Errorf("no %s in:\n%s", want, out)
				}
			}
		})
	}
}
