// Package image builds the sandbox root filesystem that every isolation level
// above subprocess shares: a minimal Debian with python3, pip and the CA
// certificates (see [DefaultPackages]) and the Debian packages the operator
// adds ([Config.Packages], `moat image build --packages python3-numpy`, the
// config file's image.packages), made from Debian's packages with
// debootstrap (no container registry involved) and kept in moat's state
// directory. A build reports its steps on [Config.Progress] (see
// [Progress]). Package image only builds and describes it; it
// talks to no engine and links no Docker package (deps_test.go checks that,
// for gvisor and microvm too).
//
// The root filesystem is content-addressed: its key is a hash of everything
// that decides what goes into it (the recipe version, the suite, the package
// list, the mirror, the architecture). Building twice with the same inputs
// does nothing the second time and says so. Nothing of the host goes into
// it: files that debootstrap copies from the host (resolv.conf, hostname) are
// replaced, the apt sources (which may hold a mirror's credentials) are
// removed, and the build fails if /root or /home hold anything or a key file
// is found.
//
// Consumers: the container level imports it into Docker under
// [Config.Tag] (container.ImportImage, which `moat image build` calls after
// [BuildRootFS]) and runs that image; the gvisor and microvm levels read
// the directory at [Path] and must treat it as read-only, giving each run
// its own view (an overlay, a copy, a disk image made from it).
//
// Layout of the state directory:
//
//	STATE/images/KEY/rootfs       the root filesystem (complete when present)
//	STATE/images/KEY/image.json   what was built, from what, when, how big
//	STATE/images/KEY.lock         serializes builds of one key
package image

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
)

// RecipeVersion names the way the root filesystem is made from its packages
// (what is stripped, what is fixed up). Changing the recipe changes it, so
// that every key changes and images are rebuilt.
const RecipeVersion = "1"

// DefaultRepository is the Docker repository the container level imports
// the root filesystem into.
const DefaultRepository = "moat-sandbox"

// Python is the interpreter's path inside the image.
const Python = "/usr/bin/python3"

// WorkDir is the directory inside the image meant as the run's working
// directory. It is empty in the image; levels mount a fresh, size-limited
// filesystem over it.
const WorkDir = "/work"

// DefaultPackages are the packages of every image, to which
// Config.Packages adds: python3; python3-pip, so that `python3 -m pip install
// --index-url ... --target DIR pkg` works through moat's egress proxy where
// the operator allowed the index (pip also brings setuptools and wheel);
// and ca-certificates, the image's trust store (/etc/ssl/certs), which the
// CA bundle the proxy hands the code (SSL_CERT_FILE, PIP_CERT) adds to.
// They are part of the key: changing them makes every level's image (and
// the microvm disk made from it) be built afresh.
var DefaultPackages = []string{"python3", "python3-pip", "ca-certificates"}

// Config says what to build and where to keep it. The zero value builds
// Debian 12 (bookworm) with [DefaultPackages] from the mirror this
// machine's apt uses, into the default state directory.
type Config struct {
	// StateDir is moat's state directory. Zero means [DefaultStateDir].
	StateDir string `json:"state_dir,omitempty"`
	// Suite is the Debian suite. Zero means "bookworm".
	Suite string `json:"suite,omitempty"`
	// Packages are installed, with [DefaultPackages] (python3,
	// python3-pip, ca-certificates), on top of debootstrap's minbase
	// variant, without their Recommends: Debian package names such as
	// python3-numpy (lowercase letters, digits, "+", "-" and ".", starting
	// with a letter or digit, at least two characters). Zero means
	// [DefaultPackages] alone. The default packages are always in the
	// image, since every level needs them; naming one of them changes
	// nothing. Order and repetition do not matter: the key hashes the
	// sorted list ([Config.PackageList]).
	Packages []string `json:"packages,omitempty"`
	// Mirror is the Debian mirror to install from. Zero means the first
	// mirror that this machine's apt sources list for Suite, or
	// http://deb.debian.org/debian when they list none.
	Mirror string `json:"mirror,omitempty"`
	// Repository is the Docker repository the image is tagged in. Zero
	// means "moat-sandbox"; the tag is the key's first 12 hex digits.
	Repository string `json:"repository,omitempty"`

	// Force rebuilds the root filesystem even when it is cached, and makes
	// container.ImportImage re-import it even when the engine has it.
	Force bool `json:"-"`
	// Progress receives the build's progress (see [Progress]): a line per
	// step with its elapsed time and sizes, and lines within steps. Nil
	// means discard.
	Progress io.Writer `json:"-"`
	// Terminal says that Progress is a terminal: the lines within a step
	// (debootstrap's, the bytes imported) then rewrite one status line
	// instead of each being a line of its own.
	Terminal bool `json:"-"`
	// Logger receives debug logs. Nil means discard.
	Logger *slog.Logger `json:"-"`
}

// DefaultStateDir returns moat's state directory: /var/lib/moat for root;
// otherwise $XDG_STATE_HOME/moat, or ~/.local/state/moat.
func DefaultStateDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/moat"
	}
	if d := os.Getenv("XDG_STATE_HOME"); filepath.IsAbs(d) {
		return filepath.Join(d, "moat")
	}
	if home, err := os.UserHomeDir(); err == nil {
		return filepath.Join(home, ".local", "state", "moat")
	}
	return filepath.Join(os.TempDir(), "moat-state")
}

// WithDefaults returns c with every zero field filled in.
func (c Config) WithDefaults() Config {
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir()
	}
	if c.Suite == "" {
		c.Suite = "bookworm"
	}
	c.Packages = c.PackageList()
	if c.Mirror == "" {
		c.Mirror = SystemMirror(c.Suite)
	}
	if c.Repository == "" {
		c.Repository = DefaultRepository
	}
	return c
}

// Validate reports whether c can be built. The error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	if err := c.validate(); err != nil {
		return moat.Invalid(err)
	}
	return nil
}

func (c Config) validate() error {
	c = c.WithDefaults()
	if !filepath.IsAbs(c.StateDir) {
		return fmt.Errorf("image: state dir %q is not an absolute path", c.StateDir)
	}
	if !validName(c.Suite) {
		return fmt.Errorf("image: suite %q is not a Debian suite name", c.Suite)
	}
	for _, p := range c.Packages {
		if !validPackage(p) {
			return fmt.Errorf("image: package %q is not a Debian package name (lowercase letters, digits, +, - and ., starting with a letter or digit, at least two characters)", p)
		}
	}
	if !strings.HasPrefix(c.Mirror, "http://") && !strings.HasPrefix(c.Mirror, "https://") && !strings.HasPrefix(c.Mirror, "file:/") {
		return fmt.Errorf("image: mirror %q is not an http, https or file URL", c.Mirror)
	}
	if !validName(c.Repository) || strings.ToLower(c.Repository) != c.Repository {
		return fmt.Errorf("image: repository %q is not a lowercase Docker repository name", c.Repository)
	}
	return nil
}

// PackageList is what the image holds: [DefaultPackages] and
// c.Packages, sorted, each once. It is what the key hashes and what the
// record lists.
func (c Config) PackageList() []string {
	pkgs := append(slices.Clone(DefaultPackages), c.Packages...)
	slices.Sort(pkgs)
	return slices.Compact(pkgs)
}

// Extra returns the packages of c beyond [DefaultPackages], sorted, each
// once: what `moat image build --packages` was given.
func (c Config) Extra() []string {
	var out []string
	for _, p := range c.PackageList() {
		if !slices.Contains(DefaultPackages, p) {
			out = append(out, p)
		}
	}
	return out
}

// BuildCommand returns the command that builds the image of c, for error
// messages' remedies: "moat image build", with --packages when c adds
// packages. Settings without a flag (suite, mirror) come from the config
// file's image section (--config).
func (c Config) BuildCommand() string {
	cmd := "moat image build"
	if extra := c.Extra(); len(extra) > 0 {
		cmd += " --packages " + strings.Join(extra, ",")
	}
	if c.StateDir != "" && c.StateDir != DefaultStateDir() {
		cmd += " --state-dir " + c.StateDir
	}
	return cmd
}

// validPackage reports whether s is a Debian package name, as Debian
// Policy 5.6.1 defines it: at least two characters of lowercase letters,
// digits, "+", "-" and ".", starting with a letter or digit. Nothing else
// reaches debootstrap's --include (a comma would name a second package,
// a leading "-" an option).
func validPackage(s string) bool {
	if len(s) < 2 || !(s[0] >= 'a' && s[0] <= 'z' || s[0] >= '0' && s[0] <= '9') {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || strings.ContainsRune("+-.", r)) {
			return false
		}
	}
	return true
}

func validName(s string) bool {
	if s == "" || s[0] == '-' {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("+-._", r)) {
			return false
		}
	}
	return true
}

// Arch is the Debian architecture of this machine.
func Arch() string {
	switch runtime.GOARCH {
	case "386":
		return "i386"
	case "arm":
		return "armhf"
	}
	return runtime.GOARCH // amd64, arm64, ppc64le, s390x, riscv64 match
}

// Key returns the hex sha256 that names the root filesystem c builds: a
// hash of the recipe version, the architecture, the suite, the package
// list ([Config.PackageList]: sorted, the defaults included) and the
// mirror. The same packages in another order, or repeated, give the same
// key; one package more gives another.
func (c Config) Key() string {
	c = c.WithDefaults()
	pkgs := c.PackageList()
	h := sha256.New()
	fmt.Fprintf(h, "moat-image\nrecipe=%s\narch=%s\nvariant=minbase\nsuite=%s\npackages=%s\nmirror=%s\n",
		RecipeVersion, Arch(), c.Suite, strings.Join(pkgs, ","), strings.TrimRight(c.Mirror, "/"))
	return hex.EncodeToString(h.Sum(nil))
}

// Tag returns the Docker reference the image is imported as, e.g.
// "moat-sandbox:3f2a9c0b1d4e".
func (c Config) Tag() string {
	c = c.WithDefaults()
	return c.Repository + ":" + c.Key()[:12]
}

// Dir returns the directory that holds the root filesystem and its record.
func (c Config) Dir() string {
	c = c.WithDefaults()
	return filepath.Join(c.StateDir, "images", c.Key())
}

// Path returns the root filesystem's directory. It is complete when it
// exists (builds happen elsewhere and are renamed into place). Consumers
// must not write to it.
func Path(c Config) string { return filepath.Join(c.Dir(), "rootfs") }

// Record is what image.json says about a built root filesystem.
type Record struct {
	Key           string    `json:"key"`
	Recipe        string    `json:"recipe"`
	Arch          string    `json:"arch"`
	Suite         string    `json:"suite"`
	Packages      []string  `json:"packages"`
	Mirror        string    `json:"mirror"`
	BuiltAt       time.Time `json:"built_at"`
	BuildSeconds  float64   `json:"build_seconds"`
	Size          int64     `json:"size_bytes"`
	Files         int       `json:"files"`
	PythonVersion string    `json:"python_version,omitempty"`
}

func readRecord(dir string) (*Record, error) {
	b, err := os.ReadFile(filepath.Join(dir, "image.json"))
	if err != nil {
		return nil, err
	}
	var r Record
	if err := jsonUnmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("image: %s: %w", filepath.Join(dir, "image.json"), err)
	}
	return &r, nil
}

// SystemMirror returns the first Debian mirror that this machine's apt
// sources (/etc/apt/sources.list, /etc/apt/sources.list.d/*.list and
// *.sources) list for suite with type deb, or http://deb.debian.org/debian.
func SystemMirror(suite string) string {
	return systemMirror("/etc/apt", suite)
}

func systemMirror(aptDir, suite string) string {
	const fallback = "http://deb.debian.org/debian"
	files := []string{filepath.Join(aptDir, "sources.list")}
	lists, _ := filepath.Glob(filepath.Join(aptDir, "sources.list.d", "*.list"))
	srcs, _ := filepath.Glob(filepath.Join(aptDir, "sources.list.d", "*.sources"))
	files = append(files, lists...)
	files = append(files, srcs...)
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var m string
		if strings.HasSuffix(f, ".sources") {
			m = mirrorDeb822(string(b), suite)
		} else {
			m = mirrorOneLine(string(b), suite)
		}
		if m != "" {
			return strings.TrimRight(m, "/")
		}
	}
	return fallback
}

// mirrorOneLine reads "deb [opts] URI SUITE COMPONENTS..." lines.
func mirrorOneLine(text, suite string) string {
	for _, line := range strings.Split(text, "\n") {
		line, _, _ = strings.Cut(line, "#")
		f := strings.Fields(line)
		if len(f) < 3 || f[0] != "deb" {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") { // options, possibly spread over fields
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) == 0 {
				continue
			}
			f = f[1:]
		}
		if len(f) >= 2 && f[1] == suite {
			return f[0]
		}
	}
	return ""
}

// mirrorDeb822 reads stanzas of "Types:", "URIs:", "Suites:" fields.
func mirrorDeb822(text, suite string) string {
	for _, stanza := range strings.Split(strings.ReplaceAll(text, "\r\n", "\n"), "\n\n") {
		fields := map[string][]string{}
		sc := bufio.NewScanner(strings.NewReader(stanza))
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "#") {
				continue
			}
			k, v, ok := strings.Cut(line, ":")
			if !ok || strings.HasPrefix(line, " ") {
				continue
			}
			fields[strings.ToLower(strings.TrimSpace(k))] = strings.Fields(v)
		}
		if strings.EqualFold(strings.Join(fields["enabled"], ""), "no") {
			continue
		}
		if !slices.Contains(fields["types"], "deb") || !slices.Contains(fields["suites"], suite) || len(fields["uris"]) == 0 {
			continue
		}
		return fields["uris"][0]
	}
	return ""
}

// ErrNotBuilt means the root filesystem for a Config has not been built.
var ErrNotBuilt = errors.New("image: not built (run 'moat image build')")
