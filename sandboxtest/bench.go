package sandboxtest

import (
	"context"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// BenchmarkWarm times print(1) through sb on its warm path: before each
// timed run it waits, off the clock, for sb's pool to hold a prepared
// instance (a sandbox that is not a moat.PoolReporter, or keeps no pool,
// is timed run after run). It reports "hit/op", the share of runs that
// found an instance ready, which is 1 unless the pool failed to refill
// within a minute. Each level's `go test -bench Warm` calls it.
func BenchmarkWarm(b *testing.B, sb moat.Sandbox) {
	pr, _ := sb.(moat.PoolReporter)
	req := moat.Request{Code: []byte("print(1)")}
	var hits, runs int64
	for b.Loop() {
		if pr != nil && pr.PoolStats().Size > 0 {
			b.StopTimer()
			deadline := time.Now().Add(time.Minute)
			for pr.PoolStats().Ready == 0 && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			b.StartTimer()
		}
		var before moat.PoolStats
		if pr != nil {
			before = pr.PoolStats()
		}
		res, err := sb.Run(context.Background(), req)
		if err != nil || res.ExitCode != 0 || string(res.Stdout) != "1\n" {
			b.Fatalf("%v %+v", err, res)
		}
		runs++
		if pr != nil && pr.PoolStats().Hits > before.Hits {
			hits++
		}
	}
	if pr != nil && runs > 0 {
		b.ReportMetric(float64(hits)/float64(runs), "hit/op")
	}
}
