package gvisor

import (
	"bufio"
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/sessionfiles"
)

// Sessions at the gvisor level.
//
// A session is one gVisor sandbox for its whole life, booted with the same
// runsc flags, spec hardening, host cgroup, logs and clean-up as a run's
// (run.go), but whose container init is a shell that execs sleep, as root
// with no capability: it does nothing, and the code (another uid) can
// neither signal nor trace it. The session's files live in the sandbox's
// /work tmpfs; /tmp and /dev/shm persist between runs too.
//
// Each run is started with runsc exec: the launcher (launcher.py), a
// python3 -I -S of moat's run as root with the four capabilities it needs,
// makes a PID namespace, forks the run's first process into it as that
// namespace's init, drops to the session's uid (nobody) with no
// capability in any set, sets no_new_privs, installs the guest seccomp
// filter (guestfilter.go: gVisor applies the spec's filter to the
// container's init only, never to an exec'd process) and execs python3
// with the code on stdin. The launcher reports to the host, on a pipe
// only it holds (runsc exec --pass-fd), the run's init's pid and, once it
// has ended, its wait status.
//
// Why every process of a run, and nothing else, ends at the run's end: the
// code's processes are all in the run's PID namespace, which they cannot
// leave (the filter denies setns, unshare and clone's namespace flags, so
// no process can be created outside it), and when the namespace's init
// ends, gVisor's kernel kills every other process in the namespace and
// completes the init's exit only once they are gone (pid_namespaces(7),
// gVisor's Task.exitChildren). The launcher's status therefore means the
// run is wholly gone. To end a run from the host, moat kills that init
// with runsc kill --pid, with the pid the launcher reported: one signal
// that ends the namespace, whatever the code did with process groups or
// sessions. The init of the container, the launchers and the file
// operations' programs are outside every run's namespace, so no run's end
// touches them. A kill is sent only while the launcher has not reported
// the status (the pid is then still the run's init: gVisor hands out pids
// in increasing order and reuses one only after wrapping around its pid
// space); if runsc exec has not returned killGrace after a kill, the whole
// sandbox is killed and the session fails.
//
// Between runs nothing of a run is left, and the sandbox is paused (runsc
// pause) besides: no task of it is scheduled until the next run or file
// operation resumes it (runsc resume). Before pausing, moat starts the
// next run's launcher, whose python3 (-s: the user site directory the code
// could write to is not read, so nothing planted runs as it starts) waits
// for its code on stdin: a run then costs the resume, not a launch.
//
// Limits: each run gets the run limits that gVisor's kernel enforces per
// process (the spec's rlimits, which runsc gives every exec'd process: CPU
// time, file size, open files, and RLIMIT_NPROC for the session uid's
// tasks, which are only the run's own (the launcher gives the run's init
// one less than Limits.Pids: gVisor counts a task by the uid it was made
// with, and the init is made as root), and those of a file operation in
// progress, since nothing of earlier runs is left) and the wall time; its CPU time is also watched from the host
// cgroup while it runs. The session as a whole has the level's memory and
// disk limits (the cgroup holds the whole sandbox; the tmpfs mounts are
// the sandbox's, with their sizes) and a CPU budget (Config.SessionCPUTime,
// counted from the cgroup while runs are in progress). The working
// directory gets Disk less /tmp's Disk/16 and /dev/shm's Disk/64. A run
// that passes the memory limit ends the whole sandbox: the run says
// memory, and the session's later runs fail with an error wrapping
// moat.ErrUnavailable.
//
// The file operations run package sessionfiles' program in the sandbox
// with runsc exec, as the session's uid, from /, with python3 -I, outside
// every run's namespace. They have no seccomp filter: they are moat's code,
// and the code can reach them only as the same uid could (through /proc,
// during a run), which gives it nothing it does not already have: the
// files are its own.
//
// A session with a live interpreter (SessionOptions.Interpreter) differs
// in three things: its runs are handed to one python3 that lives across
// them (interpreter.go); its container's init is not a shell but moat's
// launcher, which starts that python3 and relays its streams, so that
// nothing of the session but the init holds a host file and a checkpoint
// of the sandbox keeps it (interpinit.go, suspend.go); and its working
// directory is a tmpfs of the host, bind-mounted into the sandbox, on which
// the file operations are done from the host (hostfiles.go), so that they
// never resume the paused sandbox.

//go:embed launcher.py
var launcherPy string

// killGrace is how long a run may take to end after moat killed it before
// the session's whole sandbox is killed.
const killGrace = 5 * time.Second

// bootTimeout bounds how long a session's sandbox may take to start.
const bootTimeout = 30 * time.Second

// launcherCaps are the capabilities the launcher needs: a PID namespace,
// dropping the bounding set, and becoming the session's uid.
var launcherCaps = []string{"CAP_SYS_ADMIN", "CAP_SETPCAP", "CAP_SETUID", "CAP_SETGID"}

// session is one session's sandbox; see engine.SessionInstance.
type session struct {
	b          *backend
	bt         *booted
	launchSpec string   // the launcher's process.json
	env        []string // the code's environment
	budget     time.Duration
	moat.Files
	seq atomic.Int64 // names the runs' and file operations' files

	// primed is closed once the launcher of the next run is started (next,
	// guarded by mu, or nil when that failed); Start takes it. primed is
	// replaced only by the session's runs, which the engine serializes.
	primed chan struct{}
	next   *sessionRun
	bg     sync.WaitGroup // prime

	// interpreter says the session keeps a live interpreter
	// (interpreter.go), started by the init; interp is it, or nil
	// before the first run and after one ended it, and ended why the last
	// one ended. interp and ended are the runs' (which the engine
	// serializes) and Close's, after them; interp is set under mu.
	interpreter bool
	// recycled says the session serves one tenant's one-shot runs
	// (recycle.go): it is not paused between them, since nothing of a
	// run is left after its reset but moat's own launcher waiting.
	recycled bool
	init     *initConn // the container's init (interpinit.go)
	initErr  tail      // what the init wrote on its stderr
	interp   *driver
	ended    string
	fileOps  sync.WaitGroup // host file operations in progress (hostfiles.go)

	mu     sync.Mutex // guards what follows; held while pausing and resuming
	holds  int        // runs and file operations that need the sandbox running
	paused bool
	broken error // why the sandbox can no longer serve, once it cannot
	closed bool
	spent  time.Duration // CPU used by the runs so far
	execs  map[*exec.Cmd]bool
	execWG sync.WaitGroup
}

var _ engine.SessionInstance = (*session)(nil)

// sessionCPUTime is the CPU budget of a session's runs together.
func (b *backend) sessionCPUTime() time.Duration {
	if b.cfg.SessionCPUTime != 0 {
		return time.Duration(b.cfg.SessionCPUTime)
	}
	return 10 * time.Duration(b.limits.CPUTime)
}

// NewSession boots the session's sandbox and waits until it runs; see
// engine.SessionBackend. A session with a live interpreter has the init
// of interpinit.go as its container's init, which starts the interpreter
// at the first run; one without has an init that does nothing, and a
// launcher of its first run started ahead.
func (b *backend) NewSession(ctx context.Context, opts moat.SessionOptions) (engine.SessionInstance, error) {
	return b.newSession(ctx, opts, sessionTmpShare, sessionShmShare)
}

// newSession is NewSession with /tmp given Disk/tmpShare and /dev/shm
// Disk/shmShare (a recycled sandbox has a run's shares: recycle.go).
func (b *backend) newSession(ctx context.Context, opts moat.SessionOptions, tmpShare, shmShare int64) (engine.SessionInstance, error) {
	raw, err := guestFilterBytes()
	if err != nil {
		return nil, err
	}
	for _, p := range []string{"/bin/sh", "/bin/sleep"} {
		if _, err := os.Stat(filepath.Join(b.rootfs, p)); err != nil {
			return nil, unavailable("the root filesystem has no "+p+" for the session's init", "rebuild it with 'moat image build'", err)
		}
	}
	// One run of the egress proxy for the session's life: its runs share
	// the placeholders, and each run's notes are the decisions since the
	// previous one's.
	var netRun *egress.Run
	if b.cfg.Egress != nil {
		netRun = b.cfg.Egress.NewRun()
	}
	env := b.codeEnv(netRun)
	spec, work := b.sessionSpecShares(opts.Interpreter, tmpShare, shmShare)
	if opts.Interpreter {
		spec = b.withInit(spec, raw, env)
	}
	bt, err := b.boot(spec, work, netRun)
	if err != nil {
		return nil, err
	}
	ss := &session{b: b, bt: bt, budget: b.sessionCPUTime(), execs: map[*exec.Cmd]bool{}, interpreter: opts.Interpreter}
	fail := func(err error) (engine.SessionInstance, error) {
		bt.remove()
		return nil, err
	}
	if opts.Interpreter {
		if err := ss.startInit(ctx, bootTimeout, "start"); err != nil {
			return fail(err)
		}
		// The files are the host's; the interpreter starts with the
		// first run. The sandbox pauses now.
		ss.Files = hostFiles{ss}
		ss.holds = 1
		ss.primed = make(chan struct{})
		close(ss.primed)
		ss.release()
		b.log.Debug("gvisor: session started", "id", bt.id, "interpreter", true)
		return ss.instance(), nil
	}
	bt.stdin.Close()
	if err := ss.waitReady(ctx); err != nil {
		return fail(err)
	}
	// The init writes nothing more; what it would is dropped.
	go io.Copy(io.Discard, bt.stdout)
	go io.Copy(io.Discard, bt.stderr)

	ss.env = env
	if err := ss.writeLaunchSpec(); err != nil {
		return fail(err)
	}
	ss.Files = sessionfiles.New(ss.exec, sessionfiles.Options{Python: image.Python, Dir: image.WorkDir, FileSize: b.limits.FileSize})
	// The sandbox runs; the first run's launcher starts now, and the
	// sandbox pauses once it waits.
	ss.holds = 1
	ss.startPriming()
	b.log.Debug("gvisor: session started", "id", bt.id)
	return ss.instance(), nil
}

// filesOnly is a session the engine suspends through its files path: it
// is no engine.StateSaver.
type filesOnly struct{ engine.SessionInstance }

// instance is the session as the engine gets it: one with a network,
// which cannot be checkpointed (suspend.go), keeps its files when
// suspended, as at the levels that keep no memory.
func (ss *session) instance() engine.SessionInstance {
	if ss.bt.net != nil {
		return filesOnly{ss}
	}
	return ss
}

// sessionSpec is the spec of a session's sandbox: a run's, but for its
// process, the container's init, which does nothing. With a live
// interpreter, the working directory is left out of the spec's mounts:
// boot mounts the host's, of size work (see hostfiles.go).
func (b *backend) sessionSpec(interpreter bool) (_ *ociSpec, work moat.Bytes) {
	return b.sessionSpecShares(interpreter, sessionTmpShare, sessionShmShare)
}

// sessionSpecShares is sessionSpec with /tmp given Disk/tmpShare and
// /dev/shm Disk/shmShare.
func (b *backend) sessionSpecShares(interpreter bool, tmpShare, shmShare int64) (_ *ociSpec, work moat.Bytes) {
	places := writableShares(b.limits.Disk, tmpShare, shmShare)
	if interpreter {
		work, places = moat.Bytes(places[0].size), places[1:]
	}
	spec := specWith(b.rootfs, image.Python, b.limits, places)
	spec.Process.Args = []string{"/bin/sh", "-c", "echo ready && exec /bin/sleep infinity"}
	spec.Process.User = ociUser{UID: 0, GID: 0, AdditionalGids: []uint32{}}
	spec.Process.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/", "LANG=C.UTF-8"}
	spec.Process.Cwd = "/"
	return spec, work
}

// waitReady waits for the init's word that the container runs.
func (ss *session) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, bootTimeout)
	defer cancel()
	got := make(chan error, 1)
	go func() {
		line, err := bufio.NewReaderSize(ss.bt.stdout, 16).ReadString('\n')
		if err == nil && line != "ready\n" {
			err = fmt.Errorf("the session's init said %q", clip([]byte(line), 100))
		}
		got <- err
	}()
	select {
	case err := <-got:
		if err == nil {
			return nil
		}
		<-ss.bt.exited
		ev := ss.sandboxEvidence()
		return fmt.Errorf("gvisor: session: the sandbox did not start (%v): %w", err, ev.failure())
	case <-ctx.Done():
		ss.bt.kill()
		<-got
		if ctx.Err() == context.DeadlineExceeded {
			return fmt.Errorf("gvisor: session: the sandbox did not start within %v: %w", bootTimeout, moat.ErrUnavailable)
		}
		return ctx.Err()
	}
}

// sandboxEvidence is what the sandbox's own end says, for errors.
func (ss *session) sandboxEvidence() evidence {
	bt := ss.bt
	ev := evidence{cgroup: bt.group.Events(), runscExit: -1, sent: bt.events.snapshot(),
		panicLog: readPanicLog(filepath.Join(bt.bundle, "log-panic"))}
	select {
	case <-bt.exited:
		ev.runscExit, ev.waitErr = bt.cmd.ProcessState.ExitCode(), bt.waitErr
	default:
	}
	b, _ := os.ReadFile(filepath.Join(bt.bundle, "log-"+bt.command()))
	ev.run = parseRunLog(b)
	return ev
}

// control runs one of runsc's commands on the session's container: cmd,
// its flags, the container's id, then the rest.
func (ss *session) control(cmd string, flags []string, rest ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
	defer cancel()
	args := append([]string{"--root=" + ss.b.runscRoot, cmd}, flags...)
	args = append(append(args, ss.bt.id), rest...)
	if _, err := runQuiet(ctx, ss.b.runsc, args...); err != nil {
		return fmt.Errorf("gvisor: session: runsc %s: %w", cmd, err)
	}
	return nil
}

// killPid kills a process of the sandbox by its pid in the sandbox's root
// PID namespace.
func (ss *session) killPid(pid int) error {
	return ss.control("kill", []string{"--pid", strconv.Itoa(pid)}, "KILL")
}

func (ss *session) pauseLocked() error {
	if err := ss.control("pause", nil); err != nil {
		return ss.breakLocked(err)
	}
	ss.paused = true
	return nil
}

// breakLocked makes the session fail from now on, for err, and kills its
// sandbox: a sandbox moat cannot pause or resume is not one it runs code
// in.
func (ss *session) breakLocked(err error) error {
	if ss.broken == nil {
		ss.broken = fmt.Errorf("gvisor: session: %w: %w", moat.ErrUnavailable, err)
		ss.b.log.Warn("gvisor: session broken; killing its sandbox", "id", ss.bt.id, "err", err)
		go ss.bt.kill()
	}
	return ss.broken
}

// hold resumes the sandbox for a run or a file operation, unless others
// hold it already; release undoes it, and the last one pauses it.
func (ss *session) hold() error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	switch {
	case ss.closed:
		return fmt.Errorf("gvisor: session: %w", moat.ErrClosed)
	case ss.broken != nil:
		return ss.broken
	case !ss.bt.alive():
		ev := ss.sandboxEvidence()
		why := "the session's sandbox has ended"
		if ev.cgroup.OOMKill {
			why += " (a run passed the memory limit)"
		}
		ss.broken = fmt.Errorf("gvisor: session: %s: %w", why, moat.ErrUnavailable)
		return ss.broken
	}
	if ss.holds == 0 && ss.paused {
		if err := ss.control("resume", nil); err != nil {
			return ss.breakLocked(err)
		}
		ss.paused = false
	}
	ss.holds++
	return nil
}

func (ss *session) release() {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.holds--
	if ss.holds == 0 && !ss.recycled && !ss.closed && ss.broken == nil && ss.bt.alive() {
		ss.pauseLocked()
	}
}

// startExec starts cmd and counts it, so that Close can end it; done
// uncounts it once it has been waited for.
func (ss *session) startExec(cmd *exec.Cmd) error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return fmt.Errorf("gvisor: session: %w", moat.ErrClosed)
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("gvisor: session: cannot start runsc exec: %w: %w", err, moat.ErrUnavailable)
	}
	ss.execs[cmd] = true
	ss.execWG.Add(1)
	return nil
}

func (ss *session) doneExec(cmd *exec.Cmd) {
	ss.mu.Lock()
	delete(ss.execs, cmd)
	ss.mu.Unlock()
	ss.execWG.Done()
}

// Close kills the session's sandbox and every runsc exec of it, and
// removes the sandbox's state, cgroup and bundle.
func (ss *session) Close() error {
	ss.mu.Lock()
	ss.closed = true
	ss.mu.Unlock()
	// The sandbox first, then what runsc exec still runs for it (each ends
	// once the sandbox is gone), then its files: no runsc exec writes into
	// the bundle while it is removed.
	ss.bt.kill()
	ss.mu.Lock()
	for cmd := range ss.execs {
		cmd.Process.Kill()
	}
	ss.mu.Unlock()
	ss.execWG.Wait()
	ss.bg.Wait()
	// The host working directory is unmounted by remove, once no file
	// operation uses it.
	ss.fileOps.Wait()
	ss.mu.Lock()
	if r := ss.next; r != nil {
		closeAll([]*os.File{r.stdin, r.stdout, r.stderr})
		ss.next = nil
	}
	ss.mu.Unlock()
	ss.bt.remove()
	ss.b.log.Debug("gvisor: session closed", "id", ss.bt.id)
	return nil
}

// exec runs argv in the sandbox as the session's uid, from /, for package
// sessionfiles; see sessionfiles.Exec.
func (ss *session) exec(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error {
	if err := ss.hold(); err != nil {
		return err
	}
	defer ss.release()
	pidFile := filepath.Join(ss.bt.bundle, fmt.Sprintf("pid-files-%d", ss.seq.Add(1)))
	defer os.Remove(pidFile)
	args := []string{"--root=" + ss.b.runscRoot, "exec", "--user", fmt.Sprintf("%d:%d", sandboxUID, sandboxGID),
		"--cwd", "/", "--internal-pid-file", pidFile, ss.bt.id}
	cmd := exec.Command(ss.b.runsc, append(args, argv...)...)
	cmd.Env = []string{}
	cmd.Dir = "/"
	cmd.Stdin, cmd.Stdout = stdin, stdout
	var errTail tail
	cmd.Stderr = &errTail
	cmd.WaitDelay = time.Second
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := ss.startExec(cmd); err != nil {
		return err
	}
	defer ss.doneExec(cmd)
	// The caller's end ends the program in the sandbox, then runsc exec.
	stop := context.AfterFunc(ctx, func() {
		if b, err := os.ReadFile(pidFile); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && pid > 1 {
				ss.killPid(pid)
			}
		}
		cmd.Process.Kill()
	})
	err := cmd.Wait()
	stop()
	if err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("gvisor: session: runsc exec: %w: %s", err, clip(errTail.bytes(), 300))
	}
	return nil
}

// Start starts one run; see engine.SessionInstance. It takes the launcher
// primed after the previous run (or at the session's start), resumes the
// sandbox, and hands the waiting python3 the code. A session whose CPU
// budget is used up (Config.SessionCPUTime), a resumed one included, whose
// engine does not know it yet, starts nothing: its error wraps
// moat.ErrSpent.
func (ss *session) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (_ engine.Process, err error) {
	ss.mu.Lock()
	spent := ss.spent >= ss.budget
	ss.mu.Unlock()
	if spent {
		return nil, fmt.Errorf("gvisor: session: its CPU budget of %v is used up; its files can still be read: %w", ss.budget, moat.ErrSpent)
	}
	if ss.interpreter {
		return ss.startInterpRun(ctx, code, stdout, stderr)
	}
	var r *sessionRun
	select {
	case <-ss.primed:
		ss.mu.Lock()
		r, ss.next = ss.next, nil
		ss.mu.Unlock()
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if err := ss.hold(); err != nil {
		if r != nil {
			r.abandon()
		}
		return nil, err
	}
	defer func() {
		if err != nil {
			ss.release()
		}
	}()
	if r != nil && !r.waiting() {
		ss.b.log.Warn("gvisor: session: the launcher primed for this run ended before it", "id", ss.bt.id)
		r.abandon()
		r = nil
	}
	if r == nil {
		if r, err = ss.launch(ss.launchSpec); err != nil {
			return nil, err
		}
	}
	r.begin(code, stdout, stderr)
	return r, nil
}

// startPriming primes the next run's launcher in the background, with
// the hold the caller has taken.
func (ss *session) startPriming() {
	ss.primed = make(chan struct{})
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		ss.holds--
		close(ss.primed)
		return
	}
	ss.bg.Go(ss.prime)
}

// prime starts the next run's launcher ahead of it, holding the sandbox
// running until the launcher's python3 waits for its code, idle, then lets
// it pause. The caller has taken the hold prime releases; see
// startPriming.
func (ss *session) prime() {
	defer close(ss.primed)
	defer ss.release()
	r, err := ss.launch(ss.launchSpec)
	if err != nil {
		if !errors.Is(err, moat.ErrClosed) {
			ss.b.log.Warn("gvisor: session: prime the next run", "id", ss.bt.id, "err", err)
		}
		return
	}
	select {
	case <-r.ready:
	case <-r.exited:
	case <-time.After(bootTimeout):
	}
	// python3 has started; let it reach the read of its stdin before the
	// sandbox pauses, so that its start is off the next run's path. Only
	// the latency depends on this: a python3 paused earlier starts when
	// its run resumes the sandbox.
	ss.waitIdle()
	ss.mu.Lock()
	ss.next = r
	ss.mu.Unlock()
}

// idleWindow and idleCPU: the sandbox is idle when its cgroup used less
// than idleCPU in each of three idleWindows in a row.
const (
	idleWindow = 10 * time.Millisecond
	idleCPU    = time.Millisecond
)

// waitIdle waits, at most a second, until the sandbox's CPU use stops.
func (ss *session) waitIdle() {
	deadline := time.Now().Add(time.Second)
	last, err := ss.bt.group.CPUUsage()
	for quiet := 0; err == nil && quiet < 3 && time.Now().Before(deadline); {
		time.Sleep(idleWindow)
		var now time.Duration
		if now, err = ss.bt.group.CPUUsage(); err == nil {
			if now-last < idleCPU {
				quiet++
			} else {
				quiet = 0
			}
			last = now
		}
	}
}

// launch starts a run's launcher with runsc exec, with its process.json
// spec (ss.launchSpec: the run's python3 then waits for its code). The
// caller holds the sandbox.
func (ss *session) launch(spec string) (*sessionRun, error) {
	bt := ss.bt
	r := &sessionRun{ss: ss, feed: make(chan struct{}), exited: make(chan struct{}), reported: make(chan struct{}), ready: make(chan struct{})}
	r.log = filepath.Join(bt.bundle, fmt.Sprintf("log-exec-%d", ss.seq.Add(1)))
	var files [8]*os.File
	for i := 0; i < 8; i += 2 {
		pr, pw, err := os.Pipe()
		if err != nil {
			closeAll(files[:i])
			return nil, fmt.Errorf("gvisor: %w", err)
		}
		files[i], files[i+1] = pr, pw
	}
	inR, outW, errW, repR, repW := files[0], files[3], files[5], files[6], files[7]
	r.stdin, r.stdout, r.stderr = files[1], files[2], files[4]
	r.cmd = &exec.Cmd{
		Path: ss.b.runsc,
		Args: []string{"runsc", "--root=" + ss.b.runscRoot, "--debug-log=" + r.log, "--debug-log-format=json",
			"exec", "--process", spec, "--pass-fd", "3:3", bt.id},
		Env:         []string{},
		Dir:         "/",
		Stdin:       inR,
		Stdout:      outW,
		Stderr:      errW,
		ExtraFiles:  []*os.File{repW}, // fd 3: the launcher's reports
		SysProcAttr: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL},
	}
	err := ss.startExec(r.cmd)
	closeAll([]*os.File{inR, outW, errW, repW})
	if err != nil {
		closeAll([]*os.File{r.stdin, r.stdout, r.stderr, repR})
		return nil, err
	}
	go func() {
		r.waitErr = r.cmd.Wait()
		ss.doneExec(r.cmd)
		close(r.exited)
	}()
	go r.readReports(repR)
	return r, nil
}

// begin hands the code to the run's python3, passes its output on, and
// watches its CPU time.
func (r *sessionRun) begin(code []byte, stdout, stderr io.Writer) {
	ss, lim := r.ss, r.ss.b.limits
	r.base, _ = ss.bt.group.CPUUsage()
	r.startEvents, r.startFacts = ss.bt.group.Events(), ss.bt.events.snapshot()
	r.copies.Go(func() { io.Copy(stdout, r.stdout); r.stdout.Close() })
	r.copies.Go(func() { io.Copy(io.MultiWriter(stderr, &r.tail), r.stderr); r.stderr.Close() })
	go func() {
		defer close(r.feed)
		r.stdin.Write(code)
		r.stdin.Close()
	}()
	ss.mu.Lock()
	left := ss.budget - ss.spent
	ss.mu.Unlock()
	limit := min(time.Duration(lim.CPUTime), left)
	r.budgetLimited = left < time.Duration(lim.CPUTime)
	r.stopCPU = ss.bt.group.WatchCPU(r.base, limit, r.kill, &r.cpuOver)
}

// waiting reports whether the launcher still waits for its run.
func (r *sessionRun) waiting() bool {
	select {
	case <-r.exited:
		return false
	case <-r.reported:
		return false
	default:
		return true
	}
}

// abandon ends a primed run that no run will use.
func (r *sessionRun) abandon() {
	r.kill()
	closeAll([]*os.File{r.stdin, r.stdout, r.stderr})
	go func() {
		<-r.exited
		r.mu.Lock()
		r.done = true
		if r.backstop != nil {
			r.backstop.Stop()
		}
		r.mu.Unlock()
	}()
}

// sessionRun is one run of a session.
type sessionRun struct {
	ss       *session
	cmd      *exec.Cmd // runsc exec of the launcher
	log      string    // runsc exec's log
	stdin    *os.File  // the host's ends of the run's streams
	stdout   *os.File
	stderr   *os.File
	ready    chan struct{} // closed once the launcher said ready, or its reports ended
	feed     chan struct{}
	exited   chan struct{} // closed once runsc exec has been waited for
	waitErr  error
	copies   sync.WaitGroup
	tail     tail
	reported chan struct{} // closed once the launcher's reports ended
	report   launchReport  // once reported is closed

	base                  time.Duration // the cgroup's CPU use at the start
	startEvents           cgroup.Events
	startFacts            sentryFacts
	stopCPU               func()
	cpuOver               atomic.Bool
	budgetLimited         bool // the CPU watch's limit is what is left of the session's budget
	mu                    sync.Mutex
	pid                   int  // the run's init, once the launcher has said
	status                bool // the launcher has reported the status: the pid is no longer the run's
	killed, killing, done bool
	backstop              *time.Timer
	kills                 sync.WaitGroup
	readyOnce             sync.Once
}

// launchReport is what the launcher said on its pipe.
type launchReport struct {
	pid       int
	hasStatus bool
	status    syscall.WaitStatus
	err       string
}

// maxReport bounds what moat reads of the launcher's reports.
const maxReport = 4 << 10

func (r *sessionRun) readReports(f *os.File) {
	defer close(r.reported)
	defer f.Close()
	sc := bufio.NewScanner(io.LimitReader(f, maxReport))
	var rep launchReport
	for sc.Scan() {
		kind, arg, _ := strings.Cut(sc.Text(), " ")
		switch kind {
		case "pid":
			if n, err := strconv.Atoi(arg); err == nil && n > 1 && rep.pid == 0 {
				rep.pid = n
				r.mu.Lock()
				r.pid = n
				if r.killing && !r.done {
					r.kills.Go(func() { r.killPid(n) })
				}
				r.mu.Unlock()
			}
		case "status":
			if n, err := strconv.ParseUint(arg, 10, 32); err == nil && !rep.hasStatus {
				rep.hasStatus, rep.status = true, syscall.WaitStatus(n)
				r.mu.Lock()
				r.status = true
				r.mu.Unlock()
			}
		case "ready":
			r.readyOnce.Do(func() { close(r.ready) })
		case "error":
			rep.err = clip([]byte(arg), 300)
		}
	}
	r.readyOnce.Do(func() { close(r.ready) })
	io.Copy(io.Discard, f)
	r.report = rep
}

// Kill ends the run: see engine.Process.
func (r *sessionRun) Kill() {
	r.mu.Lock()
	r.killed = true
	r.mu.Unlock()
	r.kill()
}

// kill kills the run's init (and so its whole PID namespace) from a
// goroutine of its own, once, and arms the backstop.
func (r *sessionRun) kill() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done || r.killing {
		return
	}
	r.killing = true
	if pid := r.pid; pid != 0 && !r.status {
		r.kills.Go(func() { r.killPid(pid) })
	}
	r.backstop = time.AfterFunc(killGrace, r.giveUp)
}

func (r *sessionRun) killPid(pid int) {
	if err := r.ss.killPid(pid); err != nil {
		r.ss.b.log.Warn("gvisor: session: kill a run", "id", r.ss.bt.id, "err", err)
	}
}

// giveUp kills the session's sandbox when a killed run did not end.
func (r *sessionRun) giveUp() {
	select {
	case <-r.exited:
		return
	default:
	}
	r.ss.mu.Lock()
	r.ss.breakLocked(fmt.Errorf("a run killed %v ago has not ended", killGrace))
	r.ss.mu.Unlock()
	r.cmd.Process.Kill()
}

// Wait waits for runsc exec, drains the output and the launcher's reports,
// pauses the sandbox, and returns the evidence.
func (r *sessionRun) Wait() (engine.Evidence, error) {
	ss := r.ss
	<-r.exited
	r.stopCPU()
	r.mu.Lock()
	r.done = true
	if r.backstop != nil {
		r.backstop.Stop()
	}
	killed := r.killed
	r.mu.Unlock()
	r.kills.Wait()
	<-r.feed
	// Every process of the run is gone; what still holds the pipes is a
	// sandbox moat no longer trusts.
	drained := waitTimeout(&r.copies, streamDrain)
	select {
	case <-r.reported:
	case <-time.After(streamDrain):
		drained = false
	}
	used, cpuErr := ss.bt.group.CPUUsage()
	used -= r.base
	ev := runEvidence{
		killed:   killed,
		cpuOver:  r.cpuOver.Load(),
		cpuUsed:  used,
		cpuLimit: time.Duration(ss.b.limits.CPUTime),
		execExit: r.cmd.ProcessState.ExitCode(),
		waitErr:  r.waitErr,
		stderr:   r.tail.bytes(),
	}
	if drained {
		ev.report = r.report
	}
	b, _ := os.ReadFile(r.log)
	ev.exec = parseRunLog(b)
	os.Remove(r.log)
	events, facts := ss.bt.group.Events(), ss.bt.events.snapshot()
	ev.oom = events.OOMKill && !r.startEvents.OOMKill
	ev.pidsMax = events.PidsMax && !r.startEvents.PidsMax
	ev.pids, ev.fileSize, ev.disk = facts.refused.since(r.startFacts.refused)

	ss.mu.Lock()
	ev.closed = ss.closed
	if cpuErr != nil {
		ss.spent = ss.budget // fail closed: an account that cannot be read spends the budget
	} else {
		ss.spent += used
	}
	spent := ss.spent >= ss.budget
	ss.mu.Unlock()
	if !ss.bt.alive() {
		ev.sandboxGone = ss.sandboxEvidence()
		ev.sandboxDead = true
	}
	// The run's hold passes to the priming of the next run's launcher,
	// which pauses the sandbox once that waits.
	ss.startPriming()
	if !drained {
		r.killOutput()
	}
	out, err := ev.judge()
	if err != nil {
		return out, err
	}
	if n := ss.bt.net; n != nil {
		out.Notes = append(out.Notes, n.Notes()...)
	}
	out.Spent = spent
	if spent && ev.cpuOver && r.budgetLimited {
		out.Notes = append(out.Notes, fmt.Sprintf("gvisor: this run used up the session's CPU budget of %v (session_cpu_time); later runs fail, the files stay readable", ss.budget))
	}
	return out, nil
}

// killOutput ends the session when a run's output did not end with its
// last process: something in the sandbox holds it.
func (r *sessionRun) killOutput() {
	r.ss.mu.Lock()
	r.ss.breakLocked(errors.New("a run's output or reports stayed open after it ended"))
	r.ss.mu.Unlock()
}

// runEvidence is what the host knows about how a session's run ended.
type runEvidence struct {
	killed  bool // the engine killed the run
	cpuOver bool // the CPU watch killed it (its limit or the session's budget)
	// cpuUsed is the cgroup's CPU time since the run began, cpuLimit the
	// run's CPU time limit: see evidence.
	cpuUsed, cpuLimit time.Duration
	closed            bool // the session was closed meanwhile
	report            launchReport
	// execExit is runsc exec's exit code as the host kernel reports it
	// (-1 when it was killed), and exec its log.
	execExit int
	waitErr  error
	exec     runLog
	// The cgroup's and the sentry's facts from the run's start to its end.
	oom, pidsMax         bool
	pids, fileSize, disk bool
	sandboxDead          bool     // the session's sandbox ended
	sandboxGone          evidence // what it said, when it did
	stderr               []byte
}

// judge turns a session run's evidence into the engine's, or into an error
// wrapping moat.ErrUnavailable when the sandbox failed. The run's status
// counts only when the launcher reported it, runsc exec logged the same
// status of the launcher and exited with its code, and nothing of moat's
// killed the run.
func (ev runEvidence) judge() (engine.Evidence, error) {
	byUs := ev.killed || ev.cpuOver || ev.closed
	hostLimit := ev.oom || ev.pidsMax
	st := ev.report.status
	reported := ev.report.hasStatus && ev.report.err == "" && ev.execExit == exitCode(st) &&
		ev.exec.exited && sameEnd(ev.exec.status, st)
	if !reported && !byUs && !hostLimit {
		return engine.Evidence{}, ev.failure()
	}
	out := engine.Evidence{
		Exited:   reported && !byUs,
		CPUTime:  ev.cpuOver || (reported && engine.XCPUAtLimit(st, ev.cpuUsed, ev.cpuLimit, engine.XCPUSlack)),
		Memory:   ev.oom,
		Pids:     ev.pidsMax || ev.pids,
		FileSize: ev.fileSize,
		Disk:     ev.disk,
	}
	if out.Exited {
		out.Status = st
	}
	return out, nil
}

// sameEnd reports whether two wait statuses say the same exit or signal
// (the core-dump bit aside).
func sameEnd(a, b syscall.WaitStatus) bool { return a&^0x80 == b&^0x80 }

func (ev runEvidence) failure() error {
	var msg string
	switch {
	case ev.sandboxDead:
		msg = "the session's sandbox ended during the run: " + ev.sandboxGone.failure().Error()
	case ev.report.err != "":
		msg = "the run could not be started: " + ev.report.err
	case ev.exec.fatal != "":
		msg = "runsc exec failed, nothing ran: " + ev.exec.fatal
	case !ev.report.hasStatus:
		msg = fmt.Sprintf("runsc exec ended (%v) without the run's status: %s %s", ev.waitErr, strings.Join(ev.exec.warnings, " | "), clip(ev.stderr, 300))
	default:
		msg = fmt.Sprintf("the launcher and runsc exec disagree on how the run ended: the launcher said %#x, runsc logged %#x and exited with %d",
			uint32(ev.report.status), uint32(ev.exec.status), ev.execExit)
	}
	return fmt.Errorf("gvisor: session: %s: %w", msg, moat.ErrUnavailable)
}
