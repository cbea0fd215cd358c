// Package container is moat's container level: each run is a fresh,
// hardened Docker container, driven through the Engine API with Docker's
// official Go client (never the docker CLI), from the image that package
// image builds.
//
// Every container is hardened, with no way to turn an item off:
//
//   - no network at all (network mode none, networking disabled);
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
//     family but AF_UNIX, so no AF_VSOCK, whose ports are not namespaced;
//     ptrace, userfaultfd, memfd_secret, keyrings, bpf, perf_event_open,
//     the mount family, namespaces, clone3; only the native syscall
//     convention). It is checked twice from the host: New runs a probe
//     container and fails unless the probe's calls are refused in it
//     (once per process, engine, image and profile; Check always), and
//     every run's init must run under as many seccomp filters as the
//     probe's did (/proc/PID/status) before its code is written. Docker's
//     default masked and read-only /proc paths stay;
//   - private IPC, PID, UTS and cgroup namespaces; no host mounts of any
//     kind, no Docker socket, no docker-init from the host;
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
// no code runs unwatched. A Sandbox keeps Config.Warm containers created and
// attached ahead of runs (nothing runs in them before a run starts one):
// creating a container costs the engine tens of milliseconds that then stay
// out of a run's time. Every
// container carries the labels moat.sandbox=1 and moat.owner=<pid> (with the
// owner's start time and boot id); New removes the containers whose owner is
// gone, so a moat killed mid-run leaks nothing past the next start. Each run
// removes its container before Run returns, whatever happened.
//
// How each reason is found, from the host side: timeout, when moat's wall
// timer or the cgroup's CPU usage fires (moat kills the container), or the
// code dies of SIGXCPU; memory, from Docker's OOMKilled; pids, from the
// kernel's log of the first refused fork in the container's cgroup (see
// kmsg.go; it needs root) and the pids cgroup's event counter; filesize and
// disk, from the run's tmpfs mounts, which moat holds open while the run ends
// (see watch).
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
	"syscall"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/client"
	"github.com/docker/docker/pkg/stdcopy"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/capture"
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
	// Image is the Docker image to run. Zero means the image that package
	// image builds with its default Config (moat-sandbox:<key>).
	Image string `json:"image,omitempty"`
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
	// Warm is how many containers the sandbox keeps created and attached
	// ahead of runs (nothing runs in them until a run starts one), which
	// takes their creation out of a run's time. Zero means 1; a negative
	// number means none.
	Warm int `json:"warm,omitempty"`
	// Logger receives debug logs. Nil means discard.
	Logger *slog.Logger `json:"-"`
}

// withDefaults fills the zero fields and checks the result.
func (c Config) withDefaults() (Config, error) {
	if err := c.Limits.Validate(); err != nil {
		return c, err
	}
	c.Limits = c.Limits.WithDefaults()
	if c.Image == "" {
		c.Image = image.Config{}.Tag()
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
	if c.Warm == 0 {
		c.Warm = 1
	}
	c.Warm = max(c.Warm, 0)
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.CPUs < 0.01 {
		return c, fmt.Errorf("container: cpus %v is below 0.01: %w", c.CPUs, moat.ErrInvalid)
	}
	if !strings.HasPrefix(c.Python, "/") || strings.ContainsAny(c.Python, " \t\n'\"$`\\;&|<>") {
		return c, fmt.Errorf("container: python %q must be an absolute path without spaces or shell characters: %w", c.Python, moat.ErrInvalid)
	}
	return c, nil
}

// Sandbox runs code in hardened Docker containers. It is safe for concurrent
// use; see moat.Sandbox for the contract.
type Sandbox struct {
	cli   *client.Client
	kmsg  *kmsgReader // nil when the kernel log cannot be read
	spec  *spec
	log   *slog.Logger
	notes []string
	// watched says that moat is root and watches every run from the host
	// (see watch): a run that cannot be watched then fails.
	watched bool
	// uids leases each container its own uid, held from its creation to
	// its removal.
	uids     *uidpool.Pool
	uidFirst int // the range's first uid
	// filters is the number of seccomp filters the probe's container ran
	// under (see probeSeccomp); every run's init must show as many. Set
	// before the first run, never changed after.
	filters int
	// probe is what the seccomp probe found (for Check).
	probe *probeResult

	// The pool of prepared containers: fill keeps it full, one container
	// per token in refill, until quit closes; then it closes fillDone.
	pool     chan *prepared
	refill   chan struct{}
	quit     chan struct{}
	fillDone chan struct{}

	mu     sync.Mutex
	closed bool
	runs   sync.WaitGroup
}

var _ moat.Sandbox = (*Sandbox)(nil)

// New connects to the Docker engine (DOCKER_HOST, or the local socket),
// checks that it can run the level with every protection (seccomp, a fixed
// runc, the image), and removes the containers that dead moat processes
// left behind. It returns an error wrapping moat.ErrUnavailable when it
// cannot.
func New(cfg Config) (*Sandbox, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cli, err := newClient()
	if err != nil {
		return nil, unavailable("no Docker client", "set DOCKER_HOST or run scripts/setup-docker.sh", err)
	}
	ok := false
	defer func() {
		if !ok {
			cli.Close()
		}
	}()
	eng, err := probe(ctx, cli, cfg)
	if err != nil {
		return nil, err
	}
	if err := eng.refusal(cfg); err != nil {
		return nil, err
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
	s, err := assemble(cfg, cli, eng, notes)
	if err != nil {
		return nil, err
	}
	// The probe runs once per engine, image and profile in this process;
	// every run still checks its own init's filter.
	key := probeKey(eng, cfg.Image, s.spec.seccomp)
	if v, ok := probed.Load(key); ok {
		s.probe = v.(*probeResult)
	} else {
		r, err := s.probeSeccomp(ctx)
		if err != nil {
			return nil, err
		}
		probed.Store(key, r)
		s.probe = r
	}
	s.filters = s.probe.filters
	ok = true
	for range cfg.Warm {
		s.refill <- struct{}{}
	}
	go s.fill()
	return s, nil
}

// assemble makes the Sandbox for cfg on engine eng, with no container yet
// and its pool not started: New starts it, Check only probes.
func assemble(cfg Config, cli *client.Client, eng *engine, notes []string) (*Sandbox, error) {
	owner, err := ownerLabels()
	if err != nil {
		return nil, fmt.Errorf("container: %w", err)
	}
	prof, err := newProfile()
	if err != nil {
		return nil, err
	}
	uids, err := uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidLockDir())
	if err != nil {
		return nil, unavailable("cannot set up the uid pool", "", err)
	}
	return &Sandbox{
		cli:      cli,
		kmsg:     kernelLog(),
		spec:     newSpec(cfg, eng.runtime, owner, prof),
		log:      cfg.Logger,
		notes:    notes,
		watched:  os.Geteuid() == 0,
		uids:     uids,
		uidFirst: cfg.UIDFirst,
		pool:     make(chan *prepared, cfg.Warm),
		refill:   make(chan struct{}, cfg.Warm),
		quit:     make(chan struct{}),
		fillDone: make(chan struct{}),
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

// Level returns moat.LevelContainer.
func (s *Sandbox) Level() moat.Level { return moat.LevelContainer }

// Close makes later runs fail with moat.ErrClosed, waits for the runs in
// progress, removes the containers prepared ahead of runs and releases the
// engine connection. It may be called more than once.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	s.runs.Wait()
	close(s.quit)
	<-s.fillDone
	s.drain()
	return s.cli.Close()
}

func (s *Sandbox) enter() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("container: %w", moat.ErrClosed)
	}
	s.runs.Add(1)
	return nil
}

// removeTimeout bounds the removal of a run's container.
const removeTimeout = 30 * time.Second

// Run runs req.Code in a fresh container. See moat.Sandbox.
func (s *Sandbox) Run(ctx context.Context, req moat.Request) (res *moat.Result, err error) {
	if len(req.Code) == 0 {
		return nil, fmt.Errorf("container: empty code: %w", moat.ErrInvalid)
	}
	if err := s.enter(); err != nil {
		return nil, err
	}
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	start := time.Now()
	p, err := s.take()
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	// Whatever happens from here on, the container goes, under a context of
	// its own: the caller's may be cancelled already. The Result's Duration
	// counts the clean-up.
	defer func() {
		s.discard(p)
		if res != nil {
			res.Duration = time.Since(start)
		}
	}()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return s.run(ctx, p, req)
}

func (s *Sandbox) run(ctx context.Context, p *prepared, req moat.Request) (*moat.Result, error) {
	// The run's own context: it outlives the caller's cancellation long
	// enough to kill the container and read its end.
	rctx, rcancel := context.WithCancel(context.Background())
	defer rcancel()
	id, hj, waitC, waitErrC := p.id, p.hj, p.waitC, p.waitErrC
	lim := s.spec.limits

	if err := s.cli.ContainerStart(rctx, id, container.StartOptions{}); err != nil {
		return s.setupFailed(ctx, "start", err)
	}
	pid, err := s.initPid(rctx, id)
	if err != nil {
		return s.setupFailed(ctx, "start", err)
	}

	var (
		killOnce sync.Once
		killedBy moat.Reason
		killMu   sync.Mutex
		killing  sync.WaitGroup
	)
	// kill records why and asks the engine to kill the container without
	// waiting for it: the engine's kill waits for the container's exit,
	// which waits for its output to be drained, and the output cap calls
	// kill from the goroutine that drains it.
	kill := func(why moat.Reason) {
		killOnce.Do(func() {
			killMu.Lock()
			killedBy = why
			killMu.Unlock()
			killing.Go(func() {
				kctx, cancel := context.WithTimeout(context.Background(), removeTimeout)
				defer cancel()
				if err := s.cli.ContainerKill(kctx, id, "KILL"); err != nil && !cerrdefs.IsConflict(err) && !cerrdefs.IsNotFound(err) {
					s.log.Warn("container: kill", "id", shortID(id), "err", err)
				}
			})
		})
	}
	defer killing.Wait()

	// The first byte past the output cap ends the run, as the wall timer
	// does: nothing past the cap is passed on.
	over := func() { kill(moat.ReasonOutput) }
	stdout := capture.New(int64(lim.Output), req.Stdout, over)
	stderr := capture.New(int64(lim.Output), req.Stderr, over)

	// Watch from the host before the code can run: Python runs nothing
	// until it has read all of stdin, which is written only once the watch
	// holds the run's cgroups and mounts. Only root can watch; without it,
	// New put a note in every Result instead.
	var w *watch
	if s.watched {
		var err error
		if w, err = s.startWatch(id, pid, func() { kill(moat.ReasonTimeout) }); err != nil {
			// No code runs unwatched (the tree's CPU time would go
			// unbounded): nothing has run yet, and discard removes the
			// container.
			return s.setupFailed(ctx, "watch", err)
		}
		defer w.close()
	}
	// No code runs without moat's seccomp filter: the init must run under
	// as many filters as the probe's container did, which the probe showed
	// to be moat's.
	n, err := initSeccomp(pid)
	if err == nil && s.filters != 0 && n != s.filters {
		err = fmt.Errorf("container: the run's init runs under %d seccomp filters, the probe's under %d", n, s.filters)
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, unavailable("a container would run without moat's seccomp filter", "check dockerd and the runtime", err)
	}
	p.filters = n

	// The code goes in on stdin; its end closes stdin.
	go func() {
		hj.Conn.Write(req.Code)
		hj.CloseWrite()
	}()
	outDone := make(chan error, 1)
	go func() {
		_, err := stdcopy.StdCopy(stdout, stderr, hj.Reader)
		outDone <- err
	}()

	wall := time.NewTimer(time.Duration(lim.WallTime))
	defer wall.Stop()
	var exit container.WaitResponse
	exited := false
	select {
	case exit = <-waitC:
		exited, p.waited = true, true
	case err := <-waitErrC:
		p.waited = true
		return nil, fmt.Errorf("container: wait: %w", err)
	case <-wall.C:
		kill(moat.ReasonTimeout)
	case <-ctx.Done():
		kill(moat.ReasonCanceled)
	}
	if !exited {
		p.waited = true
		select {
		case exit = <-waitC:
		case err := <-waitErrC:
			return nil, fmt.Errorf("container: wait after the kill: %w", err)
		}
	}

	// The output ends with the container; a process that closed its
	// streams early cannot hold it open past the exit.
	select {
	case <-outDone:
	case <-time.After(2 * time.Second):
		hj.Close()
		<-outDone
	}
	if w != nil {
		w.stop()
	}

	ictx, icancel := context.WithTimeout(context.Background(), removeTimeout)
	defer icancel()
	ins, err := s.cli.ContainerInspect(ictx, id)
	if err != nil {
		return nil, fmt.Errorf("container: inspect after the run: %w", err)
	}

	killMu.Lock()
	k := killedBy
	killMu.Unlock()
	res := &moat.Result{
		Level:     moat.LevelContainer,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: stdout.Truncated() || stderr.Truncated(),
		ExitCode:  int(exit.StatusCode),
		Notes:     s.notes,
	}
	if k != "" {
		res.ExitCode = 128 + int(syscall.SIGKILL)
	}
	var sig syscall.Signal
	if res.ExitCode > 128 && res.ExitCode <= 128+64 {
		sig = syscall.Signal(res.ExitCode - 128)
		res.Signal = unix.SignalName(sig)
	}
	oom := ins.State != nil && ins.State.OOMKilled
	forkRefused := s.kmsg.forkRefused(id)
	switch {
	case k == moat.ReasonCanceled:
		res.Reason = moat.ReasonCanceled
	case k == moat.ReasonTimeout:
		res.Reason = moat.ReasonTimeout
	case sig == syscall.SIGXCPU:
		res.Reason = moat.ReasonTimeout
	case oom:
		res.Reason = moat.ReasonMemory
	case forkRefused || w != nil && w.pidsHit.Load():
		res.Reason = moat.ReasonPids
	case w != nil && w.fileAtLimit(int64(lim.FileSize)):
		res.Reason = moat.ReasonFileSize
	case w != nil && w.diskFull():
		res.Reason = moat.ReasonDisk
	case res.Truncated:
		res.Reason = moat.ReasonOutput
	case sig != 0:
		res.Reason = moat.ReasonSignal
	}
	return res, nil
}

// setupFailed turns a failure before the code ran into the caller's
// cancellation when that is what it was.
func (s *Sandbox) setupFailed(ctx context.Context, step string, err error) (*moat.Result, error) {
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	return nil, fmt.Errorf("container: %s: %w", step, err)
}

// initPid finds the host pid of the container's init, from its cgroup or
// else from the engine.
func (s *Sandbox) initPid(ctx context.Context, id string) (int, error) {
	if pid := findInit(id); pid != 0 {
		return pid, nil
	}
	ins, err := s.cli.ContainerInspect(ctx, id)
	if err != nil {
		return 0, err
	}
	if ins.State == nil || ins.State.Pid == 0 {
		return 0, errors.New("container: the run ended before it could be watched")
	}
	return ins.State.Pid, nil
}

// startWatch starts watching the container whose init is pid.
func (s *Sandbox) startWatch(id string, pid int, onCPU func()) (*watch, error) {
	paths := make([]string, len(s.spec.mounts))
	for i, m := range s.spec.mounts {
		paths[i] = m.path
	}
	return startWatch(id, pid, paths, time.Duration(s.spec.limits.CPUTime), onCPU)
}

// remove removes the container, killing it first if it still runs, and
// reports whether it is gone.
func (s *Sandbox) remove(id string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), removeTimeout)
	defer cancel()
	err := s.cli.ContainerRemove(ctx, id, container.RemoveOptions{Force: true, RemoveVolumes: true})
	if err != nil && !cerrdefs.IsNotFound(err) {
		s.log.Warn("container: remove", "id", shortID(id), "err", err)
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
