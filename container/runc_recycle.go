package container

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/engine"
)

// Recycling with the runc driver (Config.Recycle; see engine.Recycler).
//
// A tenant's recycled container is made as a one-shot run's (runcSpec:
// the same uid lease, seccomp filter, namespaces, read-only root, tmpfs
// mounts, cgroup limits and rlimits, all checked from the host as a fresh
// container's are), but its init is a run server (recycle_server.py), of
// uid 0 with three capabilities (see below),
// instead of the shell of one run. The server starts each run's python3
// when the host tells it to, with stdin, stdout and stderr the host made
// for that run alone (passed over a unix socket pair only the server holds
// in the container), and reports its wait status; it never reads what the
// code writes. Each run's python3 is a fresh exec (its own hash seed and
// randomness), started in the reset after the previous run, so that its
// start is off the next run's path, as in a fresh pooled container.
//
// A run ends when its python3 does (the server's report) or when moat
// kills it: then moat kills, from the host, every process of the container
// but the server (the cgroup frozen meanwhile; cgroupFiles.killAllBut), so
// nothing a run started outlives it. The evidence is the host's: the
// cgroup's CPU usage since the run began (watched, and killed at the CPU
// time limit), its OOM kills and refused forks since then, files at the
// size limit changed since then and full mounts, from the mounts opened
// when the container was made.
//
// The reset, off the run's path, makes the container as a fresh one would
// be, judged from the host (the code's processes are all gone by then, so
// nothing of the code's runs while it does):
//   - no unix socket is left in the container's network namespace: a socket
//     passed (SCM_RIGHTS) into its own queue outlives every process, and
//     with it whatever was passed (a pipe's end, a memfd, a listener); the
//     server holds none, so one listed in the namespace's /proc/net/unix
//     fails the reset;
//   - SysV IPC objects and POSIX message queues, which outlive their
//     processes in the container's IPC namespace, are removed from a host
//     thread that joined that namespace (ipcClear);
//   - /work, /tmp and /dev/shm are emptied through the directories opened
//     when the container was made, by root on the host through os.Root (no
//     link is followed), and their modes, owners, times and extended
//     attributes restored;
//   - the new python3 is checked as a fresh container's init is (its uid,
//     no capability in any set, no_new_privs, moat's seccomp filters, the
//     spec's rlimits and cgroups), once it runs python3 (its command line,
//     read from the host), and its attributes and the server's (rlimits,
//     nice, scheduling, affinity, I/O priority) against the server's as
//     runc made it, which nothing of the code's can change (see below).
//
// What the code can do to the server while it runs: nothing. The server
// runs as uid 0 with only CAP_SETUID, CAP_SETGID and CAP_SETPCAP (checked
// from the host, as each run's python3 is checked to have dropped them
// all), so the code, of the container's uid, can neither signal it, trace
// it, read its memory or descriptors, nor change its rlimits, nice,
// scheduling or I/O priority: the kernel allows those only to the same uid
// or to capabilities the code has none of. (A hostile review found that a
// server of the code's own uid, undumpable, still had its limits and its
// fair-scheduler slice changed through prlimit and sched_setattr, and was
// killed so; checking attributes one by one would never have been
// complete.) The server also catches only SIGCHLD and ignores SIGINT, and
// its oom_score_adj is below the runs' (500 against 1000), so the memory
// cgroup's OOM killer takes the code's processes first; a server that dies
// in a run all the same ends the run, with the memory verdict when the
// cgroup counted an OOM kill.

// What recycling gives up, within one tenant only: the runs share the
// container's network and IPC namespaces and kernel objects a reset does
// not list (the page cache, a pid counter), and the server is the same
// process from run to run.

//go:embed recycle_server.py
var recycleServer string

// recycleCmd is the command of a recycled container's init: the run server,
// once it has given the cue on fd 4 that runc's init exec'd it.
func (s *spec) recycleCmd() []string {
	return []string{"/bin/sh", "-c", `echo >&4; exec 4>&-; exec "$0" -I -S -c "$1" "$0" "$2" "$3"`, s.python, recycleServer, image.WorkDir, "UID"}
}

// serverCaps are the run server's capabilities, its only ones: to make
// each run's python3 the container's uid, with no capability left in any
// set (the bounding set emptied first).
var serverCaps = []string{"CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP"}

// serverSpec makes the spec of a recycled container's init the run
// server's: uid and gid 0 with serverCaps and nothing else, from /, less
// likely than the runs to be the memory cgroup OOM killer's choice
// (oom_score_adj 500, the runs' python3 1000), and uid, the container's,
// as its last argument.
func serverSpec(s *ociSpec, uid int) {
	p := &s.Process
	p.User = ociUser{UID: 0, GID: 0, AdditionalGids: []uint32{}}
	p.Capabilities.Bounding = serverCaps
	p.Capabilities.Effective = serverCaps
	p.Capabilities.Permitted = serverCaps
	p.Cwd = "/"
	p.OOMScoreAdj = serverOOMScoreAdj
	p.Args[len(p.Args)-1] = strconv.Itoa(uid)
}

const serverOOMScoreAdj = 500

// checkServerCreds checks from the host that the run server (pid) has uid
// and gid 0 (real, effective, saved, fs), no supplementary group,
// no_new_privs, and serverCaps in its bounding, permitted and effective
// sets, none inheritable or ambient.
func checkServerCreds(pid int) error {
	st, err := procStatus(pid)
	if err != nil {
		return fmt.Errorf("container: the run server (pid %d): %w", pid, err)
	}
	var want uint64
	for _, c := range []int{unix.CAP_SETGID, unix.CAP_SETUID, unix.CAP_SETPCAP} {
		want |= 1 << c
	}
	for k, w := range map[string]uint64{"CapInh": 0, "CapPrm": want, "CapEff": want, "CapBnd": want, "CapAmb": 0} {
		v, err := strconv.ParseUint(st[k], 16, 64)
		if err != nil || v != w {
			return fmt.Errorf("container: the run server has %s %q, want %016x", k, st[k], w)
		}
	}
	if st["NoNewPrivs"] != "1" {
		return fmt.Errorf("container: the run server has NoNewPrivs %q", st["NoNewPrivs"])
	}
	for _, k := range []string{"Uid", "Gid"} {
		if strings.Join(strings.Fields(st[k]), " ") != "0 0 0 0" {
			return fmt.Errorf("container: the run server has %s %q, want 0", k, st[k])
		}
	}
	if st["Groups"] != "" {
		return fmt.Errorf("container: the run server has supplementary groups %q", st["Groups"])
	}
	return nil
}

var _ engine.Recycler = (*runcBackend)(nil)

// runcRecycled is one recycled container of the runc driver.
type runcRecycled struct {
	*runcInstance          // the container; its Discard removes it
	ctl           *os.File // moat's end of the control socket pair
	pidfd         int      // the server's
	mounts        []*os.File
	attrs         procAttrs // the server's as runc made it

	// killMu serializes the kills (cgroupFiles.killAllBut).
	killMu sync.Mutex

	mu     sync.Mutex
	next   *nextRun      // the python3 started for the next run, or nil
	run    *recycledRun  // the run in progress, or nil
	broken error         // why the container can serve no more runs
	dead   chan struct{} // closed when the control socket ends
	spawn  chan string   // the server's answer to a start: "P<pid>" or "F<why>"
}

// nextRun is a python3 started for the next run, waiting for its code.
type nextRun struct {
	cpid, pid             int // in the container's namespace, on the host
	stdin, stdout, stderr *os.File
	// The container's counters before it started: its run's CPU time
	// counts its start, as a fresh container's does.
	cpuBase           time.Duration
	pidsBase, oomBase int64
}

// recycleStartTimeout bounds how long a run's python3 may take to start
// in the reset.
const recycleStartTimeout = 30 * time.Second

// NewRecycled makes a container for one tenant's runs: see engine.Recycler.
func (b *runcBackend) NewRecycled(ctx context.Context) (_ engine.SessionInstance, err error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	in, err := b.newContainer(b.spec.recycleCmd(), serverSpec)
	if err != nil {
		return nil, err
	}
	rc := &runcRecycled{runcInstance: in, pidfd: -1, dead: make(chan struct{}), spawn: make(chan string, 1)}
	defer func() {
		if err != nil {
			rc.Close()
		}
	}()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("container: recycle: %w", err)
	}
	rc.ctl = os.NewFile(uintptr(fds[0]), "recycle-ctl")
	theirs := os.NewFile(uintptr(fds[1]), "recycle-ctl-server")
	ready, readyW, err := os.Pipe()
	if err != nil {
		theirs.Close()
		return nil, fmt.Errorf("container: recycle: %w", err)
	}
	in.ready = ready
	err = in.startWith([]*os.File{theirs, readyW}) // fds 3 and 4
	theirs.Close()
	readyW.Close()
	if err != nil {
		return nil, err
	}
	if err := in.checkInit(checkServerCreds); err != nil {
		return nil, err
	}
	if in.cg, err = cgroupPaths(in.pid); err != nil {
		return nil, err
	}
	if in.cg.oom == "" || in.cg.freezer == "" {
		return nil, unavailable("a recycled container needs memory and freezer cgroups", "", nil)
	}
	if rc.pidfd, err = unix.PidfdOpen(in.pid, 0); err != nil {
		return nil, fmt.Errorf("container: recycle: pidfd of the server: %w", err)
	}
	// The server's first word: it is up, undumpable, SIGINT ignored.
	rc.ctl.SetReadDeadline(time.Now().Add(runcStartTimeout))
	buf := make([]byte, 16)
	n, err := rc.ctl.Read(buf)
	if err != nil || string(buf[:n]) != "R" {
		return nil, unavailable("the run server of a recycled container did not start", "check "+b.spec.python, errors.Join(err, errors.New(string(buf[:n]))))
	}
	rc.ctl.SetReadDeadline(time.Time{})
	if err := checkServer(in.pid); err != nil {
		return nil, unavailable("the run server of a recycled container is reachable by the code", "", err)
	}
	if rc.attrs, err = readProcAttrs(in.pid); err != nil {
		return nil, fmt.Errorf("container: recycle: %w", err)
	}
	root := fmt.Sprintf("/proc/%d/root", in.pid)
	for _, m := range b.spec.mounts {
		f, err := openTmpfs(root, m.path)
		if err != nil {
			return nil, err
		}
		rc.mounts = append(rc.mounts, f)
	}
	go rc.read()
	if err := rc.startNext(ctx); err != nil {
		return nil, err
	}
	return rc, nil
}

// openTmpfs opens the tmpfs mounted at path under root (a container's
// /proc/PID/root) without following a link, and checks it is one.
func openTmpfs(root, path string) (*os.File, error) {
	f, err := os.OpenFile(root+path, os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("container: open the container's %s from the host: %w", path, err)
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		f.Close()
		return nil, fmt.Errorf("container: the container's %s is not the tmpfs moat mounted (statfs type %#x, %v)", path, st.Type, err)
	}
	return f, nil
}

// checkServer checks from the host what the run server does on top of
// running as another uid than the code (checkServerCreds): it is
// undumpable (the kernel then gives the files of its /proc directory, such
// as fd and mem, to root), and it catches no signal but SIGCHLD (so, as
// its namespace's init, it would get no other from inside even from its
// own uid).
func checkServer(pid int) error {
	var st unix.Stat_t
	for _, f := range []string{"fd", "mem"} {
		if err := unix.Stat(fmt.Sprintf("/proc/%d/%s", pid, f), &st); err != nil {
			return err
		}
		if st.Uid != 0 {
			return fmt.Errorf("the server (pid %d) is dumpable: its /proc/PID/%s belongs to uid %d", pid, f, st.Uid)
		}
	}
	s, err := procStatus(pid)
	if err != nil {
		return err
	}
	caught, err := strconv.ParseUint(s["SigCgt"], 16, 64)
	if err != nil {
		return fmt.Errorf("the server's SigCgt %q: %w", s["SigCgt"], err)
	}
	if want := uint64(1) << (unix.SIGCHLD - 1); caught != want {
		return fmt.Errorf("the server catches signals %#x, not only SIGCHLD (%#x)", caught, want)
	}
	return nil
}

// read takes the server's messages until the control socket ends, which
// breaks the container: the server (its init) is gone, or spoke out of
// turn.
func (rc *runcRecycled) read() {
	buf := make([]byte, 256)
	var why error
	for {
		n, err := rc.ctl.Read(buf)
		if err != nil || n == 0 {
			why = fmt.Errorf("container: recycle: the run server ended: %v", err)
			break
		}
		msg := string(buf[:n])
		switch msg[0] {
		case 'P', 'F':
			select {
			case rc.spawn <- msg:
				continue
			default:
			}
		case 'E':
			if rc.exited(msg[1:]) {
				continue
			}
		}
		why = fmt.Errorf("container: recycle: the run server said %q out of turn", msg)
		break
	}
	rc.mu.Lock()
	if rc.broken == nil {
		rc.broken = why
	}
	rc.mu.Unlock()
	close(rc.dead)
}

// exited records the server's report "PID STATUS" of a run's python3.
func (rc *runcRecycled) exited(report string) bool {
	p, s, ok := strings.Cut(report, " ")
	cpid, err1 := strconv.Atoi(p)
	st, err2 := strconv.Atoi(s)
	if !ok || err1 != nil || err2 != nil {
		return false
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	switch {
	case rc.run != nil && rc.run.cpid == cpid && !rc.run.reported:
		rc.run.reported, rc.run.status = true, syscall.WaitStatus(st)
		close(rc.run.ended)
	case rc.next != nil && rc.next.cpid == cpid:
		// The python3 waiting for its run died (OOM, say): Start then
		// reports the container stale.
		rc.next.pid = 0
	default:
		return false
	}
	return true
}

// startNext has the server start the next run's python3 and checks it
// from the host.
func (rc *runcRecycled) startNext(ctx context.Context) (err error) {
	var mine, theirs [3]*os.File
	defer func() {
		for _, f := range theirs {
			if f != nil {
				f.Close()
			}
		}
		if err != nil {
			for _, f := range mine {
				if f != nil {
					f.Close()
				}
			}
		}
	}()
	for i := range 3 {
		r, w, err := os.Pipe()
		if err != nil {
			return fmt.Errorf("container: recycle: %w", err)
		}
		if i == 0 {
			mine[i], theirs[i] = w, r
		} else {
			mine[i], theirs[i] = r, w
		}
	}
	nr := &nextRun{stdin: mine[0], stdout: mine[1], stderr: mine[2]}
	if nr.cpuBase, err = rc.cg.cpuUsage(); err == nil {
		if nr.pidsBase, err = rc.cg.pidsRefused(); err == nil {
			nr.oomBase, err = rc.cg.oomKills()
		}
	}
	if err != nil {
		return fmt.Errorf("container: recycle: the container's counters: %w", err)
	}
	rights := unix.UnixRights(int(theirs[0].Fd()), int(theirs[1].Fd()), int(theirs[2].Fd()))
	if err := unix.Sendmsg(int(rc.ctl.Fd()), []byte("S"), rights, nil, 0); err != nil {
		return fmt.Errorf("container: recycle: ask the server for a python3: %w", err)
	}
	var msg string
	select {
	case msg = <-rc.spawn:
	case <-rc.dead:
		return rc.brokenErr()
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(recycleStartTimeout):
		return fmt.Errorf("container: recycle: the server did not start a python3 within %v", recycleStartTimeout)
	}
	if msg[0] != 'P' {
		return fmt.Errorf("container: recycle: the server could not start a python3: %s", msg[1:])
	}
	cpid, err := strconv.Atoi(msg[1:])
	if err != nil {
		return fmt.Errorf("container: recycle: the server's answer %q", msg)
	}
	pid, err := rc.hostPid(cpid)
	if err != nil {
		return err
	}
	nr.cpid, nr.pid = cpid, pid
	rc.mu.Lock()
	rc.next = nr
	rc.mu.Unlock()
	if err := rc.checkChild(ctx, pid); err != nil {
		return err
	}
	return nil
}

// hostPid finds the host pid of the container's process cpid.
func (rc *runcRecycled) hostPid(cpid int) (int, error) {
	pids, err := rc.cg.pids()
	if err != nil {
		return 0, fmt.Errorf("container: recycle: %w", err)
	}
	for _, pid := range pids {
		if pid == rc.pid {
			continue
		}
		st, err := procStatus(pid)
		if err != nil {
			continue
		}
		ns := strings.Fields(st["NSpid"])
		if len(ns) > 0 && ns[len(ns)-1] == strconv.Itoa(cpid) {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("container: recycle: the server's python3 (pid %d in the container) is not in its cgroup", cpid)
}

// checkChild waits until the new python3 (host pid) runs python3 reading
// its code, then checks it from the host as a fresh container's init is,
// and its attributes against the server's as runc made it.
func (rc *runcRecycled) checkChild(ctx context.Context, pid int) error {
	want := rc.b.spec.python + "\x00-\x00"
	deadline := time.Now().Add(recycleStartTimeout)
	for pause := 50 * time.Microsecond; ; pause = min(2*pause, 5*time.Millisecond) {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			return fmt.Errorf("container: recycle: the new python3: %w", err)
		}
		if string(b) == want {
			break
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("container: recycle: the new python3 did not start within %v (%q)", recycleStartTimeout, b)
		}
		time.Sleep(pause)
	}
	b := rc.b
	nf, err := initSeccomp(pid)
	if err == nil && nf != b.filters {
		err = fmt.Errorf("it runs under %d seccomp filters, the probe's under %d", nf, b.filters)
	}
	if err == nil {
		err = checkCreds(pid, rc.lease.UID)
	}
	if err == nil {
		err = b.spec.checkLimits(pid, rc.cgroupsPath())
	}
	if err == nil {
		var got procAttrs
		if got, err = readProcAttrs(pid); err == nil && got != rc.attrs {
			err = fmt.Errorf("its attributes %+v differ from a fresh container's %+v", got, rc.attrs)
		}
	}
	if err != nil {
		return fmt.Errorf("container: recycle: the next run's python3: %w", err)
	}
	return nil
}

// brokenErr is why the container serves no more runs.
func (rc *runcRecycled) brokenErr() error {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	if rc.broken != nil {
		return rc.broken
	}
	return errors.New("container: recycle: the container ended")
}

// Start hands the code to the python3 started for it; see
// engine.SessionInstance.
func (rc *runcRecycled) Start(ctx context.Context, code []byte, stdout, stderr io.Writer) (engine.Process, error) {
	rc.mu.Lock()
	nr, broken := rc.next, rc.broken
	if broken == nil && (nr == nil || nr.pid == 0 || rc.run != nil) {
		broken = errors.New("container: recycle: no python3 waits for the run")
	}
	if broken != nil {
		rc.mu.Unlock()
		return nil, fmt.Errorf("%w: %w", broken, engine.ErrStale)
	}
	rc.next = nil
	r := &recycledRun{rc: rc, cpid: nr.cpid, pid: nr.pid, ended: make(chan struct{}), began: time.Now(),
		outDone: make(chan struct{}), stopCPU: make(chan struct{}), cpuDone: make(chan struct{})}
	rc.run = r
	rc.mu.Unlock()
	r.cpuBase, r.pidsBase, r.oomBase = nr.cpuBase, nr.pidsBase, nr.oomBase
	r.stdout, r.stderr = nr.stdout, nr.stderr
	var wg sync.WaitGroup
	for _, s := range []struct {
		r *os.File
		w io.Writer
	}{{nr.stdout, stdout}, {nr.stderr, stderr}} {
		wg.Go(func() { io.Copy(s.w, s.r) })
	}
	go func() {
		wg.Wait()
		close(r.outDone)
	}()
	go r.watchCPU()
	go func() {
		nr.stdin.Write(code)
		nr.stdin.Close()
	}()
	return r, nil
}

// kill kills every process of the container but the server.
func (rc *runcRecycled) kill() error {
	rc.killMu.Lock()
	defer rc.killMu.Unlock()
	return rc.killLocked()
}

func (rc *runcRecycled) killLocked() error {
	// Most runs leave nothing: then the server is alone in the cgroup, and
	// nothing can fork (the run's python3 has been reaped, and a process
	// is in the cgroup before its fork returns), so there is nothing to
	// freeze.
	if pids, err := rc.cg.pids(); err == nil && len(pids) == 1 && pids[0] == rc.pid {
		return nil
	}
	err := rc.cg.killAllBut(func(pid int) bool { return pid == rc.pid })
	if err != nil {
		rc.mu.Lock()
		if rc.broken == nil {
			rc.broken = err
		}
		rc.mu.Unlock()
	}
	return err
}

// Close kills the container and removes it.
func (rc *runcRecycled) Close() error {
	rc.mu.Lock()
	if rc.broken == nil {
		rc.broken = errors.New("container: recycle: the container is closed")
	}
	nr := rc.next
	rc.next = nil
	rc.mu.Unlock()
	if nr != nil {
		for _, f := range []*os.File{nr.stdin, nr.stdout, nr.stderr} {
			f.Close()
		}
	}
	rc.Discard() // kills the init (in.pid), so the whole namespace, and runc ends
	if rc.ctl != nil {
		rc.ctl.Close()
	}
	if rc.pidfd >= 0 {
		unix.Close(rc.pidfd)
		rc.pidfd = -1
	}
	for _, f := range rc.mounts {
		f.Close()
	}
	rc.mounts = nil
	return nil
}

// The file operations of a session: a recycled container is never one.
var errNotSession = fmt.Errorf("container: a recycled container has no files of a session: %w", moat.ErrInvalid)

func (rc *runcRecycled) WriteFile(context.Context, string, io.Reader) error { return errNotSession }
func (rc *runcRecycled) ReadFile(context.Context, string) (io.ReadCloser, error) {
	return nil, errNotSession
}
func (rc *runcRecycled) ListFiles(context.Context) ([]moat.FileInfo, error) {
	return nil, errNotSession
}
func (rc *runcRecycled) Stat(context.Context, string) (moat.FileInfo, error) {
	return moat.FileInfo{}, errNotSession
}
func (rc *runcRecycled) Mkdir(context.Context, string) error          { return errNotSession }
func (rc *runcRecycled) Rename(context.Context, string, string) error { return errNotSession }
func (rc *runcRecycled) RemoveFile(context.Context, string) error     { return errNotSession }

// recycledRun is one run in a recycled container.
type recycledRun struct {
	rc        *runcRecycled
	cpid, pid int
	began     time.Time

	cpuBase                   time.Duration
	pidsBase, oomBase         int64
	stdout, stderr            *os.File
	outDone, stopCPU, cpuDone chan struct{}
	cpuHit                    atomic.Bool

	// Set under rc.mu by the server's report.
	ended    chan struct{}
	reported bool
	status   syscall.WaitStatus

	killed atomic.Bool
}

// watchCPU kills the run once the container's CPU usage since it began
// reaches the CPU time limit (RLIMIT_CPU bounds each process only).
func (r *recycledRun) watchCPU() {
	defer close(r.cpuDone)
	limit := time.Duration(r.rc.b.spec.limits.CPUTime)
	t := time.NewTicker(pollEvery)
	defer t.Stop()
	for {
		select {
		case <-r.stopCPU:
			return
		case <-t.C:
		}
		if used, err := r.rc.cg.cpuUsage(); err == nil && limit > 0 && used-r.cpuBase >= limit {
			r.cpuHit.Store(true)
			r.Kill()
			return
		}
	}
}

// Kill kills every process of the run; see engine.Process.
func (r *recycledRun) Kill() {
	if r.killed.Swap(true) {
		return
	}
	rc := r.rc
	// Under killMu, and only while r is the container's run: once Wait
	// has returned, the processes of the cgroup are the next run's.
	rc.killMu.Lock()
	defer rc.killMu.Unlock()
	rc.mu.Lock()
	current := rc.run == r
	rc.mu.Unlock()
	if current {
		rc.killLocked()
	}
}

// Wait waits for the server's report of the run's python3, kills what is
// left of the run, and gathers the evidence from the host; see
// engine.Process. A server that ended meanwhile fails the run (the
// container serves no more).
func (r *recycledRun) Wait() (engine.Evidence, error) {
	rc := r.rc
	var err error
	select {
	case <-r.ended:
	case <-rc.dead:
		err = rc.brokenErr()
	}
	if kerr := rc.kill(); kerr != nil && err == nil {
		err = kerr
	}
	select {
	case <-r.outDone:
	case <-time.After(outputGrace):
		r.stdout.Close()
		r.stderr.Close()
		<-r.outDone
	}
	r.stdout.Close()
	r.stderr.Close()
	close(r.stopCPU)
	<-r.cpuDone
	rc.mu.Lock()
	if rc.run == r {
		rc.run = nil
	}
	status := r.status
	rc.mu.Unlock()
	if err != nil {
		// The server died: with the OOM killer's count up, the memory
		// limit was hit (the run got no status of its python3, and the
		// container serves no more runs); else the run failed.
		if oom, oerr := rc.cg.oomKills(); oerr == nil && oom > r.oomBase {
			return engine.Evidence{Memory: true}, nil
		}
		return engine.Evidence{}, err
	}
	used, err1 := rc.cg.cpuUsage()
	oom, err2 := rc.cg.oomKills()
	refused, err3 := rc.cg.pidsRefused()
	if err := errors.Join(err1, err2, err3); err != nil {
		return engine.Evidence{}, unavailable("the recycled container's counters cannot be read", "", err)
	}
	limit := time.Duration(rc.b.spec.limits.CPUTime)
	return engine.Evidence{
		Exited:   !r.killed.Load() || !status.Signaled() || status.Signal() != syscall.SIGKILL,
		Status:   status,
		CPUTime:  r.cpuHit.Load() || engine.XCPUAtLimit(status, used-r.cpuBase, limit, engine.XCPUSlack),
		Memory:   oom > r.oomBase,
		Pids:     refused > r.pidsBase,
		FileSize: filesAtLimit(rc.mounts, int64(rc.b.spec.limits.FileSize), r.began),
		Disk:     mountsFull(rc.mounts),
	}, nil
}

// Reset makes the container as a fresh one for its tenant's next run; see
// engine.Recycler and the top of this file.
func (b *runcBackend) Reset(ctx context.Context, inst engine.SessionInstance) error {
	rc, ok := inst.(*runcRecycled)
	if !ok {
		return fmt.Errorf("container: recycle: not a recycled container of this driver: %w", moat.ErrInvalid)
	}
	if rc.isBroken() {
		return rc.brokenErr()
	}
	if err := rc.kill(); err != nil {
		return err
	}
	if n, err := unixSockets(rc.pid); err != nil || n != 0 {
		return fmt.Errorf("container: recycle: %d unix sockets outlived the run (held in flight by no process): the container is not reused (%v)", n, err)
	}
	if err := ipcClear(rc.pid, rc.bundle); err != nil {
		return fmt.Errorf("container: recycle: %w", err)
	}
	for i, m := range b.spec.mounts {
		if err := wipeTmpfs(rc.mounts[i], m, rc.lease.UID); err != nil {
			return fmt.Errorf("container: recycle: %s: %w", m.path, err)
		}
	}
	if got, err := readProcAttrs(rc.pid); err != nil || got != rc.attrs {
		return fmt.Errorf("container: recycle: the run server's attributes changed (%+v, was %+v; %v)", got, rc.attrs, err)
	}
	if err := checkServer(rc.pid); err != nil {
		return fmt.Errorf("container: recycle: %w", err)
	}
	// The server's own CPU time counts against its RLIMIT_CPU (the run's
	// limit) over all the runs it serves: it goes before it gets near.
	if used, err := procCPU(rc.pid); err != nil || used > time.Duration(b.spec.limits.CPUTime)/2 {
		return fmt.Errorf("container: recycle: the run server has used %v of CPU time (%v)", used, err)
	}
	return rc.startNext(ctx)
}

func (rc *runcRecycled) isBroken() bool {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return rc.broken != nil
}

// procCPU is the CPU time process pid has used (utime and stime of
// /proc/PID/stat, in clock ticks of 1/100 s).
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[i+1:]))
	if i < 0 || len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %q", pid, b)
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, err
	}
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}

// unixSockets counts the unix sockets of the network namespace of pid.
func unixSockets(pid int) (int, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/unix", pid))
	if err != nil {
		return 0, err
	}
	return max(strings.Count(string(b), "\n")-1, 0), nil
}
