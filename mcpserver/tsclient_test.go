package mcpserver

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestTypeScriptClient drives the server with the official TypeScript SDK's
// client (@modelcontextprotocol/sdk from npm, pinned in
// testdata/ts-client/package-lock.json), a client moat did not write.
//
// Over stdio the client spawns this test binary, which TestMain turns into
// the server `moat mcp` runs (the same Server, over stdin and stdout, on the
// real subprocess level); the binary itself is exercised the same way by
// cmd/moat's tests. Over HTTP it connects to a server started here.
//
// It needs node and npm; `npm ci` fetches the client when node_modules is
// missing. Without node it fails when CI is set, and skips otherwise.
func TestTypeScriptClient(t *testing.T) {
	dir := tsClientSetup(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}

	t.Run("stdio", func(t *testing.T) {
		out := runTSClient(t, dir, []string{envServe + "=stdio"}, "--", self)
		checkTSOutput(t, out)
	})

	t.Run("http", func(t *testing.T) {
		s := newServer(t, Config{})
		ln, err := Listen("127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		served := make(chan error, 1)
		go func() { served <- s.Serve(ctx, ln) }()
		defer func() {
			cancel()
			if err := <-served; err != nil {
				t.Errorf("Serve: %v", err)
			}
		}()
		out := runTSClient(t, dir, nil, "--url", "http://"+ln.Addr().String()+"/")
		checkTSOutput(t, out)
	})
}

func checkTSOutput(t *testing.T, out string) {
	t.Helper()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var got struct {
		OK     bool     `json:"ok"`
		Tools  []string `json:"tools"`
		Result string   `json:"result"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &got); err != nil {
		t.Fatalf("the client's last line is not its JSON summary: %v\n%s", err, out)
	}
	if !got.OK || len(got.Tools) != 1 || got.Tools[0] != "run_python" || !strings.Contains(got.Result, "stdout:\n42\n") {
		t.Errorf("client summary %+v", got)
	}
}

// tsClientSetup returns the directory of the TypeScript client, after
// installing its dependencies if they are missing. It fails the test when
// node or npm is missing and CI is set, and skips it otherwise.
func tsClientSetup(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("testdata", "ts-client"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("%s is required to run the TypeScript MCP client (install nodejs and npm): %v", tool, err)
			}
			t.Skipf("%s is not installed, so the official TypeScript MCP client cannot run (with CI set this fails instead)", tool)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@modelcontextprotocol", "sdk", "package.json")); err != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in %s: %v\n%s", dir, err, out)
		}
	}
	return dir
}

// runTSClient runs client.mjs with args and the extra environment, and
// returns its standard output; it fails the test if the client fails.
func runTSClient(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", append([]string{"client.mjs"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("node client.mjs %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, out, stderr.String())
	}
	t.Logf("TypeScript client: %s", strings.TrimSpace(string(out)))
	return string(out)
}
