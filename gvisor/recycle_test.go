package gvisor_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/sandboxtest"
)

// leaveBehind is a run that leaves what a next run could find: files in
// every writable place (one unreadable directory, a link out, a deep
// tree), changed modes, and a SysV shared memory segment, which outlives
// its process.
const leaveBehind = `
import ctypes, os
for d in ('/work', '/tmp', '/dev/shm'):
    with open(d + '/left', 'w') as f:
        f.write('residue')
os.makedirs('/work/locked/inner')
open('/work/locked/inner/f', 'w').close()
os.chmod('/work/locked', 0)
os.symlink('/etc/passwd', '/tmp/link')
deep = '/dev/shm'
for i in range(1500):
    deep += '/d'
    os.mkdir(deep)
os.chmod('/work', 0o777)
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0x6d6f6174, 4096, 0o1600)
print('shm', shmid, ctypes.get_errno())
`

// lookForIt exits 0 only when nothing of leaveBehind is left.
const lookForIt = `
import ctypes, os, sys
left = [(d, os.listdir(d)) for d in ('/work', '/tmp', '/dev/shm') if os.listdir(d)]
modes = [oct(os.lstat(d).st_mode & 0o7777) for d in ('/work', '/tmp', '/dev/shm')]
libc = ctypes.CDLL(None, use_errno=True)
shm = libc.shmget(0x6d6f6174, 0, 0)
print(left, modes, shm)
sys.exit(0 if not left and modes == ['0o700', '0o1777', '0o1777'] and shm == -1 else 1)
`

// TestRecycleResets checks that a tenant's recycled sandbox comes to its
// next run as a fresh one would: nothing the previous run left.
func TestRecycleResets(t *testing.T) {
	need(t, gvisor.Config{})
	sb := newSandbox(t, gvisor.Config{Recycle: true})
	defer sb.Close()
	pr := moat.PoolReporter(sb)
	runAs := func(tenant, code string) *moat.Result {
		t.Helper()
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code), Tenant: tenant})
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	waitParked := func(n int) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for pr.PoolStats().Parked != n {
			if time.Now().After(deadline) {
				t.Fatalf("parked %d, want %d", pr.PoolStats().Parked, n)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	runAs("alice", "print(1)") // fresh sandboxes; the second run has one made for alice
	runAs("alice", "print(1)")
	waitParked(1)
	res := runAs("alice", leaveBehind)
	if res.ExitCode != 0 || !strings.HasPrefix(string(res.Stdout), "shm ") || strings.HasPrefix(string(res.Stdout), "shm -1") {
		t.Fatalf("the run that leaves things behind: %+v %s %s", res, res.Stdout, res.Stderr)
	}
	waitParked(1) // reset
	res = runAs("alice", lookForIt)
	if res.ExitCode != 0 {
		t.Fatalf("the next run of the tenant found what the previous one left: %s %s", res.Stdout, res.Stderr)
	}
	recycled := false
	for _, n := range res.Notes {
		recycled = recycled || strings.HasPrefix(n, "recycled:")
	}
	if !recycled {
		t.Fatalf("the run was not recycled (notes %v): it proves nothing", res.Notes)
	}
	if ps := pr.PoolStats(); ps.Recycled != 1 {
		t.Fatalf("pool stats %+v: want 1 recycled run (the first run of the tenant's instance is not one)", ps)
	}
}

// tenantSandbox gives every run one tenant, so that a recycling sandbox
// serves the suite's runs after the first from a recycled instance.
type tenantSandbox struct{ *gvisor.Sandbox }

func (s tenantSandbox) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	req.Tenant = "suite"
	return s.Sandbox.Run(ctx, req)
}

// TestConformanceRecycled runs the conformance suite with recycling on and
// every run of one tenant: a recycled run must behave as a fresh one, and
// nothing may be left once the sandbox is closed.
func TestConformanceRecycled(t *testing.T) {
	need(t, gvisor.Config{})
	me := self(t)
	recycled := 0
	sandboxtest.Run(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		sb := newSandbox(t, gvisor.Config{Limits: l, Recycle: true})
		t.Cleanup(func() { recycled += int(sb.PoolStats().Recycled) })
		// Runs of the tenant's before the suite's: two, so that an
		// instance is made for it, then one in that instance, which is
		// then reset: the suite's runs then find it parked and are
		// recycled ones, each after a reset.
		leave := func() {
			t.Helper()
			if _, err := sb.Run(context.Background(), moat.Request{Code: []byte("open('left', 'w').write('x')"), Tenant: "suite"}); err != nil {
				t.Fatal(err)
			}
		}
		waitParked := func() {
			t.Helper()
			deadline := time.Now().Add(time.Minute)
			for sb.PoolStats().Parked == 0 {
				if time.Now().After(deadline) {
					t.Fatal("no instance parked for the tenant within a minute")
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		leave()
		leave()
		waitParked()
		leave()
		waitParked()
		return tenantSandbox{sb}
	}, sandboxtest.Options{
		Leftovers: func() []string { return leftovers(gvisor.DefaultStateDir, me) },
		Parallel:  concurrency,
	})
	if recycled == 0 {
		t.Fatal("no run of the suite was recycled: the test proves nothing")
	}
	t.Logf("%d runs recycled", recycled)
}
