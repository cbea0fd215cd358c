package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestHelperStartsBeforeHeavyInits: a subprocess helper (moat re-executed
// as moat-sandbox-helper) does its work in package init, and the packages
// of moat's binary that the helper does not need (Docker's client,
// Prometheus, the SDKs) are initialized only after it, so that no helper
// pays for them (subprocess/internal/helper). Their inits, traced by the
// runtime, must not run in a helper.
func TestHelperStartsBeforeHeavyInits(t *testing.T) {
	cmd := exec.Command(os.Args[0])
	cmd.Args = []string{"moat-sandbox-helper"}
	cmd.Env = []string{"GODEBUG=inittrace=1"}
	// Its status pipe (fd 3) and an empty spec (fd 4): a helper
	// discarded before any run, which exits at once.
	null, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	cmd.ExtraFiles = []*os.File{null, null}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper with no spec: %v\n%s", err, out)
	}
	trace := string(out)
	if !strings.Contains(trace, "init runtime ") && !strings.Contains(trace, "init os ") {
		t.Fatalf("no init trace from the helper:\n%s", trace)
	}
	for _, heavy := range []string{
		"github.com/distribution/reference",
		"github.com/prometheus/client_golang/prometheus",
		"github.com/docker/docker/client",
		"github.com/anthropics/anthropic-sdk-go/v2",
	} {
		if strings.Contains(trace, "init "+heavy+" @") {
			t.Errorf("the helper initialized %s before doing its work", heavy)
		}
	}
}
