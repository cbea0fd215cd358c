package server_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// clientEnv is the environment a client's tests get: the server's URL and
// two tokens, nothing of this process's own.
func clientEnv(ts *testServer, home string, extra ...string) []string {
	return append([]string{
		"PATH=" + os.Getenv("PATH"),
		"HOME=" + home,
		"MOAT_URL=" + ts.URL,
		"MOAT_TOKEN=" + tokenA,
		"MOAT_OTHER_TOKEN=" + tokenB,
	}, extra...)
}

// TestPythonClient installs the Python client (clients/python) with pip,
// offline, into a venv of its own (the host's Python is not touched), and
// runs its tests with that venv against a real server on loopback.
func TestPythonClient(t *testing.T) {
	requireRoot(t)
	tmp := t.TempDir()
	// A copy: a build leaves nothing in the source tree.
	src := filepath.Join(tmp, "src")
	if err := os.CopyFS(src, os.DirFS("../clients/python")); err != nil {
		t.Fatal(err)
	}
	venv := filepath.Join(tmp, "venv")
	env := []string{"PATH=" + os.Getenv("PATH"), "HOME=" + tmp, "PIP_NO_CACHE_DIR=1", "PIP_DISABLE_PIP_VERSION_CHECK=1", "PYTHONDONTWRITEBYTECODE=1"}
	for _, args := range [][]string{
		{"python3", "-m", "venv", venv},
		{filepath.Join(venv, "bin", "pip"), "install", "--no-build-isolation", "--no-index", src},
	} {
		cmd := exec.Command(args[0], args[1:]...)
		cmd.Env = env
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	// From the tests' directory: the source (under src/) is not on the
	// path, so the tests import the installed package.
	cmd := exec.Command(filepath.Join(venv, "bin", "python"), "-m", "unittest", "discover", "-v", "-s", "tests")
	cmd.Dir = src
	cmd.Env = clientEnv(ts, tmp, "PYTHONDONTWRITEBYTECODE=1", "MOAT_CLIENT_INSTALLED=1")
	out, err := cmd.CombinedOutput()
	t.Logf("python -m unittest:\n%s", out)
	if err != nil {
		t.Fatalf("the Python client's tests failed: %v", err)
	}
	// They must have run, not been skipped.
	if strings.Contains(string(out), "skipped") || !strings.Contains(string(out), "OK") {
		t.Errorf("the Python tests did not all run")
	}
}

// TestJSClient runs the JavaScript client's tests (clients/js, node --test)
// against a real server on loopback. CI has Node 20; elsewhere a machine
// without node skips.
func TestJSClient(t *testing.T) {
	node, err := exec.LookPath("node")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must have node (Node 20) for the JavaScript client's tests")
		}
		t.Skip("no node on PATH (CI has Node 20)")
	}
	if out, err := exec.Command(node, "--version").Output(); err != nil || !regexp.MustCompile(`^v(2[0-9]|[3-9][0-9])\.`).Match(out) {
		t.Fatalf("node --version: %q, %v: the client needs Node 20 or later", out, err)
	}
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	cmd := exec.Command(node, "--test")
	cmd.Dir = "../clients/js"
	cmd.Env = clientEnv(ts, t.TempDir())
	out, err := cmd.CombinedOutput()
	t.Logf("node --test:\n%s", out)
	if err != nil {
		t.Fatalf("the JavaScript client's tests failed: %v", err)
	}
	// They must have run, not been skipped: the suite against the server
	// holds more than ten.
	n := 0
	if m := regexp.MustCompile(`(?m)^# pass (\d+)$`).FindSubmatch(out); m != nil {
		n, _ = strconv.Atoi(string(m[1]))
	}
	if n < 10 || !regexp.MustCompile(`(?m)^# fail 0$`).Match(out) ||
		!regexp.MustCompile(`(?m)^# skipped 0$`).Match(out) {
		t.Errorf("the JavaScript tests did not all run")
	}
}
