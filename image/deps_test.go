package image

import (
	"bytes"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// engineClientPrefixes are the import path prefixes of Docker's Engine API
// client and of what it brings along. Only the container level talks to
// Docker; package image and the levels that read its root filesystem
// directly (gvisor, microvm) must link none of it.
var engineClientPrefixes = []string{
	"github.com/docker/",
	"github.com/moby/",
	"github.com/containerd/",
}

// TestNoDockerDeps checks, with `go list -deps` as Tailscale's deptest
// does, that package image, gvisor and microvm link no package of Docker's
// client: importing the root filesystem into Docker is package container's
// business.
func TestNoDockerDeps(t *testing.T) {
	// go test puts its own GOROOT/bin first in the test's PATH.
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("no go command to list the dependencies with: %v", err)
	}
	roots := []string{
		"github.com/moatsandbox/moat/image",
		"github.com/moatsandbox/moat/gvisor",
		"github.com/moatsandbox/moat/microvm",
	}
	args := append([]string{"list", "-deps", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}"}, roots...)
	cmd := exec.Command(gobin, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, stderr.Bytes())
	}
	importers := map[string][]string{} // package -> the listed packages that import it
	var deps []string
	for line := range strings.Lines(string(out)) {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		deps = append(deps, f[0])
		for _, imp := range f[1:] {
			importers[imp] = append(importers[imp], f[0])
		}
	}
	if !slices.Contains(deps, roots[0]) {
		t.Fatalf("go list -deps did not list %s; it printed:\n%s", roots[0], out)
	}
	for _, dep := range deps {
		for _, prefix := range engineClientPrefixes {
			if strings.HasPrefix(dep, prefix) {
				t.Errorf("%s links %s (imported by %s)", strings.Join(roots, ", "), dep, strings.Join(importers[dep], ", "))
			}
		}
	}
}
