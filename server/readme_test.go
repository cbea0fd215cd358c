package server_test

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// step is one shell command of a README block and the texts its output
// must contain.
type step struct {
	cmd    string
	expect []string
}

// quickstartSteps returns the commands of the sh blocks of the README's
// Quickstart section, continuation lines joined, each with the "# =>"
// lines under it.
func quickstartSteps(t *testing.T, readme string) []step {
	t.Helper()
	start := strings.Index(readme, "\n## Quickstart\n")
	if start < 0 {
		t.Fatal("server/README.md has no Quickstart section")
	}
	section := readme[start+1:]
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	var steps []step
	for _, m := range regexp.MustCompile("(?s)```sh\n(.*?)```").FindAllStringSubmatch(section, -1) {
		var cur []string
		for _, line := range strings.Split(m[1], "\n") {
			switch {
			case strings.HasPrefix(line, "# => "):
				if len(steps) == 0 || cur != nil {
					t.Fatalf("README: %q follows no command", line)
				}
				steps[len(steps)-1].expect = append(steps[len(steps)-1].expect, strings.TrimPrefix(line, "# => "))
			case cur == nil && (strings.TrimSpace(line) == "" || strings.HasPrefix(line, "#")):
			case strings.HasSuffix(line, "\\"):
				cur = append(cur, line)
			default:
				steps = append(steps, step{cmd: strings.Join(append(cur, line), "\n")})
				cur = nil
			}
		}
		if cur != nil {
			t.Fatalf("README: a command ends its block with a continuation: %q", cur)
		}
	}
	return steps
}

// TestREADMEQuickstart runs the curl commands of server/README.md's
// Quickstart, as written, against a real server at the subprocess level,
// and checks what each prints, so that the README cannot drift from the
// API.
func TestREADMEQuickstart(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	steps := quickstartSteps(t, string(readme))
	// What the quickstart must show a newcomer.
	all := ""
	for _, s := range steps {
		all += s.cmd + "\n"
	}
	for _, want := range []string{"/v1/runs", "/v1/sessions", "-X PUT", "/files/out.txt", "text/event-stream", "-X DELETE", "Content-Type: application/json"} {
		if !strings.Contains(all, want) {
			t.Errorf("the quickstart has no command with %q", want)
		}
	}
	ts := startServer(t, moat.Limits{WallTime: moat.Duration(time.Minute)}, nil)
	var script strings.Builder
	script.WriteString("set -eo pipefail\n")
	for i, s := range steps {
		// The marker starts a line of its own even after output
		// without a newline at its end.
		fmt.Fprintf(&script, "printf '\\n@@step %d\\n'\n%s\n", i, s.cmd)
	}
	cmd := exec.Command("bash", "-c", script.String())
	cmd.Dir = t.TempDir()
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + cmd.Dir, "MOAT_URL=" + ts.URL, "MOAT_TOKEN=" + tokenA}
	out, err := cmd.CombinedOutput()
	t.Logf("the quickstart printed:\n%s", out)
	parts := regexp.MustCompile(`\n@@step \d+\n`).Split(string(out), -1)[1:]
	if err != nil {
		t.Fatalf("the quickstart failed at step %d (%q): %v", len(parts)-1, steps[max(len(parts)-1, 0)].cmd, err)
	}
	if len(parts) != len(steps) {
		t.Fatalf("%d steps printed, %d in the README", len(parts), len(steps))
	}
	for i, s := range steps {
		for _, want := range s.expect {
			if !strings.Contains(parts[i], want) {
				t.Errorf("step %d:\n%s\nprinted %q, which lacks %q", i, s.cmd, parts[i], want)
			}
		}
	}
}
