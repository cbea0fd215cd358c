package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/egress"
	"github.com/moatsandbox/moat/internal/engine"
)

// booted is one sandbox, started: runsc runs in the sandbox's cgroup, and
// the spec's process (Python waiting for the code on stdin, for a run; the
// init of a session) starts once gVisor has booted. A booted sandbox of a
// run serves exactly one Start, or is thrown away (Discard); either way
// everything of it is removed.
type booted struct {
	b      *backend
	id     string
	bundle string
	group  *cgroup.Group

	cmd    *exec.Cmd
	stdin  *os.File // write end of the process's stdin
	stdout *os.File // read end of its stdout
	stderr *os.File // read end of its stderr

	events  *sentryEvents
	logDone chan struct{} // closed when the sentry's log reached EOF

	exited  chan struct{} // closed when runsc exited
	waitErr error         // runsc's exit, once exited is closed

	// work is the host directory mounted as the working directory, or "".
	work string

	// image is the checkpoint image this sandbox was restored from
	// (runsc restore), or "" for a sandbox booted afresh (runsc run).
	image string

	// net is the egress proxy's run of this sandbox, and netL its listener
	// in the sandbox's network namespace, or nil without a network
	// (network.go).
	net  *egress.Run
	netL net.Listener

	// removed makes remove run once.
	removed sync.Once
}

var _ engine.Instance = (*booted)(nil)

// hostPids is the host pids limit of a run's cgroup: a backstop against a
// runaway sentry, not the task limit. The sentry, the gofer and runsc use
// about 25 host threads, and the systrap platform adds about two host tasks
// per process of the code; gVisor's RLIMIT_NPROC holds the code's tasks to
// Limits.Pids well before this.
func hostPids(pids int) int64 { return int64(256 + 8*pids) }

// joinScript moves the shell into the run's cgroups (its arguments: how
// many files, the files, then the command) and execs runsc, so that runsc
// and everything it starts are in the cgroups from their first instruction.
const joinScript = `n=$1; shift
while [ "$n" -gt 0 ]; do echo $$ >"$1" || exit 125; shift; n=$((n-1)); done
exec "$@"`

// boot starts a sandbox with spec. It returns once runsc is started; the
// sandbox boots on its own while the caller goes on. A hostWork of more
// than zero gives the sandbox a working directory on the host: a tmpfs of
// that size in the bundle (booted.work), bind-mounted at image.WorkDir
// (see hostWorkMount). A non-nil netRun makes the egress proxy the sandbox's
// only way out (network.go): runsc starts in a network namespace of its
// own, and netRun serves the listener placed in it before boot returns; the
// sandbox owns netRun from then on, and closes it when it is removed (even
// when boot fails). The caller has put egressEnv(netRun) in the environment
// of the spec's code.
func (b *backend) boot(spec *ociSpec, hostWork moat.Bytes, netRun *egress.Run) (_ *booted, err error) {
	return b.bootFrom(spec, hostWork, netRun, nil)
}

// restoreSource is what a sandbox is restored from: a checkpoint image
// (its directory, which runsc only reads) and what fills the host working
// directory before runsc starts.
type restoreSource struct {
	image string
	fill  func(work string) error
}

// bootFrom is boot, or, with from, the restore of a checkpoint with spec
// (runsc restore instead of runsc run): the same bundle, cgroup, flags,
// pipes and logs as a fresh sandbox's.
func (b *backend) bootFrom(spec *ociSpec, hostWork moat.Bytes, netRun *egress.Run, from *restoreSource) (_ *booted, err error) {
	lim := b.limits
	var rnd [8]byte
	rand.Read(rnd[:])
	bt := &booted{b: b, id: b.owner + "-" + hex.EncodeToString(rnd[:]), exited: make(chan struct{}), logDone: make(chan struct{}), net: netRun}
	if from != nil {
		bt.image = from.image
	}
	defer func() {
		if err != nil {
			bt.remove()
		}
	}()

	// The bundle: config.json and where runsc writes its logs. The sentry's
	// log goes to a pipe (its "file" is a link to the fd runsc inherits), the
	// gofer's nowhere, runsc's own to a small file read after the run.
	bt.bundle = filepath.Join(b.bundles, bt.id)
	if err := os.Mkdir(bt.bundle, 0o700); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	if hostWork > 0 {
		bt.work = filepath.Join(bt.bundle, "work")
		if err := mountHostWork(bt.work, hostWork); err != nil {
			bt.work = ""
			return nil, err
		}
		spec.Mounts = append(spec.Mounts, hostWorkMount(bt.work))
		if from != nil && from.fill != nil {
			if err := from.fill(bt.work); err != nil {
				return nil, err
			}
		}
	}
	if netRun != nil {
		if err := withEgress(spec, bt.bundle, b.cfg.Egress); err != nil {
			return nil, err
		}
	}
	specJSON, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	if err := os.WriteFile(filepath.Join(bt.bundle, "config.json"), specJSON, 0o600); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	for name, target := range map[string]string{"log-boot": "/proc/self/fd/3", "log-gofer": "/dev/null"} {
		if err := os.Symlink(target, filepath.Join(bt.bundle, name)); err != nil {
			return nil, fmt.Errorf("gvisor: %w", err)
		}
	}
	bt.group, err = b.cg.New(bt.id, cgroup.Limits{Memory: int64(lim.Memory), Pids: hostPids(lim.Pids)})
	if err != nil {
		bt.group = nil
		return nil, unavailable("cannot create the sandbox's cgroup", "", err)
	}

	// Pipes: the process's three streams and the sentry's log. The child's
	// ends are closed here once it holds them.
	var files [8]*os.File
	for i := 0; i < 8; i += 2 {
		r, w, err := os.Pipe()
		if err != nil {
			closeAll(files[:i])
			return nil, fmt.Errorf("gvisor: %w", err)
		}
		files[i], files[i+1] = r, w
	}
	inR, inW, outR, outW, errR, errW, logR, logW := files[0], files[1], files[2], files[3], files[4], files[5], files[6], files[7]
	// A deep log pipe lets the sentry write a burst of traced calls without
	// waiting for moat to read them. Best effort: the default works too.
	unix.FcntlInt(logW.Fd(), unix.F_SETPIPE_SZ, logPipeSize)

	join := bt.group.JoinFiles()
	args := append([]string{"-c", joinScript, "moat-gvisor", strconv.Itoa(len(join))}, join...)
	args = append(args, b.runsc)
	args = append(args, bt.runscArgs()...)
	bt.cmd = &exec.Cmd{
		Path:       "/bin/sh",
		Args:       append([]string{"sh"}, args...),
		Env:        []string{}, // nothing of moat's environment
		Dir:        "/",
		Stdin:      inR,
		Stdout:     outW,
		Stderr:     errW,
		ExtraFiles: []*os.File{logW}, // fd 3, the sentry's log
		// runsc dies with moat, and the sentry (started --attached) with
		// runsc.
		SysProcAttr: &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL},
	}
	if netRun != nil {
		// A network namespace of the sandbox's own, holding only loopback:
		// the proxy's listener is all there is in it.
		bt.cmd.SysProcAttr.Cloneflags = syscall.CLONE_NEWNET
	}
	err = bt.cmd.Start()
	closeAll([]*os.File{inR, outW, errW, logW})
	if err != nil {
		closeAll([]*os.File{inW, outR, errR, logR})
		return nil, unavailable("cannot start runsc", "", err)
	}
	bt.stdin, bt.stdout, bt.stderr = inW, outR, errR
	// The listener goes in before runsc can have started anything in the
	// namespace, and while runsc is not yet reaped, so that its pid names
	// its namespace. The sandbox's code starts only once the sandbox has
	// booted, later still.
	var netErr error
	if netRun != nil {
		bt.netL, netErr = listenEgress(bt.cmd.Process.Pid, netRun)
	}
	bt.events = &sentryEvents{}
	go func() {
		defer close(bt.logDone)
		defer logR.Close()
		bt.events.read(logR)
	}()
	go func() {
		bt.waitErr = bt.cmd.Wait()
		close(bt.exited)
	}()
	if netErr != nil {
		return nil, netErr
	}
	return bt, nil
}

// runscArgs is runsc's command line for the sandbox: the flags of every
// command (the state's root), those that shape the sandbox, and run.
func (bt *booted) runscArgs() []string {
	b := bt.b
	network := "--network=none"
	if bt.net != nil {
		network = "--network=host" // host sockets, in the sandbox's own namespace (network.go)
	}
	args := []string{
		"--root=" + b.runscRoot,
		"--platform=" + string(b.platform),
		network,
		"--host-uds=none",
		"--overlay2=none",
		// Mounts other than the root (a session's host working directory)
		// are revalidated: what the host changes there, the code sees.
		"--file-access-mounts=shared",
		"--host-fifo=none",
		// The spec's seccomp filter, applied by gVisor's kernel to the code.
		"--oci-seccomp",
		// moat's cgroup holds runsc and everything it starts.
		"--ignore-cgroups",
		"--strace",
		"--strace-syscalls=" + strings.Join(straceSyscalls, ","),
		"--strace-log-size=8",
		// Every log as JSON, which the code's text cannot break out of
		// (logs.go), and the sentry's runtime messages in a file of their
		// own.
		"--debug-log=" + filepath.Join(bt.bundle, "log-%COMMAND%"),
		"--debug-log-format=json",
		"--panic-log=" + filepath.Join(bt.bundle, "log-panic"),
	}
	args = append(args, b.testFlags...)
	if bt.image != "" {
		return append(args, "restore", "--image-path="+bt.image, "--bundle="+bt.bundle, bt.id)
	}
	return append(args, "run", "--bundle="+bt.bundle, bt.id)
}

// command is the runsc command that started the sandbox, which names its
// log (log-run or log-restore).
func (bt *booted) command() string {
	if bt.image != "" {
		return "restore"
	}
	return "run"
}

// alive reports whether runsc still runs. It asks the kernel too (waitid
// with WNOWAIT, which leaves the exit to the goroutine that waits for it),
// so that a runsc that has just exited is not taken for alive while that
// goroutine has yet to run.
func (bt *booted) alive() bool {
	select {
	case <-bt.exited:
		return false
	default:
	}
	var info unix.Siginfo
	if err := unix.Waitid(unix.P_PID, bt.cmd.Process.Pid, &info, unix.WEXITED|unix.WNOHANG|unix.WNOWAIT, nil); err != nil {
		return false // reaped meanwhile
	}
	return info.Signo == 0 // WNOHANG leaves it zero while the child runs
}

// logPipeSize is the capacity asked for the sentry's log pipe.
const logPipeSize = 1 << 20

// streamDrain bounds how long the output is read after the sandbox ended:
// every writer is dead by then, so the pipes are empty soon.
const streamDrain = 2 * time.Second

// Start feeds code to the Python waiting in the sandbox, passes its output
// on, and watches the sandbox's CPU account: see engine.Instance. A sandbox
// that died while it waited is stale.
func (bt *booted) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	if !bt.alive() {
		// It died while it waited (killed from outside, out of memory): it
		// proves nothing about the next one.
		return nil, fmt.Errorf("gvisor: the sandbox booted ahead died before its run (%v): %w: %w", bt.waitErr, engine.ErrStale, moat.ErrUnavailable)
	}
	lim := bt.b.limits
	p := &process{bt: bt, feed: make(chan struct{})}
	p.copies.Go(func() { io.Copy(stdout, bt.stdout) })
	p.copies.Go(func() { io.Copy(io.MultiWriter(stderr, &p.tail), bt.stderr) })
	// Python reads all of its stdin before it runs anything; a sandbox that
	// died makes the write fail, and Wait says why.
	go func() {
		defer close(p.feed)
		bt.stdin.Write(code)
		bt.stdin.Close()
	}()
	base, _ := bt.group.CPUUsage()
	p.cpuBase, p.cpuLimit = base, time.Duration(lim.CPUTime)
	p.stopCPU = bt.group.WatchCPU(base, time.Duration(lim.CPUTime), p.killAsync, &p.cpuOver)
	return p, nil
}

// process is a run in a booted sandbox.
type process struct {
	bt      *booted
	feed    chan struct{}  // closed once the code is written
	copies  sync.WaitGroup // the output copies
	tail    tail           // the end of stderr, for errors
	stopCPU func()
	cpuOver atomic.Bool // the CPU watch killed the sandbox
	// cpuBase is the cgroup's CPU usage when the run began, cpuLimit its
	// CPU time limit.
	cpuBase, cpuLimit time.Duration

	mu     sync.Mutex
	killed bool           // Kill was called: the engine ended the run
	done   bool           // Wait has cleaned up: kills are no-ops
	kills  sync.WaitGroup // the cgroup kill Kill started
}

// Kill kills runsc at once and the sandbox's cgroup from a goroutine of
// its own, so that it returns without waiting, even when called from the
// output writer.
func (p *process) Kill() {
	p.mu.Lock()
	p.killed = true
	p.mu.Unlock()
	p.killAsync()
}

func (p *process) killAsync() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.done {
		return
	}
	if c := p.bt.cmd; c != nil && c.Process != nil {
		c.Process.Kill()
	}
	p.kills.Go(func() { p.bt.group.Kill() })
}

// Wait waits for runsc's exit, kills what is left of the sandbox, drains
// the output and the sentry's log, and returns the evidence.
func (p *process) Wait() (engine.Evidence, error) {
	bt := p.bt
	<-bt.exited
	p.stopCPU()
	// Whatever runsc left running dies now; then the pipes' writers are
	// gone.
	err := bt.kill()
	p.mu.Lock()
	p.done = true
	p.mu.Unlock()
	p.kills.Wait()
	if err != nil {
		return engine.Evidence{}, fmt.Errorf("gvisor: %w", err)
	}
	<-p.feed
	if !waitTimeout(&p.copies, streamDrain) {
		bt.stdout.Close()
		bt.stderr.Close()
		p.copies.Wait()
	}
	select {
	case <-bt.logDone:
	case <-time.After(streamDrain):
		return engine.Evidence{}, fmt.Errorf("gvisor: the sentry's log did not close after the run ended: %w", moat.ErrUnavailable)
	}
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	used, _ := bt.group.CPUUsage()
	ev := evidence{
		killed:    killed,
		cpuOver:   p.cpuOver.Load(),
		cpuUsed:   used - p.cpuBase,
		cpuLimit:  p.cpuLimit,
		cgroup:    bt.group.Events(),
		runscExit: bt.cmd.ProcessState.ExitCode(),
		waitErr:   bt.waitErr,
		sent:      bt.events.snapshot(),
		panicLog:  readPanicLog(filepath.Join(bt.bundle, "log-panic")),
		stderr:    p.tail.bytes(),
	}
	runLogBytes, _ := os.ReadFile(filepath.Join(bt.bundle, "log-run"))
	ev.run = parseRunLog(runLogBytes)
	out, err := ev.judge()
	if err == nil && bt.net != nil {
		out.Notes = append(out.Notes, bt.net.Notes()...)
	}
	return out, err
}

// tail keeps the last bytes written to it.
type tail struct {
	mu  sync.Mutex
	buf []byte
}

const tailSize = 512

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf = append(t.buf, p...)
	if len(t.buf) > tailSize {
		t.buf = append(t.buf[:0], t.buf[len(t.buf)-tailSize:]...)
	}
	return len(p), nil
}

func (t *tail) bytes() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]byte(nil), t.buf...)
}

// waitTimeout waits for wg at most d and reports whether it finished.
func waitTimeout(wg *sync.WaitGroup, d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	select {
	case <-done:
		return true
	case <-time.After(d):
		return false
	}
}

// kill kills runsc and everything in the sandbox's cgroup, whatever state
// it is in, and waits (bounded) until the cgroup is empty. runsc itself is
// killed directly too, in case it has not joined the cgroup yet (then it
// has started nothing).
func (bt *booted) kill() error {
	if bt.cmd != nil && bt.cmd.Process != nil {
		bt.cmd.Process.Kill()
	}
	if bt.group == nil {
		return nil
	}
	return bt.group.Kill()
}

// Discard removes the sandbox: see engine.Instance.
func (bt *booted) Discard() { bt.remove() }

// remove kills whatever of the sandbox still runs and removes everything
// of it: runsc's state, the cgroup, the bundle. Errors are logged: what
// fails here is reaped by the next New. It is safe to call more than once.
func (bt *booted) remove() { bt.removed.Do(bt.removeOnce) }

func (bt *booted) removeOnce() {
	log := bt.b.log
	if err := bt.kill(); err != nil {
		log.Warn("gvisor: cleanup", "id", bt.id, "err", err)
	}
	if bt.net != nil {
		bt.net.Close()
		if bt.netL != nil {
			bt.netL.Close()
		}
	}
	if bt.cmd != nil && bt.cmd.Process != nil {
		<-bt.exited
		// Bounded: if the kill left a holder of the log pipe, clean-up
		// goes on and the reader ends when that holder does.
		select {
		case <-bt.logDone:
		case <-time.After(streamDrain):
			log.Warn("gvisor: cleanup: the sentry's log is still open", "id", bt.id)
		}
		closeAll([]*os.File{bt.stdin, bt.stdout, bt.stderr})
		// runsc removes its state when it ends by itself; when it was
		// killed, its files (all named after the sandbox's id) are still
		// there, and nothing of the sandbox runs any more to need them.
		if err := removeState(bt.b.runscRoot, bt.id); err != nil {
			log.Warn("gvisor: cleanup", "id", bt.id, "err", err)
		}
	}
	if bt.group != nil {
		if err := bt.group.Remove(); err != nil {
			log.Warn("gvisor: cleanup", "id", bt.id, "err", err)
		}
	}
	if bt.work != "" {
		if err := unmountHostWork(bt.work); err != nil {
			log.Warn("gvisor: cleanup", "id", bt.id, "err", err)
		}
	}
	if bt.bundle != "" {
		if err := os.RemoveAll(bt.bundle); err != nil {
			log.Warn("gvisor: cleanup", "id", bt.id, "err", err)
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

func closeAll(files []*os.File) {
	for _, f := range files {
		if f != nil {
			f.Close()
		}
	}
}
