package gvisor_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/internal/egress"
)

// BenchmarkSessionVsOneShot measures, in one run and alternating, how
// long a run of print(1) takes in a session and as a one-shot run (from a
// sandbox booted ahead), and reports the median of each:
//
//	go test -run '^$' -bench SessionVsOneShot -benchtime 10x ./gvisor
func BenchmarkSessionVsOneShot(b *testing.B) { benchSessionVsOneShot(b, moat.SessionOptions{}) }

// BenchmarkInterpreterSessionVsOneShot is BenchmarkSessionVsOneShot with
// a live interpreter in the session:
//
//	go test -run '^$' -bench InterpreterSessionVsOneShot -benchtime 10x ./gvisor
func BenchmarkInterpreterSessionVsOneShot(b *testing.B) {
	benchSessionVsOneShot(b, moat.SessionOptions{Interpreter: true})
}

func benchSessionVsOneShot(b *testing.B, opts moat.SessionOptions) {
	cfg := gvisor.Config{}
	if a := gvisor.Check(context.Background(), cfg); !a.Available {
		b.Skipf("the gvisor level cannot run here: %s", a.Reason)
	}
	sb, err := gvisor.New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	defer sb.Close()
	ctx := context.Background()
	ss, err := sb.NewSession(ctx, opts)
	if err != nil {
		b.Fatal(err)
	}
	defer ss.Close()
	req := moat.Request{Code: []byte("print(1)")}
	timed := func(run func(context.Context, moat.Request) (*moat.Result, error)) time.Duration {
		start := time.Now()
		res, err := run(ctx, req)
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatalf("run: %+v, %v", res, err)
		}
		return time.Since(start)
	}
	// One of each first, unmeasured: the session's first launcher and the
	// first sandbox booted ahead are ready by then.
	timed(ss.Run)
	timed(sb.Run)
	var session, oneShot []time.Duration
	b.ResetTimer()
	for range b.N {
		// Idle between runs as a caller would be, so that what is
		// prepared ahead (the next launcher, the next sandbox) is ready.
		time.Sleep(300 * time.Millisecond)
		session = append(session, timed(ss.Run))
		time.Sleep(300 * time.Millisecond)
		oneShot = append(oneShot, timed(sb.Run))
	}
	b.StopTimer()
	median := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2]) / float64(time.Millisecond)
	}
	b.ReportMetric(median(session), "session-ms")
	b.ReportMetric(median(oneShot), "oneshot-ms")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkEgressOneShot measures, in one run and alternating, how long a
// one-shot run of print(1) takes with an egress proxy and without (no
// network), both from a sandbox booted ahead (warm) and with the boot on
// the run's path (cold: the network namespace, the listener and runsc's
// host network are then on it too), and reports the median of each:
//
//	go test -run '^$' -bench EgressOneShot -benchtime 10x ./gvisor
func BenchmarkEgressOneShot(b *testing.B) {
	if a := gvisor.Check(context.Background(), gvisor.Config{}); !a.Available {
		b.Skipf("the gvisor level cannot run here: %s", a.Reason)
	}
	p, err := egress.New(egress.Config{
		Egress: moat.Egress{Network: &moat.Network{Allow: []string{"pypi.test"}}},
		CADir:  b.TempDir(),
	})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	type variant struct {
		name string
		cfg  gvisor.Config
		sb   *gvisor.Sandbox
		took []time.Duration
	}
	vs := []*variant{
		{name: "none-warm", cfg: gvisor.Config{}},
		{name: "egress-warm", cfg: gvisor.Config{Egress: p}},
		{name: "none-cold", cfg: gvisor.Config{Warm: -1}},
		{name: "egress-cold", cfg: gvisor.Config{Warm: -1, Egress: p}},
	}
	for _, v := range vs {
		if v.sb, err = gvisor.New(v.cfg); err != nil {
			b.Fatal(err)
		}
		defer v.sb.Close()
	}
	ctx := context.Background()
	req := moat.Request{Code: []byte("print(1)")}
	timed := func(sb *gvisor.Sandbox) time.Duration {
		start := time.Now()
		res, err := sb.Run(ctx, req)
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatalf("run: %+v, %v", res, err)
		}
		return time.Since(start)
	}
	for _, v := range vs {
		timed(v.sb) // the first sandbox booted ahead is ready after it
	}
	b.ResetTimer()
	for range b.N {
		for _, v := range vs {
			// Idle between runs as a caller would be, so that the next
			// sandbox booted ahead is ready.
			time.Sleep(300 * time.Millisecond)
			v.took = append(v.took, timed(v.sb))
		}
	}
	b.StopTimer()
	median := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2]) / float64(time.Millisecond)
	}
	m := map[string]float64{}
	for _, v := range vs {
		m[v.name] = median(v.took)
		b.ReportMetric(m[v.name], v.name+"-ms")
	}
	b.ReportMetric(m["egress-warm"]/m["none-warm"], "warm-ratio")
	b.ReportMetric(m["egress-cold"]/m["none-cold"], "cold-ratio")
	b.ReportMetric(0, "ns/op")
}
