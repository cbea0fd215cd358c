package container

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// A watch observes one running container from the host, where the code
// cannot tamper with what is seen:
//
//   - the pids cgroup's "max" event counter (pids.events), which the kernel
//     raises when it refuses a fork. On cgroup v1 it counts only in the
//     container's own cgroup and the kernel sends no change notification for
//     it, and Docker removes the cgroup soon after the container ends; so the
//     watch reads it on every tick and once more the moment the container's
//     init exits (a pidfd tells), before Docker's clean-up can remove it;
//   - the cgroup's CPU usage (cpuacct.usage, or usage_usec in cpu.stat),
//     read every pollEvery, against the CPU time limit of the whole tree
//     (RLIMIT_CPU only bounds each process);
//   - the run's tmpfs mounts, opened through /proc/PID/root while the
//     container runs: the open directories keep each mount alive after the
//     container is gone, so that moat can see, after the run, whether one is
//     full (disk) and whether a file reached the file size limit (filesize,
//     which Python gets as EFBIG: it ignores SIGXFSZ).
//
// Memory is judged from Docker's record of the OOM killer (OOMKilled).
type watch struct {
	mounts []*os.File // the tmpfs roots; closed by close

	pidfd      int // the container's init, readable once it exited
	pidsEvents *os.File
	cpuFile    string
	cpuV2      bool
	cpuLimit   time.Duration
	onCPU      func() // called once when the CPU limit is passed

	pidsHit atomic.Bool
	cpuHit  atomic.Bool
	// cpuLast is the last CPU usage read, in ns: at every poll and once
	// more when the init exits, while its cgroup is still there.
	cpuLast atomic.Int64

	stopR, stopW *os.File
	done         chan struct{}
	closeOnce    sync.Once
}

// pollEvery is how often the watch reads the CPU usage.
const pollEvery = 50 * time.Millisecond

// startWatch opens what the watch needs of the container whose init is
// pid and starts polling. Paths are the tmpfs mount points inside the
// container. A missing piece is an error: the run must not go on unwatched.
func startWatch(id string, pid int, paths []string, cpuLimit time.Duration, onCPU func()) (*watch, error) {
	w := &watch{pidfd: -1, cpuLimit: cpuLimit, onCPU: onCPU, done: make(chan struct{})}
	fail := func(err error) (*watch, error) {
		w.close()
		return nil, err
	}
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return fail(fmt.Errorf("container: pidfd of the run's init: %w", err))
	}
	w.pidfd = pidfd
	root := fmt.Sprintf("/proc/%d/root", pid)
	for _, p := range paths {
		f, err := os.OpenFile(filepath.Join(root, p), os.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return fail(fmt.Errorf("container: open the run's %s from the host: %w", p, err))
		}
		w.mounts = append(w.mounts, f)
		var st unix.Statfs_t
		if err := unix.Fstatfs(int(f.Fd()), &st); err != nil || st.Type != unix.TMPFS_MAGIC {
			return fail(fmt.Errorf("container: the run's %s is not the tmpfs moat mounted (statfs type %#x, %v)", p, st.Type, err))
		}
	}
	cg, err := cgroupPaths(pid)
	if err != nil {
		return fail(err)
	}
	// The pidfd is open: pid cannot be reused from here on. Make sure it
	// was the container's to begin with.
	if !strings.Contains(cg.pidsEvents, id) {
		return fail(fmt.Errorf("container: pid %d is not in the container's cgroup (%s)", pid, cg.pidsEvents))
	}
	if w.pidsEvents, err = os.Open(cg.pidsEvents); err != nil {
		return fail(fmt.Errorf("container: open the run's pids events: %w", err))
	}
	w.cpuFile, w.cpuV2 = cg.cpu, cg.v2
	if _, err := w.cpuUsage(); err != nil {
		return fail(fmt.Errorf("container: read the run's CPU usage: %w", err))
	}
	if w.stopR, w.stopW, err = os.Pipe(); err != nil {
		return fail(fmt.Errorf("container: %w", err))
	}
	w.readPids()
	go w.loop()
	return w, nil
}

func (w *watch) loop() {
	defer close(w.done)
	fds := []unix.PollFd{
		{Fd: int32(w.pidfd), Events: unix.POLLIN},
		{Fd: int32(w.stopR.Fd()), Events: unix.POLLIN},
	}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		_, err := unix.Poll(fds, int(pollEvery/time.Millisecond))
		if err != nil && !errors.Is(err, unix.EINTR) {
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		// Read on every tick, and once more the moment the init exits: the
		// cgroup lives on until Docker's clean-up removes it, milliseconds
		// later, so the last count is read before it goes.
		used, err := w.cpuUsage()
		if err == nil {
			w.cpuLast.Store(int64(used))
		}
		if !w.readPids() || fds[0].Revents != 0 {
			return
		}
		if w.cpuLimit > 0 && !w.cpuHit.Load() && err == nil && used >= w.cpuLimit {
			w.cpuHit.Store(true)
			w.onCPU()
		}
	}
}

// readPids reads pids.events ("max N") and records a refused fork. It
// reports whether the file could be read.
func (w *watch) readPids() bool {
	buf := make([]byte, 128)
	n, err := w.pidsEvents.ReadAt(buf, 0)
	if n == 0 && err != nil {
		return false
	}
	for _, line := range strings.Split(string(buf[:n]), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == "max" {
			if c, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64); err == nil && c > 0 {
				w.pidsHit.Store(true)
			}
		}
	}
	return true
}

func (w *watch) cpuUsage() (time.Duration, error) {
	return cgroupFiles{cpu: w.cpuFile, v2: w.cpuV2}.cpuUsage()
}

// lastCPU is the run's CPU usage as last read, up to pollEvery before its
// init ended.
func (w *watch) lastCPU() time.Duration { return time.Duration(w.cpuLast.Load()) }

// stop ends the polling; the mounts stay open for the verdicts.
func (w *watch) stop() {
	w.closeOnce.Do(func() {
		if w.stopW != nil {
			w.stopW.Write([]byte{1})
			<-w.done
		}
	})
}

// close stops the watch and releases everything it holds.
func (w *watch) close() {
	w.stop()
	if w.pidfd >= 0 {
		unix.Close(w.pidfd)
		w.pidfd = -1
	}
	for _, f := range []*os.File{w.pidsEvents, w.stopR, w.stopW} {
		if f != nil {
			f.Close()
		}
	}
	for _, f := range w.mounts {
		f.Close()
	}
	w.mounts = nil
}

// ctime is the inode change time of info, or the zero time.
func ctime(info fs.FileInfo) time.Time {
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		return time.Unix(st.Ctim.Sec, st.Ctim.Nsec)
	}
	return time.Time{}
}

// diskFull reports whether one of the run's tmpfs mounts has no block or no
// inode left.
func (w *watch) diskFull() bool { return mountsFull(w.mounts) }

func mountsFull(mounts []*os.File) bool {
	for _, f := range mounts {
		var st unix.Statfs_t
		if unix.Fstatfs(int(f.Fd()), &st) == nil && (st.Bfree == 0 || st.Ffree == 0) {
			return true
		}
	}
	return false
}

// fileAtLimit reports whether a file in the run's mounts reached limit
// bytes; with a non-zero since, only a file changed since then (its ctime,
// which the code cannot set back, is not before it) counts.
func (w *watch) fileAtLimit(limit int64, since time.Time) bool {
	return filesAtLimit(w.mounts, limit, since)
}

func filesAtLimit(mounts []*os.File, limit int64, since time.Time) bool {
	for _, f := range mounts {
		found := false
		// The trailing slash makes WalkDir follow the magic link.
		root := fmt.Sprintf("/proc/self/fd/%d/", f.Fd())
		filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
			if err != nil || found {
				return filepath.SkipDir
			}
			if d.Type().IsRegular() {
				if info, err := d.Info(); err == nil && info.Size() >= limit && (since.IsZero() || !ctime(info).Before(since)) {
					found = true
					return filepath.SkipAll
				}
			}
			return nil
		})
		if found {
			return true
		}
	}
	return false
}

// cgroupFiles are the files of a process's cgroups that the watch and
// sessions read.
type cgroupFiles struct {
	pidsEvents string
	cpu        string
	v2         bool
	// oom holds the OOM killer's "oom_kill N" count (memory.oom_control on
	// v1, memory.events on v2).
	oom string
	// procs lists the cgroup's processes (in the pids hierarchy on v1).
	procs string
	// freezer is the cgroup's directory in the freezer hierarchy on v1,
	// the cgroup's own directory on v2 ("" when there is no freezer).
	freezer string
}

// cgroupPaths finds the pids, CPU, memory and freezer files of pid's
// cgroups, on cgroup v1 (pids.events, cpuacct.usage, memory.oom_control,
// freezer.state) or v2 (pids.events, cpu.stat, memory.events,
// cgroup.freeze).
func cgroupPaths(pid int) (cgroupFiles, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return cgroupFiles{}, fmt.Errorf("container: the run's cgroups: %w", err)
	}
	mounts, err := cgroupMounts()
	if err != nil {
		return cgroupFiles{}, err
	}
	var pidsDir, cpuDir, memDir, freezerDir, v2Dir string
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		if parts[0] == "0" && parts[1] == "" {
			if m, ok := mounts[""]; ok {
				v2Dir = filepath.Join(m, parts[2])
			}
			continue
		}
		for _, c := range strings.Split(parts[1], ",") {
			if m, ok := mounts[c]; ok {
				switch c {
				case "pids":
					pidsDir = filepath.Join(m, parts[2])
				case "cpuacct":
					cpuDir = filepath.Join(m, parts[2])
				case "memory":
					memDir = filepath.Join(m, parts[2])
				case "freezer":
					freezerDir = filepath.Join(m, parts[2])
				}
			}
		}
	}
	if pidsDir != "" && cpuDir != "" {
		f := cgroupFiles{pidsEvents: filepath.Join(pidsDir, "pids.events"), cpu: filepath.Join(cpuDir, "cpuacct.usage"),
			procs: filepath.Join(pidsDir, "cgroup.procs"), freezer: freezerDir}
		if memDir != "" {
			f.oom = filepath.Join(memDir, "memory.oom_control")
		}
		return f, nil
	}
	if v2Dir != "" {
		if _, err := os.Stat(filepath.Join(v2Dir, "pids.events")); err == nil {
			f := cgroupFiles{pidsEvents: filepath.Join(v2Dir, "pids.events"), cpu: filepath.Join(v2Dir, "cpu.stat"), v2: true,
				oom: filepath.Join(v2Dir, "memory.events"), procs: filepath.Join(v2Dir, "cgroup.procs")}
			if _, err := os.Stat(filepath.Join(v2Dir, "cgroup.freeze")); err == nil {
				f.freezer = v2Dir
			}
			return f, nil
		}
	}
	return cgroupFiles{}, fmt.Errorf("container: no pids and CPU accounting cgroups for the run (pid %d)", pid)
}

// cpuUsage reads the cgroup's CPU usage.
func (c cgroupFiles) cpuUsage() (time.Duration, error) {
	b, err := os.ReadFile(c.cpu)
	if err != nil {
		return 0, err
	}
	if !c.v2 {
		ns, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		return time.Duration(ns), err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "usage_usec "); ok {
			us, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return time.Duration(us) * time.Microsecond, err
		}
	}
	return 0, errors.New("no usage_usec in cpu.stat")
}

// counter reads the value of key in a flat keyed file ("key N" lines).
func counter(path, key string) (int64, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, " "); ok && k == key {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, fmt.Errorf("no %s in %s", key, path)
}

// pidsRefused is the number of forks the pids controller refused.
func (c cgroupFiles) pidsRefused() (int64, error) { return counter(c.pidsEvents, "max") }

// oomKills is the number of processes the OOM killer killed in the cgroup.
func (c cgroupFiles) oomKills() (int64, error) {
	if c.oom == "" {
		return 0, errors.New("no memory cgroup")
	}
	return counter(c.oom, "oom_kill")
}

// pids lists the processes of the cgroup and, on v2, of the cgroups
// under it: there a cgroup.procs lists only its own cgroup's, and a
// session's live interpreter, with all it forks, lives in a child cgroup
// of the container's (interpFreezer). On v1 the children are made only in
// the freezer hierarchy, and procs is the pids hierarchy's, which holds
// them all.
func (c cgroupFiles) pids() ([]int, error) {
	files := []string{c.procs}
	if c.v2 {
		files = nil
		top := filepath.Dir(c.procs)
		err := filepath.WalkDir(top, func(p string, d fs.DirEntry, err error) error {
			if err != nil && (p == top || !errors.Is(err, fs.ErrNotExist)) {
				return err
			}
			if err != nil {
				return nil // a child cgroup removed meanwhile
			}
			if d.IsDir() {
				files = append(files, filepath.Join(p, "cgroup.procs"))
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	var pids []int
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil && (file == c.procs || !errors.Is(err, fs.ErrNotExist)) {
			return nil, err
		}
		for _, f := range strings.Fields(string(b)) {
			if pid, err := strconv.Atoi(f); err == nil {
				pids = append(pids, pid)
			}
		}
	}
	return pids, nil
}

// killAllBut kills every process of the cgroup for which spare is false
// and returns once they have left it: with the cgroup frozen, so that
// nothing forks or exits meanwhile (no pid can be reused while it is
// listed), each such pid of cgroup.procs gets SIGKILL; then the cgroup is
// thawed and the dead leave it. It repeats until only spared processes
// are left, and fails if it cannot get there within 5 seconds. Callers
// serialize their calls on one cgroup: a thaw of one would undo the
// freeze of another.
func (c cgroupFiles) killAllBut(spare func(pid int) bool) error {
	deadline := time.Now().Add(5 * time.Second)
	for {
		if err := c.setFrozen(true); err != nil {
			c.setFrozen(false)
			return err
		}
		pids, err := c.pids()
		n := 0
		for _, pid := range pids {
			if !spare(pid) {
				unix.Kill(pid, unix.SIGKILL)
				n++
			}
		}
		if terr := c.setFrozen(false); terr != nil && err == nil {
			err = terr
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		// The killed leave the cgroup once thawed and dead.
		for wait := 50 * time.Microsecond; ; wait = min(2*wait, 5*time.Millisecond) {
			pids, err := c.pids()
			if err != nil {
				return err
			}
			left := slices.DeleteFunc(pids, spare)
			if len(left) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(wait)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("container: processes of the container survive their SIGKILL")
		}
	}
}

// freezeTimeout bounds how long freezing or thawing the cgroup may take.
const freezeTimeout = 2 * time.Second

// setFrozen freezes or thaws every process of the cgroup and returns once
// the kernel reports it done. A frozen process does not run, whatever it
// arranged: a SIGCONT does not wake it.
func (c cgroupFiles) setFrozen(frozen bool) error { return c.setFrozenAs(frozen, false) }

// setFrozenAs is setFrozen; with self, a thaw waits only for the cgroup's
// own state, not its effective one, which stays frozen while a parent is
// (as within a paused container).
func (c cgroupFiles) setFrozenAs(frozen, self bool) error {
	if c.freezer == "" {
		return errors.New("container: the container's cgroup has no freezer")
	}
	file, value, want := "freezer.state", "THAWED", "THAWED"
	if frozen {
		value, want = "FROZEN", "FROZEN"
	}
	if c.v2 {
		file, value = "cgroup.freeze", "0"
		if frozen {
			value = "1"
		}
	}
	write := func(v string) error {
		if err := os.WriteFile(filepath.Join(c.freezer, file), []byte(v), 0); err != nil {
			return fmt.Errorf("container: freezer: %w", err)
		}
		return nil
	}
	if err := write(value); err != nil {
		return err
	}
	deadline := time.Now().Add(freezeTimeout)
	pause := 20 * time.Microsecond
	for try := 1; ; try++ {
		var done bool
		if self && !frozen {
			// The own state: v1 freezer.self_freezing, v2 cgroup.freeze.
			f := "freezer.self_freezing"
			if c.v2 {
				f = "cgroup.freeze"
			}
			b, err := os.ReadFile(filepath.Join(c.freezer, f))
			if err != nil {
				return fmt.Errorf("container: freezer: %w", err)
			}
			done = strings.TrimSpace(string(b)) == "0"
		} else if c.v2 {
			n, err := counter(filepath.Join(c.freezer, "cgroup.events"), "frozen")
			if err != nil {
				return fmt.Errorf("container: freezer: %w", err)
			}
			done = (n == 1) == frozen
		} else {
			b, err := os.ReadFile(filepath.Join(c.freezer, "freezer.state"))
			if err != nil {
				return fmt.Errorf("container: freezer: %w", err)
			}
			done = strings.TrimSpace(string(b)) == want
		}
		if done {
			return nil
		}
		if time.Now().After(deadline) {
			if frozen {
				// Not left freezing: a cgroup stuck so blocks its tasks
				// half-way. The caller fails closed.
				write(map[bool]string{false: "THAWED", true: "0"}[c.v2])
			}
			return fmt.Errorf("container: the container's cgroup did not reach %s within %v", value, freezeTimeout)
		}
		time.Sleep(pause)
		pause = min(2*pause, 5*time.Millisecond)
		if frozen && !c.v2 {
			// A v1 freezer can stay FREEZING while tasks appear in the
			// cgroup (a fork, a task moved in); as runc does, ask again,
			// and now and then thaw for a moment and start over.
			if try%20 == 0 {
				write("THAWED")
				time.Sleep(10 * time.Millisecond)
			}
			if err := write(value); err != nil {
				return err
			}
		}
	}
}

var (
	cgMountsOnce sync.Once
	cgMounts     map[string]string
	cgMountsErr  error
)

// cgroupMounts maps each v1 controller to its mount point, and "" to the
// cgroup v2 mount point, from this process's mountinfo; read once.
func cgroupMounts() (map[string]string, error) {
	cgMountsOnce.Do(func() { cgMounts, cgMountsErr = readCgroupMounts() })
	return cgMounts, cgMountsErr
}

// findInit returns the host pid of the init of container id, found in the
// cgroup where Docker's cgroupfs driver (/docker/ID) or systemd driver
// (/system.slice/docker-ID.scope) puts it, or 0. It saves the engine a
// round trip at the start of every run.
func findInit(id string) int {
	m, err := cgroupMounts()
	if err != nil {
		return 0
	}
	for _, root := range []string{m["pids"], m[""]} {
		if root == "" {
			continue
		}
		for _, dir := range []string{filepath.Join(root, "docker", id), filepath.Join(root, "system.slice", "docker-"+id+".scope")} {
			b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			if err != nil {
				continue
			}
			for _, f := range strings.Fields(string(b)) {
				if pid, err := strconv.Atoi(f); err == nil && isNamespaceInit(pid) {
					return pid
				}
			}
		}
	}
	return 0
}

// isNamespaceInit reports whether pid is PID 1 of its innermost PID
// namespace.
func isNamespaceInit(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			return len(f) > 1 && f[len(f)-1] == "1"
		}
	}
	return false
}

func readCgroupMounts() (map[string]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("container: %w", err)
	}
	m := map[string]string{}
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 {
			continue
		}
		switch qf[0] {
		case "cgroup2":
			if _, seen := m[""]; !seen {
				m[""] = pf[4]
			}
		case "cgroup":
			for _, o := range strings.Split(qf[2], ",") {
				if _, seen := m[o]; !seen {
					m[o] = pf[4]
				}
			}
		}
	}
	return m, nil
}

// exited reports whether the container's init has exited, as its pidfd
// tells without waiting.
func (w *watch) exited() bool {
	fds := []unix.PollFd{{Fd: int32(w.pidfd), Events: unix.POLLIN}}
	for {
		n, err := unix.Poll(fds, 0)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		return err != nil || (n > 0 && fds[0].Revents != 0)
	}
}
