// Package mcptest drives a moat MCP server with the official TypeScript
// SDK's client (@modelcontextprotocol/sdk from npm), a client moat did not
// write, for the tests of package mcpserver and of `moat mcp`.
//
// The client is the script mcpserver/testdata/ts-client/client.mjs; its
// dependencies are pinned in the package-lock.json beside it and installed
// with `npm ci` the first time a test needs them. Node.js and npm must be
// installed: without them a test fails when the CI environment variable is
// set, and is skipped otherwise.
package mcptest

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// Dir returns the directory of the TypeScript client, after installing its
// dependencies if they are missing.
func Dir(t testing.TB) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("mcptest: cannot locate the package's source")
	}
	dir := filepath.Join(filepath.Dir(file), "..", "testdata", "ts-client")
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") != "" {
				t.Fatalf("mcptest: %s is required to run the TypeScript MCP client (install nodejs and npm): %v", tool, err)
			}
			t.Skipf("mcptest: %s is not installed, so the official TypeScript MCP client cannot run (with CI set this fails instead)", tool)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@modelcontextprotocol", "sdk", "package.json")); err != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "npm", "ci", "--no-audit", "--no-fund")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("mcptest: npm ci in %s: %v\n%s", dir, err, out)
		}
	}
	return dir
}

// Run runs the client with args ("--", COMMAND, ARG... to spawn a server
// over stdio; "--url", URL for streamable HTTP) and env added to the
// test's environment (the spawned server inherits it). The client lists the
// tools, checks run_python's schema, calls it with print(6*7) and checks
// 42, sends bad input and checks the tool errors, and checks that the
// server still answers. Run fails t if the client fails or its summary is
// wrong.
func Run(t testing.TB, env []string, args ...string) {
	t.Helper()
	dir := Dir(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", append([]string{"client.mjs"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("mcptest: node client.mjs %s: %v\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), err, out, stderr.String())
	}
	t.Logf("TypeScript client: %s", strings.TrimSpace(string(out)))

	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var got struct {
		OK     bool     `json:"ok"`
		Tools  []string `json:"tools"`
		Result string   `json:"result"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &got); err != nil {
		t.Fatalf("mcptest: the client's last line is not its JSON summary: %v\n%s", err, out)
	}
	if !got.OK || len(got.Tools) != 1 || got.Tools[0] != "run_python" || !strings.Contains(got.Result, "stdout:\n42\n") {
		t.Errorf("mcptest: client summary %+v", got)
	}
}
