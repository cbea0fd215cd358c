package microvm

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// An interpreter session whose VM comes from the pool gets, as its
// interpreter, the python3 that the pool's Refresh started (in a run's
// cgroup, run-N, where an interpreter the session started itself has one
// of its own, interp-N): Python's start is off the session's path. It is
// still the VM's own: two such sessions draw different hash secrets, and
// the interpreter keeps its variables from run to run.
func TestInterpreterFromPoolZygote(t *testing.T) {
	parallel(t)
	sb := open(t, requireVMs(t), moat.Limits{})
	waitForPool(t, sb)
	probe := "x = 41\nprint(open('/proc/self/cgroup').read().strip().rsplit('/', 1)[-1], hash('moat-seed'))\n"
	var hashes []string
	for i := range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		is, err := sb.NewSession(ctx, moat.SessionOptions{Interpreter: true})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		defer is.Close()
		if vs := vmOf(t, is); !fromThePool(vs) {
			t.Fatalf("session %d: the VM did not come from the pool: %s", i, vs.how)
		}
		f := strings.Fields(runOK(t, is, probe))
		if len(f) != 2 {
			t.Fatalf("session %d: the probe printed %q", i, f)
		}
		if !strings.HasPrefix(f[0], "run-") {
			t.Errorf("session %d: the interpreter's cgroup is %s: it is not the python3 the pool started (run-N)", i, f[0])
		}
		for _, h := range hashes {
			if h == f[1] {
				t.Errorf("session %d: hash('moat-seed') = %s, as in the session before: the hash secret is not the VM's own", i, h)
			}
		}
		hashes = append(hashes, f[1])
		if out := runOK(t, is, "print(x + 1)"); out != "42\n" {
			t.Errorf("session %d: the second run printed %q, want the variable kept", i, out)
		}
	}
}
