package container

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// What a recycled container's reset (runc_recycle.go) does from the host.

// procAttrs are the attributes of a process that another process of its
// uid may change (prlimit, setpriority, sched_setscheduler,
// sched_setaffinity, set_mempolicy is its own only, ioprio_set) and that
// its children inherit.
type procAttrs struct {
	limits                      string // /proc/PID/limits
	priority, nice, rtPrio, pol string // /proc/PID/stat
	cpus, mems                  string // /proc/PID/status
	ioprio                      int
	timerslack                  string
}

// readProcAttrs reads pid's procAttrs from the host.
func readProcAttrs(pid int) (procAttrs, error) {
	var a procAttrs
	dir := fmt.Sprintf("/proc/%d/", pid)
	b, err := os.ReadFile(dir + "limits")
	if err != nil {
		return a, err
	}
	a.limits = string(b)
	if b, err = os.ReadFile(dir + "stat"); err != nil {
		return a, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return a, fmt.Errorf("%sstat: no comm", dir)
	}
	// Fields from the third (state) on: priority is the 18th, nice the
	// 19th, rt_priority the 40th, policy the 41st.
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 39 {
		return a, fmt.Errorf("%sstat: %d fields", dir, len(f)+2)
	}
	a.priority, a.nice, a.rtPrio, a.pol = f[15], f[16], f[37], f[38]
	st, err := procStatus(pid)
	if err != nil {
		return a, err
	}
	a.cpus, a.mems = st["Cpus_allowed_list"], st["Mems_allowed_list"]
	if b, err = os.ReadFile(dir + "timerslack_ns"); err != nil {
		return a, err
	}
	a.timerslack = strings.TrimSpace(string(b))
	const ioprioWhoProcess = 1
	r, _, e := unix.Syscall(unix.SYS_IOPRIO_GET, ioprioWhoProcess, uintptr(pid), 0)
	if e != 0 {
		return a, fmt.Errorf("ioprio_get %d: %w", pid, e)
	}
	a.ioprio = int(r)
	return a, nil
}

// wipeTmpfs empties the tmpfs m of a recycled container, opened as dir
// when the container was made, and restores its top as mounted for uid:
// mode, owner, no extended attribute, times now. It follows no link
// (os.Root) and fails unless the mount is empty afterwards.
func wipeTmpfs(dir *os.File, m tmpfs, uid int) error {
	root, err := os.OpenRoot(fmt.Sprintf("/proc/self/fd/%d", dir.Fd()))
	if err != nil {
		return err
	}
	defer root.Close()
	list := func() ([]string, error) {
		d, err := root.Open(".")
		if err != nil {
			return nil, err
		}
		defer d.Close()
		return d.Readdirnames(-1)
	}
	names, err := list()
	if err != nil {
		return err
	}
	for _, n := range names {
		if err := root.RemoveAll(n); err != nil {
			return err
		}
	}
	if names, err = list(); err != nil || len(names) > 0 {
		return fmt.Errorf("not empty after the wipe (%d left, %v)", len(names), err)
	}
	fd := int(dir.Fd())
	mode, err := strconv.ParseUint(m.mode, 8, 32)
	if err != nil {
		return err
	}
	buf := make([]byte, 64<<10)
	n, err := unix.Flistxattr(fd, buf)
	if err != nil {
		return fmt.Errorf("list its extended attributes: %w", err)
	}
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if name == "" {
			continue
		}
		if err := unix.Fremovexattr(fd, name); err != nil {
			return fmt.Errorf("remove its extended attribute %q: %w", name, err)
		}
	}
	if n, err := unix.Flistxattr(fd, buf); err != nil || n != 0 {
		return fmt.Errorf("extended attributes left (%d bytes, %v)", n, err)
	}
	if err := errors.Join(unix.Fchown(fd, uid, uid), unix.Fchmod(fd, uint32(mode)), unix.Futimes(fd, nil)); err != nil {
		return fmt.Errorf("restore its top: %w", err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&0o7777 != uint32(mode) || int(st.Uid) != uid || int(st.Gid) != uid {
		return fmt.Errorf("its top is not restored (mode %o, owner %d:%d, %v)", st.Mode&0o7777, st.Uid, st.Gid, err)
	}
	return nil
}

// ipcClear removes every SysV IPC object and POSIX message queue of the
// IPC namespace of process pid, which outlive their processes: from a
// thread of moat's that joins the namespace for that and then goes back
// to its own. The thread stays locked to its goroutine until it is back;
// if it cannot go back it is never unlocked, and the runtime ends it with
// the goroutine. (A thread that ends takes with it the children started
// from it with a parent death signal, runc's unshare among them: hence
// the way back.) The message queues are listed through an mqueue file
// system of that namespace mounted for a moment in a fresh subdirectory
// of mqDir.
func ipcClear(pid int, mqDir string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		back, err := unix.Open("/proc/thread-self/ns/ipc", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("moat's IPC namespace: %w", err)
			return
		}
		defer unix.Close(back)
		err = ipcClearHere(pid, mqDir)
		if unix.Setns(back, unix.CLONE_NEWIPC) == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	return <-errc
}

func ipcClearHere(pid int, mqDir string) error {
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/ipc", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("the container's IPC namespace: %w", err)
	}
	err = unix.Setns(fd, unix.CLONE_NEWIPC)
	unix.Close(fd)
	if err != nil {
		return fmt.Errorf("join the container's IPC namespace: %w", err)
	}
	rm := map[string]func(id int) error{
		"shm": func(id int) error { _, err := unix.SysvShmCtl(id, unix.IPC_RMID, nil); return err },
		"sem": func(id int) error {
			_, _, e := unix.Syscall6(unix.SYS_SEMCTL, uintptr(id), 0, unix.IPC_RMID, 0, 0, 0)
			return errnoErr(e)
		},
		"msg": func(id int) error {
			_, _, e := unix.Syscall(unix.SYS_MSGCTL, uintptr(id), unix.IPC_RMID, 0)
			return errnoErr(e)
		},
	}
	for kind, remove := range rm {
		ids, err := sysvIDs(kind)
		if err != nil {
			return err
		}
		for _, id := range ids {
			if err := remove(id); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EIDRM) {
				return fmt.Errorf("remove SysV %s %d: %w", kind, id, err)
			}
		}
		if ids, err := sysvIDs(kind); err != nil || len(ids) > 0 {
			return fmt.Errorf("SysV %s objects left: %v (%v)", kind, ids, err)
		}
	}
	dir, err := os.MkdirTemp(mqDir, "mq-")
	if err != nil {
		return err
	}
	defer os.Remove(dir)
	if err := unix.Mount("mqueue", dir, "mqueue", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount the container's message queues: %w", err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
			return fmt.Errorf("remove a message queue: %w", err)
		}
	}
	if ents, err := os.ReadDir(dir); err != nil || len(ents) > 0 {
		return fmt.Errorf("message queues left: %d (%v)", len(ents), err)
	}
	return nil
}

func errnoErr(e unix.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

// sysvIDs lists the ids of the SysV objects of kind ("shm", "sem", "msg")
// in the calling thread's IPC namespace.
func sysvIDs(kind string) ([]int, error) {
	b, err := os.ReadFile("/proc/sysvipc/" + kind)
	if err != nil {
		return nil, err
	}
	var ids []int
	for i, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if i == 0 || len(f) < 2 {
			continue
		}
		id, err := strconv.Atoi(f[1])
		if err != nil {
			return nil, fmt.Errorf("/proc/sysvipc/%s: %q", kind, line)
		}
		ids = append(ids, id)
	}
	return ids, nil
}
