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
	"sync"
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
	p := NewProgress(cfg.Progress, cfg.Terminal)
	defer p.Clear()
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir := cfg.Dir()
	if !cfg.Force {
		if r, err := readRecord(dir); err == nil && exists(Path(cfg)) {
			p.Say("rootfs %s: already built %s ago (%s, %s), nothing to do",
				r.Key[:12], time.Since(r.BuiltAt).Round(time.Second), HumanSize(r.Size), Path(cfg))
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
			p.Say("rootfs %s: built meanwhile by another process, nothing to do", r.Key[:12])
			return r, true, nil
		}
	}

	start := time.Now()
	key := cfg.Key()
	p.Say("rootfs %s: building Debian %s (%s) with %s from %s", key[:12], cfg.Suite, Arch(),
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
	p.Say("step 1/3 debootstrap: fetching and installing %d packages and their dependencies", len(cfg.Packages))
	stepStart := time.Now()
	if err := runDebootstrap(ctx, p, root, deboot, args...); err != nil {
		return nil, false, fmt.Errorf("image: debootstrap failed (see the lines above): %w", err)
	}
	if size, files, err := diskUsage(root); err == nil {
		p.Say("step 1/3 debootstrap: done in %s: %s in %d files", time.Since(stepStart).Round(100*time.Millisecond), HumanSize(size), files)
	}

	p.Say("step 2/3 recipe %s: strip docs and caches, drop host files", RecipeVersion)
	stepStart = time.Now()
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
	p.Say("step 2/3 recipe: done in %s: %s in %d files", time.Since(stepStart).Round(100*time.Millisecond), HumanSize(size), files)
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
	p.Say("rootfs %s: built in %s: %s in %d files, python %s, at %s", key[:12],
		time.Since(start).Round(100*time.Millisecond), HumanSize(size), files, r.PythonVersion, Path(cfg))
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

// treeSize is diskUsage of a tree being built: what debootstrap mounted in
// it (/proc, /sys, /dev) is left out, and what cannot be read, or is gone
// by the time it is looked at, is skipped.
func treeSize(root string) (size int64, files int) {
	filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.IsDir() {
			switch strings.TrimPrefix(path, root) {
			case "/proc", "/sys", "/dev":
				return fs.SkipDir
			}
		}
		files++
		if info, err := d.Info(); err == nil && info.Mode().IsRegular() {
			size += info.Size()
		}
		return nil
	})
	return size, files
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

// runDebootstrap runs debootstrap, building into root, and shows each line
// of its output within its step (see [Progress.Status]), and how much it has
// written so far: every second on a terminal, every 15 seconds otherwise.
// Cancelling ctx sends it SIGTERM, so that debootstrap unmounts what it
// mounted in the tree, then SIGKILL after a few seconds.
func runDebootstrap(ctx context.Context, p *Progress, root, name string, args ...string) error {
	every := 15 * time.Second
	if p.tty {
		every = time.Second
	}
	var mu sync.Mutex
	last := "starting"
	stop := make(chan struct{})
	ticked := make(chan struct{})
	go func() {
		defer close(ticked)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				size, files := treeSize(root)
				mu.Lock()
				l := last
				mu.Unlock()
				p.Status("debootstrap: %s in %d files so far; %s", HumanSize(size), files, l)
			}
		}
	}()
	defer func() { close(stop); <-ticked }()
	return runLogged(ctx, func(line string) {
		mu.Lock()
		last = line
		mu.Unlock()
		p.Status("debootstrap: %s", line)
	}, name, args...)
}

// runLogged runs a command, passing each line of its output to show.
// Cancelling ctx sends it SIGTERM, then SIGKILL after a few seconds.
func runLogged(ctx context.Context, show func(line string), name string, args ...string) error {
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
			if line = strings.TrimSpace(line); line != "" {
				show(line)
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
func lockFile(ctx context.Context, path string, p *Progress) (unlock func(), err error) {
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
			p.Say("waiting for another build of this image to finish (%s)", path)
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

// HumanSize is n in the largest binary unit that keeps it at 1 or more,
// with one decimal ("137.6 MiB"): for progress lines.
func HumanSize(n int64) string {
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
