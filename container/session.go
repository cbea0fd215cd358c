package container

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/pkg/stdcopy"
	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/sessionfiles"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// Sessions.
//
// A session is one long-lived container, made and hardened as a one-shot
// run's (moat's seccomp profile, a uid of its own leased for the session's
// life, a read-only root, the tmpfs mounts of the disk limit, no network,
// every capability dropped, the same labels, so that New's reaper removes
// it once its owner is dead), whose init does nothing but reap
// (sessionInit). Each run is an exec in it: Python reading the code on
// stdin, as the session's uid, in the working directory, with the
// container's rlimits (Docker gives an exec the container's). As for a
// one-shot run, the code is written only once moat holds the exec's
// process (a pidfd), has checked from the host that it is in the
// container's cgroup and runs under moat's seccomp filter.
//
//   - The session as a whole gets the level's limits on memory, processes
//     and disk: they are the container's. The CPU time limit applies to
//     each run, counted from the container's cgroup since the run began;
//     the session's container may use Config.SessionCPUTime over its whole
//     life (runs and file operations together), after which its runs fail
//     with moat.ErrSpent.
//   - A run ends when its Python ends, or is killed: then moat kills, from
//     the host, every process of the container but its init (the cgroup
//     frozen meanwhile, so that nothing forks past the kill), so that
//     nothing a run started survives it.
//   - Between runs the container is paused: its cgroup is frozen (the
//     freezer, what Docker's ContainerPause uses), so nothing of it runs. A
//     file operation thaws it for its exec and freezes it again. moat
//     writes the freezer itself rather than asking Docker: Docker 20.10
//     also sets its paused flag from containerd's asynchronous events, so
//     a pause soon followed by an unpause can leave it believing the
//     container paused and refusing execs (seen here under load); and a
//     write takes microseconds where a pause through the engine takes tens
//     of milliseconds. The engine still removes a container frozen so (its
//     runtime thaws a cgroup to kill it), and removals thaw it first
//     anyway (see removeContainer).
//   - The file operations run inside the container, as execs of the
//     session's uid (see exec) of internal/sessionfiles' program, which
//     never follows a link the code planted.
//
// A kill at a run's end spares the file operations in flight (spare):
// each holds a pidfd of its process, checked live, so a pid of the code's
// cannot pass for one. A spared process is the operation's own, of the
// session's uid like the code: one the code took over (through
// /proc/PID/mem, say) lives no longer than the operation, whose end kills
// it (exec's end), and what it starts is not spared.
type session struct {
	b       *backend
	release func() // of the backend's client
	lease   *uidpool.Lease
	id      string
	uid     int
	user    string
	initPid int
	initFd  int // a pidfd of the init: readable once it died
	cg      cgroupFiles
	mounts  []*os.File // the tmpfs roots, opened through /proc/PID/root
	files   moat.Files
	killMu  sync.Mutex // held by killAllButInit
	// opStart is read-held by a file operation from its exec's start until
	// its process is in spared, and write-held by a kill: a kill never
	// sees a file operation it cannot tell from the code's processes.
	opStart sync.RWMutex
	spareMu sync.Mutex
	spared  map[int]int // a file operation's pid: a pidfd of it
	// unkillable is set once a kill of the container's processes failed:
	// what a run left may still be there, so nothing more runs (enter).
	unkillable atomic.Bool
	// interpOn: the session keeps a live interpreter (interp, nil until
	// the first run and after one ended it; ended says why it last ended,
	// for the next run's notes). Only runs touch them, one at a time;
	// interpFrozen reads interp under mu.
	interpOn bool
	interp   *interp
	ended    string
	// net is the egress proxy's run for the session's life, nil without
	// a proxy; l its listener in the container's network namespace.
	net egressRun
	l   net.Listener

	mu      sync.Mutex
	idle    *sync.Cond // signalled when active drops to zero
	active  int        // runs and file operations in progress: unpaused while > 0
	paused  bool       // the container's cgroup is frozen
	running bool       // a run is in
	closed  bool
	broken  error // set once the container cannot serve a run any more
}

var _ engine.SessionInstance = (*session)(nil)

// NewSession makes a session's container; see engine.SessionBackend.
func (b *backend) NewSession(ctx context.Context, opts moat.SessionOptions) (engine.SessionInstance, error) {
	if !b.watched {
		return nil, unavailable("container sessions need moat to be root: each run is watched and killed, and the container frozen, from the host", "run moat as root", nil)
	}
	release, err := b.holdClient()
	if err != nil {
		return nil, err
	}
	s := &session{b: b, release: release, initFd: -1, interpOn: opts.Interpreter}
	s.idle = sync.NewCond(&s.mu)
	ok := false
	defer func() {
		if !ok {
			s.Close()
		}
	}()
	// As for prepare, the engine is asked under a context of its own: a
	// create cancelled in flight may still make a container.
	cctx, cancel := context.WithTimeout(context.Background(), createTimeout)
	defer cancel()
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	if s.lease, err = b.freeUID(cctx); err != nil {
		return nil, err
	}
	s.uid = s.lease.UID
	s.user = user(s.uid)
	// One egress run for the session's life: its placeholders are in the
	// container's environment, which every exec inherits.
	var netEnv []string
	if b.egress != nil {
		s.net = b.newRun(b.egress)
		netEnv = s.net.Env(proxyURL, caPath)
	}
	cfg := b.spec.sessionConfig(s.uid, netEnv)
	created, err := b.cli.ContainerCreate(cctx, cfg, b.spec.hostConfig(s.uid), nil, nil, "")
	if err != nil {
		return nil, b.createError(err)
	}
	s.id = created.ID
	if err := b.cli.ContainerStart(cctx, s.id, container.StartOptions{}); err != nil {
		return nil, fmt.Errorf("container: start the session's container: %w", err)
	}
	if s.initPid, err = b.initPid(cctx, s.id); err != nil {
		return nil, fmt.Errorf("container: the session's init: %w", err)
	}
	if s.initFd, err = unix.PidfdOpen(s.initPid, 0); err != nil {
		return nil, fmt.Errorf("container: pidfd of the session's init: %w", err)
	}
	if err := b.checkSeccomp(s.initPid); err != nil {
		return nil, err
	}
	if s.cg, err = cgroupPaths(s.initPid); err != nil {
		return nil, err
	}
	if !strings.Contains(s.cg.procs, s.id) {
		return nil, fmt.Errorf("container: pid %d is not in the session container's cgroup (%s)", s.initPid, s.cg.procs)
	}
	if s.cg.freezer == "" {
		return nil, unavailable("the session container's cgroup has no freezer, so its leftovers could run between runs", "use a kernel with the cgroup freezer", nil)
	}
	if _, err := s.cg.cpuUsage(); err != nil {
		return nil, fmt.Errorf("container: the session's CPU usage: %w", err)
	}
	if _, err := s.cg.pidsRefused(); err != nil {
		return nil, fmt.Errorf("container: the session's pids events: %w", err)
	}
	if _, err := s.cg.oomKills(); err != nil {
		return nil, fmt.Errorf("container: the session's OOM kills: %w", err)
	}
	if s.net != nil {
		if s.l, err = listenIn(s.initFd, s.initPid); err != nil {
			return nil, err
		}
		b.serveEgress(s.net, s.l)
	}
	root := fmt.Sprintf("/proc/%d/root", s.initPid)
	for _, p := range b.mountPaths() {
		f, err := os.OpenFile(filepath.Join(root, p), os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return nil, fmt.Errorf("container: open the session's %s from the host: %w", p, err)
		}
		s.mounts = append(s.mounts, f)
		var st unix.Statfs_t
		if err := unix.Fstatfs(int(f.Fd()), &st); err != nil || st.Type != unix.TMPFS_MAGIC {
			return nil, fmt.Errorf("container: the session's %s is not the tmpfs moat mounted (statfs type %#x, %v)", p, st.Type, err)
		}
	}
	s.files = sessionfiles.New(s.exec, sessionfiles.Options{Python: b.spec.python, Dir: image.WorkDir, FileSize: b.spec.limits.FileSize})
	// Nothing runs until the first run or file operation.
	if err := s.cg.setFrozen(true); err != nil {
		return nil, fmt.Errorf("container: freeze the session's container: %w", err)
	}
	s.paused = true
	ok = true
	return s, nil
}

// errSessionClosed is what a session's operations return after Close.
var errSessionClosed = fmt.Errorf("container: session: %w", moat.ErrClosed)

// enter counts a run (run) or a file operation in, unpausing the container
// for the first one. While only file operations are in, the live
// interpreter, if any, stays frozen in a cgroup of its own (see interp).
func (s *session) enter(ctx context.Context, run bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return errSessionClosed
	case s.broken != nil:
		return s.broken
	case s.unkillable.Load():
		s.broken = unavailable("a kill of the session's processes failed, so what a run left may still be there", "close the session and make a new one", nil)
		return s.broken
	}
	if s.initDied() {
		s.broken = unavailable("the session's container stopped (its init died)", "close the session and make a new one", nil)
		return s.broken
	}
	if s.active == 0 && s.paused {
		if !run {
			// Frozen first, while the container is paused: the interpreter
			// does not run for a moment between runs.
			if err := s.interpFrozen(true); err != nil {
				return err
			}
		}
		if err := s.cg.setFrozen(false); err != nil {
			s.broken = fmt.Errorf("container: thaw the session's container: %w", err)
			return s.broken
		}
		s.paused = false
	}
	if run {
		if err := s.interpFrozen(false); err != nil {
			// Nothing of the broken session may run unwatched.
			s.killAllButInit()
			return err
		}
		s.running = true
	}
	s.active++
	return nil
}

// leave counts a run (run) or a file operation out, pausing the container
// after the last one. A container that cannot be paused serves no further
// run.
func (s *session) leave(run bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.active--
	if run {
		s.running = false
	}
	if s.active == 0 {
		s.idle.Broadcast()
	}
	if s.closed {
		return
	}
	if s.active > 0 {
		if run {
			// File operations go on: the interpreter stops with the run.
			s.interpFrozen(true)
		}
		return
	}
	if err := s.cg.setFrozen(true); err != nil {
		s.b.log.Warn("container: freeze a session's container", "id", shortID(s.id), "err", err)
		if s.broken == nil {
			s.broken = unavailable("the session's container could not be frozen between runs", "close the session", err)
		}
		return
	}
	s.paused = true
	// Within the paused container, the interpreter's own cgroup is thawed
	// again, ready for the next run.
	s.interpFrozen(false)
}

// interpFrozen freezes or thaws the live interpreter's own cgroup, if there
// is one; within a paused container a thaw only clears its own state. The
// caller holds s.mu. A failure breaks the session: the
// interpreter could run while it should not.
func (s *session) interpFrozen(frozen bool) error {
	in := s.interp
	if in == nil || in.frozen == frozen {
		return nil
	}
	if err := in.frz.setFrozenAs(frozen, s.paused); err != nil {
		if s.broken == nil {
			s.broken = unavailable("the session's interpreter could not be frozen or thawed", "close the session", err)
		}
		return s.broken
	}
	in.frozen = frozen
	return nil
}

// initDied reports whether the session's init is gone.
func (s *session) initDied() bool {
	fds := []unix.PollFd{{Fd: int32(s.initFd), Events: unix.POLLIN}}
	n, err := unix.Poll(fds, 0)
	return err == nil && n > 0
}

// killAllButInit kills every process of the container but its init: with
// the cgroup frozen, so that nothing forks or exits meanwhile (no pid can
// be reused while it is listed), each pid of cgroup.procs but the init's
// gets SIGKILL; then the cgroup is thawed and the dead leave it. It repeats
// until the init is alone, and fails if it cannot get there.
func (s *session) killAllButInit() error { return s.killAllBut(0) }

// killAllBut is killAllButInit sparing also process keep (the live
// interpreter), if not 0.
//
// A failure makes the session refuse every later run and file operation
// (unkillable): the engine does not break a session on a Wait error.
func (s *session) killAllBut(keep int) (err error) {
	// One at a time: a thaw of one would undo the freeze of another.
	s.killMu.Lock()
	defer s.killMu.Unlock()
	defer func() {
		if err != nil {
			s.unkillable.Store(true)
		}
	}()
	s.opStart.Lock()
	defer s.opStart.Unlock()
	return s.cg.killAllBut(func(pid int) bool { return pid == s.initPid || pid == keep || s.isSpared(pid) })
}

// Start starts one run of the session: an exec of Python in its container,
// fed the code once moat holds its process; see engine.SessionInstance.
func (s *session) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	if err := s.enter(ctx, true); err != nil {
		return nil, err
	}
	r := &sessionRun{s: s, pidfd: -1, began: time.Now(), done: make(chan struct{})}
	ok := false
	defer func() {
		if !ok {
			r.close()
			// An exec may be running, waiting for its code; a new driver
			// too.
			s.killAllButInit()
			if r.in != nil {
				s.endInterp(r.in, "")
			}
			s.leave(true)
		}
	}()
	var err error
	if r.cpuBase, err = s.cg.cpuUsage(); err != nil {
		return nil, fmt.Errorf("container: the session's CPU usage: %w", err)
	}
	if r.pidsBase, err = s.cg.pidsRefused(); err != nil {
		return nil, fmt.Errorf("container: the session's pids events: %w", err)
	}
	if r.oomBase, err = s.cg.oomKills(); err != nil {
		return nil, fmt.Errorf("container: the session's OOM kills: %w", err)
	}
	r.fullAtStart = mountsFull(s.mounts)
	if r.cpuBase >= s.b.sessionCPU {
		return nil, fmt.Errorf("container: session: its CPU budget of %v (session_cpu_time) is used up: %w", s.b.sessionCPU, moat.ErrSpent)
	}
	if s.interpOn {
		err = s.startInterpRun(ctx, r, code, stdout, stderr)
	} else {
		err = s.startExecRun(ctx, r, code, stdout, stderr)
	}
	if err != nil {
		return nil, err
	}
	go r.meter()
	ok = true
	return r, nil
}

// startExecRun starts a run as an exec of its own Python.
func (s *session) startExecRun(ctx context.Context, r *sessionRun, code []byte, stdout, stderr io.Writer) error {
	var err error
	if r.execID, r.hj, err = s.startExec(ctx, s.b.spec.runCmd(), true); err != nil {
		return err
	}
	if r.pidfd, _, err = s.holdExec(ctx, r.execID); err != nil {
		return err
	}
	r.outDone = make(chan error, 1)
	hj := r.hj
	go func() {
		hj.Conn.Write(code)
		hj.CloseWrite()
	}()
	go func() {
		_, err := stdcopy.StdCopy(stdout, stderr, hj.Reader)
		r.outDone <- err
	}()
	return nil
}

// holdExec waits for the process of an exec that waits for its code on
// stdin, opens a pidfd of it (so that its pid cannot be reused) and checks
// that it is the container's, runs as the session's uid and under moat's
// seccomp filter.
func (s *session) holdExec(ctx context.Context, execID string) (pidfd, pid int, err error) {
	pid, err = s.execPid(ctx, execID)
	if err != nil {
		return -1, 0, err
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1, 0, fmt.Errorf("container: pidfd of the run's process: %w", err)
	}
	fail := func(err error) (int, int, error) {
		unix.Close(fd)
		return -1, 0, err
	}
	if cg, err := cgroupPaths(pid); err != nil || cg.procs != s.cg.procs {
		return fail(fmt.Errorf("container: the run's process %d is not in the session container's cgroup (%v)", pid, err))
	}
	if err := s.b.checkSeccomp(pid); err != nil {
		return fail(err)
	}
	if st, err := procStatus(pid); err != nil || !strings.HasPrefix(st["Uid"], fmt.Sprintf("%d\t", s.uid)) {
		return fail(fmt.Errorf("container: the run's process %d is not of the session's uid %d (%v)", pid, s.uid, err))
	}
	return fd, pid, nil
}

// startExec creates and starts an exec of argv in the session's container
// as its uid, attached to its stdout and stderr, and to its stdin when
// stdin is true.
func (s *session) startExec(ctx context.Context, argv []string, stdin bool) (string, types.HijackedResponse, error) {
	ex, err := s.b.cli.ContainerExecCreate(ctx, s.id, container.ExecOptions{
		User:         s.user,
		Cmd:          argv,
		Env:          s.b.spec.env(),
		WorkingDir:   image.WorkDir,
		AttachStdin:  stdin,
		AttachStdout: true,
		AttachStderr: true,
	})
	if err != nil {
		return "", types.HijackedResponse{}, fmt.Errorf("container: exec create: %w", err)
	}
	hj, err := s.b.cli.ContainerExecAttach(ctx, ex.ID, container.ExecAttachOptions{})
	if err != nil {
		return "", types.HijackedResponse{}, fmt.Errorf("container: exec start: %w", err)
	}
	return ex.ID, hj, nil
}

// execWait bounds how long an exec's process may take to show, and how long
// the engine may take to report its end.
const execWait = 10 * time.Second

// execPid waits for the host pid of an exec's process.
func (s *session) execPid(ctx context.Context, execID string) (int, error) {
	deadline := time.Now().Add(execWait)
	for pause := 500 * time.Microsecond; ; pause = min(2*pause, 2*time.Millisecond) {
		ins, err := s.b.cli.ContainerExecInspect(ctx, execID)
		if err != nil {
			return 0, fmt.Errorf("container: exec inspect: %w", err)
		}
		if ins.Pid != 0 {
			return ins.Pid, nil
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("container: the exec's process did not start within %v", execWait)
		}
		time.Sleep(pause)
	}
}

// execExit waits for the engine to report the end of an exec, and returns
// its exit code (128+N for a death by signal N).
func (s *session) execExit(execID string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), execWait)
	defer cancel()
	for pause := 200 * time.Microsecond; ; pause = min(2*pause, 10*time.Millisecond) {
		ins, err := s.b.cli.ContainerExecInspect(ctx, execID)
		if err != nil {
			return 0, fmt.Errorf("container: exec inspect: %w", err)
		}
		if !ins.Running {
			return ins.ExitCode, nil
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("container: the engine did not report the exec's end within %v", execWait)
		case <-time.After(pause):
		}
	}
}

// exec runs argv in the session's container as the session's uid, in its
// working directory, with stdin (when not nil) as its standard input and
// its standard output written to stdout; it returns once the command ended
// and its output is written, with an error when it failed (its exit code
// and the start of its standard error). It is what the file operations run
// through. It thaws the container for the command; ctx's end kills it.
func (s *session) exec(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error {
	if len(argv) == 0 {
		return fmt.Errorf("container: session exec: no command: %w", moat.ErrInvalid)
	}
	if err := s.enter(ctx, false); err != nil {
		return err
	}
	defer s.leave(false)
	s.opStart.RLock()
	execID, hj, err := s.startExec(ctx, argv, true)
	if err != nil {
		s.opStart.RUnlock()
		return err
	}
	defer hj.Close()
	unspare := s.spare(ctx, execID)
	s.opStart.RUnlock()
	defer unspare()
	// end kills the command, if it still runs; its end closes the stream.
	end := func() {
		ictx, cancel := context.WithTimeout(context.Background(), execWait)
		defer cancel()
		if ins, err := s.b.cli.ContainerExecInspect(ictx, execID); err == nil && ins.Running && ins.Pid != 0 {
			s.killExec(ins.Pid)
		}
		hj.Close()
	}
	stop := context.AfterFunc(ctx, end)
	defer stop()
	go func() {
		if stdin != nil {
			io.Copy(hj.Conn, stdin)
		}
		hj.CloseWrite()
	}()
	var errOut limitedBuffer
	errOut.max = 4096
	out := &errWriter{w: stdout}
	_, cerr := stdcopy.StdCopy(out, &errOut, hj.Reader)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if out.err != nil {
		// The caller stopped reading: the command must not go on.
		end()
		return fmt.Errorf("container: session exec %s: its output: %w", argv[0], out.err)
	}
	code, err := s.execExit(execID)
	if err != nil {
		return err
	}
	if code != 0 {
		return fmt.Errorf("container: session exec %s: exit %d: %s", argv[0], code, bytes.TrimSpace(errOut.Bytes()))
	}
	if cerr != nil {
		return fmt.Errorf("container: session exec %s: its output: %w", argv[0], cerr)
	}
	return nil
}

// spare makes the end-of-run kills spare the process of file operation
// execID while it lives, and returns what undoes it. The pid counts only
// while a pidfd opened on it still refers to a live process that the
// engine, after the pidfd was opened, reported as the exec's running one:
// then the pid cannot have been reused by a process of the code's. A
// process that ended first needs no sparing.
func (s *session) spare(ctx context.Context, execID string) (unspare func()) {
	none := func() {}
	pid, err := s.execPid(ctx, execID)
	if err != nil {
		return none
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return none
	}
	ins, err := s.b.cli.ContainerExecInspect(ctx, execID)
	if err != nil || !ins.Running || ins.Pid != pid {
		unix.Close(fd)
		return none
	}
	s.spareMu.Lock()
	if s.spared == nil {
		s.spared = map[int]int{}
	}
	s.spared[pid] = fd
	s.spareMu.Unlock()
	return func() {
		s.spareMu.Lock()
		delete(s.spared, pid)
		s.spareMu.Unlock()
		unix.Close(fd)
	}
}

// isSpared reports whether pid is the live process of a file operation.
func (s *session) isSpared(pid int) bool {
	s.spareMu.Lock()
	defer s.spareMu.Unlock()
	fd, ok := s.spared[pid]
	return ok && unix.PidfdSendSignal(fd, 0, nil, 0) == nil
}

// killExec kills process pid if it is still a process of the session's
// container.
func (s *session) killExec(pid int) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return
	}
	defer unix.Close(fd)
	if cg, err := cgroupPaths(pid); err == nil && cg.procs == s.cg.procs {
		unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
	}
}

// errWriter remembers the first error of w.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) Write(p []byte) (int, error) {
	n, err := e.w.Write(p)
	if err != nil && e.err == nil {
		e.err = err
	}
	return n, err
}

// limitedBuffer keeps the first max bytes written to it and drops the
// rest.
type limitedBuffer struct {
	bytes.Buffer
	max int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

// Close removes the session's container, killing whatever runs in it, and
// releases its uid; see engine.SessionInstance.
func (s *session) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	// The proxy's connections end before the container goes.
	if s.net != nil {
		s.net.Close()
	}
	if s.l != nil {
		s.l.Close()
	}
	var err error
	if s.id != "" {
		if !s.b.remove(s.id) {
			err = fmt.Errorf("container: the session's container %s could not be removed; a later New removes it", shortID(s.id))
			s.lease = nil // the container may still run as the uid
		}
	}
	// The run and the file operations in progress end with the container;
	// what they hold goes once they have.
	s.mu.Lock()
	for s.active > 0 {
		s.idle.Wait()
	}
	in := s.interp
	s.interp = nil
	s.mu.Unlock()
	if in != nil {
		in.close()
	}
	if s.lease != nil {
		s.lease.Release()
	}
	for _, f := range s.mounts {
		f.Close()
	}
	s.mounts = nil
	if s.initFd >= 0 {
		unix.Close(s.initFd)
		s.initFd = -1
	}
	s.release()
	return err
}

// sessionRun is one run of a session.
type sessionRun struct {
	s       *session
	execID  string
	hj      types.HijackedResponse
	pidfd   int // the run's Python, readable once it ended
	outDone chan error
	began   time.Time

	cpuBase     time.Duration
	pidsBase    int64
	oomBase     int64
	fullAtStart bool

	in      *interp   // the live interpreter the run is in, if any
	end     chan bool // the interpreter's end markers of the run: true once both are read
	restart string    // why the previous interpreter ended, when this run starts the next

	cpuHit atomic.Bool // the run's CPU time reached the limit
	spent  atomic.Bool // the session's CPU budget is used up

	mu      sync.Mutex
	killed  bool
	killing sync.WaitGroup
	done    chan struct{} // closed when the run ended: the meter stops
}

// meter watches the container's CPU usage while the run goes on: the run's
// own since it began, against the CPU time limit, and the container's
// since it was made, against the session's budget. Either kills the run.
func (r *sessionRun) meter() {
	limit := time.Duration(r.s.b.spec.limits.CPUTime)
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-r.done:
			return
		case <-t.C:
		}
		used, err := r.s.cg.cpuUsage()
		if err != nil {
			continue
		}
		if used-r.cpuBase >= limit || used >= r.s.b.sessionCPU {
			if used >= r.s.b.sessionCPU {
				r.spent.Store(true)
			}
			r.cpuHit.Store(true)
			r.Kill()
			return
		}
	}
}

// Kill kills every process of the container but its init, from another
// goroutine: it must not block, since the output cap calls it from the
// goroutine that copies the output.
func (r *sessionRun) Kill() {
	r.mu.Lock()
	defer r.mu.Unlock()
	select {
	case <-r.done:
		return
	default:
	}
	if r.killed {
		return
	}
	r.killed = true
	r.killing.Go(func() {
		if err := r.s.killAllButInit(); err != nil {
			r.s.b.log.Warn("container: kill a session's run", "id", shortID(r.s.id), "err", err)
		}
	})
}

// Wait waits for the run to end, kills whatever of it is left, waits for
// its output and gathers the evidence from the host side: the exit code
// from the engine, the CPU time from the cgroup, the OOM kills and refused
// forks counted in the cgroup since the run began, a file at the size limit
// changed since then, a mount full; then freezes the container.
func (r *sessionRun) Wait() (ev engine.Evidence, err error) {
	defer r.s.leave(true)
	defer r.close()
	if r.in != nil {
		ev, err = r.waitInterp()
	} else {
		ev, err = r.waitExec()
	}
	if err == nil && r.s.net != nil {
		ev.Notes = append(ev.Notes, r.s.net.Notes()...)
	}
	return ev, err
}

// waitExec waits for a run's own Python to end.
func (r *sessionRun) waitExec() (engine.Evidence, error) {
	s := r.s
	waitPidfd(r.pidfd)
	// Nothing the run started outlives it.
	kerr := s.killAllButInit()
	killed := r.finish()
	select {
	case <-r.outDone:
	case <-time.After(outputGrace):
		r.hj.Close()
		<-r.outDone
	}
	if kerr != nil {
		return engine.Evidence{}, kerr
	}
	code, err := s.execExit(r.execID)
	if err != nil {
		return engine.Evidence{}, err
	}
	ev := engine.Evidence{Exited: !killed, Status: exitStatus(int64(code))}
	r.evidence(&ev)
	return ev, nil
}

// waitPidfd waits until the process of pidfd has ended.
func waitPidfd(pidfd int) {
	fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	for {
		_, err := unix.Poll(fds, -1)
		if err == nil || !errors.Is(err, unix.EINTR) {
			return
		}
	}
}

// finish stops the meter and later Kills, waits for a kill in flight, and
// reports whether the run was killed.
func (r *sessionRun) finish() (killed bool) {
	r.mu.Lock()
	close(r.done)
	killed = r.killed
	r.mu.Unlock()
	r.killing.Wait()
	return killed
}

// evidence adds what the cgroup and the mounts say of the run to ev, whose
// Exited and Status are set.
func (r *sessionRun) evidence(ev *engine.Evidence) {
	s := r.s
	ev.CPUTime = r.cpuHit.Load()
	ev.Spent = r.spent.Load()
	if used, err := s.cg.cpuUsage(); err == nil {
		ev.Spent = ev.Spent || used >= s.b.sessionCPU
		// A death by SIGXCPU counts only with the CPU time behind it,
		// as the session's cgroup counted it since the run began.
		ev.CPUTime = ev.CPUTime || engine.XCPUAtLimit(ev.Status, used-r.cpuBase, time.Duration(s.b.spec.limits.CPUTime), engine.XCPUSlack)
	}
	if n, err := s.cg.oomKills(); err == nil && n > r.oomBase {
		ev.Memory = true
	}
	if n, err := s.cg.pidsRefused(); err == nil && n > r.pidsBase {
		ev.Pids = true
	}
	ev.FileSize = filesAtLimit(s.mounts, int64(s.b.spec.limits.FileSize), r.began)
	clean := ev.Exited && ev.Status.Exited() && ev.Status.ExitStatus() == 0
	ev.Disk = mountsFull(s.mounts) && (!r.fullAtStart || !clean)
}

// close releases what the run holds (the interpreter's are its own).
func (r *sessionRun) close() {
	if r.pidfd >= 0 {
		unix.Close(r.pidfd)
		r.pidfd = -1
	}
	if r.hj.Conn != nil {
		r.hj.Close()
	}
}

// The file operations; see moat.Files.

func (s *session) WriteFile(ctx context.Context, name string, r io.Reader) error {
	return s.files.WriteFile(ctx, name, r)
}

func (s *session) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	return s.files.ReadFile(ctx, name)
}

func (s *session) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	return s.files.ListFiles(ctx)
}

func (s *session) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	return s.files.Stat(ctx, name)
}

func (s *session) Mkdir(ctx context.Context, name string) error { return s.files.Mkdir(ctx, name) }

func (s *session) Rename(ctx context.Context, from, to string) error {
	return s.files.Rename(ctx, from, to)
}

func (s *session) RemoveFile(ctx context.Context, name string) error {
	return s.files.RemoveFile(ctx, name)
}
