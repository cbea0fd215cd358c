package container

import (
	"context"
	"io"
	"testing"
	"time"
)

// BenchmarkWarmPathParts splits the run's path from a started container
// into its parts, each reported as a metric in ms per run: start (writing
// the code), exit (from there to the engine's wait answering: python3's
// run and Docker's exit handling), inspect (the evidence after the exit)
// and discard (the removal of the exited container). Each container is
// prepared, and waits a moment, out of the timing.
func BenchmarkWarmPathParts(b *testing.B) {
	sb, err := New(Config{Warm: -1})
	if err != nil {
		b.Skip(err)
	}
	defer sb.Close()
	var start, exit, inspect, discard time.Duration
	n := 0
	for b.Loop() {
		b.StopTimer()
		inst, err := sb.b.Prepare(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		in := inst.(*instance)
		time.Sleep(200 * time.Millisecond) // python3 reaches its read of stdin
		b.StartTimer()
		t0 := time.Now()
		pr, err := in.Start(context.Background(), []byte("print(1)"), io.Discard, io.Discard)
		if err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		p := pr.(*process)
		<-in.waitC
		in.waited = true
		<-p.outDone
		t2 := time.Now()
		if _, err := in.b.cli.ContainerInspect(context.Background(), in.id); err != nil {
			b.Fatal(err)
		}
		t3 := time.Now()
		in.Discard()
		t4 := time.Now()
		start, exit, inspect, discard = start+t1.Sub(t0), exit+t2.Sub(t1), inspect+t3.Sub(t2), discard+t4.Sub(t3)
		n++
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) / float64(n) }
	b.ReportMetric(ms(start), "start-ms/op")
	b.ReportMetric(ms(exit), "exit-ms/op")
	b.ReportMetric(ms(inspect), "inspect-ms/op")
	b.ReportMetric(ms(discard), "discard-ms/op")
}
