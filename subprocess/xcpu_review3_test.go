package subprocess_test

import (
	"context"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// TestReview3XCPUAggregateForged: RLIMIT_CPU's SIGXCPU needs the soft limit
// in one process, but XCPUAtLimit takes the reaper's rusage, which counts
// python3's reaped children too. Two children each burning 0.5 s (no
// process near the 1 s soft limit, the run far under its 1.9 s limit), then
// a SIGXCPU the code sends itself: the verdict should be signal.
func TestReview3XCPUAggregateForged(t *testing.T) {
	requireRoot(t)
	l := moat.Limits{CPUTime: moat.Duration(1900 * time.Millisecond)}.WithDefaults()
	sb := newStrict(t, l)
	defer sb.Close()
	code := `
import os, signal, time
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s: pass
kids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        burn(0.5); os._exit(0)
    kids.append(pid)
for k in kids: os.waitpid(k, 0)
os.kill(os.getpid(), signal.SIGXCPU)
`
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("exit=%d reason=%s signal=%s stderr=%q", res.ExitCode, res.Reason, res.Signal, res.Stderr)
	if res.Reason == moat.ReasonTimeout {
		t.Errorf("forged SIGXCPU after 1 s of CPU spread over two children: reason timeout, want signal")
	}
}
