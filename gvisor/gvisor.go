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
//     --host-uds=none: no host unix socket can be reached or created;
//   - the root filesystem is the shared image's (package image), read-only,
//     with no overlay (--overlay2=none): nothing is ever written to it;
//   - the working directory (/work), /tmp and /dev/shm are tmpfs mounts of
//     the sandbox's own kernel whose sizes add up to Limits.Disk; nothing of
//     the host is mounted, and the code arrives on stdin;
//   - the user nobody (65534:65534), no capability in any set,
//     no_new_privs;
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
// How each Reason is found, from outside the code: timeout, when moat's
// wall timer or the cgroup's CPU account fires (moat kills the cgroup), or
// the code dies of SIGXCPU; memory, from the cgroup's OOM kill counter;
// pids, filesize and disk, from the sentry's log of the clone and write
// calls that it refused with EAGAIN, EFBIG or ENOSPC (runsc's --strace,
// limited to those calls, read from a pipe); the exit status and the signal
// from runsc's own log, which carries the container's wait status.
//
// The level needs root: runsc runs rootful, and the cgroups are moat's.
package gvisor

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/cgroup"
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
	// runs' bundles (StateDir/bundles), one directory per run, removed
	// after it. Zero means /run/moat/gvisor.
	StateDir string `json:"state_dir,omitempty"`
	// RootFS is the root filesystem the code sees, read-only. Zero means
	// the one package image builds with its default Config (`moat image
	// build`). It must hold /usr/bin/python3 and an empty /work.
	RootFS string `json:"rootfs,omitempty"`
	// Logger receives a line per run at debug level and set-up facts at
	// info level. Nil means discard.
	Logger *slog.Logger `json:"-"`
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

// Sandbox is the gvisor level. It is safe for concurrent use.
type Sandbox struct {
	cfg       Config
	limits    moat.Limits
	runsc     string
	info      runscInfo
	platform  Platform
	rootfs    string
	runscRoot string // runsc's --root
	bundles   string // one directory per run
	cg        *cgroup.Manager
	// owner is this process's owner id: the prefix of its runs' ids, which
	// name their bundles, runsc containers and cgroups.
	owner string
	notes []string
	log   *slog.Logger

	mu     sync.Mutex
	closed bool
	runs   sync.WaitGroup
}

var _ moat.Sandbox = (*Sandbox)(nil)

func unavailable(reason, remedy string, err error) error {
	return &moat.UnavailableError{Level: moat.LevelGVisor, Reason: reason, Remedy: remedy, Err: err}
}

// New checks that every protection can be applied here (root, runsc with
// the platform, the root filesystem, the cgroup controllers), reaps what
// moat processes that died left behind, and returns the sandbox. It returns
// an error wrapping moat.ErrUnavailable when something is missing; the
// error says what to do.
func New(cfg Config) (*Sandbox, error) {
	s, err := prepare(context.Background(), cfg)
	if err != nil {
		return nil, err
	}
	id, err := owner.Self(ownersDir)
	if err != nil {
		return nil, unavailable("cannot record this process as an owner in "+ownersDir, "", err)
	}
	s.owner = id
	s.reap()
	return s, nil
}

// Check says whether a sandbox with cfg can run here, and which runsc,
// platform and image it would use, without reaping or running anything.
func Check(ctx context.Context, cfg Config) moat.Availability {
	a := moat.Availability{Level: moat.LevelGVisor}
	s, err := prepare(ctx, cfg)
	if err != nil {
		var ue *moat.UnavailableError
		if errors.As(err, &ue) {
			a.Reason, a.Remedy = ue.Reason, ue.Remedy
			if ue.Err != nil {
				a.Reason += ": " + ue.Err.Error()
			}
		} else {
			a.Reason = err.Error()
		}
		return a
	}
	a.Available = true
	a.Details = s.details()
	return a
}

func (s *Sandbox) details() []string {
	d := []string{
		fmt.Sprintf("runsc: %s, version %s", s.runsc, s.info.Version),
		fmt.Sprintf("platform: %s (runsc has %s)", s.platform, strings.Join(s.info.Platforms, ", ")),
		"rootfs: " + s.rootfs + " (read-only)",
		fmt.Sprintf("cgroup: v%d (memory, pids backstop, cpu account)", s.cg.Version()),
	}
	if r, err := readImageRecord(s.rootfs); err == nil {
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
func prepare(ctx context.Context, cfg Config) (*Sandbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Sandbox{cfg: cfg, limits: cfg.Limits.WithDefaults(), log: cfg.Logger}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if os.Geteuid() != 0 {
		return nil, unavailable(fmt.Sprintf("not root (uid %d): the gvisor level runs runsc as root and gives each run a cgroup", os.Geteuid()),
			"run moat as root", nil)
	}
	runsc, err := findRunsc(cfg.Runsc)
	if err != nil {
		return nil, unavailable("runsc is not installed", "run scripts/setup-gvisor.sh as root (it installs runsc from Debian's packages)", err)
	}
	s.runsc = runsc
	info, err := probeRunsc(ctx, runsc)
	if err != nil {
		return nil, unavailable("runsc does not answer", "reinstall it with scripts/setup-gvisor.sh", err)
	}
	s.info = info
	s.platform = cfg.Platform
	if s.platform == "" {
		s.platform = PlatformSystrap
	}
	if !slices.Contains(info.Platforms, string(s.platform)) {
		remedy := "run scripts/setup-gvisor.sh to install a runsc with systrap (Debian 13's), or choose platform ptrace explicitly"
		if s.platform != PlatformSystrap {
			remedy = "choose one of: " + strings.Join(info.Platforms, ", ")
		}
		return nil, unavailable(fmt.Sprintf("runsc %s has no %s platform (it has %s)", info.Version, s.platform, strings.Join(info.Platforms, ", ")), remedy, nil)
	}
	if s.platform == PlatformKVM {
		if _, err := os.Stat("/dev/kvm"); err != nil {
			return nil, unavailable("the kvm platform needs /dev/kvm", "choose platform systrap", err)
		}
	}

	s.rootfs = cfg.RootFS
	if s.rootfs == "" {
		s.rootfs = image.Path(image.Config{})
	}
	if err := checkRootFS(s.rootfs); err != nil {
		remedy := "run 'moat image build' (or scripts/setup-gvisor.sh) as root"
		if cfg.RootFS != "" {
			remedy = "set rootfs to a root filesystem made by 'moat image build'"
		}
		return nil, unavailable("the sandbox root filesystem is not there", remedy, err)
	}

	cg, err := cgroup.Detect(cgroupParent)
	if err != nil {
		return nil, unavailable("no usable memory, pids and cpu accounting cgroup controllers", "mount cgroup v2 with memory and pids enabled, or the v1 memory, pids and cpuacct hierarchies", err)
	}
	s.cg = cg

	state := cfg.StateDir
	if state == "" {
		state = DefaultStateDir
	}
	s.runscRoot = filepath.Join(state, "runsc")
	s.bundles = filepath.Join(state, "bundles")
	for _, d := range []string{state, s.runscRoot, s.bundles} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, unavailable("cannot create the state directory "+d, "set state_dir to a writable directory", err)
		}
	}
	s.notes = []string{fmt.Sprintf("gvisor: runsc %s, platform %s", info.Version, s.platform)}
	return s, nil
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

// Level returns moat.LevelGVisor.
func (s *Sandbox) Level() moat.Level { return moat.LevelGVisor }

// Limits returns the limits every run gets, defaults filled in.
func (s *Sandbox) Limits() moat.Limits { return s.limits }

// Platform returns the platform the runs use.
func (s *Sandbox) Platform() Platform { return s.platform }

// Version returns runsc's version.
func (s *Sandbox) Version() string { return s.info.Version }

// Close makes later runs fail with moat.ErrClosed and waits for runs in
// progress. It is safe to call more than once.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.runs.Wait()
	return nil
}

// Run runs req.Code under python3 in a fresh gVisor sandbox; see
// moat.Sandbox for the contract.
func (s *Sandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	if len(req.Code) == 0 {
		return nil, fmt.Errorf("gvisor: empty code: %w", moat.ErrInvalid)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("gvisor: %w", moat.ErrClosed)
	}
	s.runs.Add(1)
	s.mu.Unlock()
	defer s.runs.Done()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	r := &run{s: s, req: req, start: time.Now()}
	defer r.cleanup()
	res, err := r.do(ctx)
	if err == nil {
		s.log.Debug("gvisor: run", "id", r.id, "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason)
	}
	return res, err
}

// run is the state of one Run, released by cleanup.
type run struct {
	s      *Sandbox
	req    moat.Request
	id     string
	start  time.Time
	bundle string
	group  *cgroup.Group
	// started is set once runsc started: cleanup then makes sure its state
	// is gone.
	started bool
}

// hostPids is the host pids limit of a run's cgroup: a backstop against a
// runaway sentry, not the task limit. The sentry, the gofer and runsc use a
// few dozen host threads, and the systrap platform a host stub process per
// address space of the code; gVisor's RLIMIT_NPROC holds the code's tasks
// to Limits.Pids well before this.
func hostPids(pids int) int64 { return int64(256 + 8*pids) }

// joinScript moves the shell into the run's cgroups (its arguments: how
// many files, the files, then the command) and execs runsc, so that runsc
// and everything it starts are in the cgroups from their first instruction.
const joinScript = `n=$1; shift
while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 125; shift; n=$((n-1)); done
exec "$@"`

func (r *run) do(ctx context.Context) (*moat.Result, error) {
	s, lim := r.s, r.s.limits
	var rnd [8]byte
	rand.Read(rnd[:])
	r.id = s.owner + "-" + hex.EncodeToString(rnd[:])

	// The bundle: config.json and where runsc writes its logs. The sentry's
	// log goes to a pipe (its "file" is a link to the fd runsc inherits), the
	// gofer's nowhere, runsc's own to a small file read after the run.
	r.bundle = filepath.Join(s.bundles, r.id)
	if err := os.Mkdir(r.bundle, 0o700); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	spec, err := json.Marshal(newSpec(s.rootfs, image.Python, lim))
	if err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	if err := os.WriteFile(filepath.Join(r.bundle, "config.json"), spec, 0o600); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	for name, target := range map[string]string{"log-boot": "/proc/self/fd/3", "log-gofer": "/dev/null"} {
		if err := os.Symlink(target, filepath.Join(r.bundle, name)); err != nil {
			return nil, fmt.Errorf("gvisor: %w", err)
		}
	}

	group, err := s.cg.New(r.id, cgroup.Limits{Memory: int64(lim.Memory), Pids: hostPids(lim.Pids)})
	if err != nil {
		return nil, unavailable("cannot create the run's cgroup", "", err)
	}
	r.group = group
	return r.exec(ctx)
}

// runscArgs is runsc's command line for the run.
func (r *run) runscArgs() []string {
	s := r.s
	return []string{
		"--root=" + s.runscRoot,
		"--platform=" + string(s.platform),
		"--network=none",
		"--host-uds=none",
		"--overlay2=none",
		// moat's cgroup holds runsc and everything it starts.
		"--ignore-cgroups",
		"--strace",
		"--strace-syscalls=" + strings.Join(straceSyscalls, ","),
		"--strace-log-size=8",
		"--debug-log=" + filepath.Join(r.bundle, "log-%COMMAND%"),
		"run", "--bundle=" + r.bundle, r.id,
	}
}

// exec starts runsc in the run's cgroup and waits for the run to end.
func (r *run) exec(ctx context.Context) (*moat.Result, error) {
	s, lim := r.s, r.s.limits
	logR, logW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	defer logR.Close()

	runCtx, cancel := context.WithTimeout(ctx, time.Duration(lim.WallTime))
	defer cancel()
	stdout := capture.New(int64(lim.Output), r.req.Stdout)
	stderr := capture.New(int64(lim.Output), r.req.Stderr)
	join := r.group.JoinFiles()
	args := append([]string{"-c", joinScript, "moat-gvisor", strconv.Itoa(len(join))}, join...)
	args = append(args, s.runsc)
	args = append(args, r.runscArgs()...)
	cmd := exec.CommandContext(runCtx, "/bin/sh", args...)
	cmd.Env = []string{} // nothing of moat's environment
	cmd.Dir = "/"
	cmd.Stdin = bytes.NewReader(r.req.Code)
	cmd.Stdout, cmd.Stderr = stdout, stderr
	cmd.ExtraFiles = []*os.File{logW}
	cmd.WaitDelay = time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	var killed atomic.Bool
	// Killing the cgroup kills runsc, the sentry and the gofer: the whole
	// sandbox, whatever state it is in.
	cmd.Cancel = func() error {
		killed.Store(true)
		return r.group.Kill()
	}

	events := &sentryEvents{}
	logDone := make(chan struct{})
	err = cmd.Start()
	logW.Close()
	if err != nil {
		return nil, unavailable("cannot start runsc", "", err)
	}
	r.started = true
	go func() {
		defer close(logDone)
		events.read(logR)
	}()
	var cpuOver atomic.Bool
	stop := r.watchCPU(time.Duration(lim.CPUTime), &cpuOver)
	waitErr := cmd.Wait()
	stop()
	end := time.Now()
	// Whatever runsc left running dies now; then the log's writers are gone.
	if err := r.group.Kill(); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	select {
	case <-logDone:
	case <-time.After(5 * time.Second):
		return nil, fmt.Errorf("gvisor: the sentry's log did not close after the run ended: %w", moat.ErrUnavailable)
	}
	ev := events.snapshot()
	runLogBytes, _ := os.ReadFile(filepath.Join(r.bundle, "log-run"))
	rl := parseRunLog(runLogBytes)
	cgEv := r.group.Events()
	byUs := killed.Load() || cpuOver.Load()

	if !byUs && !cgEv.OOMKill {
		switch {
		case rl.fatal != "":
			return nil, fmt.Errorf("gvisor: runsc failed, nothing ran: %s: %w", rl.fatal, moat.ErrUnavailable)
		case ev.panicked:
			return nil, fmt.Errorf("gvisor: the sentry panicked: %s: %w", strings.Join(ev.last, " | "), moat.ErrUnavailable)
		case !rl.exited:
			return nil, fmt.Errorf("gvisor: runsc ended (%v) without the container's status: %s %s: %w",
				waitErr, strings.Join(rl.warnings, " | "), clip(stderr.Bytes(), 300), moat.ErrUnavailable)
		}
	}

	res := &moat.Result{
		Level:     moat.LevelGVisor,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: stdout.Truncated() || stderr.Truncated(),
		Notes:     s.notes,
		Duration:  end.Sub(r.start),
	}
	var sig syscall.Signal
	switch {
	case byUs || (!rl.exited && cgEv.OOMKill):
		sig = syscall.SIGKILL
	case rl.status.Signaled():
		sig = rl.status.Signal()
	default:
		res.ExitCode = rl.status.ExitStatus()
	}
	if sig != 0 {
		res.ExitCode = 128 + int(sig)
		res.Signal = unix.SignalName(sig)
	}
	switch {
	case killed.Load() && ctx.Err() != nil:
		res.Reason = moat.ReasonCanceled
	case byUs || sig == syscall.SIGXCPU:
		res.Reason = moat.ReasonTimeout
	case cgEv.OOMKill:
		res.Reason = moat.ReasonMemory
	case ev.pids:
		res.Reason = moat.ReasonPids
	case ev.fileSize:
		res.Reason = moat.ReasonFileSize
	case ev.disk:
		res.Reason = moat.ReasonDisk
	case res.Truncated:
		res.Reason = moat.ReasonOutput
	case sig != 0:
		res.Reason = moat.ReasonSignal
	}
	return res, nil
}

// watchCPU kills the run's cgroup once it has used limit of CPU time, and
// sets over. The returned function stops watching.
func (r *run) watchCPU(limit time.Duration, over *atomic.Bool) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(cpuPoll)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			used, err := r.group.CPUUsage()
			if err != nil || used >= limit {
				over.Store(true)
				r.group.Kill()
				return
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

// cpuPoll is how often a run's CPU account is read. A run overshoots its
// CPU limit by at most this times the number of CPUs.
const cpuPoll = 100 * time.Millisecond

// cleanup releases everything of the run. Errors are logged: the result is
// already decided, and what fails here is reaped by the next New.
func (r *run) cleanup() {
	s := r.s
	if r.group != nil {
		if err := r.group.Kill(); err != nil {
			s.log.Warn("gvisor: cleanup", "id", r.id, "err", err)
		}
	}
	if r.started {
		// runsc removes its state when it ends by itself; when it was
		// killed, its files (all named after the run's id) are still
		// there, and nothing of the sandbox runs any more to need them.
		if err := removeState(s.runscRoot, r.id); err != nil {
			s.log.Warn("gvisor: cleanup", "id", r.id, "err", err)
		}
	}
	if r.group != nil {
		if err := r.group.Remove(); err != nil {
			s.log.Warn("gvisor: cleanup", "id", r.id, "err", err)
		}
	}
	if r.bundle != "" {
		if err := os.RemoveAll(r.bundle); err != nil {
			s.log.Warn("gvisor: cleanup", "id", r.id, "err", err)
		}
	}
}

// removeState removes the files runsc keeps under root for container id
// (its state, lock and control socket carry the id in their names). The ids
// are random, so no other container's file matches.
func removeState(root, id string) error {
	entries, err := os.ReadDir(root)
	if err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	var errs []error
	for _, e := range entries {
		if strings.Contains(e.Name(), id) {
			if err := os.RemoveAll(filepath.Join(root, e.Name())); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// reap removes what moat processes that are no longer alive left behind:
// their sandboxes' processes and cgroups, runsc's state of their
// containers, and their bundles.
func (s *Sandbox) reap() {
	names, err := s.cg.ReapDead(deadOwner)
	if len(names) > 0 {
		s.log.Info("gvisor: reaped leftover cgroups", "groups", names)
	}
	if err != nil {
		s.log.Warn("gvisor: reap leftover cgroups", "err", err)
	}
	ids := map[string]bool{}
	for _, dir := range []string{s.runscRoot, s.bundles} {
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
		runQuiet(ctx, s.runsc, "--root="+s.runscRoot, "delete", "--force", id)
		cancel()
		err := errors.Join(removeState(s.runscRoot, id), os.RemoveAll(filepath.Join(s.bundles, id)))
		if err != nil {
			s.log.Warn("gvisor: reap leftover container", "id", id, "err", err)
		} else {
			s.log.Info("gvisor: reaped leftover container", "id", id)
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
