package image

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func TestKeyNamesEveryInput(t *testing.T) {
	base := Config{StateDir: "/s", Suite: "bookworm", Packages: []string{"python3"}, Mirror: "http://m/debian"}
	variants := map[string]Config{
		"suite":    {StateDir: "/s", Suite: "trixie", Packages: []string{"python3"}, Mirror: "http://m/debian"},
		"packages": {StateDir: "/s", Suite: "bookworm", Packages: []string{"python3", "curl"}, Mirror: "http://m/debian"},
		"mirror":   {StateDir: "/s", Suite: "bookworm", Packages: []string{"python3"}, Mirror: "http://other/debian"},
	}
	for what, c := range variants {
		if c.Key() == base.Key() {
			t.Errorf("changing the %s does not change the key", what)
		}
	}
	same := map[string]Config{
		"state dir":        {StateDir: "/elsewhere", Suite: "bookworm", Packages: []string{"python3"}, Mirror: "http://m/debian"},
		"package order":    {StateDir: "/s", Suite: "bookworm", Packages: []string{"python3", "python3"}, Mirror: "http://m/debian/"},
		"a trailing slash": {StateDir: "/s", Suite: "bookworm", Packages: []string{"python3"}, Mirror: "http://m/debian/"},
	}
	for what, c := range same {
		if c.Key() != base.Key() {
			t.Errorf("changing the %s changes the key", what)
		}
	}
	if tag := base.Tag(); tag != "moat-sandbox:"+base.Key()[:12] {
		t.Errorf("Tag() = %q", tag)
	}
	if p := Path(base); p != filepath.Join("/s/images", base.Key(), "rootfs") {
		t.Errorf("Path() = %q", p)
	}
}

func TestValidate(t *testing.T) {
	bad := []Config{
		{StateDir: "relative"},
		{Suite: "book worm"},
		{Packages: []string{"-oops"}},
		{Packages: []string{"a;b"}},
		{Mirror: "ftp://x"},
		{Repository: "Upper"},
	}
	for _, c := range bad {
		if err := c.Validate(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Validate(%+v) = %v, want ErrInvalid", c, err)
		}
	}
	if err := (Config{StateDir: "/x"}).Validate(); err != nil {
		t.Errorf("the zero Config does not validate: %v", err)
	}
}

func TestSystemMirror(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) {
		t.Helper()
		p := filepath.Join(dir, name)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got := systemMirror(dir, "bookworm"); got != "http://deb.debian.org/debian" {
		t.Errorf("no sources: %q, want the fallback", got)
	}
	write("sources.list.d/debian.sources", `Types: deb
# a comment
URIs: http://mirror.example/debian/
Suites: bookworm bookworm-updates
Components: main

Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main
`)
	if got := systemMirror(dir, "bookworm"); got != "http://mirror.example/debian" {
		t.Errorf("deb822: %q", got)
	}
	if got := systemMirror(dir, "bookworm-security"); got != "http://security.example/debian-security" {
		t.Errorf("deb822, second stanza: %q", got)
	}
	write("sources.list", "# deb http://commented/debian bookworm main\ndeb-src http://src/debian bookworm main\ndeb [arch=amd64 signed-by=/k.gpg] http://one/debian bookworm main\n")
	if got := systemMirror(dir, "bookworm"); got != "http://one/debian" {
		t.Errorf("one-line format with options: %q", got)
	}
}

func TestCheckClean(t *testing.T) {
	mk := func(files ...string) string {
		root := t.TempDir()
		for _, d := range []string{"root", "home", "etc", "usr/bin"} {
			os.MkdirAll(filepath.Join(root, d), 0o755)
		}
		for _, f := range files {
			p := filepath.Join(root, f)
			os.MkdirAll(filepath.Dir(p), 0o755)
			os.WriteFile(p, []byte("x"), 0o600)
		}
		return root
	}
	if err := CheckClean(mk("usr/bin/python3", "etc/hostname")); err != nil {
		t.Errorf("a clean tree: %v", err)
	}
	for _, f := range []string{"root/.bashrc", "home/alice/notes", "etc/ssh/ssh_host_ed25519_key", "etc/resolv.conf",
		"usr/share/x/.ssh/config", "opt/id_rsa", "srv/.aws/credentials", "var/lib/authorized_keys"} {
		if err := CheckClean(mk(f)); err == nil {
			t.Errorf("a tree holding /%s passes the check", f)
		}
	}
}

func TestRecipeDropsHostFiles(t *testing.T) {
	root := t.TempDir()
	for _, f := range []string{"etc/resolv.conf", "etc/hostname", "etc/apt/sources.list", "root/.profile", "usr/share/doc/x/copyright", "var/cache/apt/archives/a.deb", "usr/bin/python3.11"} {
		p := filepath.Join(root, f)
		os.MkdirAll(filepath.Dir(p), 0o755)
		os.WriteFile(p, []byte("host"), 0o644)
	}
	os.MkdirAll(filepath.Join(root, "home"), 0o755)
	os.Symlink("python3.11", filepath.Join(root, "usr/bin/python3"))
	if err := applyRecipe(root); err != nil {
		t.Fatal(err)
	}
	if err := CheckClean(root); err != nil {
		t.Errorf("after the recipe: %v", err)
	}
	for _, gone := range []string{"etc/resolv.conf", "etc/apt/sources.list", "root/.profile", "usr/share/doc", "var/cache/apt/archives"} {
		if exists(filepath.Join(root, gone)) {
			t.Errorf("the recipe left /%s", gone)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(root, "etc/hostname")); string(b) != "sandbox\n" {
		t.Errorf("/etc/hostname = %q, want sandbox", b)
	}
	if !exists(filepath.Join(root, "work")) {
		t.Error("the recipe made no /work")
	}
	if v := pythonVersion(root); v != "3.11" {
		t.Errorf("pythonVersion = %q", v)
	}
}

// TestBuildCached checks that a build whose root filesystem is there does
// nothing and says so, without root and without debootstrap.
func TestBuildCached(t *testing.T) {
	cfg := Config{StateDir: t.TempDir(), Mirror: "http://m/debian"}
	if st := GetStatus(cfg); st.Exists {
		t.Fatalf("status of an empty state dir: %+v", st)
	}
	if err := os.MkdirAll(Path(cfg), 0o755); err != nil {
		t.Fatal(err)
	}
	rec := `{"key":"` + cfg.Key() + `","built_at":"` + time.Now().Add(-time.Hour).UTC().Format(time.RFC3339) + `","size_bytes":1234}`
	if err := os.WriteFile(filepath.Join(cfg.Dir(), "image.json"), []byte(rec), 0o644); err != nil {
		t.Fatal(err)
	}
	var progress bytes.Buffer
	cfg.Progress = &progress
	r, cached, err := BuildRootFS(context.Background(), cfg)
	if err != nil || !cached || r.Size != 1234 {
		t.Fatalf("BuildRootFS of a built key: %+v, %v, %v", r, cached, err)
	}
	if !strings.Contains(progress.String(), "nothing to do") {
		t.Errorf("a cached build does not say so: %q", progress.String())
	}
	st := GetStatus(cfg)
	if !st.Exists || st.Size != 1234 || st.BuiltAt.IsZero() {
		t.Errorf("status of a built key: %+v", st)
	}
}

// TestRemoveBuildKeepsWhatIsMountedIn checks that removing an unfinished
// build detaches what a killed debootstrap left mounted in it instead of
// removing the files of the mounted filesystem (the host's /dev/shm, say).
func TestRemoveBuildKeepsWhatIsMountedIn(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting needs root (CI runs as root)")
	}
	host := t.TempDir()
	hostFile := filepath.Join(host, "keep")
	if err := os.WriteFile(hostFile, []byte("host"), 0o644); err != nil {
		t.Fatal(err)
	}
	build := filepath.Join(t.TempDir(), "key with space.tmp")
	for _, d := range []string{"rootfs/dev/shm", "rootfs/proc"} {
		if err := os.MkdirAll(filepath.Join(build, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := syscall.Mount(host, filepath.Join(build, "rootfs/dev/shm"), "", syscall.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mount("tmpfs", filepath.Join(build, "rootfs/proc"), "tmpfs", 0, "size=64k"); err != nil {
		syscall.Unmount(filepath.Join(build, "rootfs/dev/shm"), syscall.MNT_DETACH)
		t.Fatal(err)
	}
	if err := removeBuild(build); err != nil {
		t.Fatalf("removeBuild: %v", err)
	}
	if _, err := os.Stat(hostFile); err != nil {
		t.Errorf("the file of the filesystem mounted in the build is gone: %v", err)
	}
	if _, err := os.Stat(build); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the build is still there: %v", err)
	}
	b, _ := os.ReadFile("/proc/self/mountinfo")
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && strings.HasPrefix(unescapeMountPoint(f[4]), build+"/") {
			t.Errorf("a mount under the build is left: %s", line)
		}
	}
}

func TestUnescapeMountPoint(t *testing.T) {
	for in, want := range map[string]string{`/a\040b/c`: "/a b/c", `/plain`: "/plain", `/tab\011x`: "/tab\tx", `/end\04`: `/end\04`} {
		if got := unescapeMountPoint(in); got != want {
			t.Errorf("unescapeMountPoint(%q) = %q, want %q", in, got, want)
		}
	}
}

// TestDefaultPackagesHavePip checks that every image has pip and the
// trust store, that a package named adds to them, and that the key of the
// default image is the one it has always had (an image built before
// packages could be added is not rebuilt for nothing).
func TestDefaultPackagesHavePip(t *testing.T) {
	c := Config{StateDir: "/s", Mirror: "http://m/debian"}.WithDefaults()
	for _, want := range []string{"python3", "python3-pip", "ca-certificates"} {
		if !slices.Contains(c.Packages, want) {
			t.Errorf("default packages %v lack %s", c.Packages, want)
		}
	}
	numpy := Config{StateDir: "/s", Mirror: "http://m/debian", Packages: []string{"python3-numpy"}}
	if got, want := numpy.PackageList(), []string{"ca-certificates", "python3", "python3-numpy", "python3-pip"}; !slices.Equal(got, want) {
		t.Errorf("PackageList with python3-numpy = %v, want %v", got, want)
	}
	if numpy.Key() == c.Key() {
		t.Errorf("adding python3-numpy does not change the key")
	}
	if named := (Config{StateDir: "/s", Mirror: "http://m/debian", Packages: []string{"python3-pip", "python3"}}); named.Key() != c.Key() {
		t.Errorf("naming default packages changes the key")
	}
	if runtime.GOARCH == "amd64" {
		// The key setup.sh's image has had since pip was added.
		const want = "2ceb3b5d2302144ba033817e02409071b719e439610b159faef43220ab80f772"
		if got := (Config{StateDir: "/s", Mirror: "http://deb.debian.org/debian"}).Key(); got != want {
			t.Errorf("the default key is %s, was %s: every built image would be rebuilt", got, want)
		}
	}
	c.Packages[0] = "changed"
	if DefaultPackages[0] != "python3" {
		t.Errorf("WithDefaults shares DefaultPackages with its result: a caller's change reached it")
	}
}

// TestValidatePackageNames checks the package names Validate takes: Debian
// Policy's, and nothing that debootstrap's --include would read as more
// than one package or as an option.
func TestValidatePackageNames(t *testing.T) {
	for _, good := range []string{"python3-numpy", "libstdc++6", "g++", "python3.11", "0ad", "r-base"} {
		if err := (Config{StateDir: "/s", Packages: []string{good}}).Validate(); err != nil {
			t.Errorf("Validate(%q) = %v, want nil", good, err)
		}
	}
	for _, bad := range []string{"", "a", "Python3", "python3,curl", "-python3", "+x", "python3 curl", "python3_numpy", "numpy:amd64", "../x", "pkg=1.0", "ä"} {
		if err := (Config{StateDir: "/s", Packages: []string{bad}}).Validate(); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("Validate(%q) = %v, want ErrInvalid", bad, err)
		}
	}
}
