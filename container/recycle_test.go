package container_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os/exec"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/sandboxtest"
)

// TestRuncRecycled runs the shared recycling suite with the runc driver.
func TestRuncRecycled(t *testing.T) {
	needRunc(t)
	sandboxtest.RunRecycled(t, func(t *testing.T, l moat.Limits, logs io.Writer) moat.Sandbox {
		sb, err := moatcontainer.New(moatcontainer.Config{Limits: l, Driver: moatcontainer.DriverRunc, Recycle: true,
			Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
		if err != nil {
			t.Fatalf("container.New with the runc driver, recycling: %v", err)
		}
		return sb
	}, sandboxtest.Options{Leftovers: runcLeftovers})
}

// TestRecycleNeedsRunc checks that recycling with the Docker driver is
// refused, not silently off.
func TestRecycleNeedsRunc(t *testing.T) {
	_, err := moatcontainer.New(moatcontainer.Config{Recycle: true})
	if err == nil || !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("container.New with recycle and the Docker driver: %v, want moat.ErrInvalid", err)
	}
}

// BenchmarkRuncRecycledRun times one tenant's runs in a recycled container
// of the runc driver, each after its reset (the timer stopped while the
// reset runs), and reports the CPU time per run of everything the runs
// and resets cost (moat, and every process of the container, counted once
// the sandbox is closed), and a bare python3 start's, for comparison.
func BenchmarkRuncRecycledRun(b *testing.B) {
	needRunc(b)
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Recycle: true, Warm: -1})
	if err != nil {
		b.Fatal(err)
	}
	run := func() *moat.Result {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print(1)"), Tenant: "bench"})
		if err != nil || string(res.Stdout) != "1\n" {
			b.Fatal(res, err)
		}
		return res
	}
	// parked waits for the tenant's container to be parked again; after
	// the most runs one container serves, none is until a run has a new
	// one made.
	parked := func() bool {
		for deadline := time.Now().Add(5 * time.Second); sb.PoolStats().Parked == 0; {
			if time.Now().After(deadline) {
				return false
			}
			time.Sleep(time.Millisecond)
		}
		return true
	}
	// The tenant's second run has a container made for it.
	run()
	run()
	if !parked() {
		b.Fatal("no container parked for the tenant")
	}
	c0, recycled := cpuTime(), 0
	for b.Loop() {
		b.StopTimer()
		parked()
		b.StartTimer()
		if sandboxtest.Recycled(run()) {
			recycled++
		}
	}
	b.StopTimer()
	parked()
	n := b.N
	sb.Close()
	b.ReportMetric(float64((cpuTime()-c0).Microseconds())/1000/float64(n), "cpu-ms/run")
	b.ReportMetric(float64(recycled)/float64(n), "recycled/run")
	c0 = cpuTime()
	for range 10 {
		exec.Command("/usr/bin/python3", "-c", "print(1)").Run()
	}
	b.ReportMetric(float64((cpuTime()-c0).Microseconds())/1000/10, "python3-cpu-ms/run")
}
