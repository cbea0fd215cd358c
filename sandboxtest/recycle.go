package sandboxtest

import (
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// RecycleFactory builds a Sandbox with recycling on (the level's recycle
// setting) and limits l, whose logs go to logs (at debug level).
type RecycleFactory func(t *testing.T, l moat.Limits, logs io.Writer) moat.Sandbox

// RunRecycled runs the recycling suite: the conformance suite (Run) with
// every run of one tenant and recycled, then probes that plant something
// in one run of a tenant and look for it in the tenant's next run, in the
// same instance once reset. A reset may refuse an instance (fail closed:
// the tenant's next run then gets a fresh one), but a run that follows a
// reset must find nothing of the run before it.
//
// The sandbox's PoolStats (moat.PoolReporter) must count parked and
// recycled instances, and a refused reset must log a line holding "reset
// failed".
func RunRecycled(t *testing.T, newSandbox RecycleFactory, opts Options) {
	t.Run("Conformance", func(t *testing.T) {
		recycled := int64(0)
		Run(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
			r := newRecycling(t, newSandbox, l)
			t.Cleanup(func() { recycled += r.pr.PoolStats().Recycled })
			return tenantSandbox{r.sb}
		}, opts)
		if recycled == 0 {
			t.Fatal("no run of the suite was recycled: the test proves nothing")
		}
		t.Logf("%d runs recycled", recycled)
	})
	for _, p := range recycleProbes {
		t.Run(p.name, func(t *testing.T) {
			r := newRecycling(t, newSandbox, p.limits)
			p.check(t, r)
		})
	}
}

// tenantSandbox gives every run one tenant, so that a recycling sandbox
// serves the suite's runs after the first from a recycled instance.
type tenantSandbox struct{ moat.Sandbox }

func (s tenantSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	req.Tenant = "suite"
	return s.Sandbox.Run(ctx, req)
}

func (s tenantSandbox) PoolStats() moat.PoolStats { return s.Sandbox.(moat.PoolReporter).PoolStats() }

// recycling drives one tenant's recycled instance.
type recycling struct {
	t    *testing.T
	sb   moat.Sandbox
	pr   moat.PoolReporter
	logs *syncLog
}

type syncLog struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *syncLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *syncLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// newRecycling makes a sandbox and primes a tenant's instance: the
// tenant's second run has one made for it, whose first run is fresh; the
// runs after it are recycled, each after a reset.
func newRecycling(t *testing.T, newSandbox RecycleFactory, l moat.Limits) *recycling {
	t.Helper()
	logs := &syncLog{}
	sb := newSandbox(t, l, logs)
	t.Cleanup(func() { sb.Close() })
	pr, ok := sb.(moat.PoolReporter)
	if !ok {
		t.Fatalf("%T reports no pool stats", sb)
	}
	r := &recycling{t: t, sb: sb, pr: pr, logs: logs}
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

func (r *recycling) run(code string) *moat.Result {
	r.t.Helper()
	res, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(code), Tenant: "suite"})
	if err != nil {
		r.t.Fatal(err)
	}
	return res
}

// waitParked waits until an instance is parked (true) or a reset failed
// (false).
func (r *recycling) waitParked() bool {
	r.t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for r.pr.PoolStats().Parked == 0 {
		if strings.Contains(r.logs.String(), "reset failed") {
			return false
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("nothing parked after 60s: %s", r.logs.String())
		}
		time.Sleep(5 * time.Millisecond)
	}
	return true
}

// plantThenLook runs plant in the tenant's instance, then look in the
// same instance once it is reset. It returns look's result, or nil when
// the reset refused the instance.
func (r *recycling) plantThenLook(plant, look string) *moat.Result {
	r.t.Helper()
	res := r.run(plant)
	r.t.Logf("plant: exit %d reason %q stdout %q stderr %q", res.ExitCode, res.Reason, clip(res.Stdout), clip(res.Stderr))
	if !Recycled(res) {
		r.t.Fatalf("the planting run was not recycled: %v", res.Notes)
	}
	if !r.waitParked() {
		r.t.Logf("the reset refused the instance: %s", lastLines(r.logs.String(), 3))
		return nil
	}
	res = r.run(look)
	r.t.Logf("look: exit %d reason %q stdout %q stderr %q", res.ExitCode, res.Reason, clip(res.Stdout), clip(res.Stderr))
	if !Recycled(res) {
		r.t.Fatalf("the looking run was not recycled: %v", res.Notes)
	}
	return res
}

// Recycled says whether res's notes say its run was recycled.
func Recycled(res *moat.Result) bool {
	for _, n := range res.Notes {
		if strings.HasPrefix(n, "recycled:") {
			return true
		}
	}
	return false
}

func clip(b []byte) string {
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

type recycleProbe struct {
	name   string
	limits moat.Limits
	check  func(t *testing.T, r *recycling)
}

// plantLook is a probe that passes when the reset refuses the instance or
// look exits 0 (and fails when refuse is false and the reset refuses).
func plantLook(plant, look string, mustReuse bool) func(t *testing.T, r *recycling) {
	return func(t *testing.T, r *recycling) {
		res := r.plantThenLook(plant, look)
		if res == nil {
			if mustReuse {
				t.Fatal("the reset refused an instance whose run did nothing wrong")
			}
			return
		}
		if res.ExitCode != 0 || res.Reason != "" {
			t.Fatalf("the tenant's next run found what the previous one left: exit %d reason %q: %s %s", res.ExitCode, res.Reason, res.Stdout, res.Stderr)
		}
	}
}

var recycleProbes = []recycleProbe{
	{name: "Leftovers", check: plantLook(plantLeftovers, lookLeftovers, true)},
	{name: "Tops", check: plantLook(plantTops, lookTops, true)},
	{name: "DeepTree", check: plantLook(plantDeep, lookEmpty, false)},
	{name: "Inflight", check: plantLook(plantInflight, lookInflight, false)},
	{name: "AfterSockets", check: plantLook(plantSockets, lookEmpty, true)},
	{name: "Memory/shm", limits: moat.Limits{Memory: 256 * moat.MiB}, check: plantLook(plantShm, lookMemory, false)},
	{name: "Memory/memfd", limits: moat.Limits{Memory: 256 * moat.MiB, Disk: 256 * moat.MiB}, check: plantLook(plantMemfd, lookMemory, false)},
	{name: "Daemon", check: plantLook(plantDaemon, lookDaemon, true)},
	{name: "LimitsAsFresh", check: limitsAsFresh},
	{name: "Others/nofile", check: othersAsFresh("nofile")},
	{name: "Others/cpu", check: othersAsFresh("cpu")},
	{name: "Others/nproc", check: othersAsFresh("nproc")},
	{name: "Others/nice", check: othersAsFresh("nice")},
	{name: "Others/idle", check: othersAsFresh("idle")},
	{name: "Others/affinity", check: othersAsFresh("affinity")},
	{name: "Others/ioprio", check: othersAsFresh("ioprio")},
	{name: "Others/signals", check: othersAsFresh("signals")},
	{name: "Canceled", check: canceledRun},
	{name: "CPUTime", limits: moat.Limits{CPUTime: moat.Duration(time.Second)}, check: cpuFresh},
}

// plantLeftovers leaves what a next run could find: files in every
// writable place (one unreadable directory, a link out), changed modes,
// a SysV shared memory segment, semaphore set and message queue, which
// outlive their process, and a POSIX message queue.
const plantLeftovers = `
import ctypes, os
for d in ('/work', '/tmp', '/dev/shm'):
    with open(d + '/left', 'w') as f:
        f.write('residue')
os.makedirs('/work/locked/inner')
open('/work/locked/inner/f', 'w').close()
os.chmod('/work/locked', 0)
os.symlink('/etc/passwd', '/tmp/link')
os.mkfifo('/dev/shm/fifo')
os.chmod('/work', 0o777)
os.chmod('/tmp', 0o700)
libc = ctypes.CDLL(None, use_errno=True)
ids = [libc.shmget(0x6d6f6174, 4096, 0o1600), libc.semget(0x6d6f6174, 1, 0o1600), libc.msgget(0x6d6f6174, 0o1600)]
libc.mq_open.restype = ctypes.c_int
ids.append(libc.mq_open(b'/moatleak', os.O_CREAT | os.O_RDWR, 0o600, None))
print('ids', ids)
assert -1 not in ids, ctypes.get_errno()
`

// lookLeftovers exits 0 only when nothing of plantLeftovers is left.
const lookLeftovers = `
import ctypes, os, sys
left = [(d, os.listdir(d)) for d in ('/work', '/tmp', '/dev/shm') if os.listdir(d)]
modes = [oct(os.lstat(d).st_mode & 0o7777) for d in ('/work', '/tmp', '/dev/shm')]
libc = ctypes.CDLL(None, use_errno=True)
libc.mq_open.restype = ctypes.c_int
ids = [libc.shmget(0x6d6f6174, 0, 0), libc.semget(0x6d6f6174, 0, 0), libc.msgget(0x6d6f6174, 0), libc.mq_open(b'/moatleak', os.O_RDWR, 0, None)]
print(left, modes, ids)
sys.exit(0 if not left and modes == ['0o700', '0o1777', '0o1777'] and ids == [-1] * 4 else 1)
`

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

// plantDeep leaves a tree deeper than PATH_MAX and one 1500 directories
// deep: a wipe by full paths fails on the first, a recursive one may on
// the second.
const plantDeep = `
import os
os.chdir('/tmp')
for i in range(20):
    os.mkdir('a' * 250)
    os.chdir('a' * 250)
open('residue', 'w').write('run N was here')
deep = '/work'
for i in range(1500):
    deep += '/d'
    os.mkdir(deep)
print('planted')
`

// lookEmpty exits 0 only when the three writable places are empty.
const lookEmpty = `
import os, sys
left = {d: os.listdir(d) for d in ('/work', '/tmp', '/dev/shm') if os.listdir(d)}
print(left)
sys.exit(1 if left else 0)
`

// plantInflight leaves sockets that no process holds: each is in flight
// (SCM_RIGHTS) in a unix socket's queue that is itself in flight in its
// own queue, a cycle no process can reach. A listening abstract socket, a
// listening loopback TCP socket where the level gives one, and 12 MiB of
// memory (a memfd, or an unlinked file where memfd_create is refused).
const plantInflight = `
import array, mmap, os, socket
def cycle(fds):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds + [b.fileno()]))])
    a.close(); b.close()
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); u.bind('\0moat-leak'); u.listen(8)
fds = [u.fileno()]
try:
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM); t.bind(('127.0.0.1', 47111)); t.listen(8)
    fds.append(t.fileno())
except OSError as e:
    print('no tcp:', e)
try:
    m = os.memfd_create('leak')
except OSError:
    m = os.open('/work/leak', os.O_RDWR | os.O_CREAT, 0o600)
    os.unlink('/work/leak')
os.ftruncate(m, 12 << 20)
with mmap.mmap(m, 12 << 20) as mm:
    for i in range(0, 12 << 20, 4096):
        mm[i] = 1
cycle(fds + [m])
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
try:
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.connect(('127.0.0.1', 47111)); found.append('tcp listener')
except OSError:
    pass
print(found)
sys.exit(1 if found else 0)
`

// plantSockets uses sockets as code does, closing them: nothing is left,
// and the instance must be reused.
const plantSockets = `
import socket
a, b = socket.socketpair()
a.sendall(b'x'); b.recv(1)
u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); u.bind('\0moat-ok'); u.listen(1)
u.close(); a.close(); b.close()
print('used')
`

// plantShm leaves a SysV shared memory segment of 120 MiB, touched, never
// removed: it outlives its process.
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

// plantMemfd leaves 96 MiB of memfds (or unlinked files, where
// memfd_create is refused) held only by an in-flight cycle.
const plantMemfd = `
import array, mmap, os, socket
fds = []
for i in range(8):
    try:
        m = os.memfd_create('leak')
    except OSError:
        m = os.open('/work/leak', os.O_RDWR | os.O_CREAT, 0o600)
        os.unlink('/work/leak')
    os.ftruncate(m, 12 << 20)
    with mmap.mmap(m, 12 << 20) as mm:
        mm.write(b'\1' * (12 << 20))
    fds.append(m)
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
a.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', fds + [b.fileno()]))])
print('planted')
`

// lookMemory uses 160 MiB of the 256 MiB limit, which a fresh instance
// gives it.
const lookMemory = `
b = b'\1' * (160 << 20)
print('ok', len(b))
`

// plantDaemon leaves a double-forked daemon in a session of its own.
const plantDaemon = `
import os, time
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
import os, sys, time
time.sleep(0.5)
mine = [p for p in os.listdir('/proc') if p.isdigit() and os.stat('/proc/' + p).st_uid == os.getuid() and int(p) != os.getpid()]
print('alive', os.path.exists('/tmp/alive'), 'others of my uid', mine)
sys.exit(0 if not os.path.exists('/tmp/alive') else 1)
`

// lookLimits prints what bounds a run from the inside: the sizes of the
// writable places, the rlimits, and the attributes another process of
// the uid could have changed (nice, scheduling, affinity, I/O priority).
const lookLimits = `
import ctypes, os, resource
for d in ('/work', '/tmp', '/dev/shm'):
    s = os.statvfs(d)
    print(d, s.f_blocks * s.f_frsize, s.f_files)
for r in ('CPU', 'FSIZE', 'NOFILE', 'NPROC', 'CORE', 'AS', 'DATA', 'STACK', 'MEMLOCK', 'MSGQUEUE', 'NICE', 'RTPRIO', 'SIGPENDING'):
    print(r, resource.getrlimit(getattr(resource, 'RLIMIT_' + r)))
print('nice', os.getpriority(os.PRIO_PROCESS, 0), 'sched', os.sched_getscheduler(0), 'cpus', sorted(os.sched_getaffinity(0)))
libc = ctypes.CDLL(None, use_errno=True)
print("ioprio", libc.syscall(252, 1, 0))  # ioprio_get(IOPRIO_WHO_PROCESS, 0), x86-64
print(os.getcwd(), oct(os.umask(0)), sorted(os.environ.items()))
`

// limitsAsFresh checks that a recycled run is bounded as a fresh one is.
func limitsAsFresh(t *testing.T, r *recycling) {
	fresh, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(lookLimits)})
	if err != nil {
		t.Fatal(err)
	}
	res := r.run(lookLimits)
	if !Recycled(res) {
		t.Fatalf("not recycled: %v", res.Notes)
	}
	if fresh.ExitCode != 0 || string(res.Stdout) != string(fresh.Stdout) {
		t.Fatalf("a recycled run is bounded otherwise than a fresh one:\nfresh (exit %d):\n%s%s\nrecycled:\n%s%s", fresh.ExitCode, fresh.Stdout, fresh.Stderr, res.Stdout, res.Stderr)
	}
}

// plantOthers does to every other process it can see one thing (ONLY)
// that a process may do to another of its uid: lower an rlimit, raise its
// nice, change its scheduling, affinity or I/O priority, signal it; and it
// tries their memory and descriptors. The instance's own processes (an
// init, a server) are among them; what they start for the next run must
// not inherit any of it.
const plantOthers = `
import ctypes, os, resource, signal
libc = ctypes.CDLL(None, use_errno=True)
only = 'ONLY'
done = []
for p in os.listdir('/proc'):
    if not p.isdigit() or int(p) == os.getpid():
        continue
    pid = int(p)
    for what, f in [
        ('nofile', lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (64, 64))),
        ('cpu', lambda: resource.prlimit(pid, resource.RLIMIT_CPU, (1, 1))),
        ('nproc', lambda: resource.prlimit(pid, resource.RLIMIT_NPROC, (50, 50))),
        ('nice', lambda: os.setpriority(os.PRIO_PROCESS, pid, 19)),
        ('idle', lambda: os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))),
        ('affinity', lambda: os.sched_setaffinity(pid, {min(os.sched_getaffinity(0))})),
        # ioprio_set(IOPRIO_WHO_PROCESS, pid, the idle class), x86-64
        ('ioprio', lambda: libc.syscall(251, 1, pid, 3 << 13) == 0 or (_ for _ in ()).throw(OSError(ctypes.get_errno(), 'ioprio_set'))),
        ('mem', lambda: open('/proc/%d/mem' % pid, 'r+b').close()),
        ('fd', lambda: os.listdir('/proc/%d/fd' % pid)),
    ]:
        if what not in (only, 'mem', 'fd'):
            continue
        try:
            f()
            done.append((pid, what))
        except Exception:
            pass
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGPIPE, signal.SIGCHLD, signal.SIGSTOP):
        if only != 'signals':
            break
        try:
            os.kill(pid, s)
            done.append((pid, s))
        except Exception:
            pass
print('done', done)
`

// othersAsFresh checks that what a run did to the instance's other
// processes does not reach the tenant's next run.
func othersAsFresh(only string) func(t *testing.T, r *recycling) {
	return func(t *testing.T, r *recycling) { othersAsFreshOnly(t, r, only) }
}

func othersAsFreshOnly(t *testing.T, r *recycling, only string) {
	fresh, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(lookLimits)})
	if err != nil {
		t.Fatal(err)
	}
	res := r.plantThenLook(strings.Replace(plantOthers, "ONLY", only, 1), lookLimits)
	if res == nil {
		return
	}
	if fresh.ExitCode != 0 || string(res.Stdout) != string(fresh.Stdout) {
		t.Fatalf("after a run that changed the instance's other processes, the next run is bounded otherwise than a fresh one:\nfresh:\n%s\nrecycled:\n%s%s", fresh.Stdout, res.Stdout, res.Stderr)
	}
	// And the instance still serves runs.
	if !r.waitParked() {
		t.Fatalf("the instance was not reset after the look: %s", lastLines(r.logs.String(), 3))
	}
	if res := r.run("print(6 * 7)"); string(res.Stdout) != "42\n" || !Recycled(res) {
		t.Fatalf("after it: %q %v", res.Stdout, res.Notes)
	}
}

// canceledRun cancels a recycled run mid-way, with files and a daemon of
// its left: the tenant's next run, recycled, finds neither.
func canceledRun(t *testing.T, r *recycling) {
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(1500*time.Millisecond, cancel)
	res, err := r.sb.Run(ctx, moat.Request{Tenant: "suite", Code: []byte(`
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
	if res.Reason != moat.ReasonCanceled || !Recycled(res) {
		t.Fatalf("the canceled run: reason %q, notes %v", res.Reason, res.Notes)
	}
	if !r.waitParked() {
		t.Fatalf("a canceled run's instance was not reset: %s", lastLines(r.logs.String(), 3))
	}
	if res := r.run(lookDaemon); res.ExitCode != 0 || !Recycled(res) {
		t.Fatalf("after a canceled run: exit %d %s %v", res.ExitCode, res.Stdout, res.Notes)
	}
	if res := r.run(lookEmpty); res.ExitCode != 0 {
		t.Fatalf("after a canceled run: %s", res.Stdout)
	}
}

// cpuFresh spends most of the CPU time limit in one run: the next run
// gets the whole limit again.
func cpuFresh(t *testing.T, r *recycling) {
	burn := `
import time
t = time.process_time()
while time.process_time() - t < 0.7:
    pass
print('burnt')
`
	for i := range 3 {
		res := r.run(burn)
		if res.ExitCode != 0 || res.Reason != "" || string(res.Stdout) != "burnt\n" {
			t.Fatalf("run %d of 0.7 s under a 1 s CPU limit: exit %d reason %q %s %s", i, res.ExitCode, res.Reason, res.Stdout, res.Stderr)
		}
		if i > 0 && !Recycled(res) {
			t.Fatalf("run %d not recycled: %v", i, res.Notes)
		}
		if !r.waitParked() {
			t.Fatal(fmt.Sprintf("reset refused after run %d: %s", i, lastLines(r.logs.String(), 3)))
		}
	}
}
