package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
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

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/cgroup"
)

// booted is one run's sandbox, started: runsc runs in the run's cgroup,
// and Python, once gVisor has booted, waits for the code on stdin. A booted
// sandbox serves exactly one run (use) or is thrown away (discard); either
// way everything of it is removed.
type booted struct {
	s      *Sandbox
	id     string
	bundle string
	group  *cgroup.Group

	cmd    *exec.Cmd
	stdin  *os.File // write end of Python's stdin
	stdout *os.File // read end of Python's stdout
	stderr *os.File // read end of Python's stderr

	events  *sentryEvents
	logDone chan struct{} // closed when the sentry's log reached EOF

	exited  chan struct{} // closed when runsc exited
	waitErr error         // runsc's exit, once exited is closed

	// killed is set when moat killed the sandbox: the wall time, a
	// cancellation, a discard.
	killed atomic.Bool
	// removed makes remove run once.
	removed sync.Once
}

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

// boot starts a sandbox for one run. It returns once runsc is started; the
// sandbox boots on its own while the caller goes on.
func (s *Sandbox) boot() (_ *booted, err error) {
	lim := s.limits
	var rnd [8]byte
	rand.Read(rnd[:])
	b := &booted{s: s, id: s.owner + "-" + hex.EncodeToString(rnd[:]), exited: make(chan struct{}), logDone: make(chan struct{})}
	defer func() {
		if err != nil {
			b.remove()
		}
	}()

	// The bundle: config.json and where runsc writes its logs. The sentry's
	// log goes to a pipe (its "file" is a link to the fd runsc inherits), the
	// gofer's nowhere, runsc's own to a small file read after the run.
	b.bundle = filepath.Join(s.bundles, b.id)
	if err := os.Mkdir(b.bundle, 0o700); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	spec, err := json.Marshal(newSpec(s.rootfs, image.Python, lim))
	if err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	if err := os.WriteFile(filepath.Join(b.bundle, "config.json"), spec, 0o600); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	for name, target := range map[string]string{"log-boot": "/proc/self/fd/3", "log-gofer": "/dev/null"} {
		if err := os.Symlink(target, filepath.Join(b.bundle, name)); err != nil {
			return nil, fmt.Errorf("gvisor: %w", err)
		}
	}
	b.group, err = s.cg.New(b.id, cgroup.Limits{Memory: int64(lim.Memory), Pids: hostPids(lim.Pids)})
	if err != nil {
		b.group = nil
		return nil, unavailable("cannot create the run's cgroup", "", err)
	}

	// Pipes: Python's three streams and the sentry's log. The child's ends
	// are closed here once it holds them.
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

	join := b.group.JoinFiles()
	args := append([]string{"-c", joinScript, "moat-gvisor", strconv.Itoa(len(join))}, join...)
	args = append(args, s.runsc)
	args = append(args, b.runscArgs()...)
	b.cmd = &exec.Cmd{
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
	err = b.cmd.Start()
	closeAll([]*os.File{inR, outW, errW, logW})
	if err != nil {
		closeAll([]*os.File{inW, outR, errR, logR})
		return nil, unavailable("cannot start runsc", "", err)
	}
	b.stdin, b.stdout, b.stderr = inW, outR, errR
	b.events = &sentryEvents{}
	go func() {
		defer close(b.logDone)
		defer logR.Close()
		b.events.read(logR)
	}()
	go func() {
		b.waitErr = b.cmd.Wait()
		close(b.exited)
	}()
	return b, nil
}

// runscArgs is runsc's command line for the run.
func (b *booted) runscArgs() []string {
	s := b.s
	args := []string{
		"--root=" + s.runscRoot,
		"--platform=" + string(s.platform),
		"--network=none",
		"--host-uds=none",
		"--overlay2=none",
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
		"--debug-log=" + filepath.Join(b.bundle, "log-%COMMAND%"),
		"--debug-log-format=json",
		"--panic-log=" + filepath.Join(b.bundle, "log-panic"),
	}
	args = append(args, s.testFlags...)
	return append(args, "run", "--bundle="+b.bundle, b.id)
}

// alive reports whether runsc still runs.
func (b *booted) alive() bool {
	select {
	case <-b.exited:
		return false
	default:
		return true
	}
}

// logPipeSize is the capacity asked for the sentry's log pipe.
const logPipeSize = 1 << 20

// streamDrain bounds how long the output is read after the sandbox ended:
// every writer is dead by then, so the pipes are empty soon.
const streamDrain = 2 * time.Second

// use runs req in the booted sandbox and returns its result. start is when
// the caller's Run began. The sandbox is gone when use returns.
func (b *booted) use(ctx context.Context, req moat.Request, start time.Time) (*moat.Result, error) {
	s, lim := b.s, b.s.limits
	defer b.remove()
	runCtx, cancel := context.WithTimeout(ctx, time.Duration(lim.WallTime))
	defer cancel()

	// The first byte past the output cap ends the run, by the wall timer's
	// kill: nothing past the cap is passed on.
	var outOver atomic.Bool
	over := func() { outOver.Store(true); b.kill() }
	stdout := capture.New(int64(lim.Output), req.Stdout, over)
	stderr := capture.New(int64(lim.Output), req.Stderr, over)
	var copies sync.WaitGroup
	copies.Go(func() { io.Copy(stdout, b.stdout) })
	copies.Go(func() { io.Copy(stderr, b.stderr) })
	// Python reads all of its stdin before it runs anything; a sandbox that
	// died makes the write fail, and the exit below says why.
	feed := make(chan struct{})
	go func() {
		defer close(feed)
		b.stdin.Write(req.Code)
		b.stdin.Close()
	}()

	base, _ := b.group.CPUUsage()
	var cpuOver atomic.Bool
	stop := b.group.WatchCPU(base, time.Duration(lim.CPUTime), func() { b.kill() }, &cpuOver)
	select {
	case <-b.exited:
	case <-runCtx.Done():
		b.killed.Store(true)
		b.kill()
		<-b.exited
	}
	stop()
	// Whatever runsc left running dies now; then the pipes' writers are
	// gone.
	if err := b.kill(); err != nil {
		return nil, fmt.Errorf("gvisor: %w", err)
	}
	<-feed
	if !waitTimeout(&copies, streamDrain) {
		b.stdout.Close()
		b.stderr.Close()
		copies.Wait()
	}
	select {
	case <-b.logDone:
	case <-time.After(streamDrain):
		return nil, fmt.Errorf("gvisor: the sentry's log did not close after the run ended: %w", moat.ErrUnavailable)
	}
	ev := evidence{
		killed:    b.killed.Load(),
		canceled:  ctx.Err() != nil,
		cpuOver:   cpuOver.Load(),
		outOver:   outOver.Load(),
		cgroup:    b.group.Events(),
		runscExit: b.cmd.ProcessState.ExitCode(),
		waitErr:   b.waitErr,
		sent:      b.events.snapshot(),
		panicLog:  readPanicLog(filepath.Join(b.bundle, "log-panic")),
		truncated: stdout.Truncated() || stderr.Truncated(),
		stderr:    stderr.Bytes(),
	}
	runLogBytes, _ := os.ReadFile(filepath.Join(b.bundle, "log-run"))
	ev.run = parseRunLog(runLogBytes)
	out, err := ev.verdict()
	if err != nil {
		return nil, err
	}
	res := &moat.Result{
		Level:     moat.LevelGVisor,
		Stdout:    stdout.Bytes(),
		Stderr:    stderr.Bytes(),
		Truncated: ev.truncated,
		ExitCode:  out.exitCode,
		Reason:    out.reason,
		Notes:     s.notes,
	}
	if out.signal != 0 {
		res.Signal = unix.SignalName(out.signal)
	}
	// The duration counts the clean-up: Run returns only after it.
	b.remove()
	res.Duration = time.Since(start)
	s.log.Debug("gvisor: run", "id", b.id, "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason)
	return res, nil
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

// kill kills runsc and everything in the run's cgroup: the whole sandbox,
// whatever state it is in. runsc itself is killed directly too, in case it
// has not joined the cgroup yet (then it has started nothing).
func (b *booted) kill() error {
	if b.cmd != nil && b.cmd.Process != nil {
		b.cmd.Process.Kill()
	}
	if b.group == nil {
		return nil
	}
	return b.group.Kill()
}

// discard ends a sandbox that served no run.
func (b *booted) discard() {
	b.killed.Store(true)
	b.remove()
}

// remove kills whatever of the sandbox still runs and removes everything
// of it: runsc's state, the cgroup, the bundle. Errors are logged: what
// fails here is reaped by the next New. It is safe to call more than once.
func (b *booted) remove() { b.removed.Do(b.removeOnce) }

func (b *booted) removeOnce() {
	log := b.s.log
	if err := b.kill(); err != nil {
		log.Warn("gvisor: cleanup", "id", b.id, "err", err)
	}
	if b.cmd != nil && b.cmd.Process != nil {
		<-b.exited
		// Bounded: if the kill left a holder of the log pipe, clean-up
		// goes on and the reader ends when that holder does.
		select {
		case <-b.logDone:
		case <-time.After(streamDrain):
			log.Warn("gvisor: cleanup: the sentry's log is still open", "id", b.id)
		}
		closeAll([]*os.File{b.stdin, b.stdout, b.stderr})
		// runsc removes its state when it ends by itself; when it was
		// killed, its files (all named after the run's id) are still
		// there, and nothing of the sandbox runs any more to need them.
		if err := removeState(b.s.runscRoot, b.id); err != nil {
			log.Warn("gvisor: cleanup", "id", b.id, "err", err)
		}
	}
	if b.group != nil {
		if err := b.group.Remove(); err != nil {
			log.Warn("gvisor: cleanup", "id", b.id, "err", err)
		}
	}
	if b.bundle != "" {
		if err := os.RemoveAll(b.bundle); err != nil {
			log.Warn("gvisor: cleanup", "id", b.id, "err", err)
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
