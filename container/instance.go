package container

import (
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"syscall"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types"
	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/pkg/stdcopy"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// An instance is a prepared container: created, waited for, attached to
// and started, so that its python3 has already started (the runtime's
// namespaces and cgroups made, the shell and python3 exec'd, Python's own
// start done) and is blocked reading its code from stdin, under every
// restriction a run has: the same uid, capabilities, seccomp filter,
// no-new-privileges, read-only root, limits and network, applied when the
// container was created, and watched from the host since it started.
// Python runs nothing of what it reads until stdin ends, so no code runs
// before Start writes it, and none unwatched. A run's path only writes the
// code and waits for the end; preparing one takes the engine a hundred
// milliseconds or more (more when it is busy), which the engine keeps out of
// runs by holding Config.Warm of them ready. Each serves one run at most,
// and its python3 with it: every run gets a python3 of its own, with its own
// hash seed and randomness. Each holds the lease of its own uid from before
// its creation until it is removed, whether it waits in the pool or runs.
type instance struct {
	b        *backend
	lease    *uidpool.Lease
	id       string
	hj       types.HijackedResponse
	waitC    <-chan container.WaitResponse
	waitErrC <-chan error
	cancel   context.CancelFunc // ends the wait and the attach
	waited   bool               // a receive from waitC or waitErrC happened
	exited   bool               // the receive was from waitC: the container has exited
	// p is the run to come, made when the container starts (the watch's
	// CPU limit kills through it); Start hands it to the engine.
	p *process
	// net is the egress proxy's run for this container, nil without a
	// proxy; l its listener in the container's network namespace, once
	// started.
	net egressRun
	l   net.Listener
}

// createTimeout bounds the preparation of a container.
const createTimeout = time.Minute

// Prepare creates a container and registers the wait and the attach that a
// run needs before it starts; see engine.Backend.
func (b *backend) Prepare(ctx context.Context) (engine.Instance, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return b.prepare()
}

// prepare makes an instance. The engine is asked under a context of its
// own, never the caller's: a create cancelled in flight may still make a
// container whose id moat would never learn.
func (b *backend) prepare() (*instance, error) {
	ctx, cancel := context.WithTimeout(context.Background(), createTimeout)
	defer cancel()
	lease, err := b.freeUID(ctx)
	if err != nil {
		return nil, err
	}
	// The proxy's environment is the container's: its placeholders are
	// this container's, which serves one run.
	var run egressRun
	var netEnv []string
	if b.egress != nil {
		run = b.newRun(b.egress)
		netEnv = run.Env(proxyURL, caPath)
	}
	created, err := b.cli.ContainerCreate(ctx, b.spec.config(lease.UID, netEnv), b.spec.hostConfig(lease.UID), nil, nil, "")
	if err != nil {
		// A create that failed in flight may still have made a container
		// with this uid, but one that nobody starts: no process ever runs
		// as the uid in it, so the uid is free again.
		lease.Release()
		if run != nil {
			run.Close()
		}
		return nil, b.createError(err)
	}
	// The wait and the attach live as long as the container: their context
	// is ended by Discard.
	lctx, lcancel := context.WithCancel(context.Background())
	in := &instance{b: b, lease: lease, id: created.ID, cancel: lcancel, net: run}
	// Wait first, then attach: the wait is acknowledged before the container
	// can exit, and the attach before it can write.
	in.waitC, in.waitErrC = b.cli.ContainerWait(lctx, in.id, container.WaitConditionNextExit)
	select {
	case err := <-in.waitErrC:
		in.waited = true
		in.Discard()
		return nil, fmt.Errorf("container: wait: %w", err)
	default:
	}
	in.hj, err = b.cli.ContainerAttach(lctx, in.id, container.AttachOptions{Stream: true, Stdin: true, Stdout: true, Stderr: true})
	if err != nil {
		in.Discard()
		return nil, fmt.Errorf("container: attach: %w", err)
	}
	if err := in.start(ctx); err != nil {
		in.Discard()
		return nil, err
	}
	return in, nil
}

// start starts the container, whose python3 then starts and waits for its
// code on stdin, and makes sure of what a run needs before any code can
// run: moat watches the container from the host, its init runs under
// moat's seccomp filter, and the egress proxy listens in it. Any of these
// that cannot be done fails the preparation, and Discard removes the
// container: nothing has run in it.
//
// The CPU the runtime's init, the shell and python3's start use (tens of
// milliseconds) is counted in the container's cgroup, and so against the
// run's CPU time limit, as it was when the container started on the run's
// path; python3's own start counts against its RLIMIT_CPU too. The wall
// time is not: the engine starts the wall timer once Start has returned,
// so the wait in the pool is not the run's.
func (in *instance) start(ctx context.Context) error {
	b := in.b
	if err := b.cli.ContainerStart(ctx, in.id, container.StartOptions{}); err != nil {
		return fmt.Errorf("container: start: %w", err)
	}
	pid, err := b.initPid(ctx, in.id)
	if err != nil {
		return fmt.Errorf("container: start: %w", err)
	}
	p := &process{in: in}
	in.p = p
	// Watch from the host before the code can run. Only root can watch;
	// without it, New put a note in every Result instead.
	if b.watched {
		w, err := startWatch(in.id, pid, b.mountPaths(), time.Duration(b.spec.limits.CPUTime), p.Kill)
		if err != nil {
			// No code runs unwatched (the tree's CPU time would go
			// unbounded).
			return fmt.Errorf("container: watch: %w", err)
		}
		p.w = w
	}
	// No code runs without moat's seccomp filter: the init must run under
	// as many filters as the probe's container did, which the probe showed
	// to be moat's.
	if err := b.checkSeccomp(pid); err != nil {
		return err
	}
	// The egress proxy listens in the container before the code can run
	// (b.egress needs root, so the watch holds the init's pidfd).
	if in.net != nil {
		if p.w == nil {
			return unavailable("a container with network must be watched from the host", "run moat as root", nil)
		}
		if in.l, err = listenIn(p.w.pidfd, pid); err != nil {
			return err
		}
		b.serveEgress(in.net, in.l)
	}
	return nil
}

// createError is the error of a failed ContainerCreate.
func (b *backend) createError(err error) error {
	if cerrdefs.IsNotFound(err) {
		return unavailable(fmt.Sprintf("image %s is not in the Docker engine", b.spec.image), "run 'moat image build'", err)
	}
	return fmt.Errorf("container: create: %w", err)
}

// freeUID leases a uid that no container runs as. A lease ends with the
// moat process that held it, but its container may outlive it until a later
// New reaps it: a container still labelled with the uid just leased belongs
// to a moat that is gone, so it is removed before the uid is used. A uid
// whose orphan cannot be removed stays leased, unused, and another is tried.
func (b *backend) freeUID(ctx context.Context) (*uidpool.Lease, error) {
	for try := 0; try < 3; try++ {
		lease, err := b.uids.Acquire()
		if err != nil {
			return nil, fmt.Errorf("container: a uid for the container: %w", err)
		}
		list, err := b.cli.ContainerList(ctx, container.ListOptions{
			All:     true,
			Filters: filters.NewArgs(filters.Arg("label", LabelUID+"="+strconv.Itoa(lease.UID))),
		})
		if err != nil {
			lease.Release()
			return nil, fmt.Errorf("container: list the containers of uid %d: %w", lease.UID, err)
		}
		clean := true
		for _, c := range list {
			err := removeContainer(ctx, b.cli, c.ID)
			if err != nil && !cerrdefs.IsNotFound(err) {
				b.log.Warn("container: remove an orphan holding a uid", "id", shortID(c.ID), "uid", lease.UID, "err", err)
				clean = false
				continue
			}
			b.log.Info("container: removed an orphan of a moat that is gone", "id", shortID(c.ID), "uid", lease.UID)
		}
		if clean {
			return lease, nil
		}
		// Held, never released: the orphan still runs as this uid.
	}
	return nil, fmt.Errorf("container: every uid tried is held by a container that cannot be removed: %w", moat.ErrUnavailable)
}

// Start hands the code to the python3 that waits for it in the container,
// on its stdin through the attach stream, and closes the stream after it,
// so that the code's own stdin is at its end; see engine.Instance. A
// container that ended while it waited in the pool (killed, out of memory,
// the engine restarted) is reported wrapping engine.ErrStale before any
// code is written, and the engine retries once on a fresh one.
func (in *instance) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	if err := in.stale(); err != nil {
		return nil, err
	}
	p := in.p
	// The code goes in on stdin; its end closes stdin.
	hj := in.hj
	go func() {
		hj.Conn.Write(code)
		hj.CloseWrite()
	}()
	p.outDone = make(chan error, 1)
	go func() {
		_, err := stdcopy.StdCopy(stdout, stderr, hj.Reader)
		p.outDone <- err
	}()
	return p, nil
}

// stale reports, wrapping engine.ErrStale, a container that can no longer
// serve a run: the engine's wait on it ended (an exit, or a wait the
// engine dropped), or its init exited as the host sees it (the watch's
// pidfd, which is quicker to tell than the engine), or a kill of moat's
// was asked.
func (in *instance) stale() error {
	select {
	case err := <-in.waitErrC:
		in.waited = true
		return fmt.Errorf("container: the wait on a container prepared ahead ended: %w: %w", engine.ErrStale, err)
	case exit := <-in.waitC:
		in.waited = true
		return fmt.Errorf("container: a container prepared ahead exited (status %d) before its run: %w", exit.StatusCode, engine.ErrStale)
	default:
	}
	p := in.p
	if p.w != nil && p.w.exited() {
		return fmt.Errorf("container: the init of a container prepared ahead exited before its run: %w", engine.ErrStale)
	}
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	if killed {
		return fmt.Errorf("container: a container prepared ahead was killed before its run (its CPU time limit): %w", engine.ErrStale)
	}
	return nil
}

// checkSeccomp checks that process pid, not yet running the code, runs
// under moat's seccomp filter: as many filters as the probe's init ran
// under (any, while the probe itself runs).
func (b *backend) checkSeccomp(pid int) error {
	n, err := initSeccomp(pid)
	if err == nil && b.filters != 0 && n != b.filters {
		err = fmt.Errorf("container: the run's init runs under %d seccomp filters, the probe's under %d", n, b.filters)
	}
	if err != nil {
		return unavailable("a container would run without moat's seccomp filter", "check dockerd and the runtime", err)
	}
	b.lastFilters.Store(int64(n))
	return nil
}

// Discard ends the container's egress run, if any, and removes the
// container, killing it first if it runs; then its uid is free for another
// container. A container the engine could not remove
// keeps its uid leased for the life of the process.
func (in *instance) Discard() {
	if in.p != nil {
		in.p.end()
	}
	// The proxy's connections end before the container goes.
	if in.net != nil {
		in.net.Close()
	}
	if in.l != nil {
		in.l.Close() // Serve closes it too, but it may have failed first
	}
	if in.hj.Conn != nil {
		in.hj.Close()
	}
	in.cancel()
	if !in.waited {
		// The client's wait goroutine ends once it handed over its answer:
		// the cancellation's error, or an exit it had already read.
		select {
		case <-in.waitC:
		case <-in.waitErrC:
		case <-time.After(5 * time.Second):
		}
	}
	if in.exited && in.p != nil && in.b.filters != 0 {
		// The engine said the container exited: no process of the run is
		// left, and its removal (the writable layer, the mounts, the
		// runtime's state) changes nothing of the result. It finishes
		// after the run has returned; the uid stays leased until it is
		// done, the backend's Close waits for it, and a removal that a
		// crash cut short is reaped as any leftover. (The probe's own run,
		// while filters is zero, is removed before New returns.)
		in.b.teardown.Add(1)
		go func() {
			defer in.b.teardown.Done()
			if in.b.remove(in.id) {
				in.lease.Release()
			}
		}()
		return
	}
	if in.b.remove(in.id) {
		in.lease.Release()
	}
}

// process is the code running in an instance's container.
type process struct {
	in      *instance
	w       *watch // nil when moat is not root
	outDone chan error

	mu      sync.Mutex
	killed  bool // Kill was called before the run ended
	ended   bool // Discard ran: Kill does nothing
	killing sync.WaitGroup
}

// Kill asks the engine to kill the container, without waiting: the
// engine's kill waits for the container's exit, which waits for its output
// to be drained, and the output cap calls Kill from the goroutine that
// drains it. Killing the container's init ends its PID namespace, and with
// it every process of the run.
func (p *process) Kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.killed || p.ended {
		return
	}
	p.killed = true
	b, id := p.in.b, p.in.id
	p.killing.Go(func() {
		ctx, cancel := context.WithTimeout(context.Background(), removeTimeout)
		defer cancel()
		if err := b.cli.ContainerKill(ctx, id, "KILL"); err != nil && !cerrdefs.IsConflict(err) && !cerrdefs.IsNotFound(err) {
			b.log.Warn("container: kill", "id", shortID(id), "err", err)
		}
	})
}

// end makes later Kills do nothing and waits for the one in flight.
func (p *process) end() {
	p.mu.Lock()
	p.ended = true
	p.mu.Unlock()
	p.killing.Wait()
	if p.w != nil {
		p.w.close()
	}
}

// outputGrace is how long the output may go on after the container exited:
// a process that closed its streams early cannot hold the attach open past
// it.
const outputGrace = 2 * time.Second

// Wait waits for the container's exit and the end of its output, then
// gathers the evidence from the host side: the exit status from the
// engine, the OOM kill from its inspection, a refused fork from the kernel
// log and the pids cgroup, the CPU time from the watch, and a file at the
// size limit or a full mount from the run's tmpfs mounts.
func (p *process) Wait() (engine.Evidence, error) {
	in := p.in
	b := in.b
	var exit container.WaitResponse
	select {
	case exit = <-in.waitC:
		in.waited, in.exited = true, true
	case err := <-in.waitErrC:
		in.waited = true
		return engine.Evidence{}, fmt.Errorf("container: wait: %w", err)
	}
	select {
	case <-p.outDone:
	case <-time.After(outputGrace):
		in.hj.Close()
		<-p.outDone
	}
	if p.w != nil {
		p.w.stop()
	}
	ctx, cancel := context.WithTimeout(context.Background(), removeTimeout)
	defer cancel()
	ins, err := b.cli.ContainerInspect(ctx, in.id)
	if err != nil {
		return engine.Evidence{}, fmt.Errorf("container: inspect after the run: %w", err)
	}
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	ev := engine.Evidence{
		Exited: !killed,
		Status: exitStatus(exit.StatusCode),
		Memory: ins.State != nil && ins.State.OOMKilled,
		Pids:   b.kmsg.forkRefused(in.id),
	}
	if w := p.w; w != nil {
		// A death by SIGXCPU (or an exit 152, which the container's shell
		// reports alike) counts only with the CPU time behind it.
		ev.CPUTime = w.cpuHit.Load() || engine.XCPUAtLimit(ev.Status, w.lastCPU(), time.Duration(b.spec.limits.CPUTime), engine.XCPUSlack+2*pollEvery)
		ev.Pids = ev.Pids || w.pidsHit.Load()
		ev.FileSize = w.fileAtLimit(int64(b.spec.limits.FileSize), time.Time{})
		ev.Disk = w.diskFull()
	}
	if in.net != nil {
		ev.Notes = append(ev.Notes, in.net.Notes()...)
	}
	return ev, nil
}

// exitStatus is the wait status of a process whose exit code the engine
// reports as code: 128+N for a death by signal N (the container's shell,
// and the runtime for an exec, report it so), else the code.
func exitStatus(code int64) syscall.WaitStatus {
	if code > 128 && code <= 128+64 {
		return engine.Signaled(syscall.Signal(code - 128))
	}
	return engine.Exit(int(code))
}
