// Package gvisor is moat's gvisor level: each run is a fresh gVisor sandbox,
// so the code's system calls are served by gVisor's kernel in user space
// (the sentry) and never reach the host's kernel directly. moat drives runsc
// itself with an OCI bundle it writes per run; there is no daemon.
//
// Every run is hardened, with no way to turn an item off:
//
//   - the systrap platform, unless the operator names another explicitly
//     ([Config.Platform]); a runsc without the chosen platform makes [New]
//     fail, never a silent fallback to a slower or different one;
//   - runsc's --network=none: a network namespace with loopback only;
//     or, with an egress proxy (Config.Egress), the proxy as the one way
//     out: runsc --network=host in a network namespace of moat's, made per
//     sandbox, holding only loopback and the proxy's listener (network.go);
//     --host-uds=none and --host-fifo=none: no host unix socket or FIFO can
//     be reached or created;
//   - the root filesystem is the shared image's (package image), read-only,
//     with no overlay (--overlay2=none): nothing is ever written to it;
//   - the working directory (/work), /tmp and /dev/shm are tmpfs mounts of
//     the sandbox's own kernel whose sizes add up to Limits.Disk (gVisor's
//     tmpfs has no inode limit: the number of files is bounded by the
//     memory limit); nothing of the host is mounted, and the code arrives
//     on stdin;
//   - the user nobody (65534:65534), no capability in any set,
//     no_new_privs;
//   - a seccomp filter that gVisor's kernel applies to the code
//     (--oci-seccomp): no namespaces (unshare, setns, clone's namespace
//     flags), no mounts, no ptrace, keyrings, BPF or io_uring, so that the
//     code cannot mount a filesystem of its own past the disk limit or take
//     capabilities in a user namespace;
//   - the rlimits that gVisor's kernel enforces: CPU time, file size, open
//     files, core dumps, and RLIMIT_NPROC for the task limit (threads inside
//     gVisor are not host tasks, so a host pids limit would not count them;
//     the sandbox user is alone in its kernel, so RLIMIT_NPROC counts
//     exactly the run's processes and threads);
//   - a host cgroup per run (v2, or the v1 memory, pids and cpuacct
//     hierarchies) holding runsc, the sentry and the gofer: its memory limit
//     is Limits.Memory for the whole sandbox, the sentry's own memory
//     included; its pids limit is a backstop well above what Limits.Pids
//     tasks need; its CPU account is watched against Limits.CPUTime;
//   - an OOM score of 1000; an empty environment but PATH, HOME and LANG;
//   - the runsc state and the bundle removed after the run, whatever
//     happened; leftovers of a moat that died (containers, bundles, cgroups)
//     are reaped by the next [New].
//
// Booting gVisor and starting Python take most of a run's time, so the
// level keeps Config.Warm sandboxes booted ahead (moat's run engine keeps
// them, package internal/engine): each is a fresh sandbox, made exactly as
// a run's own would be, in which Python has started and waits for the code
// on stdin; a run takes one and is used once, and new ones boot in the
// background after each run. Nothing passes from one run to another: every
// run still gets a sandbox, cgroup and bundle of its own. The wall time
// starts when Run is called; the CPU time that booting used is not counted
// against the run.
//
// Sessions ([Sandbox.NewSession], moat.Sessioner) keep one sandbox, made
// as a run's, for their whole life: each run is a fresh python3 started in
// it with runsc exec, as the init of a PID namespace of its own under the
// same hardening (the seccomp filter installed by moat's launcher, since
// gVisor applies the spec's to the container's init only), so that its end
// ends every process it started; between runs the sandbox is paused. The
// session's files (its working directory, nearly all of the disk limit)
// persist; runs get the run limits, the session as a whole the memory and
// disk limits and Config.SessionCPUTime of CPU. A session with a live
// interpreter (moat.SessionOptions.Interpreter) keeps one python3 across
// its runs, started by the sandbox's container init (moat's launcher,
// which relays its streams: interpinit.go), with the same hardening, and a
// working directory of the host's, so that file operations never resume
// the paused sandbox. See session.go and interpreter.go.
//
// Suspended sessions (moat.Suspender, moat.Resumer) keep their memory, a
// live interpreter's variables included: the session's sandbox is
// checkpointed whole (runsc checkpoint) and restored into a new sandbox
// (runsc restore), one state resuming many times as independent forks; a
// state of another runsc, platform, set of flags, root filesystem or
// limits is refused. Sessions with a network keep only their files (a
// live interpreter starts fresh on resume). See suspend.go.
//
// How each Reason is found, from outside the code: timeout, when moat's
// wall timer or the cgroup's CPU account fires (moat kills the cgroup), or
// the code dies of SIGXCPU; memory, from the cgroup's OOM kill counter;
// pids, from the cgroup's pids-max counter or from the sentry's log of the
// clone calls it refused with EAGAIN; filesize and disk, from the sentry's
// log of the write calls it refused with EFBIG or ENOSPC (runsc's --strace,
// limited to those calls, read from a pipe). Every log of runsc's is read
// in its JSON form, one record per line with the text escaped, so that
// nothing the code writes (its task's name, its file names, its output)
// can add a record or a line; inside a record only what the sentry formats
// is read (see logs.go). The exit status and the signal count only when
// the sentry reported them itself: it logged its own end with the
// container's wait status, runsc logged the same, runsc's exit code as the
// host kernel saw it agrees, and the sentry's Go runtime wrote nothing to
// its panic log (--panic-log). A sentry that panicked, crashed or was
// killed from outside makes the run fail with an error wrapping
// moat.ErrUnavailable; one that the cgroup's memory or pids limit ended
// is a kill by SIGKILL with that reason. The level reports these facts as
// the engine's Evidence (verdict.go); the engine decides the reason.
//
// The tracing has a cost: every write system call is logged, so code that
// makes many tiny unbuffered writes runs several times slower than under
// gVisor alone (measured here with the text log: about 30,000 one-byte
// writes a second instead of 110,000; the JSON log costs about a quarter
// more: a median 13,300 one-byte writes to a file a second against 17,600
// with the text log, side by side on a loaded machine). Python's own
// output to a pipe is buffered and barely affected.
//
// The level needs root: runsc runs rootful, and the cgroups are moat's.
package gvisor

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/owner"
)

// Platform is how the sentry intercepts the code's system calls.
type Platform string

// The platforms moat accepts. They differ in speed, not in what the code
// can reach: in each, the sentry serves every system call.
const (
	// PlatformSystrap uses seccomp traps and shared memory. It is the
	// default: runsc's fastest platform without hardware virtualization.
	PlatformSystrap Platform = "systrap"
	// PlatformPtrace uses ptrace. It is far slower; runsc versions before
	// systrap (Debian 12's) have only it and KVM.
	PlatformPtrace Platform = "ptrace"
	// PlatformKVM uses hardware virtualization. It needs /dev/kvm, and
	// hangs under some nested hypervisors.
	PlatformKVM Platform = "kvm"
)

// Config configures the gvisor level. The zero value runs the image that
// `moat image build` makes under the systrap platform, with the default
// limits.
type Config struct {
	// Limits bound each run. Zero fields mean moat's defaults.
	Limits moat.Limits `json:"limits"`
	// Runsc is the runsc binary. Zero means the first of
	// /usr/local/bin/runsc, /usr/bin/runsc and /usr/sbin/runsc; moat's PATH
	// is never searched.
	Runsc string `json:"runsc,omitempty"`
	// Platform is the platform runsc runs the sandbox on. Zero means
	// systrap. When runsc lacks the platform, New fails: moat never falls
	// back to another one by itself.
	Platform Platform `json:"platform,omitempty"`
	// StateDir holds runsc's state (its --root, StateDir/runsc) and the
	// runs' bundles (StateDir/bundles), one directory per run or session,
	// removed after it. Zero means /run/moat/gvisor.
	StateDir string `json:"state_dir,omitempty"`
	// RootFS is the root filesystem the code sees, read-only. Zero means
	// the one package image builds from SharedImage (`moat image build`).
	// It must hold /usr/bin/python3 and an empty /work; sessions
	// also need /bin/sh and /bin/sleep.
	RootFS string `json:"rootfs,omitempty"`
	// SharedImage is the shared image (its packages, suite, mirror) whose
	// root filesystem RootFS defaults to (image.Path). Zero means
	// image.Config's defaults. The config file sets it in its top-level
	// "image" section.
	SharedImage image.Config `json:"-"`
	// Warm is how many sandboxes are kept booted ahead of the runs that
	// will use them, as engine.Config.Warm means: each is a fresh sandbox
	// with this Config's limits (runsc, the sentry, and Python waiting for
	// the code on stdin) that serves exactly one run, so that booting
	// gVisor and starting Python happen off the run's path. Zero means 1;
	// -1 means none, so that every run boots its own sandbox while it
	// waits; at most 16. Close kills those still waiting.
	Warm int `json:"warm,omitempty"`
	// WarmMax is how many sandboxes the pool may grow to under a burst of
	// runs that found none ready, one more per such run, shrinking back to
	// Warm after engine.BurstDecay without one (engine.Config.WarmMax).
	// Zero means Warm: no growth. At most 16.
	WarmMax int `json:"warm_max,omitempty"`
	// Recycle lets consecutive one-shot runs of one tenant
	// (moat.Request.Tenant; moat serve's API token) reuse one sandbox, a
	// plain session's, reset after each run (recycle.go): every process
	// of the run ended with its PID and IPC namespaces, /work, /tmp and
	// /dev/shm emptied and their modes restored, the CPU budget fresh.
	// Runs of different tenants, or without one, never share a sandbox.
	// False (the default) boots a fresh sandbox for every run.
	Recycle bool `json:"recycle,omitempty"`
	// SessionCPUTime is the most CPU time the runs of one session may use
	// in all, counted from the session sandbox's host cgroup while each
	// run is in progress. The run that reaches it ends with
	// moat.ReasonTimeout; the session's later runs then fail with an
	// error wrapping moat.ErrSpent, while its files can still be read.
	// Zero means ten times Limits.CPUTime (100s with the default limits).
	SessionCPUTime moat.Duration `json:"session_cpu_time,omitempty"`
	// Logger receives a line per run at debug level and set-up facts at
	// info level. Nil means discard.
	Logger *slog.Logger `json:"-"`
	// Egress is the egress proxy that is the runs' and sessions' only way
	// out: each sandbox gets a network namespace of its own holding only
	// loopback, with the proxy listening there on 127.0.0.1:3128, its
	// address in the code's environment and moat's CA bundle at
	// /mnt/moat-ca.pem (network.go). Nil means no network, as before:
	// gVisor's own network stack with loopback only (--network=none).
	Egress *egress.Proxy `json:"-"`
}

// Validate reports whether c is usable; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	if err := c.Limits.Validate(); err != nil {
		return err
	}
	switch c.Platform {
	case "", PlatformSystrap, PlatformPtrace, PlatformKVM:
	default:
		return fmt.Errorf("gvisor: unknown platform %q (systrap, ptrace or kvm): %w", c.Platform, moat.ErrInvalid)
	}
	if err := engine.ValidateWarmMax(moat.LevelGVisor, c.Warm, c.WarmMax); err != nil {
		return err
	}
	if err := engine.ValidateWarm(moat.LevelGVisor, c.Warm); err != nil {
		return err
	}
	if c.SessionCPUTime < 0 {
		return fmt.Errorf("gvisor: session cpu time %v is negative: %w", c.SessionCPUTime, moat.ErrInvalid)
	}
	for name, p := range map[string]string{"runsc": c.Runsc, "state_dir": c.StateDir, "rootfs": c.RootFS} {
		if p != "" && !filepath.IsAbs(p) {
			return fmt.Errorf("gvisor: %s %q must be an absolute path: %w", name, p, moat.ErrInvalid)
		}
	}
	return nil
}

// DefaultStateDir is where runsc's state and the bundles live when
// Config.StateDir is empty.
const DefaultStateDir = "/run/moat/gvisor"

// cgroupParent is the parent of the runs' cgroups in each hierarchy.
const cgroupParent = "moat-gvisor"

// ownersDir is where moat processes record themselves as owners (package
// owner): one place per machine, like the cgroups they own.
const ownersDir = "/run/moat/owners"

// Sandbox is the gvisor level: moat's run engine over the level's backend.
// It is safe for concurrent use. Run, Level, Limits, Close and NewSession
// are the engine's.
type Sandbox struct {
	*engine.Sandbox
	b *backend
}

var (
	_ moat.Sandbox   = (*Sandbox)(nil)
	_ moat.Sessioner = (*Sandbox)(nil)
	_ engine.Backend = (*backend)(nil)
)

// backend is what the level knows of the host, and how it boots a sandbox.
// It is safe for concurrent use once prepared.
type backend struct {
	cfg       Config
	limits    moat.Limits
	runsc     string
	info      runscInfo
	platform  Platform
	rootfs    string
	runscRoot string // runsc's --root
	bundles   string // one directory per run or session
	cg        *cgroup.Manager
	// owner is this process's owner id: the prefix of its runs' ids, which
	// name their bundles, runsc containers and cgroups.
	owner string
	notes []string
	log   *slog.Logger

	// runscDigest is runsc's binary's, for the key of a checkpoint
	// (suspend.go), read at the first suspend or resume.
	runscDigest

	// testFlags are runsc flags that this package's tests add (to make
	// the sentry panic on a signal); nil otherwise. Set before any boot.
	testFlags []string
}

func unavailable(reason, remedy string, err error) error {
	return &moat.UnavailableError{Level: moat.LevelGVisor, Reason: reason, Remedy: remedy, Err: err}
}

// New checks that every protection can be applied here (root, runsc with
// the platform, the root filesystem, the cgroup controllers), reaps what
// moat processes that died left behind, and returns the sandbox, which
// starts booting Config.Warm sandboxes ahead of runs. It returns an error
// wrapping moat.ErrUnavailable when something is missing; the error says
// what to do.
func New(cfg Config) (*Sandbox, error) {
	b, err := prepare(context.Background(), cfg)
	if err != nil {
		return nil, err
	}
	id, err := owner.Self(ownersDir)
	if err != nil {
		return nil, unavailable("cannot record this process as an owner in "+ownersDir, "", err)
	}
	b.owner = id
	b.reap()
	go b.digestRunsc() // for the key of suspended sessions (suspend.go)
	eng, err := engine.New(engine.Config{
		Level:   moat.LevelGVisor,
		Limits:  cfg.Limits,
		Warm:    cfg.Warm,
		WarmMax: cfg.WarmMax,
		Recycle: cfg.Recycle,
		Notes:   b.notes,
		Logger:  b.log,
	}, b)
	if err != nil {
		return nil, err
	}
	return &Sandbox{Sandbox: eng, b: b}, nil
}

// Check says whether a sandbox with cfg can run here, and which runsc,
// platform and image it would use, without reaping or running anything.
func Check(ctx context.Context, cfg Config) moat.Availability {
	b, err := prepare(ctx, cfg)
	if err != nil {
		return moat.Unavailable(moat.LevelGVisor, err)
	}
	a := moat.Availability{Level: moat.LevelGVisor, Available: true}
	a.Details = b.details()
	return a
}

func (b *backend) details() []string {
	d := []string{
		fmt.Sprintf("runsc: %s, version %s", b.runsc, b.info.Version),
		fmt.Sprintf("platform: %s (runsc has %s)", b.platform, strings.Join(b.info.Platforms, ", ")),
		"rootfs: " + b.rootfs + " (read-only)",
		fmt.Sprintf("cgroup: v%d (memory, pids backstop, cpu account)", b.cg.Version()),
		"network: " + b.network(),
	}
	if r, err := readImageRecord(b.rootfs); err == nil {
		d = append(d, fmt.Sprintf("image: built %s ago, python %s", time.Since(r.BuiltAt).Round(time.Second), r.PythonVersion))
	}
	return d
}

// readImageRecord reads image.json next to a root filesystem made by package
// image, if there is one.
func readImageRecord(rootfs string) (*image.Record, error) {
	b, err := os.ReadFile(filepath.Join(filepath.Dir(rootfs), "image.json"))
	if err != nil {
		return nil, err
	}
	var r image.Record
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, err
	}
	return &r, nil
}

// prepare validates cfg and probes the host, creating nothing but moat's
// own directories.
func prepare(ctx context.Context, cfg Config) (*backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	b := &backend{cfg: cfg, limits: cfg.Limits.WithDefaults(), log: cfg.Logger}
	if b.log == nil {
		b.log = slog.New(slog.DiscardHandler)
	}
	if os.Geteuid() != 0 {
		return nil, unavailable(fmt.Sprintf("not root (uid %d): the gvisor level runs runsc as root and gives each run a cgroup", os.Geteuid()),
			"run moat as root", nil)
	}
	runsc, err := findRunsc(cfg.Runsc)
	if err != nil {
		return nil, unavailable("runsc is not installed", "run scripts/setup-gvisor.sh as root (it installs runsc from Debian's packages)", err)
	}
	b.runsc = runsc
	info, err := probeRunsc(ctx, runsc)
	if err != nil {
		return nil, unavailable("runsc does not answer", "reinstall it with scripts/setup-gvisor.sh", err)
	}
	b.info = info
	b.platform = cfg.Platform
	if b.platform == "" {
		b.platform = PlatformSystrap
	}
	if !slices.Contains(info.Platforms, string(b.platform)) {
		remedy := "run scripts/setup-gvisor.sh to install a runsc with systrap (Debian 13's), or choose platform ptrace explicitly"
		if b.platform != PlatformSystrap {
			remedy = "choose one of: " + strings.Join(info.Platforms, ", ")
		}
		return nil, unavailable(fmt.Sprintf("runsc %s has no %s platform (it has %s)", info.Version, b.platform, strings.Join(info.Platforms, ", ")), remedy, nil)
	}
	if b.platform == PlatformKVM {
		if _, err := os.Stat("/dev/kvm"); err != nil {
			return nil, unavailable("the kvm platform needs /dev/kvm", "choose platform systrap", err)
		}
	}

	b.rootfs = cfg.RootFS
	if b.rootfs == "" {
		b.rootfs = image.Path(cfg.SharedImage)
	}
	if err := checkRootFS(b.rootfs); err != nil {
		remedy := "run '" + cfg.SharedImage.BuildCommand() + "' (or scripts/setup-gvisor.sh) as root"
		if cfg.RootFS != "" {
			remedy = "set rootfs to a root filesystem made by 'moat image build'"
		}
		return nil, unavailable("the sandbox root filesystem is not there", remedy, err)
	}
	if cfg.Egress != nil {
		if err := checkEgressRoot(b.rootfs); err != nil {
			return nil, unavailable("the root filesystem has no place for the egress proxy's CA bundle", "rebuild it with 'moat image build'", err)
		}
	}

	cg, err := cgroup.Detect(cgroupParent)
	if err != nil {
		return nil, unavailable("no usable memory, pids and cpu accounting cgroup controllers", "mount cgroup v2 with memory and pids enabled, or the v1 memory, pids and cpuacct hierarchies", err)
	}
	b.cg = cg

	state := cfg.StateDir
	if state == "" {
		state = DefaultStateDir
	}
	b.runscRoot = filepath.Join(state, "runsc")
	b.bundles = filepath.Join(state, "bundles")
	for _, d := range []string{state, b.runscRoot, b.bundles} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, unavailable("cannot create the state directory "+d, "set state_dir to a writable directory", err)
		}
	}
	b.notes = []string{fmt.Sprintf("gvisor: runsc %s, platform %s", info.Version, b.platform)}
	return b, nil
}

// checkRootFS checks that root looks like the image's root filesystem.
func checkRootFS(root string) error {
	if _, err := os.Stat(root); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("%s: %w", root, image.ErrNotBuilt)
		}
		return err
	}
	py := filepath.Join(root, image.Python)
	if _, err := os.Stat(py); err != nil {
		return fmt.Errorf("no python3 in the root filesystem: %w", err)
	}
	if st, err := os.Stat(filepath.Join(root, image.WorkDir)); err != nil || !st.IsDir() {
		return fmt.Errorf("no %s directory in the root filesystem to mount the working directory on", image.WorkDir)
	}
	return nil
}

// Platform returns the platform the runs use.
func (s *Sandbox) Platform() Platform { return s.b.platform }

// Version returns runsc's version.
func (s *Sandbox) Version() string { return s.b.info.Version }

// Prepare boots a sandbox for one run: see engine.Backend. It returns once
// runsc is started; the sandbox boots on its own meanwhile.
func (b *backend) Prepare(ctx context.Context) (engine.Instance, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	spec := newSpec(b.rootfs, image.Python, b.limits)
	var r *egress.Run
	if b.cfg.Egress != nil {
		r = b.cfg.Egress.NewRun()
		spec.Process.Env = append(spec.Process.Env, egressEnv(r)...)
	}
	bt, err := b.boot(spec, 0, r)
	if err != nil {
		return nil, err
	}
	return bt, nil
}

// Close releases nothing: every sandbox is the engine's instance or a
// session's, and each removes itself.
func (b *backend) Close() error { return nil }

// reap removes what moat processes that are no longer alive left behind:
// their sandboxes' processes and cgroups, runsc's state of their
// containers, and their bundles.
func (b *backend) reap() {
	names, err := b.cg.ReapDead(deadOwner)
	if len(names) > 0 {
		b.log.Info("gvisor: reaped leftover cgroups", "groups", names)
	}
	if err != nil {
		b.log.Warn("gvisor: reap leftover cgroups", "err", err)
	}
	ids := map[string]bool{}
	for _, dir := range []string{b.runscRoot, b.bundles} {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			if id, ok := runID(e.Name()); ok && deadOwner(id) {
				ids[id] = true
			}
		}
	}
	for id := range ids {
		// Let runsc tear down what it knows of the container first; its
		// processes are dead already (the cgroup was killed).
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		runQuiet(ctx, b.runsc, "--root="+b.runscRoot, "delete", "--force", id)
		cancel()
		// A session's host working directory is a mount in the bundle:
		// it goes first, so that RemoveAll stays on moat's own files.
		err := errors.Join(removeState(b.runscRoot, id), unmountHostWork(filepath.Join(b.bundles, id, "work")))
		err = errors.Join(err, os.RemoveAll(filepath.Join(b.bundles, id)))
		if err != nil {
			b.log.Warn("gvisor: reap leftover container", "id", id, "err", err)
		} else {
			b.log.Info("gvisor: reaped leftover container", "id", id)
		}
	}
}

// deadOwner reports whether name ("<owner>-<anything>") belongs to a moat
// process that is no longer alive. Names of other forms are never reaped.
func deadOwner(name string) bool {
	id, ok := owner.Of(name)
	return ok && !owner.Alive(ownersDir, id)
}

// runIDLen is the length of a run's id: two ids of 16 hex digits and a dash.
const runIDLen = 16 + 1 + 16

// runID returns the run id that names a bundle ("<id>") or one of runsc's
// files ("<id>_sandbox:<id>.state", "runsc-<id>.sock", ...).
func runID(name string) (string, bool) {
	name = strings.TrimPrefix(name, "runsc-")
	if len(name) < runIDLen {
		return "", false
	}
	id := name[:runIDLen]
	if _, ok := owner.Of(id); !ok || id[16] != '-' {
		return "", false
	}
	if _, err := hex.DecodeString(id[17:]); err != nil {
		return "", false
	}
	return id, true
}

// Describe says which runsc and platform run the sandboxes, and how their
// network is confined; see moat.Describer.
func (s *Sandbox) Describe() string {
	return "runsc " + s.Version() + ", platform " + string(s.Platform()) + ", sandboxes booted ahead of runs, network: " + s.b.network()
}

// network says in a few words how the sandboxes' network is confined.
func (b *backend) network() string {
	if b.cfg.Egress == nil {
		return "none (runsc --network=none: gVisor's own stack, loopback only)"
	}
	return "egress proxy only (runsc --network=host in a network namespace of the sandbox's own holding only loopback, the proxy listening in it on 127.0.0.1:3128)"
}

var _ moat.Describer = (*Sandbox)(nil)
