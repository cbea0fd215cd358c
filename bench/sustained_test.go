package bench

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

func sleeper(name string, d time.Duration) Target {
	return Target{Name: name, Run: func(ctx context.Context) error {
		select {
		case <-time.After(d):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}}
}

// A row that takes twice the baseline's time per run sustains fewer runs
// per second than it; failures are counted apart and never timed; runs cut
// by the end of the duration count as neither.
func TestMeasureSustained(t *testing.T) {
	var n atomic.Int64
	flaky := Target{Name: "flaky", Run: func(ctx context.Context) error {
		time.Sleep(time.Millisecond)
		if n.Add(1)%2 == 0 {
			return fmt.Errorf("bench: flaky: odd run")
		}
		return nil
	}}
	rows, err := MeasureSustained(context.Background(), 2, 300*time.Millisecond, sleeper("base", 5*time.Millisecond), sleeper("slow", 20*time.Millisecond), flaky)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3 {
		t.Fatalf("%d rows, want 3", len(rows))
	}
	base, slow, fl := rows[0], rows[1], rows[2]
	t.Logf("%+v\n%+v\n%+v", base, slow, fl)
	if base.Ratio != 1 || base.Runs == 0 || base.Errors != 0 || base.Clients != 2 {
		t.Errorf("baseline: %+v", base)
	}
	if slow.Runs == 0 || slow.Ratio <= 0 || slow.Ratio >= 1 {
		t.Errorf("a row four times slower per run: ratio %.2f, runs %d", slow.Ratio, slow.Runs)
	}
	if slow.P50 < 20*time.Millisecond || slow.P99 < slow.P50 {
		t.Errorf("slow row latency p50 %v p99 %v, want at least its 20ms and p99 >= p50", slow.P50, slow.P99)
	}
	if fl.Errors == 0 || fl.Runs == 0 || fl.FirstError == "" {
		t.Errorf("flaky: %+v, want both runs and errors counted", fl)
	}
}

func TestMeasureSustainedRefuses(t *testing.T) {
	b := sleeper("base", time.Millisecond)
	for _, c := range []struct {
		clients int
		d       time.Duration
		targets []Target
	}{
		{0, time.Second, nil},
		{2, 0, nil},
		{2, time.Second, []Target{sleeper("base", time.Millisecond)}}, // a duplicate name
	} {
		if _, err := MeasureSustained(context.Background(), c.clients, c.d, b, c.targets...); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("clients %d, d %v, %d targets: %v, want ErrInvalid", c.clients, c.d, len(c.targets), err)
		}
	}
}
