package server_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// TestPythonClient runs the Python client's own tests (clients/python)
// against a real server on loopback.
func TestPythonClient(t *testing.T) {
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	cmd := exec.Command("python3", "-m", "unittest", "-v")
	cmd.Dir = "../clients/python"
	cmd.Env = []string{
		"PATH=" + os.Getenv("PATH"),
		"MOAT_URL=" + ts.URL,
		"MOAT_TOKEN=" + tokenA,
		"MOAT_OTHER_TOKEN=" + tokenB,
		"PYTHONDONTWRITEBYTECODE=1",
	}
	out, err := cmd.CombinedOutput()
	t.Logf("python3 -m unittest:\n%s", out)
	if err != nil {
		t.Fatalf("the Python client's tests failed: %v", err)
	}
	// They must have run, not been skipped.
	if strings.Contains(string(out), "skipped") || !strings.Contains(string(out), "OK") {
		t.Errorf("the Python tests did not all run")
	}
}
