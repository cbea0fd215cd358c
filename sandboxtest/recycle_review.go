package sandboxtest

import (
	"context"
	"testing"

	"github.com/moatsandbox/moat"
)

// RunRecycledReview runs the probes of a hostile review of recycling
// (moat issue 15) against a recycling sandbox, as RunRecycled's probes
// run: each plants something in one run of a tenant, or attacks what the
// instance keeps between runs (its init, a run server), and checks the
// tenant's next run, or the attacking run itself, against a fresh run of
// the same code.
func RunRecycledReview(t *testing.T, newSandbox RecycleFactory) {
	for _, p := range reviewProbes {
		t.Run(p.name, func(t *testing.T) {
			r := newRecycling(t, newSandbox, p.limits)
			p.check(t, r)
		})
	}
}

var reviewProbes = []recycleProbe{
	// Claim: nothing of run N reaches run N+1 (scheduling inherited from
	// what the instance keeps).
	{name: "SchedSlice", check: schedSliceAsFresh},
	// Claim: a recycled run is judged as a fresh one; a broken server
	// fails the run or the instance, never mis-reports.
	{name: "KillKeeper/prlimit", check: asFresh(killKeeperPrlimit)},
	{name: "KillKeeper/oom", limits: moat.Limits{Memory: 64 * moat.MiB, Disk: 256 * moat.MiB}, check: asFresh(killKeeperOOM)},
}

// plantSlice sets, on every other process it can see, the time slice of
// the fair scheduler (sched_setattr's sched_runtime for SCHED_OTHER, a
// custom slice since Linux 6.12), which a process of the same uid may set
// on another and which children inherit across fork. The instance's own
// processes (an init, a run server) are among them.
const plantSlice = `
import ctypes, os, platform, struct
libc = ctypes.CDLL(None, use_errno=True)
SET = {'x86_64': 314, 'aarch64': 274}[platform.machine()]
attr = ctypes.create_string_buffer(struct.pack('IIQiIQQQII', 56, 0, 0, 0, 0, 7777777, 0, 0, 0, 0), 56)
done = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid() and libc.syscall(SET, int(p), attr, 0) == 0]
print('slice set on', done)
`

// lookSlice prints the run's own scheduling attributes (sched_getattr),
// and those of the other processes it sees (an init, a run server), which
// it may read as well: what a previous run set there is as much a channel
// to this one as what this one inherits.
const lookSlice = `
import ctypes, os, platform, struct
libc = ctypes.CDLL(None, use_errno=True)
GET = {'x86_64': 315, 'aarch64': 275}[platform.machine()]
def attrs(pid):
    buf = ctypes.create_string_buffer(56)
    if libc.syscall(GET, pid, buf, 56, 0) != 0:
        return None
    size, policy, flags, nice, prio, runtime, deadline, period = struct.unpack('IIQiIQQQ', buf.raw[:48])
    return 'policy %d flags %d nice %d prio %d runtime %d deadline %d period %d' % (policy, flags, nice, prio, runtime, deadline, period)
print('mine:', attrs(0))
others = {attrs(int(p)) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()} - {None}
print('others:', sorted(others))
`

// schedSliceAsFresh checks that a slice a run set on the instance's other
// processes does not reach the tenant's next run, which must be scheduled
// as a fresh run is.
func schedSliceAsFresh(t *testing.T, r *recycling) {
	fresh, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(lookSlice)})
	if err != nil {
		t.Fatal(err)
	}
	if fresh.ExitCode != 0 {
		t.Fatalf("sched_getattr in a fresh run: %s %s", fresh.Stdout, fresh.Stderr)
	}
	res := r.plantThenLook(plantSlice, lookSlice)
	if res == nil {
		return // the reset refused the instance: fail closed
	}
	if string(res.Stdout) != string(fresh.Stdout) {
		t.Fatalf("the tenant's next run inherited the scheduling a previous run set on the instance's processes:\nfresh:    %srecycled: %s%s", fresh.Stdout, res.Stdout, res.Stderr)
	}
}

// killKeeperPrlimit lowers the hard RLIMIT_CPU of every other process it
// can see to 0 (prlimit, allowed on a process of the same uid whatever its
// dumpable flag) and makes them run (SIGCHLD, which an init that reaps
// catches): the kernel then kills them with SIGKILL, an instance's init or
// run server among them. What the code does to its own instance is the
// code's doing, and the run gets a verdict as a fresh run does.
const killKeeperPrlimit = `
import os, resource, signal, time
others = [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]
for pid in others:
    try:
        resource.prlimit(pid, resource.RLIMIT_CPU, (0, 0))
    except OSError:
        pass
for _ in range(2000):
    for pid in others:
        try:
            os.kill(pid, signal.SIGCHLD)
        except OSError:
            pass
time.sleep(0.5)
print('survived')
`

// killKeeperOOM fills the working directory from a process far smaller
// than a Python (head, under sh): the memory cgroup's OOM killer then
// picks the largest process of the instance, which may be the one the
// instance keeps (an init, a run server) rather than the code's. The limit
// was hit: the verdict is memory, as in a fresh run.
const killKeeperOOM = `
import os
os.execv('/bin/sh', ['sh', '-c', 'for i in 1 2 3 4 5 6 7 8 9 10 11 12; do head -c 15000000 /dev/zero > /work/fill$i || break; done; echo done $?'])
`

// asFresh runs code fresh and then as the tenant, recycled: both must give
// a Result (an error says the sandbox failed, and the code must not be able
// to make it say so), with the same reason.
func asFresh(code string) func(t *testing.T, r *recycling) {
	return func(t *testing.T, r *recycling) {
		fresh, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(code)})
		if err != nil {
			t.Fatalf("a fresh run: %v", err)
		}
		t.Logf("fresh: exit %d reason %q stdout %q stderr %q", fresh.ExitCode, fresh.Reason, clip(fresh.Stdout), clip(fresh.Stderr))
		res, err := r.sb.Run(context.Background(), moat.Request{Code: []byte(code), Tenant: "suite"})
		if err != nil {
			t.Fatalf("a recycled run of code that a fresh run judges %q (exit %d) fails the sandbox instead: %v", fresh.Reason, fresh.ExitCode, err)
		}
		t.Logf("recycled: exit %d reason %q stdout %q stderr %q notes %v", res.ExitCode, res.Reason, clip(res.Stdout), clip(res.Stderr), res.Notes)
		if !Recycled(res) {
			t.Fatalf("the run was not recycled: %v", res.Notes)
		}
		// The code may end a fresh run by killing its own init (the
		// shell, its uid); where the instance keeps a process out of its
		// reach the run lives on and ends by itself. Either is a verdict
		// on the code's own doing; an error or another verdict is not.
		if res.Reason != fresh.Reason && !(res.Reason == "" && res.ExitCode == 0) {
			t.Fatalf("a recycled run is judged %q (exit %d), a fresh run of the same code %q (exit %d)", res.Reason, res.ExitCode, fresh.Reason, fresh.ExitCode)
		}
	}
}
