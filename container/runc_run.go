package container

import (
	"bufio"
	"bytes"
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
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// A runcInstance is a container of the runc driver, prepared ahead of its
// run: its bundle written (config.json over the shared root filesystem),
// `runc run --keep` started in the foreground with pipes for stdio, and
// runc's init past every restriction of the spec (checked from the host,
// see check) and exec'd into the shell whose child, python3, is blocked
// reading its code from stdin. Start writes the code and closes stdin.
// Each serves one run, with a uid of its own, leased from before the
// bundle is written until the container is deleted.
//
// runc stays the parent of the container's init and reports how it ended
// (its exit code: the init's, or 128+N for a death by signal N, which
// runc's utils.ExitStatus computes from the wait status). --keep keeps the
// container's cgroups after the init exits, so that the OOM killer's and
// the pids controller's counters are read after the run, not raced against
// runc's clean-up; Discard deletes the container (runc delete), after the
// result has returned.
type runcInstance struct {
	b      *runcBackend
	lease  *uidpool.Lease
	id     string
	bundle string

	cmd     *exec.Cmd
	stdin   *os.File // the write end of runc's stdin
	stdout  *os.File // the read end of runc's stdout
	stderr  *os.File // the read end of runc's stderr
	ready   *os.File // the read end of the init's cue that it runs (runcCmd)
	exited  chan struct{}
	waitErr error // runc's end, once exited is closed

	pid int
	cg  cgroupFiles // the container's cgroups, found while it ran
	p   *runcProcess
}

// runcStartTimeout bounds how long runc may take to start a container's
// init up to its exec.
const runcStartTimeout = 30 * time.Second

// Prepare makes a container with runc and starts its python3, waiting for
// its code; see engine.Backend.
func (b *runcBackend) Prepare(ctx context.Context) (engine.Instance, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return b.prepare()
}

func (b *runcBackend) prepare() (_ *runcInstance, err error) {
	in, err := b.newContainer(b.spec.runcCmd(), nil)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			in.Discard()
		}
	}()
	if err := in.startRunc(); err != nil {
		return nil, err
	}
	if err := in.check(); err != nil {
		return nil, err
	}
	return in, nil
}

// newContainer leases a uid and writes the bundle of a container whose
// init runs args, with every protection of runcSpec, and what edit changes
// in its spec if edit is not nil; nothing runs yet. The caller Discards it
// on failure.
func (b *runcBackend) newContainer(args []string, edit func(s *ociSpec, uid int)) (_ *runcInstance, err error) {
	// A container of a moat that died may still run as a uid leased from
	// now on: reap first (cheap when there is nothing to reap).
	b.reap()
	lease, err := b.uids.Acquire()
	if err != nil {
		return nil, fmt.Errorf("container: a uid for the container: %w", err)
	}
	var rnd [8]byte
	rand.Read(rnd[:])
	in := &runcInstance{b: b, lease: lease, id: b.owner + "-" + hex.EncodeToString(rnd[:]), exited: make(chan struct{})}
	in.bundle = filepath.Join(b.paths.bundles, in.id)
	defer func() {
		if err != nil {
			in.Discard()
		}
	}()
	if err := os.Mkdir(in.bundle, 0o700); err != nil {
		return nil, fmt.Errorf("container: bundle: %w", err)
	}
	spec := b.spec.runcSpec(b.rootfs, in.cgroupsPath(), lease.UID, b.seccomp)
	spec.Process.Args = args
	if edit != nil {
		edit(spec, lease.UID)
	}
	js, err := json.Marshal(spec)
	if err != nil {
		return nil, fmt.Errorf("container: %w", err)
	}
	if err := os.WriteFile(filepath.Join(in.bundle, "config.json"), js, 0o600); err != nil {
		return nil, fmt.Errorf("container: bundle: %w", err)
	}
	return in, nil
}

// cgroupsPath is the container's cgroups path in its spec.
func (in *runcInstance) cgroupsPath() string { return "/" + in.b.paths.cgroupParent + "/" + in.id }

// startRunc starts `runc run --keep` with the run's pipes passed through
// to the container's init as fds 3, 4 and 5 (--preserve-fds), which its
// shell makes Python's stdin, stdout and stderr (runcSpec): the code and
// the output do not pass through runc's own copies of its stdio (which is
// /dev/null), and runc's messages go to its log in the bundle, never to
// the run's stderr.
func (in *runcInstance) startRunc() error {
	var child []*os.File
	defer func() {
		for _, f := range child {
			f.Close()
		}
	}()
	pipe := func() (r, w *os.File, err error) {
		r, w, err = os.Pipe()
		if err != nil {
			return nil, nil, fmt.Errorf("container: %w", err)
		}
		return r, w, nil
	}
	var err error
	var r, w *os.File
	if r, in.stdin, err = pipe(); err != nil {
		return err
	}
	child = append(child, r)
	if in.stdout, w, err = pipe(); err != nil {
		return err
	}
	child = append(child, w)
	if in.stderr, w, err = pipe(); err != nil {
		return err
	}
	child = append(child, w)
	if in.ready, w, err = pipe(); err != nil {
		return err
	}
	child = append(child, w)
	return in.startWith(child) // fds 3, 4, 5, 6
}

// startWith starts `runc run --keep` in the foreground (see startRunc)
// with files passed through to the container's init as fds 3 and up
// (--preserve-fds); the caller closes its copies once it returns.
func (in *runcInstance) startWith(files []*os.File) error {
	b := in.b
	// runc runs as PID 1 of a PID namespace of its own (with a /proc of
	// that namespace, in a mount namespace of its own), which the
	// container's is nested in, under util-linux's unshare, which moat's
	// death kills (its parent death signal) and which then kills runc
	// (--kill-child): the kernel then kills every process of runc's
	// namespace, the container's init and the code's included. So a moat
	// killed -9 leaves nothing of a run running, unbounded by its wall
	// time, as a uid whose lease died with moat; what runc leaves (its
	// state, the bundle, the cgroups) the reaper of a later moat removes.
	// The pids in runc's state are its namespace's, which only runc reads.
	args := []string{"--pid", "--mount-proc", "--kill-child=SIGKILL", "--", b.runc,
		"--root", b.root, "--log", filepath.Join(in.bundle, "runc.log"), "--log-format", "json",
		"run", "--keep", "--preserve-fds", strconv.Itoa(len(files)), "--bundle", in.bundle, in.id}
	cmd := exec.Command(b.unshare, args...)
	cmd.Env = runcEnv()
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.ExtraFiles = files
	if err := cmd.Start(); err != nil {
		return unavailable("runc does not start", "check "+b.runc, err)
	}
	in.cmd = cmd
	go func() {
		in.waitErr = cmd.Wait()
		close(in.exited)
	}()
	return nil
}

// check waits for the container's init and makes sure, from the host, of
// what a run needs before any code can run, and fails the preparation
// otherwise (Discard then removes the container: nothing has run in it):
// the init runs under moat's seccomp filter (as many filters as the
// probe's), with no capability in any set, no_new_privs, the leased uid
// and gid and no supplementary group, in namespaces of its own; and the
// watch (the CPU time of the whole tree, the pids events, the tmpfs
// mounts) is in place.
func (in *runcInstance) check() error {
	b := in.b
	if err := in.checkInit(func(pid int) error { return checkCreds(pid, in.lease.UID) }); err != nil {
		return err
	}
	p := &runcProcess{in: in}
	in.p = p
	// The init is past its seccomp filter, so past pivot_root and its
	// mounts: /proc/PID/root is the container's.
	w, err := startWatch(in.id, in.pid, mountPathsOf(b.spec), time.Duration(b.spec.limits.CPUTime), p.Kill)
	if err != nil {
		return fmt.Errorf("container: watch: %w", err)
	}
	p.w = w
	if in.cg, err = cgroupPaths(in.pid); err != nil {
		return err
	}
	if in.cg.oom == "" {
		return unavailable("the container has no memory cgroup", "", nil)
	}
	return nil
}

// checkInit waits for the cue on in.ready that the container's init runs
// and checks it from the host: everything check says but the watch, its
// credentials with creds. It sets in.pid.
func (in *runcInstance) checkInit(creds func(pid int) error) error {
	b := in.b
	// The cue that runc's init has exec'd the shell (or, at EOF, that runc
	// ended without).
	in.ready.SetReadDeadline(time.Now().Add(runcStartTimeout))
	n, _ := in.ready.Read(make([]byte, 1))
	in.ready.Close()
	in.ready = nil
	if n == 0 {
		select {
		case <-in.exited:
			return in.runcFailure("runc ended before the container's init started")
		default:
			return fmt.Errorf("container: runc did not start the container's init within %v", runcStartTimeout)
		}
	}
	pid, err := in.findInit()
	if err != nil {
		return err
	}
	in.pid = pid
	nf, err := initSeccomp(pid)
	if err == nil && b.filters != 0 && nf != b.filters {
		err = fmt.Errorf("container: the run's init runs under %d seccomp filters, the probe's under %d", nf, b.filters)
	}
	if err != nil {
		return unavailable("a container would run without moat's seccomp filter", "check "+b.runc, err)
	}
	b.lastFilters.Store(int64(nf))
	if err := creds(pid); err != nil {
		return unavailable("a container of the runc driver would run with more than moat allows", "check "+b.runc, err)
	}
	if err := checkNamespaces(pid); err != nil {
		return unavailable("a container of the runc driver would share a namespace with the host", "check "+b.runc, err)
	}
	if err := b.spec.checkMounts(pid); err != nil {
		return unavailable("a container of the runc driver would have more of the host, or less read-only, than moat allows", "check "+b.runc, err)
	}
	if err := b.spec.checkLimits(pid, in.cgroupsPath()); err != nil {
		return unavailable("a container of the runc driver would run without moat's limits", "check "+b.runc, err)
	}
	if err := checkNested(pid); err != nil {
		return unavailable("a container of the runc driver would not die with moat", "check "+b.runc, err)
	}
	return nil
}

func mountPathsOf(s *spec) []string {
	paths := make([]string, len(s.mounts))
	for i, m := range s.mounts {
		paths[i] = m.path
	}
	return paths
}

// findInit waits for the container's init in its pids cgroup: the process
// there that is PID 1 of its PID namespace.
func (in *runcInstance) findInit() (int, error) {
	m, err := cgroupMounts()
	if err != nil {
		return 0, err
	}
	root := m["pids"]
	if root == "" {
		root = m[""]
	}
	if root == "" {
		return 0, unavailable("no pids cgroup hierarchy", "", nil)
	}
	procs := filepath.Join(root, in.b.paths.cgroupParent, in.id, "cgroup.procs")
	deadline := time.Now().Add(runcStartTimeout)
	pause := 100 * time.Microsecond
	for {
		if b, err := os.ReadFile(procs); err == nil {
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && isNamespaceInit(pid) {
					return pid, nil
				}
			}
		}
		select {
		case <-in.exited:
			return 0, in.runcFailure("runc ended before the container's init started")
		default:
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("container: runc did not start the container's init within %v", runcStartTimeout)
		}
		time.Sleep(pause)
		pause = min(2*pause, 5*time.Millisecond)
	}
}

// runcFailure is the error of a runc that failed: what its log says.
func (in *runcInstance) runcFailure(what string) error {
	msg := in.runcLogErrors()
	if msg == "" {
		msg = fmt.Sprint(in.waitErr)
	}
	return unavailable(what+": "+msg, "check "+in.b.runc+" and the kernel's support for the container's restrictions", nil)
}

// runcLogErrors returns the error messages runc logged for this container.
func (in *runcInstance) runcLogErrors() string {
	b, err := os.ReadFile(filepath.Join(in.bundle, "runc.log"))
	if err != nil {
		return ""
	}
	var msgs []string
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e struct {
			Level string `json:"level"`
			Msg   string `json:"msg"`
		}
		if json.Unmarshal(sc.Bytes(), &e) == nil && (e.Level == "error" || e.Level == "fatal") {
			msgs = append(msgs, e.Msg)
		}
	}
	return strings.Join(msgs, "; ")
}

// checkCreds checks from the host that process pid has no capability in
// any set, no_new_privs, uid and gid uid (real, effective, saved, fs) and
// no supplementary group.
func checkCreds(pid, uid int) error {
	st, err := procStatus(pid)
	if err != nil {
		return fmt.Errorf("container: the run's init (pid %d): %w", pid, err)
	}
	for _, k := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		if v, ok := st[k]; !ok || strings.Trim(v, "0") != "" {
			return fmt.Errorf("container: the run's init has %s %q", k, v)
		}
	}
	if st["NoNewPrivs"] != "1" {
		return fmt.Errorf("container: the run's init has NoNewPrivs %q", st["NoNewPrivs"])
	}
	want := strings.Repeat(strconv.Itoa(uid)+" ", 4)
	for _, k := range []string{"Uid", "Gid"} {
		if strings.Join(strings.Fields(st[k]), " ")+" " != want {
			return fmt.Errorf("container: the run's init has %s %q, want %d", k, st[k], uid)
		}
	}
	if st["Groups"] != "" {
		return fmt.Errorf("container: the run's init has supplementary groups %q", st["Groups"])
	}
	return nil
}

// checkNamespaces checks from the host that process pid is in namespaces
// of its own, none of them moat's.
func checkNamespaces(pid int) error {
	for _, ns := range []string{"pid", "ipc", "uts", "mnt", "net", "cgroup"} {
		mine, err1 := os.Readlink("/proc/self/ns/" + ns)
		its, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
		if err := errors.Join(err1, err2); err != nil {
			return fmt.Errorf("container: namespaces: %w", err)
		}
		if mine == its {
			return fmt.Errorf("container: the run's init shares moat's %s namespace (%s)", ns, its)
		}
	}
	return nil
}

// checkNested checks from the host that process pid is PID 1 of a PID
// namespace nested in runc's (startRunc), itself a child of moat's: two
// levels below moat's, so that runc's death, which moat's brings, kills it.
func checkNested(pid int) error {
	mine, err := procStatus(os.Getpid())
	if err != nil {
		return fmt.Errorf("container: moat's own status: %w", err)
	}
	its, err := procStatus(pid)
	if err != nil {
		return fmt.Errorf("container: the run's init (pid %d): %w", pid, err)
	}
	m, i := strings.Fields(mine["NSpid"]), strings.Fields(its["NSpid"])
	if len(i) != len(m)+2 || i[len(i)-1] != "1" {
		return fmt.Errorf("container: the run's init has NSpid %q, not PID 1 of a namespace in runc's (moat's NSpid %q)", its["NSpid"], mine["NSpid"])
	}
	return nil
}

// Start hands the code to the python3 waiting in the container and closes
// its stdin; see engine.Instance. A container that ended while it waited
// (killed, out of memory, runc gone) is reported wrapping engine.ErrStale
// before any code is written.
func (in *runcInstance) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	select {
	case <-in.exited:
		return nil, fmt.Errorf("container: a container prepared ahead ended before its run: %w", engine.ErrStale)
	default:
	}
	p := in.p
	if p.w.exited() {
		return nil, fmt.Errorf("container: the init of a container prepared ahead exited before its run: %w", engine.ErrStale)
	}
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	if killed {
		return nil, fmt.Errorf("container: a container prepared ahead was killed before its run (its CPU time limit): %w", engine.ErrStale)
	}
	stdin := in.stdin
	in.stdin = nil
	go func() {
		stdin.Write(code)
		stdin.Close()
	}()
	p.outDone = make(chan struct{})
	var wg sync.WaitGroup
	for _, s := range []struct {
		r *os.File
		w io.Writer
	}{{in.stdout, stdout}, {in.stderr, stderr}} {
		wg.Go(func() { io.Copy(s.w, s.r) })
	}
	go func() {
		wg.Wait()
		close(p.outDone)
	}()
	return p, nil
}

// Discard kills what is left of the container and deletes it, its bundle
// and its cgroups, then frees its uid. When its run has ended the deletion
// finishes after the result has returned (Close waits for it); what it
// cannot delete, the reaper of a later moat does.
func (in *runcInstance) Discard() {
	if in.cmd != nil {
		select {
		case <-in.exited:
		default:
			// A prepared container never run, or a run cut short: its
			// init dies with every process of its PID namespace, and runc
			// with it. Before the watch, the init is still runc's child,
			// unreaped, so its pid is not reused.
			if in.p != nil {
				in.p.Kill()
			} else if in.pid > 0 {
				if fd, err := unix.PidfdOpen(in.pid, 0); err == nil {
					unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
					unix.Close(fd)
				}
			}
			select {
			case <-in.exited:
			case <-time.After(5 * time.Second):
				in.cmd.Process.Kill() // runc delete --force kills the rest
				<-in.exited
			}
		}
	}
	if in.p != nil {
		in.p.end()
	}
	for _, f := range []*os.File{in.stdin, in.stdout, in.stderr, in.ready} {
		if f != nil {
			f.Close()
		}
	}
	b := in.b
	remove := func() {
		// runc has exited, and with it the container's init and every
		// process of its PID namespace: what is left is runc's state and
		// the cgroups, which moat removes itself, as runc delete would,
		// without starting another runc per run.
		err := removeCgroups(b.paths.cgroupParent, in.id)
		if err == nil {
			err = os.RemoveAll(filepath.Join(b.root, in.id))
		}
		if err != nil {
			err = deleteContainer(b.runc, b.root, in.id, b.paths)
		}
		if err != nil {
			b.log.Warn("container: delete a runc container", "id", in.id, "err", err)
			return // the uid stays leased: something of the container may run as it
		}
		if err := os.RemoveAll(in.bundle); err != nil {
			b.log.Warn("container: remove a bundle", "id", in.id, "err", err)
		}
		in.lease.Release()
	}
	if in.p != nil && in.p.waited && b.filters != 0 {
		b.teardown.Go(remove)
		return
	}
	remove()
}

// runcProcess is the code running in a runcInstance's container.
type runcProcess struct {
	in      *runcInstance
	w       *watch
	outDone chan struct{}
	waited  bool // Wait saw the container end

	mu     sync.Mutex
	killed bool
	ended  bool
}

// Kill kills the container's init from the host (through its pidfd),
// without waiting: the kernel then kills every other process of its PID
// namespace, which is every process of the run, none of which can leave
// it.
func (p *runcProcess) Kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.killed || p.ended {
		return
	}
	p.killed = true
	if p.w != nil && p.w.pidfd >= 0 {
		if err := unix.PidfdSendSignal(p.w.pidfd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			p.in.b.log.Warn("container: kill a runc container's init", "id", p.in.id, "err", err)
		}
	}
}

// end makes later Kills do nothing and releases the watch.
func (p *runcProcess) end() {
	p.mu.Lock()
	p.ended = true
	p.mu.Unlock()
	if p.w != nil {
		p.w.close()
	}
}

// Wait waits for runc to report the init's end and for the end of the
// output, then gathers the evidence from the host: the exit status from
// runc, the OOM kills and refused forks from the container's cgroups
// (kept by --keep until Discard), the CPU time from the watch, a file at
// the size limit or a full mount from the run's tmpfs mounts.
func (p *runcProcess) Wait() (engine.Evidence, error) {
	in := p.in
	<-in.exited
	p.waited = true
	select {
	case <-p.outDone:
	case <-time.After(outputGrace):
		in.stdout.Close()
		in.stderr.Close()
		<-p.outDone
	}
	p.w.stop()
	p.mu.Lock()
	killed := p.killed
	p.mu.Unlock()
	// runc ends once the init has: every process of the PID namespace is
	// gone by then. A runc that ended otherwise (killed itself) leaves a
	// run that moat did not see end.
	if !p.w.exited() {
		p.Kill()
		return engine.Evidence{}, unavailable("runc ended before the container's init", "check "+in.b.runc, in.waitErr)
	}
	code := 0
	if in.waitErr != nil {
		var ee *exec.ExitError
		if !errors.As(in.waitErr, &ee) || !ee.Exited() {
			return engine.Evidence{}, unavailable("runc ended abnormally", "check "+in.b.runc, in.waitErr)
		}
		code = ee.ExitCode()
	}
	if msg := in.runcLogErrors(); msg != "" && !killed {
		return engine.Evidence{}, unavailable("runc failed: "+msg, "check "+in.b.runc, nil)
	}
	oom, err := in.cg.oomKills()
	if err != nil {
		return engine.Evidence{}, unavailable("the container's OOM kills cannot be read", "", err)
	}
	refused, err := in.cg.pidsRefused()
	if err != nil {
		return engine.Evidence{}, unavailable("the container's refused forks cannot be read", "", err)
	}
	status, err := in.xcpuSeen(exitStatus(int64(code)), p.w.cpuHit.Load())
	if err != nil {
		return engine.Evidence{}, err
	}
	ev := engine.Evidence{
		Exited: !killed,
		Status: status,
		Memory: oom > 0,
		Pids:   refused > 0 || p.w.pidsHit.Load(),
		// xcpuSeen kept a death by SIGXCPU only where the host saw the
		// CPU time behind it.
		CPUTime:  p.w.cpuHit.Load() || (status.Signaled() && status.Signal() == syscall.SIGXCPU),
		FileSize: p.w.fileAtLimit(int64(in.b.spec.limits.FileSize), time.Time{}),
		Disk:     p.w.diskFull(),
	}
	return ev, nil
}

// xcpuSeen returns status, save that a death by SIGXCPU (which the verdict
// counts as the CPU time limit) stands only when the host saw it: the
// shell reports Python's exit(152) as it does a death by SIGXCPU, 152, so
// unless the watch hit the CPU limit or the cgroup's CPU usage shows the
// run's CPU time limit spent (engine.XCPUAtLimit), the status is the exit
// code 152 that the code may have chosen.
func (in *runcInstance) xcpuSeen(status syscall.WaitStatus, cpuHit bool) (syscall.WaitStatus, error) {
	if !status.Signaled() || status.Signal() != syscall.SIGXCPU || cpuHit {
		return status, nil
	}
	used, err := in.cg.cpuUsage()
	if err != nil {
		return 0, unavailable("the container's CPU usage cannot be read", "", err)
	}
	if engine.XCPUAtLimit(status, used, time.Duration(in.b.spec.limits.CPUTime), engine.XCPUSlack) {
		return status, nil
	}
	return engine.Exit(128 + int(syscall.SIGXCPU)), nil
}
