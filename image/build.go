package image

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

var jsonUnmarshal = json.Unmarshal

// BuildRootFS makes the root filesystem for cfg at [Path] unless it is
// already there, and returns its record and whether it was cached.
// Concurrent builds of one key, in this process or others, wait for each
// other and build once.
func BuildRootFS(ctx context.Context, cfg Config) (rec *Record, cached bool, err error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, false, err
	}
	p := progress{w: cfg.Progress}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir := cfg.Dir()
	if !cfg.Force {
		if r, err := readRecord(dir); err == nil && exists(Path(cfg)) {
			p.say("rootfs %s: already built %s ago (%s, %s), nothing to do",
				r.Key[:12], time.Since(r.BuiltAt).Round(time.Second), humanSize(r.Size), Path(cfg))
			return r, true, nil
		}
	}
	if os.Geteuid() != 0 {
		return nil, false, fmt.Errorf("image: building the root filesystem needs root (debootstrap does); run 'sudo moat image build'")
	}
	deboot, err := exec.LookPath("debootstrap")
	if err != nil {
		return nil, false, fmt.Errorf("image: debootstrap not found (apt-get install debootstrap, or run scripts/setup-docker.sh): %w", err)
	}
	if err := os.MkdirAll(filepath.Join(cfg.StateDir, "images"), 0o755); err != nil {
		return nil, false, fmt.Errorf("image: %w", err)
	}

	unlock, err := lockFile(ctx, dir+".lock", p)
	if err != nil {
		return nil, false, err
	}
	defer unlock()
	// Another process may have built it while we waited for the lock.
	if !cfg.Force {
		if r, err := readRecord(dir); err == nil && exists(Path(cfg)) {
			p.say("rootfs %s: built meanwhile by another process, nothing to do", r.Key[:12])
			return r, true, nil
		}
	}

	start := time.Now()
	key := cfg.Key()
	p.say("rootfs %s: building Debian %s (%s) with %s from %s", key[:12], cfg.Suite, Arch(),
		strings.Join(cfg.Packages, " "), cfg.Mirror)
	tmp := dir + ".tmp"
	if err := removeBuild(tmp); err != nil {
		return nil, false, fmt.Errorf("image: clearing %s: %w", tmp, err)
	}
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return nil, false, fmt.Errorf("image: %w", err)
	}
	defer func() {
		if err := removeBuild(tmp); err != nil {
			log.Warn("image: removing the unfinished build", "dir", tmp, "err", err)
		}
	}()
	root := filepath.Join(tmp, "rootfs")

	args := []string{
		"--variant=minbase",
		"--arch=" + Arch(),
		"--include=" + strings.Join(cfg.Packages, ","),
		"--components=main",
		cfg.Suite, root, cfg.Mirror,
	}
	log.Debug("image: debootstrap", "args", args)
	if err := runLogged(ctx, p, "debootstrap", deboot, args...); err != nil {
		return nil, false, fmt.Errorf("image: debootstrap failed (see the lines above): %w", err)
	}

	p.say("rootfs %s: applying recipe %s (strip docs and caches, drop host files)", key[:12], RecipeVersion)
	if err := applyRecipe(root); err != nil {
		return nil, false, err
	}
	if err := CheckClean(root); err != nil {
		return nil, false, err
	}
	size, files, err := diskUsage(root)
	if err != nil {
		return nil, false, fmt.Errorf("image: measuring %s: %w", root, err)
	}
	r := &Record{
		Key: key, Recipe: RecipeVersion, Arch: Arch(), Suite: cfg.Suite,
		Packages: cfg.Packages, Mirror: cfg.Mirror,
		BuiltAt: time.Now().UTC(), BuildSeconds: time.Since(start).Seconds(),
		Size: size, Files: files, PythonVersion: pythonVersion(root),
	}
	b, _ := json.MarshalIndent(r, "", "  ")
	if err := os.WriteFile(filepath.Join(tmp, "image.json"), append(b, '\n'), 0o644); err != nil {
		return nil, false, fmt.Errorf("image: %w", err)
	}
	// Swap the finished build into place: readers see the old complete
	// directory or the new complete one, never a partial one.
	old := dir + ".old"
	_ = os.RemoveAll(old)
	if exists(dir) {
		if err := os.Rename(dir, old); err != nil {
			return nil, false, fmt.Errorf("image: %w", err)
		}
	}
	if err := os.Rename(tmp, dir); err != nil {
		return nil, false, fmt.Errorf("image: %w", err)
	}
	_ = os.RemoveAll(old)
	p.say("rootfs %s: built in %s: %s in %d files, python %s, at %s", key[:12],
		time.Since(start).Round(100*time.Millisecond), humanSize(size), files, r.PythonVersion, Path(cfg))
	return r, false, nil
}

// applyRecipe turns debootstrap's output into moat's image: it removes what
// a sandbox never needs (documentation, apt's lists and caches, logs), drops
// what debootstrap copied from the host, and adds the working directory.
func applyRecipe(root string) error {
	remove := []string{
		"usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale",
		"usr/share/lintian", "usr/share/bug",
		"var/cache/apt", "var/lib/apt/lists", "var/cache/debconf/config.dat-old",
		"var/cache/debconf/templates.dat-old", "var/lib/dpkg/status-old",
		"var/log", "debootstrap",
		// Copied from the host by debootstrap, or naming the build's mirror
		// (which may carry credentials).
		"etc/resolv.conf", "etc/apt/sources.list", "etc/apt/sources.list.d",
		"etc/apt/apt.conf.d/01autoremove-kernels",
	}
	for _, r := range remove {
		if err := os.RemoveAll(filepath.Join(root, r)); err != nil {
			return fmt.Errorf("image: recipe: %w", err)
		}
	}
	// Debian's skeleton dotfiles in /root are not the host's, but nothing
	// needs them: /root stays empty so that any file there is a finding.
	for _, d := range []string{"root", "home"} {
		ents, _ := os.ReadDir(filepath.Join(root, d))
		for _, e := range ents {
			if err := os.RemoveAll(filepath.Join(root, d, e.Name())); err != nil {
				return fmt.Errorf("image: recipe: %w", err)
			}
		}
	}
	writes := map[string]string{
		"etc/hostname":   "sandbox\n",
		"etc/hosts":      "127.0.0.1\tlocalhost sandbox\n::1\tlocalhost ip6-localhost ip6-loopback\n",
		"etc/machine-id": "",
	}
	for name, content := range writes {
		p := filepath.Join(root, name)
		_ = os.Remove(p)
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return fmt.Errorf("image: recipe: %w", err)
		}
	}
	for _, d := range []string{"var/log", "var/cache/apt", "var/lib/apt/lists", strings.TrimPrefix(WorkDir, "/")} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return fmt.Errorf("image: recipe: %w", err)
		}
	}
	return nil
}

// CheckClean fails when the root filesystem at root holds anything of a
// host: files in /root or /home, private keys, ssh host keys,
// authorized_keys, or a resolv.conf.
func CheckClean(root string) error {
	var found []string
	for _, d := range []string{"root", "home"} {
		ents, err := os.ReadDir(filepath.Join(root, d))
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("image: check: %w", err)
		}
		for _, e := range ents {
			found = append(found, "/"+d+"/"+e.Name())
		}
	}
	if exists(filepath.Join(root, "etc/resolv.conf")) {
		found = append(found, "/etc/resolv.conf")
	}
	if h, err := os.Hostname(); err == nil && h != "sandbox" {
		if b, err := os.ReadFile(filepath.Join(root, "etc/hostname")); err == nil && strings.TrimSpace(string(b)) == h {
			found = append(found, "/etc/hostname (the host's name)")
		}
	}
	keyNames := []string{"id_rsa", "id_dsa", "id_ecdsa", "id_ed25519", "authorized_keys", "known_hosts", ".netrc", "credentials"}
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		rel := strings.TrimPrefix(path, root)
		if d.IsDir() {
			if rel == "/proc" || rel == "/sys" || rel == "/dev" {
				return fs.SkipDir
			}
			if name == ".ssh" || name == ".gnupg" || name == ".aws" || name == ".docker" {
				found = append(found, rel)
			}
			return nil
		}
		if strings.HasPrefix(name, "ssh_host_") || strings.HasSuffix(name, ".pem") && strings.Contains(rel, "/private/") {
			found = append(found, rel)
		}
		for _, k := range keyNames {
			if name == k {
				found = append(found, rel)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("image: check: %w", err)
	}
	if len(found) > 0 {
		return fmt.Errorf("image: the root filesystem holds files that must not be in it: %s", strings.Join(found, ", "))
	}
	return nil
}

func pythonVersion(root string) string {
	// The interpreter's real path names its version: /usr/bin/python3 ->
	// python3.11.
	t, err := os.Readlink(filepath.Join(root, strings.TrimPrefix(Python, "/")))
	if err != nil {
		return ""
	}
	return strings.TrimPrefix(filepath.Base(t), "python")
}

func diskUsage(root string) (size int64, files int, err error) {
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		files++
		if info.Mode().IsRegular() {
			size += info.Size()
		}
		return nil
	})
	return size, files, err
}

// removeBuild removes an unfinished build at dir. debootstrap mounts the
// host's /proc and /sys in the tree it builds (and, in an LXC container,
// binds the host's /dev/shm and /dev/pts) and unmounts them when it exits;
// a debootstrap that was killed leaves them mounted, and removing the tree
// through them would reach into the host. So every mount under dir is
// detached first, and nothing is removed while one stays.
func removeBuild(dir string) error {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return err
	}
	var mounts []string
	for _, line := range strings.Split(string(b), "\n") {
		// Field 5 is the mount point.
		if f := strings.Fields(line); len(f) > 4 {
			if m := unescapeMountPoint(f[4]); strings.HasPrefix(m, dir+"/") {
				mounts = append(mounts, m)
			}
		}
	}
	// The deepest first.
	slices.SortFunc(mounts, func(a, b string) int { return len(b) - len(a) })
	for _, m := range mounts {
		if err := syscall.Unmount(m, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
			return fmt.Errorf("image: %s is still mounted: %w", m, err)
		}
	}
	return os.RemoveAll(dir)
}

// unescapeMountPoint undoes mountinfo's octal escapes (space is \040).
func unescapeMountPoint(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// runLogged runs a command, passing each line of its output to p with a
// prefix. Cancelling ctx sends it SIGTERM, so that debootstrap unmounts
// what it mounted in the tree, then SIGKILL after a few seconds.
func runLogged(ctx context.Context, p progress, prefix, name string, args ...string) error {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive"}
	cmd.Stdin = nil
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		r := bufio.NewReader(pr)
		for {
			line, err := r.ReadString('\n')
			if line = strings.TrimRight(line, "\r\n"); line != "" {
				p.say("%s: %s", prefix, line)
			}
			if err != nil {
				return
			}
		}
	}()
	err := cmd.Wait()
	pw.Close()
	<-done
	return err
}

// lockFile takes an exclusive flock on path, waiting for ctx.
func lockFile(ctx context.Context, path string, p progress) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	said := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("image: locking %s: %w", path, err)
		}
		if !said {
			p.say("waiting for another build of this image to finish (%s)", path)
			said = true
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// progress writes one line per step; the zero value discards.
type progress struct{ w io.Writer }

func (p progress) say(format string, args ...any) {
	if p.w != nil {
		fmt.Fprintf(p.w, "image: "+format+"\n", args...)
	}
}

func humanSize(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
