package server_test

import (
	"os"
	"os/exec"
	"path/filepath"
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
