package gvisor_test

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/internal/egress"
)

// recycler drives one tenant's recycled sandbox for the probes below.
type recycler struct {
	t    *testing.T
	sb   *gvisor.Sandbox
	pr   moat.PoolReporter
	logs *syncBuffer
}

func newRecycler(t *testing.T, cfg gvisor.Config) *recycler {
	t.Helper()
	need(t, gvisor.Config{})
	logs := &syncBuffer{}
	cfg.Recycle = true
	cfg.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	sb := newSandbox(t, cfg)
	t.Cleanup(func() { sb.Close() })
	r := &recycler{t: t, sb: sb, pr: moat.PoolReporter(sb), logs: logs}
	// The tenant's second run has an instance made for it, whose first
	// run is then fresh: the runs after it are recycled.
	r.run("print(1)")
	r.run("print(1)")
	if !r.waitParked() {
		t.Fatalf("no instance parked for the tenant: %s", logs.String())
	}
	r.run("print(1)")
	if !r.waitParked() {
		t.Fatalf("the tenant's instance was not parked again: %s", logs.String())
	}
	return r
}

func (r *recycler) run(code string) *moat.Result {
	r.t.Helper()
	res, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(code), Tenant: "alice"})
	if err != nil {
		r.t.Fatal(err)
	}
	return res
}

// waitParked waits until an instance is parked (true) or a reset failed
// (false).
func (r *recycler) waitParked() bool {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for r.pr.PoolStats().Parked == 0 {
		if strings.Contains(r.logs.String(), "reset failed") {
			return false
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("nothing parked after 60s: %s", r.logs.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return true
}

// plantThenLook runs plant in the tenant's instance, then look in the same
// instance once it is reset. It returns look's result, or nil when the
// reset refused the instance (fail closed: fine).
func (r *recycler) plantThenLook(plant, look string) *moat.Result {
	r.t.Helper()
	res := r.run(plant)
	r.t.Logf("plant: exit %d reason %q stdout %q stderr %q", res.ExitCode, res.Reason, clipS(res.Stdout), clipS(res.Stderr))
	if !recycledRun(res) {
		r.t.Fatalf("the planting run was not recycled: %v", res.Notes)
	}
	if !r.waitParked() {
		r.t.Logf("reset refused the instance: %s", lastLines(r.logs.String(), 3))
		return nil
	}
	res = r.run(look)
	r.t.Logf("look: exit %d reason %q stdout %q stderr %q", res.ExitCode, res.Reason, clipS(res.Stdout), clipS(res.Stderr))
	if !recycledRun(res) {
		r.t.Fatalf("the looking run was not recycled: %v", res.Notes)
	}
	return res
}

func recycledRun(res *moat.Result) bool {
	for _, n := range res.Notes {
		if strings.HasPrefix(n, "recycled:") {
			return true
		}
	}
	return false
}

func clipS(b []byte) string {
	if len(b) > 600 {
		return string(b[:600]) + "..."
	}
	return string(b)
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, "\n")
}

// plantHijack leaves a module named traceback in the working directory,
// then a tree deeper than PATH_MAX made after it: a wipe that walks the
// tree by full paths fails there with ENAMETOOLONG, and Python 3.13 prints
// an uncaught exception through the traceback module, which the empty entry of sys.path
// (the working directory) would give it from the code's files.
const plantHijack = `
import os
os.mkdir('/work/traceback')
with open('/work/traceback/__init__.py', 'w') as f:
    f.write('import os\nos.write(1, b"wiped")\nos._exit(0)\n')
os.chdir('/work')
for i in range(20):
    os.mkdir('a' * 250)
    os.chdir('a' * 250)
with open('/work/residue', 'w') as f:
    f.write('run N was here')
print('planted')
`

// lookEmpty exits 0 only when the three writable places are empty.
const lookEmpty = `
import os, sys
left = {d: os.listdir(d) for d in ('/work', '/tmp', '/dev/shm') if os.listdir(d)}
print(left)
sys.exit(1 if left else 0)
`

// TestRecycleWipeNotHijacked checks that what a run leaves cannot make
// the wipe report success while the files stay. The hole it looks for
// needs Python 3.13 or later in the image (earlier ones print an
// exception in C, importing nothing); the default image (bookworm) has
// 3.11, so set MOAT_TEST_ROOTFS to a root filesystem with a later one
// (debootstrap --variant=minbase --include=python3 trixie DIR, and mkdir
// DIR/work) to see it.
func TestRecycleWipeNotHijacked(t *testing.T) {
	r := newRecycler(t, gvisor.Config{RootFS: os.Getenv("MOAT_TEST_ROOTFS")})
	res := r.plantThenLook(plantHijack, lookEmpty)
	if res != nil && res.ExitCode != 0 {
		t.Fatalf("the tenant's next run found the previous run's files after a reset that said it was done: %s", res.Stdout)
	}
}

// plantTops marks the three writable places themselves, which a wipe of
// their contents leaves: an extended attribute and a modification time.
const plantTops = `
import os
for d in ('/work', '/tmp', '/dev/shm'):
    os.setxattr(d, 'user.leak', b'run N')
    os.utime(d, (7654321, 7654321))
print('planted')
`

const lookTops = `
import os, sys
found = []
for d in ('/work', '/tmp', '/dev/shm'):
    if os.listxattr(d):
        found.append((d, os.listxattr(d)))
    if os.stat(d).st_mtime == 7654321 or os.stat(d).st_atime == 7654321:
        found.append((d, 'time'))
print(found)
sys.exit(1 if found else 0)
`

// TestRecycleTopsFresh checks that the writable places come to the next
// run with no mark of the previous run on them.
func TestRecycleTopsFresh(t *testing.T) {
	r := newRecycler(t, gvisor.Config{})
	res := r.plantThenLook(plantTops, lookTops)
	if res == nil {
		t.Fatal("the reset refused an instance whose run did nothing wrong")
	}
	if res.ExitCode != 0 {
		t.Fatalf("the next run found marks of the previous one on the writable places: %s", res.Stdout)
	}
}

// plantInflight leaves sockets that no process holds: each is in flight
// (SCM_RIGHTS) in a unix socket's queue that is itself in flight in its
// own queue, a cycle no process can reach. A listening abstract socket, a
// listening loopback TCP socket, and a memfd of 12 MiB.
const plantInflight = `
import array, mmap, os, socket
def cycle(fds):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds + [b.fileno()]))])
    a.close(); b.close()
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); u.bind('\0moat-leak'); u.listen(8)
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM); t.bind(('127.0.0.1', 47111)); t.listen(8)
m = os.memfd_create('leak')
os.ftruncate(m, 12 << 20)
with mmap.mmap(m, 12 << 20) as mm:
    for i in range(0, 12 << 20, 4096):
        mm[i] = 1
cycle([u.fileno(), t.fileno(), m])
u.close(); t.close(); os.close(m)
print('planted')
`

const lookInflight = `
import socket, sys
found = []
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    u.connect('\0moat-leak'); found.append('abstract listener')
except OSError:
    pass
t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
try:
    t.connect(('127.0.0.1', 47111)); found.append('tcp listener')
except OSError:
    pass
print(found, open('/proc/net/tcp').read())
sys.exit(1 if found else 0)
`

// TestRecycleNoInflightLeak checks that what the previous run left in
// flight, held by no process, is not there for the next run, with gVisor's
// own network and with the host's (an egress proxy).
func TestRecycleNoInflightLeak(t *testing.T) {
	p, err := egress.New(egress.Config{
		Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}},
		CADir:  t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for name, cfg := range map[string]gvisor.Config{"none": {}, "egress": {Egress: p}} {
		t.Run(name, func(t *testing.T) {
			r := newRecycler(t, cfg)
			res := r.plantThenLook(plantInflight, lookInflight)
			if res != nil && res.ExitCode != 0 {
				t.Fatalf("the next run found what the previous one left in flight: %s", res.Stdout)
			}
		})
	}
}

// plantShm leaves a SysV shared memory segment of 120 MiB, touched, never
// removed: it outlives its process, and should end with the run's IPC
// namespace.
const plantShm = `
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
n = 120 << 20
shmid = libc.shmget(0x6d6f6174, n, 0o1600)
p = libc.shmat(shmid, None, 0)
ctypes.memset(p, 1, n)
print('planted', shmid)
`

// plantMemfd leaves 96 MiB of memfds held only by an in-flight cycle.
const plantMemfd = `
import array, mmap, os, socket
fds = []
for i in range(8):
    m = os.memfd_create('leak')
    os.ftruncate(m, 12 << 20)
    with mmap.mmap(m, 12 << 20) as mm:
        mm.write(b'\1' * (12 << 20))
    fds.append(m)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds + [b.fileno()]))])
print('planted')
`

// lookMemory uses 160 MiB of the 256 MiB limit, which a fresh sandbox
// gives it.
const lookMemory = `
b = b'\1' * (160 << 20)
print('ok', len(b))
`

// TestRecycleMemoryFresh checks that memory the previous run left held
// does not count against the next run.
func TestRecycleMemoryFresh(t *testing.T) {
	for name, plant := range map[string]string{"shm": plantShm, "memfd": plantMemfd} {
		t.Run(name, func(t *testing.T) {
			r := newRecycler(t, gvisor.Config{})
			res := r.plantThenLook(plant, lookMemory)
			if res != nil && (res.ExitCode != 0 || res.Reason != "") {
				t.Fatalf("the next run did not get the memory a fresh sandbox gives: exit %d reason %q", res.ExitCode, res.Reason)
			}
		})
	}
}

// lookLimits prints what bounds a run from the inside: the sizes of the
// writable places and the rlimits (but RLIMIT_NPROC, which a session's
// launcher lowers by one on purpose: gVisor does not count the run's init
// against it there).
const lookLimits = `
import os, resource
for d in ('/work', '/tmp', '/dev/shm'):
    s = os.statvfs(d)
    print(d, s.f_blocks * s.f_frsize, s.f_files)
for r in ('CPU', 'FSIZE', 'NOFILE', 'CORE', 'AS', 'DATA', 'STACK', 'MEMLOCK', 'MSGQUEUE'):
    print(r, resource.getrlimit(getattr(resource, 'RLIMIT_' + r)))
print(os.getcwd(), oct(os.umask(0)), sorted(os.environ.items()))
`

// TestRecycleLimitsAsFresh checks that a recycled run is bounded as a
// fresh one is.
func TestRecycleLimitsAsFresh(t *testing.T) {
	r := newRecycler(t, gvisor.Config{})
	fresh, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(lookLimits)})
	if err != nil {
		t.Fatal(err)
	}
	res := r.run(lookLimits)
	if !recycledRun(res) {
		t.Fatalf("not recycled: %v", res.Notes)
	}
	if string(res.Stdout) != string(fresh.Stdout) {
		t.Fatalf("a recycled run is bounded otherwise than a fresh one:\nfresh:\n%s\nrecycled:\n%s", fresh.Stdout, res.Stdout)
	}
}

// plantDaemon leaves a double-forked daemon in a session of its own and
// a POSIX message queue.
const plantDaemon = `
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
q = libc.mq_open(b'/moatleak', os.O_CREAT | os.O_RDWR, 0o600, None)
print('mq', q, ctypes.get_errno())
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            try:
                with open('/tmp/alive', 'a') as f:
                    f.write('x')
            except OSError:
                pass
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.3)
print('planted', os.path.exists('/tmp/alive'))
`

const lookDaemon = `
import ctypes, os, sys, time
time.sleep(0.5)
libc = ctypes.CDLL(None, use_errno=True)
q = libc.mq_open(b'/moatleak', os.O_RDWR, 0, None)
mine = [p for p in os.listdir('/proc') if p.isdigit() and os.stat('/proc/' + p).st_uid == os.getuid()]
print('mq', q, 'alive', os.path.exists('/tmp/alive'), 'procs', len(mine))
sys.exit(0 if q == -1 and not os.path.exists('/tmp/alive') and len(mine) == 1 else 1)
`

func TestRecycleNoProcessOrQueueLeft(t *testing.T) {
	r := newRecycler(t, gvisor.Config{})
	res := r.plantThenLook(plantDaemon, lookDaemon)
	if res == nil || res.ExitCode != 0 {
		t.Fatalf("left: %+v", res)
	}
}

// TestRecycleCloseLeavesNothing closes the sandbox while tenants' instances
// are being made, reset and parked: nothing of them may stay on the host.
func TestRecycleCloseLeavesNothing(t *testing.T) {
	cfg := gvisor.Config{StateDir: t.TempDir(), Warm: -1, Recycle: true}
	need(t, cfg)
	me := self(t)
	for _, wait := range []time.Duration{0, 300 * time.Millisecond, 3 * time.Second} {
		sb := newSandbox(t, cfg)
		for round := range 2 {
			for _, tenant := range []string{"a", "b", "c"} {
				if _, err := sb.Run(context.Background(), moat.Request{Code: []byte("open('/work/x', 'w').write('1')"), Tenant: tenant}); err != nil {
					t.Fatal(round, err)
				}
			}
		}
		time.Sleep(wait)
		t.Logf("close after %v: %+v", wait, moat.PoolReporter(sb).PoolStats())
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
		if left := leftovers(cfg.StateDir, me); len(left) > 0 {
			t.Fatalf("after Close (%v after the runs): %v", wait, left)
		}
		if ids := containers(t, cfg.StateDir); len(ids) > 0 {
			t.Fatalf("containers after Close: %v", ids)
		}
	}
}

// plantSockets uses sockets as code does, closing them: nothing is left,
// and the instance must still be recycled.
const plantSockets = `
import socket, multiprocessing.connection
a, b = socket.socketpair()
a.sendall(b'x'); b.recv(1)
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); u.bind('\0moat-ok'); u.listen(1)
t = socket.socket(); t.bind(('127.0.0.1', 0)); t.listen(1)
c = socket.create_connection(t.getsockname()); s, _ = t.accept(); c.sendall(b'y'); s.recv(1)
print('used')
`

// TestRecycleAfterSockets is the positive control of the in-flight check:
// a run whose sockets all closed leaves an instance that is recycled,
// with gVisor's own network and with the host's (an egress proxy).
func TestRecycleAfterSockets(t *testing.T) {
	p, err := egress.New(egress.Config{
		Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}},
		CADir:  t.TempDir(),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for name, cfg := range map[string]gvisor.Config{"none": {}, "egress": {Egress: p}} {
		t.Run(name, func(t *testing.T) {
			r := newRecycler(t, cfg)
			if res := r.plantThenLook(plantSockets, lookEmpty); res == nil || res.ExitCode != 0 {
				t.Fatalf("a run that closed its sockets left an instance not recycled: %+v", res)
			}
		})
	}
}

// TestRecycleCanceledRun cancels a recycled run mid-way, with files and a
// daemon of its left: the tenant's next run, recycled, finds neither.
func TestRecycleCanceledRun(t *testing.T) {
	r := newRecycler(t, gvisor.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(1500*time.Millisecond, cancel)
	res, err := r.sb.Run(ctx, moat.Request{Tenant: "alice", Code: []byte(`
import os, time
open('/work/left', 'w').write('x')
if os.fork() == 0:
    os.setsid()
    while True:
        open('/tmp/alive', 'a').write('x')
        time.sleep(0.05)
time.sleep(60)
`)})
	if err != nil {
		t.Fatal(err)
	}
	if res.Reason != moat.ReasonCanceled || !recycledRun(res) {
		t.Fatalf("the canceled run: reason %q, notes %v", res.Reason, res.Notes)
	}
	if !r.waitParked() {
		t.Fatalf("a canceled run's instance was not reset: %s", lastLines(r.logs.String(), 3))
	}
	if res := r.run(lookDaemon); res.ExitCode != 0 || !recycledRun(res) {
		t.Fatalf("after a canceled run: exit %d %s %v", res.ExitCode, res.Stdout, res.Notes)
	}
	if res := r.run(lookEmpty); res.ExitCode != 0 {
		t.Fatalf("after a canceled run: %s", res.Stdout)
	}
}
