package subprocess

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
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
	"github.com/moatsandbox/moat/internal/uidpool"
)

// A one-shot run.
//
// The engine takes a prepared instance and calls its Start with the code.
// Prepare (setUp) leased the run's uid, made its working directory (a tmpfs
// of the disk limit) and its cgroup, and handed a helper the spec: the
// helper is the run's, the init (PID 1) of its PID namespace, so that
// killing it kills every process of the run, and python3 has started under
// the run's restrictions, waiting (prestart.go). Start writes the code in
// a file and hands python3 its name. Wait gathers the evidence of the
// run's end (evidence.go); Discard removes everything of it.

// instance is a prepared helper and, once started, the run it serves; see
// engine.Instance.
type instance struct {
	b *backend
	h *helperProc // until Start hands it to the run's process

	id       string
	dir      string
	uid, gid int // the run's, or -1 without strict hardening
	mounted  bool
	started  bool     // Start succeeded: Discard comes after the run's Wait
	p        *process // the run, once started
	lease    *uidpool.Lease
	group    *cgroup.Group
	// net serves the run's connections to the egress proxy (network.go),
	// from Start; nil without Config.Egress.
	net *egress.Run
}

// newID names a run's directory and cgroup, "<owner>-<random>", so that the
// reaper knows its owner.
func (b *backend) newID() string {
	var rnd [8]byte
	rand.Read(rnd[:])
	return b.owner + "-" + hex.EncodeToString(rnd[:])
}

// codeName is the file a one-shot run's code is written in: argv cannot
// carry NUL bytes, and stdin is the code's own, empty.
const codeName = ".moat-main.py"

// setUp makes the run's uid, directory and cgroup (and egress run), hands
// the helper its spec and waits for it to say python3 has started: the
// instance then waits for nothing but its code.
func (in *instance) setUp() error {
	b, lim := in.b, in.b.limits
	in.id = b.newID()
	in.uid, in.gid = -1, -1
	if b.strict {
		lease, err := b.uids.Acquire()
		if err != nil {
			return fmt.Errorf("subprocess: %w", err)
		}
		in.lease = lease
		in.uid, in.gid = lease.UID, lease.UID
	}
	in.dir = filepath.Join(b.runsDir, in.id)
	if err := os.Mkdir(in.dir, 0o700); err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	if b.strict {
		if err := mountWorkDir(in.dir, lim.Disk, in.uid, in.gid); err != nil {
			return err
		}
		in.mounted = true
		group, err := b.cg.New(in.id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids)})
		if err != nil {
			return unavailable("cannot create the run's cgroup", "", err)
		}
		in.group = group
	}
	sp := b.runSpec(in.dir, in.uid, in.gid, in.group, prestartArgs(filepath.Join(in.dir, codeName)))
	sp.Prestart = true
	if b.cfg.Egress != nil {
		in.net = b.cfg.Egress.NewRun()
		go serve(b, in.net, in.h.listener)
		b.withNetwork(&sp, in.net)
	}
	arg, err := json.Marshal(sp)
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	_, err = in.h.spec.Write(arg)
	in.h.spec.Close()
	if err != nil {
		return fmt.Errorf("%w: %v", errHelperGone, err)
	}
	return in.h.awaitStarted()
}

// Start writes the code into the run's directory and hands it to the
// python3 that waits for it; see engine.Instance.
func (in *instance) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b, lim := in.b, in.b.limits
	if err := writeNewFile(in.dir, codeName, code, in.uid, in.gid); err != nil {
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EFBIG) {
			return nil, fmt.Errorf("subprocess: code of %d bytes does not fit in the %v working directory: %w", len(code), lim.Disk, moat.ErrInvalid)
		}
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	var atStart map[fileKey]fileStamp
	if int64(len(code)) >= int64(lim.FileSize) {
		// The fresh directory holds only the code file: it is not the
		// run's, and no walk is needed on the run's path otherwise.
		atStart = filesAtLimit(in.dir, lim.FileSize)
	}
	p := &process{b: b, h: in.h, group: in.group, dir: in.dir, mounted: in.mounted, atStart: atStart, net: in.net}
	in.h = nil // the process's now, started or discarded
	p.watch(stdout, stderr)
	if err := p.h.sendCode(filepath.Join(in.dir, codeName)); err != nil {
		p.h.discard()
		<-p.copied
		<-p.copied
		if errors.Is(err, errHelperGone) {
			// It died while it waited in the pool: the engine retries
			// once on a fresh one.
			return nil, fmt.Errorf("%w (%w)", err, engine.ErrStale)
		}
		return nil, err
	}
	in.started, in.p = true, p
	return p, nil
}

// Discard stops a helper that never got a run and removes everything of
// the run. What it cannot remove is logged, and reaped by a later New.
//
// After a run (the engine calls Discard once the run's Wait has returned,
// and Wait has made sure that nothing of the code is left in the run's
// cgroup: see process.Wait), the rest (the helper's exit, the cgroup's
// removal, the working directory's unmount and removal, the uid's lease)
// finishes after the result has returned: it changes nothing of the
// result, and nothing of the run runs by then. The backend's Close waits
// for it.
func (in *instance) Discard() {
	if in.h != nil {
		in.h.discard()
		in.h = nil
	}
	if in.net != nil {
		in.net.Close()
	}
	if !in.started {
		in.remove()
		return
	}
	// The run's Wait found nothing of the code left in its cgroup (the
	// helper had killed and reaped it before its report): what is left is
	// the helper's own exit and the removals. The run's files go before
	// the result does: the tmpfs is detached here (its contents are freed
	// once the exiting helper lets go of it), and a plain directory is
	// removed here. Nothing the run wrote is found on the host by path
	// once Run has returned.
	in.unlinkFiles()
	hook := teardownHook
	in.b.teardown.Add(1)
	go func() {
		defer in.b.teardown.Done()
		if hook != nil {
			hook()
		}
		in.remove()
	}()
}

// teardownHook, when set (by tests only), runs before the removals that
// finish after a run's result.
var teardownHook func()

// unlinkFiles makes the run's files unreachable from the host's tree: it
// detaches the run's tmpfs or, without one, removes the directory. What
// fails is logged and left to remove.
func (in *instance) unlinkFiles() {
	if in.dir == "" {
		return
	}
	if in.mounted {
		if err := unix.Unmount(in.dir, unix.MNT_DETACH); err != nil {
			in.b.log.Warn("subprocess: cleanup", "id", in.id, "err", fmt.Errorf("detach the run's tmpfs: %w", err))
			return
		}
		in.mounted = false
		return
	}
	if err := os.RemoveAll(in.dir); err != nil {
		in.b.log.Warn("subprocess: cleanup", "id", in.id, "err", err)
	}
}

// remove removes what is left of the instance: the helper, once it has
// exited, then its cgroup, its directory and its uid.
func (in *instance) remove() {
	warn := func(err error) {
		if err != nil {
			in.b.log.Warn("subprocess: cleanup", "id", in.id, "err", err)
		}
	}
	if in.p != nil {
		in.p.reap()
	}
	// The uid goes back to the pool only once nothing can run as it: a
	// group that could not be emptied keeps it leased (for this
	// process's life), failing closed.
	emptied := true
	if in.group != nil {
		if err := in.group.Kill(); err != nil {
			emptied = false
			warn(fmt.Errorf("%w; its uid stays leased", err))
		}
		warn(in.group.Remove())
	}
	if in.dir != "" {
		if in.mounted {
			warn(unix.Unmount(in.dir, unix.MNT_DETACH))
		}
		warn(os.RemoveAll(in.dir))
	}
	if in.lease != nil && emptied {
		in.lease.Release()
	}
}

// runSpec is the helper's spec for running args (python3's argv) in dir as
// uid and gid (-1: moat's), in group (strict hardening only): every run,
// one-shot or in a session, is started from it.
func (b *backend) runSpec(dir string, uid, gid int, group *cgroup.Group, args []string) spec {
	lim := b.limits
	sp := spec{
		Python: b.python,
		Args:   args,
		Env:    []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=" + dir, "LANG=C.UTF-8"},
		Dir:    dir,
		UID:    uid,
		GID:    gid,
	}
	cpu := uint64(engine.RlimitCPU(time.Duration(lim.CPUTime)) / time.Second)
	sp.Rlimits = []rlimit{
		// SIGXCPU at the limit, SIGKILL a second later for code that
		// ignores it.
		{Resource: unix.RLIMIT_CPU, Cur: cpu, Max: cpu + 1},
		{Resource: unix.RLIMIT_FSIZE, Cur: uint64(lim.FileSize), Max: uint64(lim.FileSize)},
		{Resource: unix.RLIMIT_NOFILE, Cur: uint64(lim.OpenFiles), Max: uint64(lim.OpenFiles)},
		{Resource: unix.RLIMIT_CORE, Cur: 0, Max: 0},
	}
	if !b.strict {
		// The tutorial's memory limit: address space, per process.
		sp.AddressSpace = uint64(lim.Memory)
		return sp
	}
	sp.Cgroups = group.JoinFiles()
	// The uid is the run's own, so RLIMIT_NPROC counts this run only.
	sp.Rlimits = append(sp.Rlimits, rlimit{Resource: unix.RLIMIT_NPROC, Cur: uint64(lim.Pids), Max: uint64(lim.Pids)})
	sp.NoNewPrivs = true
	sp.Seccomp = true
	ro := append(append([]string{}, readOnlyDirs...), b.pyDirs...)
	sp.Root = &rootSpec{Mount: b.rootDir, ReadOnly: ro, Devices: rwFiles, Work: dir}
	for _, f := range readOnlyFiles {
		if strings.HasPrefix(f, "/dev/") {
			sp.Root.Devices = append(sp.Root.Devices, f) // Landlock keeps them read-only
		} else {
			sp.Root.ReadOnly = append(sp.Root.ReadOnly, f)
		}
	}
	sp.Root.ReadOnly = append(sp.Root.ReadOnly, b.pyFiles...)
	sp.Landlock = &lockSpec{
		ReadOnly:  ro,
		ReadFiles: readOnlyFiles,
		ExecFiles: b.pyFiles,
		RWFiles:   rwFiles,
		Work:      dir,
	}
	return sp
}

// mountWorkDir mounts a tmpfs of disk bytes (and an inode per 4 KiB) on
// dir, owned by uid and gid, noexec, nosuid, nodev.
func mountWorkDir(dir string, disk moat.Bytes, uid, gid int) error {
	inodes := int64(disk / (4 * moat.KiB))
	if inodes < 64 {
		inodes = 64
	}
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=0700,uid=%d,gid=%d", int64(disk), inodes, uid, gid)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return unavailable("cannot mount the size-limited working directory", "", err)
	}
	return nil
}

// writeNewFile creates name in dir with data, read-only, owned by uid and
// gid (-1: moat's). It fails rather than follow or replace anything there.
func writeNewFile(dir, name string, data []byte, uid, gid int) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o400)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil && uid >= 0 {
		err = f.Chown(uid, gid)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		root.Remove(name)
	}
	return err
}

// process is a helper that has its run's spec: a one-shot run, or one run
// of a session without an interpreter; see engine.Process.
type process struct {
	b       *backend
	h       *helperProc
	group   *cgroup.Group // strict only
	dir     string        // the run's working directory
	mounted bool          // dir is the run's tmpfs
	// atStart are the files at the file size limit that dir held when the
	// run began, the code file moat wrote included: those left as they
	// were are not this run's doing (see fileAtLimit).
	atStart map[fileKey]fileStamp
	// release, if set, releases what the run's owner made for it (a
	// session's code file and cgroup) once its evidence is taken.
	release func()
	// net, if set, serves the run's connections to the egress proxy: its
	// notes go into the run's evidence.
	net *egress.Run

	stderrTail tailWriter
	copied     chan struct{}
	stopCPU    func()
	cpuOver    atomic.Bool // the CPU watch killed the run
	killed     atomic.Bool // Kill was called
	reported   atomic.Bool // Wait read the helper's report

	reapOnce sync.Once
	waitErr  error // the helper's exit, once reaped
}

// errHelperGone says the helper ended before it took its spec.
var errHelperGone = errors.New("subprocess: the sandbox helper died before its run")

// launch passes the helper's output on to stdout and stderr, hands it the
// spec, and starts the CPU watch. On an error the helper is gone.
func (p *process) launch(sp spec, stdout, stderr io.Writer) error {
	arg, err := json.Marshal(sp)
	if err != nil {
		p.h.discard()
		return fmt.Errorf("subprocess: %w", err)
	}
	p.watch(stdout, stderr)
	_, err = p.h.spec.Write(arg)
	p.h.spec.Close()
	if err != nil {
		p.h.discard()
		<-p.copied
		<-p.copied
		return fmt.Errorf("%w: %v", errHelperGone, err)
	}
	return nil
}

// watch passes the helper's output on to stdout and stderr and starts the
// CPU watch.
func (p *process) watch(stdout, stderr io.Writer) {
	p.stderrTail.n = 4096
	p.copied = make(chan struct{}, 2)
	go func() { io.Copy(stdout, p.h.stdout); p.copied <- struct{}{} }()
	go func() { io.Copy(io.MultiWriter(stderr, &p.stderrTail), p.h.stderr); p.copied <- struct{}{} }()
	p.stopCPU = func() {}
	if p.group != nil {
		// RLIMIT_CPU bounds each process; the cgroup's account bounds the
		// run as a whole, children included. What python3 spent starting,
		// before the run, counts (prestart.go).
		p.stopCPU = p.group.WatchCPU(0, time.Duration(p.b.limits.CPUTime), func() { p.h.cmd.Process.Kill() }, &p.cpuOver)
	}
}

// Kill kills the helper, init of the run's PID namespace, and with it every
// process of the run.
func (p *process) Kill() {
	p.killed.Store(true)
	p.h.cmd.Process.Kill()
}

// Wait waits for the run's end and for the last of its output, and
// returns the evidence; see engine.Process.
//
// The run has ended when the helper reports python3's end: as the init of
// the run's PID namespace it has killed and reaped every other process of
// the run by then, and closed its own ends of the output (internal/helper/helper.go). So
// Wait needs only the report, the end of the output and a look at the
// run's cgroup, which must hold nothing but the helper; the helper's own
// exit (the namespaces' teardown, a millisecond or two) is waited for by
// the run's owner afterwards (reap). When the helper ends without a report
// (killed: by the engine, the CPU watch, the OOM killer), its exit is
// waited for here.
func (p *process) Wait() (engine.Evidence, error) {
	if p.release != nil {
		// A session's run: its cgroup and code file are removed now,
		// after the helper has gone.
		defer p.release()
		defer p.reap()
	}
	// The helper's files are closed once the output has all been passed
	// on, never before: what the run wrote before a kill may still be in
	// the pipes when the helper has exited.
	defer p.h.closeFiles()
	status := readReport(p.h.status)
	var waitErr error
	if _, ok := parseStatus(status); ok {
		p.reported.Store(true)
	} else {
		waitErr = p.reapErr()
	}
	p.stopCPU()
	// Every holder of the output pipes was in the namespace, now gone; the
	// bound only guards against a kernel that is slow to tear it down.
	for range 2 {
		select {
		case <-p.copied:
		case <-time.After(time.Second):
			p.h.stdout.Close()
			p.h.stderr.Close()
			<-p.copied
		}
	}
	ev, err := p.evidence(waitErr, status)
	if err == nil && p.net != nil {
		ev.Notes = append(ev.Notes, p.net.Notes()...)
	}
	return ev, err
}

// readReport reads the helper's report (past "started"): an error line, or
// the report of python3's end (internal/helper/reaper.go), or what it wrote before it ended
// without one (at most 4 KiB).
func readReport(f *os.File) []byte {
	var buf []byte
	var b [256]byte
	for len(buf) < 4096 {
		n, err := f.Read(b[:])
		buf = append(buf, b[:n]...)
		rest := bytes.TrimPrefix(buf, []byte("started\n"))
		if bytes.HasPrefix(rest, []byte("error ")) && bytes.IndexByte(rest, '\n') >= 0 || len(rest) >= reportLen {
			return buf
		}
		if err != nil {
			return buf
		}
	}
	return buf
}

// reapErr waits for the helper's exit, once, and returns the exit's
// error. A helper that has reported has nothing left to do: it is killed
// first, so that a stuck one cannot hold its owner. It leaves the helper's
// files open: Wait closes them once the output is passed on (a Process
// whose Start failed had them closed by discard).
func (p *process) reapErr() error {
	p.reapOnce.Do(func() {
		if p.reported.Load() {
			p.h.cmd.Process.Kill()
		}
		p.waitErr = p.h.cmd.Wait()
	})
	return p.waitErr
}

// reap is reapErr for a caller that needs no error.
func (p *process) reap() { p.reapErr() }
