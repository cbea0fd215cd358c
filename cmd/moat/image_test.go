package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat/image"
)

// TestImageBuildWithoutDocker checks that `moat image build` with a built
// root filesystem and no Docker engine does nothing, exits 0 and says why
// it skipped the import, and that `moat image status` says the same; both
// as JSON with the keys they have always had.
func TestImageBuildWithoutDocker(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-engine.sock"))
	cfg := image.Config{StateDir: t.TempDir()}
	if err := os.MkdirAll(image.Path(cfg), 0o755); err != nil {
		t.Fatal(err)
	}
	rec := `{"key":"` + cfg.Key() + `","built_at":"` + time.Now().Add(-time.Hour).UTC().Format(time.RFC3339) + `","size_bytes":1234}`
	if err := os.WriteFile(filepath.Join(cfg.Dir(), "image.json"), []byte(rec), 0o644); err != nil {
		t.Fatal(err)
	}

	stdout, stderr, code := runMoat(t, "", "image", "build", "--state-dir", cfg.StateDir, "--json")
	if code != exitOK {
		t.Fatalf("moat image build: exit %d, stderr %q", code, stderr)
	}
	var build map[string]any
	if err := json.Unmarshal([]byte(stdout), &build); err != nil {
		t.Fatalf("moat image build --json: %v: %q", err, stdout)
	}
	if build["cached"] != true || build["imported"] != false || build["path"] != image.Path(cfg) || build["tag"] != nil {
		t.Errorf("moat image build --json = %v, want cached, not imported, no tag", build)
	}
	if why, _ := build["docker"].(string); !strings.Contains(why, "no Docker engine answers") {
		t.Errorf("moat image build --json: docker = %q, want why the import was skipped", why)
	}
	if !strings.Contains(stderr, "the root filesystem is built, the Docker image is not") {
		t.Errorf("moat image build does not say it skipped the import: %q", stderr)
	}

	stdout, stderr, code = runMoat(t, "", "image", "status", "--state-dir", cfg.StateDir, "--json")
	if code != exitOK {
		t.Fatalf("moat image status: exit %d, stderr %q", code, stderr)
	}
	var status map[string]any
	if err := json.Unmarshal([]byte(stdout), &status); err != nil {
		t.Fatalf("moat image status --json: %v: %q", err, stdout)
	}
	if status["exists"] != true || status["in_docker"] != false || status["tag"] != cfg.Tag() || status["size_bytes"] != 1234.0 {
		t.Errorf("moat image status --json = %v", status)
	}
	if why, _ := status["docker"].(string); !strings.Contains(why, "no Docker engine answers") {
		t.Errorf("moat image status --json: docker = %q, want why the engine could not be asked", why)
	}
}
