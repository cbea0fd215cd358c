package gvisor

import (
	"bytes"
	"context"
	"errors"
	"fmt"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/engine"
)

// Recycling (Config.Recycle). A tenant's recycled sandbox is a plain
// session's (session.go): each run a python3 in a PID and an IPC
// namespace of its own, so that when the run's init ends, gVisor's kernel
// has ended every process of the run and its SysV IPC objects are gone.
// What a run leaves behind is then in the three writable places, the
// tmpfs mounts /work, /tmp and /dev/shm of the sandbox's own kernel (the
// root is read-only), or held by no process in flight (see below); Reset
// empties the places with wipeCode, run as a run is (the session's uid,
// the guest seccomp filter, a namespace of its own), and restores their
// modes, times and extended attributes. Unlike a
// session's, a recycled sandbox is not paused between runs: nothing of the
// code's is left to hold still, and a run then costs no runsc resume and
// pause.
//
// What could make the wipe look done while it is not: the files the code
// left, and only them (none of its processes is left). The wipe's python3
// (-s: no user site) starts with the working directory on sys.path, and
// Python loads some modules only when they are needed: Python 3.13 and
// later import traceback to print an uncaught exception, which a module
// the code planted in /work would then be. So wipeCode, before anything
// else, empties sys.path and leaves for / (read-only): from then on only
// modules built into python3 or already loaded can be imported, none of
// them the code's. It imports nothing itself (os and sys are loaded as
// python3 starts), lets no exception escape (any error is os._exit(3), so
// nothing is printed through Python), never follows a link (lstat,
// scandir without following), walks with a list instead of recursion (a
// deep tree cannot exhaust the stack; one deeper than PATH_MAX fails the
// wipe, and the instance is closed), and exits 0 only when it has found
// the three places empty afterwards. Its exit status is the launcher's
// report of waitpid, outside the run's namespace; and it must have written
// "wiped" too, so that a python3 that never ran the wipe is not taken for
// one that did.
//
// What else a run can leave that a fresh sandbox would not have, and what
// the wipe does about it:
//   - marks on the three places themselves, which emptying them keeps:
//     their extended attributes are removed and their times set to now,
//     their modes restored;
//   - objects that no process holds but that are not gone either: a unix
//     socket passed (SCM_RIGHTS) into its own queue, with whatever was
//     passed with it (a listening socket, a memfd, a pipe), stays in
//     flight for ever, since gVisor's kernel collects no such cycle: its
//     memory stays charged to the sandbox and its address taken, for the
//     next runs. Every such cycle holds a unix socket, and between runs
//     the sandbox has none (its init, the launcher and the wipe hold
//     none), so a wipe that finds one listed in /proc/net/unix exits 4:
//     the instance is closed, and the tenant's next run gets a fresh one.

// wipeCode empties the writable places. It must import nothing, and
// nothing it does may import a module by its path: see above.
const wipeCode = `
import os, sys
sys.path[:] = []
os.chdir('/')
places = (('/work', 0o700), ('/tmp', 0o1777), ('/dev/shm', 0o1777))
def wipe(top, mode):
    os.chmod(top, 0o700)
    stack, dirs = [top], []
    while stack:
        d = stack.pop()
        if d != top:
            os.chmod(d, 0o700)
            dirs.append(d)
        with os.scandir(d) as it:
            for e in it:
                p = os.path.join(d, e.name)
                if e.is_dir(follow_symlinks=False):
                    stack.append(p)
                else:
                    os.unlink(p)
    for d in reversed(dirs):
        os.rmdir(d)
    for name in os.listxattr(top):
        os.removexattr(top, name)
    os.utime(top)
    os.chmod(top, mode)
def unix_sockets():
    fd = os.open('/proc/net/unix', os.O_RDONLY)
    data = b''
    while True:
        b = os.read(fd, 65536)
        if not b:
            break
        data += b
    os.close(fd)
    return data.count(b'\n') - 1
try:
    for top, mode in places:
        wipe(top, mode)
    for top, mode in places:
        if os.listdir(top) or os.lstat(top).st_mode & 0o7777 != mode or os.listxattr(top):
            os._exit(3)
    if unix_sockets() != 0:
        os._exit(4)
    os.write(1, b'wiped')
except BaseException as e:
    try:
        os.write(2, repr(e).encode('ascii', 'replace')[:300])
    finally:
        os._exit(3)
os._exit(0)
`

// NewRecycled boots a plain session's sandbox for one tenant's runs, with
// the writable places of a fresh run's sizes (spec.go's shares of the disk
// limit, not a session's, which give /tmp and /dev/shm a quarter of
// theirs), so that a recycled run is bounded as a fresh one is: see
// engine.Recycler.
func (b *backend) NewRecycled(ctx context.Context) (engine.SessionInstance, error) {
	inst, err := b.newSession(ctx, moat.SessionOptions{}, tmpShare, shmShare)
	if err != nil {
		return nil, err
	}
	ss := sessionOf(inst)
	ss.mu.Lock()
	ss.recycled = true
	ss.mu.Unlock()
	return inst, nil
}

// sessionOf is the session under inst, or nil.
func sessionOf(inst engine.SessionInstance) *session {
	if f, ok := inst.(filesOnly); ok {
		inst = f.SessionInstance
	}
	ss, _ := inst.(*session)
	return ss
}

// Reset empties a recycled sandbox for its tenant's next run: see
// engine.Recycler.
func (b *backend) Reset(ctx context.Context, inst engine.SessionInstance) error {
	ss := sessionOf(inst)
	if ss == nil || !ss.recycled {
		return fmt.Errorf("gvisor: recycle: not a plain session of this level: %w", moat.ErrInvalid)
	}
	var out, errOut limited
	p, err := ss.Start(ctx, []byte(wipeCode), &out, &errOut)
	if err != nil {
		return fmt.Errorf("gvisor: recycle: start the wipe: %w", err)
	}
	stop := context.AfterFunc(ctx, p.Kill)
	ev, err := p.Wait()
	stop()
	if err != nil {
		return fmt.Errorf("gvisor: recycle: the wipe: %w", err)
	}
	if ev.Exited && ev.Status == engine.Exit(4) {
		return errors.New("gvisor: recycle: a unix socket outlived the run (passed into its own queue, held by no process): the instance is not reused")
	}
	if !ev.Exited || ev.Status != engine.Exit(0) || ev.Spent || out.String() != "wiped" {
		return fmt.Errorf("gvisor: recycle: the wipe did not finish (exited %v, status %v, output %q, stderr %q)",
			ev.Exited, ev.Status, clip(out.Bytes(), 100), clip(errOut.Bytes(), 300))
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.broken != nil {
		return ss.broken
	}
	if ss.closed {
		return errors.New("gvisor: recycle: the session closed")
	}
	ss.spent = 0
	return nil
}

// limited keeps the first 4 KiB written to it and drops the rest.
type limited struct{ bytes.Buffer }

func (l *limited) Write(p []byte) (int, error) {
	if room := 4096 - l.Len(); room > 0 {
		l.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}
