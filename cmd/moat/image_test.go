package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
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

// TestImagePackagesFlagAndConfig checks that `moat image status` names the
// image of the packages given by --packages or by the config file's image
// section (the flag overriding the file), that the list is part of the key
// whatever its order, and that a name that is not a Debian package name is
// refused with exit 2.
func TestImagePackagesFlagAndConfig(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-engine.sock"))
	dir := t.TempDir()
	keyOf := func(args ...string) string {
		t.Helper()
		stdout, stderr, code := runMoat(t, "", append([]string{"image", "status", "--json", "--state-dir", dir}, args...)...)
		if code != exitOK {
			t.Fatalf("moat image status %v: exit %d, stderr %q", args, code, stderr)
		}
		var st struct{ Key, Tag string }
		if err := json.Unmarshal([]byte(stdout), &st); err != nil {
			t.Fatalf("moat image status --json: %v: %q", err, stdout)
		}
		return st.Key
	}
	numpy := image.Config{StateDir: dir, Packages: []string{"python3-numpy"}}.Key()
	plain := image.Config{StateDir: dir}.Key()
	if got := keyOf(); got != plain {
		t.Errorf("no packages: key %s, want the default image's %s", got, plain)
	}
	if got := keyOf("--packages", "python3-numpy"); got != numpy {
		t.Errorf("--packages python3-numpy: key %s, want %s", got, numpy)
	}
	both := image.Config{StateDir: dir, Packages: []string{"python3-numpy", "python3-pandas"}}.Key()
	if a, b := keyOf("--packages", "python3-pandas,python3-numpy"), keyOf("--packages", "python3-numpy, python3-pandas,python3-numpy"); a != both || b != both {
		t.Errorf("the same packages in another order: keys %s and %s, want %s", a, b, both)
	}
	conf := writeConfig(t, `{"image": {"packages": ["python3-numpy"]}}`)
	if got := keyOf("--config", conf); got != numpy {
		t.Errorf("image.packages in the config file: key %s, want %s", got, numpy)
	}
	if got := keyOf("--config", conf, "--packages", "python3-numpy,python3-pandas"); got != both {
		t.Errorf("--packages over the file's image.packages: key %s, want %s", got, both)
	}
	for _, bad := range []string{"Python3-Numpy", "numpy;rm", "-x", "a"} {
		_, stderr, code := runMoat(t, "", "image", "status", "--state-dir", dir, "--packages", bad)
		if code != exitUsage || !strings.Contains(stderr, "is not a Debian package name") {
			t.Errorf("--packages %q: exit %d, stderr %q; want 2 and why", bad, code, stderr)
		}
	}
	stdout, _, _ := runMoat(t, "", "image", "status", "--state-dir", dir, "--packages", "python3-numpy")
	if !strings.Contains(stdout, "moat image build --packages python3-numpy") {
		t.Errorf("moat image status of an image not built does not say how to build it: %q", stdout)
	}
}

// TestLevelsRunTheConfiguredImage checks that the image section reaches
// every level that runs the shared image: the container level's Docker tag,
// gvisor's root filesystem and the microvm's image (whose key names its
// disk, see microvm.ensureDisk) are those of the configured packages.
func TestLevelsRunTheConfiguredImage(t *testing.T) {
	fc, err := decodeConfig([]byte(`{"image": {"state_dir": "/s", "packages": ["python3-numpy"]}}`))
	if err != nil {
		t.Fatal(err)
	}
	want := image.Config{StateDir: "/s", Packages: []string{"python3-numpy"}}
	if want.Key() == (image.Config{StateDir: "/s"}).Key() {
		t.Fatal("the packages are not in the key")
	}
	cc, _ := fc.containerConfig()
	if cc.SharedImage.Key() != want.Key() {
		t.Errorf("container: shared image %s, want %s", cc.SharedImage.Key(), want.Key())
	}
	gc, _ := fc.gvisorConfig()
	if gc.SharedImage.Key() != want.Key() {
		t.Errorf("gvisor: shared image %s, want %s", gc.SharedImage.Key(), want.Key())
	}
	mc, _ := fc.microvmConfig()
	if mc.Image.Key() != want.Key() {
		t.Errorf("microvm: image %s, want %s", mc.Image.Key(), want.Key())
	}
	// An image of the operator's own at the container level is run as
	// given, whatever the image section says.
	fc.Container.Image = "registry.example/mine:1"
	if cc, _ := fc.containerConfig(); cc.Image != "registry.example/mine:1" {
		t.Errorf("container.image %q was replaced by %q", "registry.example/mine:1", cc.Image)
	}
}

// TestImagePackagesAtEveryLevel builds (once: it is cached by key) the
// image with python3-numpy and checks that `import numpy` works through
// `moat run --config` at the container, gvisor and microvm levels, which
// run that image (the microvm a disk and a template made from it), and
// fails at the default image. It needs root, debootstrap and
// Debian's mirror the first time (CI has them).
func TestImagePackagesAtEveryLevel(t *testing.T) {
	requireRoot(t)
	ctx := t.Context()
	cfg := image.Config{Packages: []string{"python3-numpy"}, Progress: testWriter{t}}
	if _, err := buildImage(ctx, cfg); err != nil {
		t.Fatalf("building the image with python3-numpy: %v", err)
	}
	const levels = `"container": {"warm": -1}, "gvisor": {"warm": -1}, "microvm": {"warm": -1}`
	conf := writeConfig(t, `{"image": {"packages": ["python3-numpy"]}, `+levels+`}`)
	plain := writeConfig(t, `{`+levels+`}`)
	const code = `import numpy; print("numpy", numpy.__version__, int(numpy.arange(5).sum()))`
	for _, level := range []string{"container", "gvisor", "microvm"} {
		stdout, stderr, exit := runMoat(t, "", "run", "--config", conf, "--level", level, "--wall-time", "120s", "--cpu-time", "120s", "-c", code)
		if exit != exitOK || !strings.Contains(stdout, "numpy ") || !strings.HasSuffix(strings.TrimSpace(stdout), " 10") {
			t.Errorf("%s with image.packages python3-numpy: exit %d, stdout %q, stderr %q", level, exit, stdout, stderr)
		}
		_, stderr, exit = runMoat(t, "", "run", "--config", plain, "--level", level, "--wall-time", "120s", "--cpu-time", "120s", "-c", code)
		if exit == exitOK || !strings.Contains(stderr, "No module named 'numpy'") {
			t.Errorf("%s with the default image: exit %d, stderr %q; want numpy missing (the control)", level, exit, stderr)
		}
	}
}

// testWriter passes each write to t.Log.
type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// TestDoctorShowsTheImage checks that moat doctor names the image the
// config's image section chooses: its key, its packages, whether it is
// built and how to build it, in text and JSON.
func TestDoctorShowsTheImage(t *testing.T) {
	dir := t.TempDir()
	conf := writeConfig(t, `{"image": {"state_dir": "`+dir+`", "packages": ["python3-numpy"]}}`)
	want := image.Config{StateDir: dir, Packages: []string{"python3-numpy"}}
	stdout, stderr, code := runMoat(t, "", "doctor", "--config", conf, "--json")
	if code != exitOK {
		t.Fatalf("moat doctor --json: exit %d, stderr %q", code, stderr)
	}
	var got struct{ Image doctorImage }
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatalf("moat doctor --json: %v: %q", err, stdout)
	}
	if got.Image.Key != want.Key() || got.Image.Built || !slices.Equal(got.Image.Packages, want.PackageList()) {
		t.Errorf("moat doctor --json: image %+v, want key %s, not built, packages %v", got.Image, want.Key(), want.PackageList())
	}
	stdout, _, _ = runMoat(t, "", "doctor", "--config", conf)
	if line := "image: " + want.Key()[:12] + ", not built (moat image build --packages python3-numpy --state-dir " + dir + ")"; !strings.Contains(stdout, line) {
		t.Errorf("moat doctor does not say %q:\n%s", line, stdout)
	}
}

// pipProbe runs pip as code does: its version, its list, the user agent it
// sends an index (which reads /etc/debian_version through its vendored
// distro, whose reader lets only a missing file pass: a file there that
// the run may not read was a PermissionError that crashed every pip
// command that talks to an index), and an install with no network, which
// must fail saying no distribution was found, not crash.
const pipProbe = `
import subprocess, sys, os
def pip(*args):
    r = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr
code, out = pip("--version"); print("version", code, out.split(" from ")[0])
code, out = pip("list"); print("list", code, "pip" in out)
from pip._internal.network.session import user_agent
print("agent", '"distro"' in user_agent())
code, out = pip("install", "--retries", "0", "--timeout", "2", "--target", os.getcwd() + "/t", "six")
print("install", code, "No matching distribution found for six" in out, "Traceback" in out or "PermissionError" in out)
`

// TestPipAtEveryLevel checks that pip works at every level that has it:
// the host's at subprocess (setup.sh installs python3-pip), the image's at
// the others; and that without a network it fails cleanly. The levels run
// at once, each its own `moat run` as `moat serve --levels all` would run
// them side by side: the microvm's pip (TCG) takes longest, and the others
// wait on their sandboxes beside it. Nothing here measures a time.
func TestPipAtEveryLevel(t *testing.T) {
	requireRoot(t)
	conf := writeConfig(t, `{"container": {"warm": -1}, "gvisor": {"warm": -1}, "microvm": {"warm": -1}}`)
	for _, level := range []string{"subprocess", "container", "gvisor", "microvm"} {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			stdout, stderr, code := runMoat(t, "", "run", "--config", conf, "--level", level, "--wall-time", "240s", "--cpu-time", "240s", "--memory", "512MiB", "-c", pipProbe)
			got := strings.Fields(stdout)
			want := []string{"version", "0", "pip", "", "list", "0", "True", "agent", "True", "install", "1", "True", "False"}
			ok := code == exitOK && len(got) == len(want)
			for i := range want {
				if ok && want[i] != "" && got[i] != want[i] {
					ok = false
				}
			}
			if !ok {
				t.Errorf("%s: exit %d, stdout %q, stderr %q; want %q", level, code, stdout, stderr, want)
			}
		})
	}
}

// TestImageBuildProgressPlain checks that `moat image build` writing to
// something that is not a terminal prints plain lines, each with the
// elapsed time, and never rewrites one.
func TestImageBuildProgressPlain(t *testing.T) {
	t.Setenv("DOCKER_HOST", "unix://"+filepath.Join(t.TempDir(), "no-engine.sock"))
	cfg := image.Config{StateDir: t.TempDir(), Packages: []string{"python3-numpy"}}
	if err := os.MkdirAll(image.Path(cfg), 0o755); err != nil {
		t.Fatal(err)
	}
	rec := `{"key":"` + cfg.Key() + `","built_at":"` + time.Now().Add(-time.Hour).UTC().Format(time.RFC3339) + `","size_bytes":1234}`
	if err := os.WriteFile(filepath.Join(cfg.Dir(), "image.json"), []byte(rec), 0o644); err != nil {
		t.Fatal(err)
	}
	stdout, stderr, code := runMoat(t, "", "image", "build", "--state-dir", cfg.StateDir, "--packages", "python3-numpy")
	if code != exitOK {
		t.Fatalf("moat image build: exit %d, stderr %q", code, stderr)
	}
	if strings.ContainsAny(stdout, "\r\x1b") {
		t.Errorf("moat image build to a pipe rewrites lines: %q", stdout)
	}
	elapsed := regexp.MustCompile(`^image: \[ *\d+\.\ds\] `)
	var steps int
	for _, l := range strings.Split(strings.TrimSpace(stdout), "\n") {
		if strings.HasPrefix(l, "image: ") {
			steps++
			if !elapsed.MatchString(l) {
				t.Errorf("progress line %q has no elapsed time", l)
			}
		}
	}
	if steps == 0 || !strings.Contains(stdout, "rootfs "+cfg.Key()[:12]+": already built") {
		t.Errorf("moat image build says nothing of the cached image:\n%s", stdout)
	}
}
