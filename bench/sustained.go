package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
)

// Sustained is what one target did under sustained load: Clients
// goroutines each running the target back to back for Duration.
type Sustained struct {
	Name     string        `json:"name"`
	Level    moat.Level    `json:"level,omitempty"`
	Clients  int           `json:"clients"`
	Duration time.Duration `json:"duration_ns"`
	// Runs counts the runs that ended within Duration and succeeded,
	// Errors those that failed (a failed run is not timed). RunsPerSec is
	// Runs over the time from the start to the last run's end.
	Runs       int     `json:"runs"`
	Errors     int     `json:"errors"`
	RunsPerSec float64 `json:"runs_per_sec"`
	// P50 and P99 are the latency of the successful runs, nearest rank.
	P50 time.Duration `json:"p50_ns"`
	P99 time.Duration `json:"p99_ns"`
	// Ratio is RunsPerSec over the baseline's, the bare interpreter
	// started by as many clients in the same measurement; 1 for the
	// baseline itself.
	Ratio float64 `json:"ratio"`
	// FirstError is the first failure's message, when there was one.
	FirstError string `json:"first_error,omitempty"`
}

// MeasureSustained runs the baseline and then each target with clients
// concurrent clients for d each, and reports runs per second, latency and
// the ratio of each to the baseline's throughput. Runs still in progress
// at d are cancelled and not counted. clients and d must be positive and
// the names unique (moat.ErrInvalid otherwise); a target whose every run
// failed is reported with Runs 0 and its first error, not as an error.
func MeasureSustained(ctx context.Context, clients int, d time.Duration, baseline Target, targets ...Target) ([]Sustained, error) {
	if clients <= 0 || d <= 0 {
		return nil, fmt.Errorf("bench: sustained: clients %d and duration %v must be positive: %w", clients, d, moat.ErrInvalid)
	}
	all := append([]Target{baseline}, targets...)
	if err := checkTargets(all); err != nil {
		return nil, err
	}
	var out []Sustained
	for _, t := range all {
		s, err := sustain(ctx, t, clients, d)
		if err != nil {
			return out, err
		}
		if len(out) > 0 && out[0].RunsPerSec > 0 {
			s.Ratio = s.RunsPerSec / out[0].RunsPerSec
		} else if len(out) == 0 {
			s.Ratio = 1
		}
		out = append(out, s)
	}
	return out, nil
}

// sustain runs t with clients goroutines for d.
func sustain(ctx context.Context, t Target, clients int, d time.Duration) (Sustained, error) {
	s := Sustained{Name: t.Name, Level: t.Level, Clients: clients, Duration: d}
	runCtx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var (
		mu    sync.Mutex
		lat   []time.Duration
		last  time.Time
		first error
		wg    sync.WaitGroup
	)
	start := time.Now()
	for i := 0; i < clients; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for runCtx.Err() == nil {
				t0 := time.Now()
				err := t.Run(runCtx)
				end := time.Now()
				if runCtx.Err() != nil {
					return // cut by the end of d: neither a run nor a failure
				}
				mu.Lock()
				if err != nil {
					s.Errors++
					if first == nil {
						first = err
					}
				} else {
					lat = append(lat, end.Sub(t0))
					last = end
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return s, err
	}
	if first != nil {
		s.FirstError = first.Error()
		if errors.Is(first, moat.ErrInvalid) {
			return s, first // a target that cannot run at all
		}
	}
	s.Runs = len(lat)
	if s.Runs > 0 {
		s.RunsPerSec = float64(s.Runs) / last.Sub(start).Seconds()
		slices.Sort(lat)
		s.P50, s.P99 = lat[nearestRank(len(lat), 50)-1], lat[nearestRank(len(lat), 99)-1]
	}
	return s, nil
}
