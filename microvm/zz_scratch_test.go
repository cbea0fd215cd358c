package microvm

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func TestScratchPar(t *testing.T) {
	sb, err := New(Config{Limits: moat.Limits{WallTime: moat.Duration(60 * time.Second)}})
	if err != nil { t.Fatal(err) }
	for _, n := range []int{4, 10, 20} {
		var wg sync.WaitGroup
		t0 := time.Now()
		for i := 0; i < n; i++ {
			wg.Go(func() {
				t1 := time.Now()
				res, err := sb.Run(context.Background(), moat.Request{Code: []byte("import time; t=time.monotonic(); time.sleep(0.3); print(time.monotonic()-t)")})
				if err != nil { t.Log(err); return }
				t.Logf("n=%d %v %q %s %v", n, time.Since(t1), res.Stdout, res.Reason, res.Notes[1])
			})
		}
		wg.Wait()
		t.Logf("n=%d all in %v", n, time.Since(t0))
	}
}
