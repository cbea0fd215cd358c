package container

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// The drivers of the container level (Config.Driver).
const (
	// DriverDocker runs every container through the Docker Engine API.
	DriverDocker = "docker"
	// DriverRunc runs the one-shot runs' containers with runc directly,
	// over the shared root filesystem; sessions still go through Docker.
	DriverRunc = "runc"
)

// Where the runc driver keeps what it leaves on the host while it runs,
// all on /run (a tmpfs): runc's state (one --root per moat process,
// runcStateDir/<owner id>), the bundles (runcBundleDir/<owner id>-<n>),
// and the owners' lock files (see internal/owner). The containers'
// cgroups are runcCgroupParent/<owner id>-<n> in every hierarchy. A later
// New removes what a dead owner left in all three, and in the cgroups.
const (
	runcStateDir     = "/run/moat/runc"
	runcBundleDir    = "/run/moat/runc-bundles"
	runcOwnersDir    = "/run/moat/runc-owners"
	runcCgroupParent = "moat-runc"
)

// runcPaths are the places of runcBackend; tests point them elsewhere.
type runcPaths struct {
	state, bundles, owners, cgroupParent string
}

var defaultRuncPaths = runcPaths{runcStateDir, runcBundleDir, runcOwnersDir, runcCgroupParent}

// findRunc returns the runc binary the driver runs: the one
// scripts/setup-docker.sh builds and registers with dockerd as runc-moat,
// MOAT_LIBEXEC/runc (by default /usr/local/lib/moat/runc), which moat
// finds without asking dockerd, so that one-shot runs need no engine.
func findRunc() string {
	dir := "/usr/local/lib/moat"
	if d := os.Getenv("MOAT_LIBEXEC"); filepath.IsAbs(d) {
		dir = d
	}
	return filepath.Join(dir, "runc")
}

// runcBackend is the container level under the engine with the runc
// driver: it prepares containers with runc (runcInstance) and hands
// sessions to the Docker path's backend, when there is one.
type runcBackend struct {
	runc    string // the runc binary
	unshare string // util-linux's unshare, which runs runc (startRunc)
	version string // its version, e.g. "1.3.6"
	paths   runcPaths
	owner   string // this process's owner id
	root    string // runc --root: paths.state/owner
	rootfs  string // the shared root filesystem, read-only
	spec    *spec
	seccomp *ociSeccomp
	log     *slog.Logger
	uids    *uidpool.Pool
	warm    int

	// filters is the number of seccomp filters the probe's init ran
	// under; every run's init must show as many. Zero while the probe
	// itself runs. lastFilters is the last run's count, for the probe.
	filters     int
	lastFilters atomic.Int64

	// docker is the Docker path's backend that keeps the sessions, nil
	// when the engine is not reachable; dockerErr then says why.
	docker    *backend
	dockerErr error

	// teardown counts the deletions of exited runs' containers still in
	// progress; Close waits for them.
	teardown sync.WaitGroup
	reapMu   sync.Mutex
}

var (
	_ engine.Backend        = (*runcBackend)(nil)
	_ engine.SessionBackend = (*runcBackend)(nil)
)

// newRuncBackend checks that the runc driver can run here with every
// protection (findRuncDriver), reaps what dead moats left, and returns its
// backend, with no container yet. It fails with an error wrapping
// moat.ErrUnavailable when it cannot: moat is not root, runc is missing,
// without seccomp or older than the November 2025 fixes (unless cfg
// allows it), the root filesystem is not built, another image or an
// egress proxy is asked (the driver does not place the proxy yet).
func newRuncBackend(cfg Config, paths runcPaths) (*runcBackend, error) {
	f, err := findRuncDriver(cfg)
	if err != nil {
		return nil, err
	}
	prof, err := newProfile(false)
	if err != nil {
		return nil, err
	}
	sc, err := ociSeccompOf(prof)
	if err != nil {
		return nil, err
	}
	id, err := owner.Self(paths.owners)
	if err != nil {
		return nil, unavailable("the runc driver cannot name its owner", "", err)
	}
	b := &runcBackend{
		runc: f.path, version: f.version, unshare: f.unshare, paths: paths, owner: id,
		root:    filepath.Join(paths.state, id),
		rootfs:  f.rootfs,
		spec:    newSpec(cfg, "", nil, prof, ""),
		seccomp: sc,
		log:     cfg.Logger,
		warm:    cfg.Warm,
	}
	for _, d := range []string{b.root, paths.bundles} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, unavailable("the runc driver cannot make its state directories", "", err)
		}
	}
	if b.uids, err = uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidLockDir()); err != nil {
		return nil, unavailable("cannot set up the uid pool", "", err)
	}
	b.reap()
	return b, nil
}

// runcFound is what findRuncDriver found.
type runcFound struct {
	path, version, rootfs, unshare string
}

// findRuncDriver checks what the runc driver needs, without making or
// removing anything: see newRuncBackend.
func findRuncDriver(cfg Config) (runcFound, error) {
	if os.Geteuid() != 0 {
		return runcFound{}, unavailable("the runc driver needs moat to be root: it makes the containers' namespaces and cgroups itself", "run moat as root, or use the docker driver", nil)
	}
	if cfg.Egress != nil {
		return runcFound{}, unavailable("the runc driver gives no network to its containers: it does not place the egress proxy in them", "use the docker driver for a sandbox with egress", nil)
	}
	if cfg.Image != "" && cfg.Image != cfg.SharedImage.Tag() {
		return runcFound{}, unavailable("the runc driver runs the shared root filesystem that 'moat image build' makes, not image "+cfg.Image, "leave container.image empty, or use the docker driver", nil)
	}
	path := findRunc()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ver := runcVersion(ctx, path)
	if ver == "" {
		return runcFound{}, unavailable("no runc at "+path+" that tells its version", "run scripts/setup-docker.sh (as root) to build it, or set MOAT_LIBEXEC", nil)
	}
	if !runcFixed(ver) && !cfg.AllowVulnerableRuntime {
		return runcFound{}, unavailable(fmt.Sprintf("%s is runc %s, older than the fixes for the November 2025 container escapes", path, ver),
			"run scripts/setup-docker.sh (as root) to build a fixed runc, or set AllowVulnerableRuntime", nil)
	}
	if err := runcHasSeccomp(ctx, path); err != nil {
		return runcFound{}, unavailable(path+" cannot apply seccomp filters", "build runc with -tags seccomp (scripts/setup-docker.sh does)", err)
	}
	unshare, err := exec.LookPath("/usr/bin/unshare")
	if err != nil {
		return runcFound{}, unavailable("the runc driver runs runc under util-linux's unshare, so that a moat that dies takes its runs with it, and there is none", "install util-linux", err)
	}
	rootfs := image.Path(cfg.SharedImage)
	if _, err := os.Stat(filepath.Join(rootfs, strings.TrimPrefix(cfg.Python, "/"))); err != nil {
		return runcFound{}, unavailable("the shared root filesystem is not built ("+rootfs+")", "run '"+cfg.SharedImage.BuildCommand()+"' (as root)", err)
	}
	return runcFound{path, ver, rootfs, unshare}, nil
}

// runcHasSeccomp checks, with `runc features`, that runc was built with
// seccomp support.
func runcHasSeccomp(ctx context.Context, path string) error {
	cmd := exec.CommandContext(ctx, path, "features")
	cmd.Env = runcEnv()
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("container: runc features: %w", err)
	}
	var f struct {
		Linux struct {
			Seccomp struct {
				Enabled *bool `json:"enabled"`
			} `json:"seccomp"`
		} `json:"linux"`
	}
	if err := json.Unmarshal(out, &f); err != nil {
		return fmt.Errorf("container: runc features: %w", err)
	}
	if f.Linux.Seccomp.Enabled == nil || !*f.Linux.Seccomp.Enabled {
		return errors.New("container: runc features says seccomp is not enabled")
	}
	return nil
}

// runcEnv is the environment of every runc moat starts: a PATH and
// nothing of moat's own.
func runcEnv() []string {
	return []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
}

// describe says which path runs the one-shot runs, for Describe and every
// Result's notes.
func (b *runcBackend) describe() string {
	return fmt.Sprintf("driver runc (runc-moat %s at %s)", b.version, b.runc)
}

// NewSession hands the session to the Docker path: sessions of the
// container level always run in a Docker container (see Config.Driver).
// Without a reachable engine it fails with an error wrapping
// moat.ErrUnavailable.
func (b *runcBackend) NewSession(ctx context.Context, opts moat.SessionOptions) (engine.SessionInstance, error) {
	if b.docker == nil {
		return nil, unavailable("container sessions go through the Docker engine, even with the runc driver, and the engine is not usable",
			"run scripts/setup-docker.sh, or use one-shot runs", b.dockerErr)
	}
	return b.docker.NewSession(ctx, opts)
}

// Close waits for the deletions of exited runs' containers, then closes
// the Docker path's backend, if any (which keeps its client for the
// sessions still open).
func (b *runcBackend) Close() error {
	b.teardown.Wait()
	if b.docker != nil {
		return b.docker.Close()
	}
	return nil
}

// deleteTimeout bounds a runc delete.
const deleteTimeout = 30 * time.Second

// deleteContainer removes container id of runc state root: its processes
// (runc delete --force kills what is left), cgroups and state. A container
// runc does not know is already gone, save for its cgroups, which
// removeCgroups removes.
func deleteContainer(runc, root, id string, paths runcPaths) error {
	ctx, cancel := context.WithTimeout(context.Background(), deleteTimeout)
	defer cancel()
	var err error
	if _, serr := os.Stat(filepath.Join(root, id)); serr == nil {
		cmd := exec.CommandContext(ctx, runc, "--root", root, "delete", "--force", id)
		cmd.Env = runcEnv()
		cmd.WaitDelay = 5 * time.Second
		if out, rerr := cmd.CombinedOutput(); rerr != nil {
			err = fmt.Errorf("container: runc delete %s: %w: %s", id, rerr, strings.TrimSpace(string(out)))
		}
	}
	return errors.Join(err, removeCgroups(paths.cgroupParent, id))
}

// removeCgroups kills what runs in cgroup parent/id and removes it, in
// every hierarchy; a cgroup that is not there is fine.
func removeCgroups(parent, id string) error {
	m, err := cgroupMounts()
	if err != nil {
		return err
	}
	seen := map[string]bool{}
	var errs []error
	for _, mp := range m {
		if seen[mp] {
			continue
		}
		seen[mp] = true
		dir := filepath.Join(mp, parent, id)
		if _, err := os.Stat(dir); err != nil {
			continue
		}
		if b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs")); err == nil {
			for _, f := range strings.Fields(string(b)) {
				var pid int
				if _, err := fmt.Sscan(f, &pid); err == nil && pid > 0 {
					syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		var rerr error
		for try := 0; try < 100; try++ {
			if rerr = syscall.Rmdir(dir); rerr == nil || errors.Is(rerr, syscall.ENOENT) {
				rerr = nil
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		if rerr != nil {
			errs = append(errs, fmt.Errorf("container: remove cgroup %s: %w", dir, rerr))
		}
	}
	return errors.Join(errs...)
}

// reap removes what the runc driver of moat processes that are no longer
// alive left behind: their containers (killed and deleted through their
// own runc state root), bundles and cgroups. A live owner's are never
// touched: an owner is alive while it holds the lock on its file in
// paths.owners (internal/owner), whatever its pid namespace.
func (b *runcBackend) reap() {
	b.reapMu.Lock()
	defer b.reapMu.Unlock()
	dead := func(name string) bool {
		// A state root is named by the owner id alone, a bundle or a
		// cgroup by the id and a dash.
		id, ok := owner.Of(name)
		if !ok {
			id, ok = owner.Of(name + "-")
		}
		return ok && id != b.owner && !owner.Alive(b.paths.owners, id)
	}
	// The state roots, one per owner: delete every container in them.
	roots, _ := os.ReadDir(b.paths.state)
	for _, r := range roots {
		if !r.IsDir() || !dead(r.Name()) {
			continue
		}
		root := filepath.Join(b.paths.state, r.Name())
		cs, _ := os.ReadDir(root)
		var errs []error
		for _, c := range cs {
			errs = append(errs, deleteContainer(b.runc, root, c.Name(), b.paths))
		}
		if err := errors.Join(errs...); err != nil {
			b.log.Warn("container: reap a dead moat's runc containers", "owner", r.Name(), "err", err)
			continue
		}
		if err := os.RemoveAll(root); err != nil {
			b.log.Warn("container: reap a dead moat's runc state", "owner", r.Name(), "err", err)
			continue
		}
		b.log.Info("container: reaped a dead moat's runc containers", "owner", r.Name(), "containers", len(cs))
	}
	// Cgroups whose state went (a crash between runc's steps).
	if m, err := cgroupMounts(); err == nil {
		seen := map[string]bool{}
		for _, mp := range m {
			es, _ := os.ReadDir(filepath.Join(mp, b.paths.cgroupParent))
			for _, e := range es {
				if e.IsDir() && !seen[e.Name()] && dead(e.Name()) {
					seen[e.Name()] = true
					if err := removeCgroups(b.paths.cgroupParent, e.Name()); err != nil {
						b.log.Warn("container: reap a dead moat's cgroup", "name", e.Name(), "err", err)
					}
				}
			}
		}
	}
	// Bundles.
	bs, _ := os.ReadDir(b.paths.bundles)
	for _, e := range bs {
		if dead(e.Name()) {
			if err := os.RemoveAll(filepath.Join(b.paths.bundles, e.Name())); err != nil {
				b.log.Warn("container: reap a dead moat's bundle", "name", e.Name(), "err", err)
			}
		}
	}
}

// RuncLeftovers lists what the runc driver of this process has on the host
// (containers in its state root, bundles, cgroups): after every Sandbox of
// this process has closed, there must be none. Tests use it.
func RuncLeftovers() []string {
	id, err := owner.Self(runcOwnersDir)
	if err != nil {
		return []string{err.Error()}
	}
	return runcLeftovers(defaultRuncPaths, id)
}

func runcLeftovers(paths runcPaths, id string) []string {
	var left []string
	cs, _ := os.ReadDir(filepath.Join(paths.state, id))
	for _, c := range cs {
		left = append(left, "runc container "+c.Name())
	}
	bs, _ := os.ReadDir(paths.bundles)
	for _, e := range bs {
		if strings.HasPrefix(e.Name(), id+"-") {
			left = append(left, "bundle "+e.Name())
		}
	}
	if m, err := cgroupMounts(); err == nil {
		seen := map[string]bool{}
		for _, mp := range m {
			if seen[mp] {
				continue
			}
			seen[mp] = true
			es, _ := os.ReadDir(filepath.Join(mp, paths.cgroupParent))
			for _, e := range es {
				if strings.HasPrefix(e.Name(), id+"-") {
					left = append(left, "cgroup "+filepath.Join(mp, paths.cgroupParent, e.Name()))
				}
			}
		}
	}
	return left
}

// newRunc is New with the runc driver: the runc backend, probed with moat's
// seccomp probe in a container made like every run's (once per process,
// runc and profile), under the engine; and the Docker path's backend for
// the sessions, when the engine is usable.
func newRunc(cfg Config) (*Sandbox, error) {
	rb, err := newRuncBackend(cfg, defaultRuncPaths)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	key := strings.Join([]string{"runc", rb.runc, rb.version, rb.rootfs, rb.spec.seccomp.digest}, "\x00")
	var r *probeResult
	if v, ok := probed.Load(key); ok {
		r = v.(*probeResult)
	} else {
		if r, err = rb.probeSeccomp(ctx); err != nil {
			return nil, err
		}
		probed.Store(key, r)
	}
	rb.filters = r.filters
	notes := []string{rb.describe()}
	if !runcFixed(rb.version) {
		notes = append(notes, fmt.Sprintf("%s is runc %s, older than the fixes for the November 2025 container escapes (allowed by the operator)", rb.runc, rb.version))
	}
	var dnotes []string
	rb.docker, dnotes, rb.dockerErr = newDocker(cfg)
	if rb.dockerErr != nil {
		cfg.Logger.Info("container: the runc driver runs one-shot runs; sessions are unavailable", "err", rb.dockerErr)
	}
	_ = dnotes // the Docker path's notes are its sessions'; they say nothing of one-shot runs
	es, err := engine.New(engine.Config{
		Level:   moat.LevelContainer,
		Limits:  cfg.Limits,
		Warm:    cfg.Warm,
		WarmMax: cfg.WarmMax,
		Recycle: cfg.Recycle,
		Notes:   notes,
		Hints:   nativeHints,
		Logger:  cfg.Logger,
	}, rb)
	if err != nil {
		rb.Close()
		return nil, err
	}
	return &Sandbox{Sandbox: es, b: rb.docker, r: rb}, nil
}

// dockerRuntime names the runtime of the Docker path's sessions.
func (b *runcBackend) dockerRuntime() string {
	if b.docker == nil {
		return "none"
	}
	return b.docker.spec.runtime
}

// probeSeccomp runs moat's seccomp probe (probeCode) in a container of the
// driver, made like every run's, through the engine's one lifecycle, and
// fails with an unavailable error unless every call was refused. b.filters
// must still be zero.
func (b *runcBackend) probeSeccomp(ctx context.Context) (*probeResult, error) {
	eng, err := engine.New(engine.Config{Level: moat.LevelContainer, Limits: b.spec.limits, Warm: -1}, runcProbeBackend{b})
	if err != nil {
		return nil, err
	}
	defer eng.Close()
	res, err := eng.Run(ctx, moat.Request{Code: []byte(probeCode())})
	if err != nil {
		return nil, unavailable("moat's seccomp probe could not run in a runc container", "check "+b.runc, err)
	}
	r := &probeResult{filters: int(b.lastFilters.Load())}
	if res.ExitCode != 0 || json.Unmarshal(res.Stdout, &r.calls) != nil {
		return nil, unavailable(fmt.Sprintf("moat's seccomp probe failed in a runc container (exit %d): %q", res.ExitCode, res.Stderr),
			"check that the root filesystem runs python3 with ctypes", nil)
	}
	var through []string
	for _, c := range probeCalls {
		v, ok := r.calls[c.name]
		if !ok {
			return nil, unavailable("moat's seccomp probe did not report "+c.name, "check the root filesystem", nil)
		}
		if v == "ok" || v == c.reached {
			through = append(through, c.name)
		}
	}
	if len(through) > 0 {
		return nil, unavailable(fmt.Sprintf("runc does not enforce moat's seccomp filter: %s succeeded in a container", strings.Join(through, ", ")),
			"use a runc built with seccomp (scripts/setup-docker.sh)", nil)
	}
	return r, nil
}

// runcProbeBackend is the probe engine's backend, which must not close the
// backend it borrows.
type runcProbeBackend struct{ *runcBackend }

func (runcProbeBackend) Close() error { return nil }
