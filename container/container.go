// Package container is moat's container level: each run is a fresh,
// hardened Docker container, driven through the Engine API with Docker's
// official Go client (never the docker CLI), from the image that package
// image builds.
//
// Every container is hardened, with no way to turn an item off:
//
//   - no network at all (network mode none, networking disabled), unless
//     Config.Egress names moat's egress proxy: then the container's own
//     network namespace still holds only its loopback, where moat listens
//     for the proxy at 127.0.0.1:3128, and the code reaches that listener
//     and nothing else (see network.go);
//   - a read-only root filesystem; the working directory (/work), /tmp and
//     /dev/shm are tmpfs mounts (nosuid, nodev, noexec, inode-limited) whose
//     sizes add up to Limits.Disk, so the disk limit covers every writable
//     place;
//   - all capabilities dropped, no-new-privileges, and a uid and gid of the
//     container's own (Config.UIDFirst, UIDCount), leased from before the
//     container is created until it is removed (see internal/uidpool), so
//     that no two live containers share the per-uid limits of the kernel
//     (inotify instances, message queue bytes, pipe pages); the writable
//     mounts belong to that uid;
//   - a pids limit (Limits.Pids), a memory limit with swap equal to it
//     (Limits.Memory), a CPU quota (Config.CPUs), the nofile, fsize, core
//     and cpu rlimits; the CPU time of the whole tree is watched from the
//     host against Limits.CPUTime;
//   - moat's own seccomp profile (internal/seccomp's Docker), never the
//     engine's default: an allow-list made from Moby's default less what
//     moat's subprocess filter refuses and more (io_uring, every socket
//     family but AF_UNIX, and AF_INET and AF_INET6 with Config.Egress, so
//     no AF_VSOCK, whose ports are not namespaced;
//     ptrace, userfaultfd, memfd_secret, keyrings, bpf, perf_event_open,
//     the mount family, namespaces, clone3; only the native syscall
//     convention). It is checked twice from the host: New runs a probe
//     container and fails unless the probe's calls are refused in it
//     (once per process, engine, image and profile; Check always), and
//     every run's init must run under as many seccomp filters as the
//     probe's did (/proc/PID/status) before its code is written. Docker's
//     default masked and read-only /proc paths stay;
//   - private IPC, PID, UTS and cgroup namespaces; no host mounts (with
//     Config.Egress only the proxy's CA bundle, a root-owned file bind
//     mounted read-only), no Docker socket, no docker-init from the host;
//   - the log driver "none": the output reaches moat and nothing else, never
//     the host's disk;
//   - an OOM score of 1000, so that a sandbox is the first to go when the
//     host runs out of memory;
//   - a runc with the fixes for the November 2025 escapes (CVE-2025-31133,
//     CVE-2025-52565, CVE-2025-52881): the runtime "runc-moat" that
//     scripts/setup-docker.sh registers, or the engine's default runtime if
//     its runc is recent enough. With only an older runc, New fails closed
//     unless Config.AllowVulnerableRuntime says otherwise.
//
// The only file Docker itself mounts in is the /etc/hostname it generates,
// read-only.
//
// The code reaches the container on stdin through the attach stream (no bind
// mount, no copy), and its output comes back on the same stream. The stdin
// is written only once moat watches the run from the host (see watch), so
// no code runs unwatched. The level is a backend of moat's run engine
// (internal/engine), which owns the run's lifecycle (output cap, wall
// timer, cancellation, verdict) and keeps Config.Warm containers ahead of
// runs: each created, attached to and started, with every restriction
// above applied, watched from the host and checked for moat's seccomp
// filter, its python3 already started (`python3 -`) and blocked reading
// its code from stdin, which it runs only once stdin ends. A run then only
// writes its code and waits for the end: the engine's create and start of
// a container and python3's own start stay out of the run's time. Each
// container, and its python3, serves one run: no PYTHONHASHSEED is set, so
// every run has its own hash seed and randomness. One that ended while it
// waited is found at Start, before any code is written, and the engine
// retries on a fresh one. The CPU its start used counts against the run's
// CPU time limit (the cgroup counts from its creation); the wall time
// starts with the run. Every
// container carries the labels moat.sandbox=1 and moat.owner=<pid> (with the
// owner's start time and boot id); New removes the containers whose owner is
// gone, so a moat killed mid-run leaks nothing past the next start. Each run
// removes its container before Run returns, whatever happened.
//
// How each piece of the evidence the engine judges is found, from the host
// side: the exit status from the engine's wait; timeout, when the cgroup's
// CPU usage reaches the limit (moat kills the container), or the code dies
// of SIGXCPU; memory, from Docker's OOMKilled; pids, from the
// kernel's log of the first refused fork in the container's cgroup (see
// kmsg.go; it needs root) and the pids cgroup's event counter; filesize and
// disk, from the run's tmpfs mounts, which moat holds open while the run ends
// (see watch).
//
// A Sandbox is also a moat.Sessioner (as root: sessions are watched,
// killed and frozen from the host). A session is one long-lived container
// with the same hardening and a uid of its own, whose init only reaps; each
// run is an exec of Python in it, checked from the host as a one-shot
// run's init is before its code goes in; at each run's end every process
// but the init is killed from the host, and between runs the container is
// paused (its cgroup frozen). The session as a whole has the level's
// memory, pids and disk limits; each run has the CPU time limit, counted
// from the container's cgroup since it began; the whole session has
// Config.SessionCPUTime. The files are handled inside the container by
// internal/sessionfiles, through execs of the session's uid. With
// SessionOptions.Interpreter, a live Python driver in the container keeps
// the variables between runs (see interpreter.go). The session's
// container carries the labels of every container (and moat.session=1),
// so the reaper removes it once its owner is gone.
//
// With Config.Driver "runc", one-shot runs skip Docker: each container is
// an OCI bundle moat writes (config.json) over the shared root filesystem
// of package image (the one the gvisor level runs), started with `runc run
// --keep` in the foreground by the runc that scripts/setup-docker.sh builds
// (runc-moat, the same version rule as above), with its stdio the run's
// own pipes, passed through (see runc.go, runc_run.go, runc_spec.go).
// Every protection above is written into the spec, with no way to turn one
// off: namespaces pid, ipc, uts, mount, cgroup and network (a new one, its
// loopback down), no capability in any set, no_new_privs, moat's seccomp
// profile converted field for field to linux.seccomp, Docker's masked and
// read-only /proc paths, no /sys, runc's default /dev, the tmpfs mounts
// and rlimits of the Docker path, memory (swap equal), pids and CPU quota
// in the cgroup, an OOM score of 1000, the environment PATH, HOME and
// LANG, the leased uid and gid with no supplementary group. Before any
// code is written, the host checks the init's seccomp filter (as many as
// the driver's own probe container showed), capabilities, no_new_privs,
// credentials and namespaces, its mounts (the root read-only, the masked
// and read-only /proc paths, the tmpfs mounts nosuid, nodev and noexec,
// no other mount), its cgroup limits and rlimits (read back), and watches
// it as above. runc runs as PID 1 of a PID namespace of its own under
// util-linux's unshare, which moat's death kills: a moat killed -9 leaves
// no code running (a later New reaps the state, bundle and cgroups). The
// evidence is runc's exit code (the init's status, 128+N for signal N;
// 128+SIGXCPU counts as the CPU limit only when the host saw the CPU
// used), the memory
// cgroup's OOM kills and the pids controller's refusals (kept past the
// run by --keep), and the watch's; a kill is a SIGKILL to the init's
// pidfd, which ends its PID namespace. Runc's state lives under
// /run/moat/runc/<owner id> (internal/owner), the bundles in
// /run/moat/runc-bundles, the cgroups under moat-runc/, all named with the
// owner id, so New reaps a dead moat's and never a live one's. The driver
// needs root, the shared image and no egress; sessions still go through
// Docker (NewSession fails with moat.ErrUnavailable when the engine is not
// usable, while one-shot runs go on).
//
// The image is the root filesystem that package image builds, imported
// into the engine by ImportImage (which `moat image build` calls) under
// image.Config.Tag and labelled with its key (ImageLabel); InspectImage
// says whether the engine holds it. Package image itself talks to no
// engine, so that the levels that read the root filesystem directly link
// no Docker package.
package container

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// The default uid range of Config: the 65536 uids past the subprocess
// level's default range (2100000000+65536).
const (
	DefaultUIDFirst = 2100065536
	DefaultUIDCount = 65536
)

// FixedRuntime is the name under which scripts/setup-docker.sh registers a
// runc with the November 2025 fixes.
const FixedRuntime = "runc-moat"

// Config configures the container level. The zero value runs the image that
// `moat image build` makes, with the default limits, on the fixed runc.
type Config struct {
	// Limits bound each run. Zero fields mean the defaults.
	Limits moat.Limits `json:"limits"`
	// Image is the Docker image to run: any image with python3 at Python
	// and an empty /work, run as uid 65534 or the container's own. Zero
	// means the image that package image builds from SharedImage
	// (moat-sandbox:<key>), which `moat image build` imports.
	Image string `json:"image,omitempty"`
	// SharedImage is the shared image (its packages, suite, mirror) whose
	// tag Image defaults to. Zero means image.Config's defaults. The
	// config file sets it in its top-level "image" section.
	SharedImage image.Config `json:"-"`
	// Runtime is the OCI runtime dockerd runs the container with. Zero means
	// "runc-moat" when the engine knows it, else the engine's default.
	Runtime string `json:"runtime,omitempty"`
	// AllowVulnerableRuntime lets runs go on a runc older than the fixes for
	// the November 2025 escapes (runc < 1.2.8, 1.3.0-1.3.2), or one whose
	// version cannot be told; each Result then says so in its Notes. False
	// (the default) makes New fail closed instead.
	AllowVulnerableRuntime bool `json:"allow_vulnerable_runtime,omitempty"`
	// Python is the interpreter's path in the image. Zero means
	// /usr/bin/python3.
	Python string `json:"python,omitempty"`
	// UIDFirst and UIDCount are the range of uids (and gids of the same
	// number) given to containers, one per container at a time, so that
	// per-uid kernel limits (inotify instances, message queue bytes, pipe
	// pages) are not shared between runs. Zero means 2100065536 and 65536,
	// just past the subprocess level's default range. The first must be
	// 1000 or more; no user of the host should own a uid in the range.
	UIDFirst int `json:"uid_first,omitempty"`
	UIDCount int `json:"uid_count,omitempty"`
	// CPUs is the CPU quota, in CPUs. Zero means 1.
	CPUs float64 `json:"cpus,omitempty"`
	// Warm is how many containers the engine keeps ahead of runs, each
	// started, with its python3 up and waiting for its code (nothing of a
	// run's code runs in it until a run writes it), which takes their
	// creation, their start and python3's start out of a run's time:
	// engine.Config.Warm, so zero means 1, -1 means none (each run makes
	// and starts its own), and at most 16.
	Warm int `json:"warm,omitempty"`
	// WarmMax is how many containers the pool may grow to under a burst of
	// runs that found none ready, one more per such run, shrinking back to
	// Warm after engine.BurstDecay without one (engine.Config.WarmMax).
	// Zero means Warm: no growth. At most 16.
	WarmMax int `json:"warm_max,omitempty"`
	// SessionCPUTime is the most CPU time one session's container may use
	// over its whole life, runs and file operations together, read from
	// its cgroup's CPU account. The run that reaches it ends with
	// moat.ReasonTimeout; the session's later runs then fail with an error
	// wrapping moat.ErrSpent (its files stay readable until Close). Zero
	// means ten times Limits.CPUTime.
	SessionCPUTime moat.Duration `json:"session_cpu_time,omitempty"`
	// Driver is how one-shot runs (Run) reach their containers: "" or
	// "docker" through the Docker Engine API, as described above; "runc"
	// with the runc binary directly (see runc.go): the runc that
	// scripts/setup-docker.sh builds and registers with dockerd as
	// runc-moat, found at MOAT_LIBEXEC/runc (/usr/local/lib/moat/runc),
	// over the shared root filesystem of package image, with the same
	// protections written into each container's OCI spec, checked from the
	// host, and none of dockerd's work on a run's path. The runc driver
	// needs root, runs only the shared image (Image empty) and gives no
	// network (Egress nil), or New fails with moat.ErrUnavailable. Sessions
	// (NewSession) go through Docker whatever the driver: with "runc" and
	// no usable engine, one-shot runs still work and NewSession fails with
	// an error wrapping moat.ErrUnavailable.
	Driver string `json:"driver,omitempty"`
	// Recycle lets consecutive one-shot runs of one tenant
	// (moat.Request.Tenant; moat serve's API token) reuse one container,
	// reset after each run (runc_recycle.go): every process of the run
	// killed, SysV IPC and message queues removed, /work, /tmp and
	// /dev/shm emptied and their tops restored, the CPU budget and the
	// counters fresh, a fresh python3 for every run. Runs of different
	// tenants, or without one, never share a container. It needs the runc
	// driver (New fails with moat.ErrInvalid otherwise). False (the
	// default) makes a fresh container for every run.
	Recycle bool `json:"recycle,omitempty"`
	// Logger receives debug logs. Nil means discard.
	Logger *slog.Logger `json:"-"`
	// Egress is the egress proxy the code reaches, and nothing else (see
	// network.go): each container, or session, gets a listener of the
	// proxy inside its own network namespace and the proxy's environment.
	// It needs moat to be root on the engine's host. Nil means no network
	// at all, as without it.
	Egress *egress.Proxy `json:"-"`
}

// withDefaults fills the zero fields and checks the result.
func (c Config) withDefaults() (Config, error) {
	if err := c.Limits.Validate(); err != nil {
		return c, err
	}
	c.Limits = c.Limits.WithDefaults()
	if c.Image == "" {
		c.Image = c.SharedImage.Tag()
	}
	if c.Python == "" {
		c.Python = image.Python
	}
	if c.UIDFirst < 0 || c.UIDCount < 0 || (c.UIDFirst != 0 && c.UIDFirst < 1000) {
		return c, fmt.Errorf("container: uid range %d+%d must lie above the system's users: %w", c.UIDFirst, c.UIDCount, moat.ErrInvalid)
	}
	if c.UIDFirst == 0 {
		c.UIDFirst = DefaultUIDFirst
	}
	if c.UIDCount == 0 {
		c.UIDCount = DefaultUIDCount
	}
	if int64(c.UIDFirst)+int64(c.UIDCount) > 1<<31-1 {
		return c, fmt.Errorf("container: uid range %d+%d passes 2^31-2: %w", c.UIDFirst, c.UIDCount, moat.ErrInvalid)
	}
	if c.CPUs == 0 {
		c.CPUs = 1
	}
	if err := engine.ValidateWarmMax(moat.LevelContainer, c.Warm, c.WarmMax); err != nil {
		return c, err
	}
	if err := engine.ValidateWarm(moat.LevelContainer, c.Warm); err != nil {
		return c, err
	}
	if c.SessionCPUTime < 0 {
		return c, fmt.Errorf("container: session cpu time %v is negative: %w", c.SessionCPUTime, moat.ErrInvalid)
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	switch c.Driver {
	case "", DriverDocker, DriverRunc:
	default:
		return c, fmt.Errorf("container: driver %q is neither %q nor %q: %w", c.Driver, DriverDocker, DriverRunc, moat.ErrInvalid)
	}
	if c.Recycle && c.Driver != DriverRunc {
		return c, fmt.Errorf("container: recycle needs the runc driver (driver %q): %w", DriverRunc, moat.ErrInvalid)
	}
	if c.CPUs < 0.01 {
		return c, fmt.Errorf("container: cpus %v is below 0.01: %w", c.CPUs, moat.ErrInvalid)
	}
	if !strings.HasPrefix(c.Python, "/") || strings.ContainsAny(c.Python, " \t\n'\"$`\\;&|<>") {
		return c, fmt.Errorf("container: python %q must be an absolute path without spaces or shell characters: %w", c.Python, moat.ErrInvalid)
	}
	return c, nil
}

// nativeHints say why a shared object a run dropped does not load: every
// place a run may write (its tmpfs mounts) is noexec (see spec.go).
var nativeHints = []engine.Hint{{
	In: "failed to map segment from shared object",
	Note: "a shared object could not be loaded (\"failed to map segment from shared object\"): every writable place of the container " +
		"(the working directory, /tmp) is mounted noexec, so native code the run writes or uploads (a .so, a binary) cannot be mapped " +
		"executable or run; add it to the image as a Debian package (moat image build --packages), or run at the gvisor or microvm level",
}}

// Sandbox runs code in hardened Docker containers. It is safe for
// concurrent use; see moat.Sandbox and moat.Sessioner for the contract. The
// run's lifecycle (the checks of the request, the output cap, the wall
// timer, the cancellation, the verdict, the pool of containers prepared
// ahead of runs) is the engine's (internal/engine); the level prepares the
// containers, starts the code in them and reports what the host saw.
type Sandbox struct {
	*engine.Sandbox
	b *backend     // the Docker path's; nil with the runc driver and no usable engine
	r *runcBackend // the runc driver's, or nil
}

var (
	_ moat.Sandbox          = (*Sandbox)(nil)
	_ moat.Sessioner        = (*Sandbox)(nil)
	_ engine.Backend        = (*backend)(nil)
	_ engine.SessionBackend = (*backend)(nil)
)

var _ moat.Describer = (*Sandbox)(nil)

// Describe says which runtime runs the containers, what is started ahead
// of runs and how they reach the network; see moat.Describer.
func (s *Sandbox) Describe() string {
	ahead := "python3 started ahead in each pooled container"
	if r := s.r; r != nil {
		if r.warm < 0 {
			ahead = "no container prepared ahead"
		}
		sessions := "sessions through Docker (runtime " + r.dockerRuntime() + ")"
		if s.b == nil {
			sessions = "no sessions (the Docker engine is not usable)"
		}
		return r.describe() + "; " + ahead + "; no network; " + sessions
	}
	if s.b.warm < 0 {
		ahead = "no container prepared ahead"
	}
	return "runtime " + s.b.spec.runtime + "; " + ahead + "; " + s.b.netDescribe()
}

// backend is the container level under the engine: it prepares containers
// (instance), starts the code in them (process) and keeps sessions
// (session).
type backend struct {
	cli  *client.Client
	kmsg *kmsgReader // nil when the kernel log cannot be read
	spec *spec
	log  *slog.Logger
	// watched says that moat is root and watches every run from the host
	// (see watch): a run that cannot be watched then fails.
	watched bool
	// uids leases each container its own uid, held from its creation to
	// its removal.
	uids     *uidpool.Pool
	uidFirst int // the range's first uid
	// sessionCPU is a session's CPU budget over its life.
	sessionCPU time.Duration
	// warm is Config.Warm.
	warm int
	// filters is the number of seccomp filters the probe's container ran
	// under (see probeSeccomp); every run's init must show as many. Set
	// before the engine starts, never changed after; zero while the probe
	// itself runs.
	filters int
	// lastFilters is the number of filters the last run's init ran under;
	// the probe reads it.
	lastFilters atomic.Int64
	// egress is the proxy the containers reach, nil for no network;
	// newRun makes each container's or session's run of it.
	egress *egress.Proxy
	newRun func(*egress.Proxy) egressRun
	// teardown counts the removals of exited runs' containers still in
	// progress (instance.Discard); Close waits for them.
	teardown sync.WaitGroup

	// The client is closed once the engine closed the backend and the last
	// session is closed: sessions outlive their Sandbox.
	mu       sync.Mutex
	closed   bool
	sessions int
}

// New connects to the Docker engine (DOCKER_HOST, or the local socket),
// checks that it can run the level with every protection (seccomp, a fixed
// runc, the image), and removes the containers that dead moat processes
// left behind. It returns an error wrapping moat.ErrUnavailable when it
// cannot.
//
// With Config.Driver "runc" it checks runc, the kernel and the shared root
// filesystem instead (see newRunc), and the Docker engine only for
// sessions.
func New(cfg Config) (*Sandbox, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if cfg.Driver == DriverRunc {
		return newRunc(cfg)
	}
	b, notes, err := newDocker(cfg)
	if err != nil {
		return nil, err
	}
	es, err := engine.New(engine.Config{
		Level:   moat.LevelContainer,
		Limits:  cfg.Limits,
		Warm:    cfg.Warm,
		WarmMax: cfg.WarmMax,
		Notes:   notes,
		Hints:   nativeHints,
		Logger:  cfg.Logger,
	}, b)
	if err != nil {
		b.cli.Close()
		return nil, err
	}
	return &Sandbox{Sandbox: es, b: b}, nil
}

// newDocker connects to the engine, checks it, reaps dead moats'
// containers and probes moat's seccomp profile in a container: the Docker
// path's backend, probed, and the notes of its Results.
func newDocker(cfg Config) (*backend, []string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli, err := newClient()
	if err != nil {
		return nil, nil, unavailable("no Docker client", "set DOCKER_HOST or run scripts/setup-docker.sh", err)
	}
	ok := false
	defer func() {
		if !ok {
			cli.Close()
		}
	}()
	eng, err := probe(ctx, cli, cfg)
	if err != nil {
		return nil, nil, err
	}
	if err := eng.refusal(cfg); err != nil {
		return nil, nil, err
	}
	var notes []string
	if os.Geteuid() != 0 {
		notes = append(notes, "moat is not root: it cannot watch runs from the host, so the CPU time of a whole process tree is not limited (each process still is) and the pids, filesize and disk reasons are not reported")
	}
	if !eng.runtimeFixed {
		notes = append(notes, fmt.Sprintf("runtime %s is %s, older than the fixes for the November 2025 container escapes (allowed by the operator)", eng.runtime, eng.runtimeVersionText()))
	}
	if removed, err := reap(ctx, cli, cfg.Logger); err != nil {
		cfg.Logger.Warn("container: removing containers of dead moat processes", "err", err)
	} else if len(removed) > 0 {
		cfg.Logger.Info("container: removed containers of dead moat processes", "ids", removed)
	}
	b, err := newBackend(cfg, cli, eng)
	if err != nil {
		return nil, nil, err
	}
	// The probe runs once per engine, image and profile in this process;
	// every run still checks its own init's filter.
	key := probeKey(eng, cfg.Image, b.spec.seccomp)
	var r *probeResult
	if v, ok := probed.Load(key); ok {
		r = v.(*probeResult)
	} else {
		if r, err = b.probeSeccomp(ctx); err != nil {
			return nil, nil, err
		}
		probed.Store(key, r)
	}
	b.filters = r.filters
	ok = true
	return b, notes, nil
}

// newBackend makes the backend for cfg on engine eng, with no container
// yet: New puts the engine over it, Check only probes.
func newBackend(cfg Config, cli *client.Client, eng *daemon) (*backend, error) {
	owner, err := ownerLabels()
	if err != nil {
		return nil, fmt.Errorf("container: %w", err)
	}
	if cfg.Egress != nil && os.Geteuid() != 0 {
		return nil, unavailable("a container with network needs moat to be root: moat places its egress proxy inside each container's network namespace", "run moat as root, or give no network", nil)
	}
	prof, err := newProfile(cfg.Egress != nil)
	if err != nil {
		return nil, err
	}
	var caHost string
	if cfg.Egress != nil {
		if caHost, err = writeCABundle(cfg.Egress.CABundle()); err != nil {
			return nil, unavailable("moat cannot write the egress proxy's CA bundle for its containers", "", err)
		}
	}
	uids, err := uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidLockDir())
	if err != nil {
		return nil, unavailable("cannot set up the uid pool", "", err)
	}
	sessionCPU := time.Duration(cfg.SessionCPUTime)
	if sessionCPU == 0 {
		sessionCPU = 10 * time.Duration(cfg.Limits.CPUTime)
	}
	return &backend{
		cli:        cli,
		kmsg:       kernelLog(),
		spec:       newSpec(cfg, eng.runtime, owner, prof, caHost),
		log:        cfg.Logger,
		watched:    os.Geteuid() == 0,
		uids:       uids,
		uidFirst:   cfg.UIDFirst,
		sessionCPU: sessionCPU,
		warm:       cfg.Warm,
		egress:     cfg.Egress,
		newRun:     newEgressRun,
	}, nil
}

// Close releases the engine connection once no session needs it; the
// engine calls it after it discarded every prepared container.
func (b *backend) Close() error {
	b.teardown.Wait() // the removals of exited runs' containers
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	if b.sessions == 0 {
		return b.cli.Close()
	}
	return nil
}

// holdClient counts a session in: the client stays open until it calls
// the returned release.
func (b *backend) holdClient() (release func(), err error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return nil, fmt.Errorf("container: %w", moat.ErrClosed)
	}
	b.sessions++
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			defer b.mu.Unlock()
			b.sessions--
			if b.closed && b.sessions == 0 {
				b.cli.Close()
			}
		})
	}, nil
}

// uidLockDir is where the uid leases are locked: as root, the directory
// the subprocess level uses by default, so that overlapping ranges of the
// two levels still never hand out one uid twice; otherwise one of this
// user's own.
func uidLockDir() string {
	if os.Geteuid() == 0 {
		return "/run/moat/uids"
	}
	return filepath.Join(os.TempDir(), fmt.Sprintf("moat-%d", os.Geteuid()), "uids")
}

func newClient() (*client.Client, error) {
	return client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
}

func unavailable(reason, remedy string, err error) error {
	return &moat.UnavailableError{Level: moat.LevelContainer, Reason: reason, Remedy: remedy, Err: err}
}

// removeTimeout bounds the removal of a container.
const removeTimeout = 30 * time.Second

// initPid finds the host pid of the container's init, from its cgroup or
// else from the engine.
func (b *backend) initPid(ctx context.Context, id string) (int, error) {
	if pid := findInit(id); pid != 0 {
		return pid, nil
	}
	ins, err := b.cli.ContainerInspect(ctx, id)
	if err != nil {
		return 0, err
	}
	if ins.State == nil || ins.State.Pid == 0 {
		return 0, errors.New("container: the run ended before it could be watched")
	}
	return ins.State.Pid, nil
}

// mountPaths are the container's tmpfs mount points.
func (b *backend) mountPaths() []string {
	paths := make([]string, len(b.spec.mounts))
	for i, m := range b.spec.mounts {
		paths[i] = m.path
	}
	return paths
}

// remove removes the container, killing it first if it still runs, and
// reports whether it is gone.
func (b *backend) remove(id string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), removeTimeout)
	defer cancel()
	err := removeContainer(ctx, b.cli, id)
	if err != nil && !cerrdefs.IsNotFound(err) {
		b.log.Warn("container: remove", "id", shortID(id), "err", err)
		return false
	}
	return true
}

func shortID(id string) string {
	if len(id) > 12 {
		return id[:12]
	}
	return id
}

// ownerLabels names this process as the owner of the containers it makes.
func ownerLabels() (map[string]string, error) {
	pid := os.Getpid()
	st, err := procStart(pid)
	if err != nil {
		return nil, err
	}
	boot, err := bootID()
	if err != nil {
		return nil, err
	}
	return map[string]string{
		LabelOwner:      strconv.Itoa(pid),
		LabelOwnerStart: strconv.FormatUint(st, 10),
		LabelBoot:       boot,
	}, nil
}
