// Package bench measures moat's latency: how long one `print(1)` takes, end
// to end, at each isolation level, next to a baseline that starts the same
// Python interpreter directly. It is what `moat bench` prints.
//
// A [Target] is one timed operation: [PythonTarget] is the baseline,
// [SandboxTarget] runs print(1) through any [moat.Sandbox], and
// [CommandTarget] runs any command that prints "1" (a `docker run` row, for
// instance). [Run] runs the baseline and the targets round-robin, so that
// drift on a busy machine hits every row alike, and returns a [Report] with
// the min, median, p90 and max of each row and its ratio to the baseline's
// median.
//
// Every target checks what it ran: a run that did not print exactly "1\n"
// and exit 0 is an error, never a timing.
package bench

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
)

// Target is one row of the bench: an operation that is timed end to end.
type Target struct {
	// Name labels the row, e.g. "python3" or "subprocess". Names must be
	// unique within one [Run].
	Name string
	// Level is the isolation level the target measures, or empty for a
	// baseline that is not a level.
	Level moat.Level
	// Note is free text printed with the row, e.g. a caveat about how the
	// target was set up.
	Note string
	// Run performs the operation once and checks its outcome. It returns
	// an error when the operation failed or produced the wrong output; the
	// bench never times a failure. The error should name the target, as
	// those of the targets this package makes do ("bench: NAME: ..."): it
	// is reported as is. Run must honour ctx.
	Run func(ctx context.Context) error
	// Pool, when not nil, reads the pool of the sandbox the target runs
	// in (moat.PoolReporter): the row then says how many of its measured
	// runs found a prepared instance.
	Pool func() moat.PoolStats
}

// Config says how many runs to make. Its zero value runs 10 measured runs
// after 1 warm-up run, quietly.
type Config struct {
	// Runs is the number of measured runs of each target. Zero means 10.
	Runs int `json:"runs,omitempty"`
	// Warmup is the number of unmeasured runs of each target before the
	// measured ones, to fill caches. Zero means 1; -1 means none.
	Warmup int `json:"warmup,omitempty"`
	// Progress, when not nil, receives one line per round (a run of every
	// target) with that round's timings, and one line per failed target.
	// Write errors are ignored. The CLI passes os.Stderr.
	Progress io.Writer `json:"-"`

	// now reads the clock; nil means time.Now. Tests set it.
	now func() time.Time
}

// DefaultRuns and DefaultWarmup are what a zero [Config] means.
const (
	DefaultRuns   = 10
	DefaultWarmup = 1
)

// WithDefaults returns c with its zero fields set to their defaults, and a
// Warmup of -1 set to 0.
func (c Config) WithDefaults() Config {
	if c.Runs == 0 {
		c.Runs = DefaultRuns
	}
	switch c.Warmup {
	case 0:
		c.Warmup = DefaultWarmup
	case -1:
		c.Warmup = 0
	}
	if c.now == nil {
		c.now = time.Now
	}
	return c
}

// Validate reports whether c can be used. The error wraps [moat.ErrInvalid].
func (c Config) Validate() error {
	if c.Runs < 0 {
		return fmt.Errorf("bench: runs %d is negative: %w", c.Runs, moat.ErrInvalid)
	}
	if c.Warmup < -1 {
		return fmt.Errorf("bench: warm-up %d is below -1 (none): %w", c.Warmup, moat.ErrInvalid)
	}
	return nil
}

// Run measures the baseline and the targets and reports one row for each,
// the baseline first.
//
// The runs are interleaved round-robin: round k runs the baseline once, then
// each target once, in the order given; the warm-up rounds come first and are
// not measured. Each timing covers one call of Target.Run, checking included.
//
// A target that fails stops being run: its row carries the error in Err and
// no statistics, and the other rows complete (see [Report.Err]). When the
// baseline fails, no ratio can be computed and Run returns an error. Run also
// returns an error when cfg or a target is invalid (wrapping
// [moat.ErrInvalid]) and when ctx ends (wrapping ctx's error); it then
// returns no report.
func Run(ctx context.Context, cfg Config, baseline Target, targets ...Target) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	all := append([]Target{baseline}, targets...)
	if err := checkTargets(all); err != nil {
		return nil, err
	}

	samples := make([][]time.Duration, len(all))
	failed := make([]error, len(all))
	// pools are the targets' pool counters before their first measured
	// run; lastEnd when each run of a target ended, and gaps the time
	// from one measured run's end to the next one's start: what its pool
	// had to refill.
	pools := make([]moat.PoolStats, len(all))
	lastEnd := make([]time.Time, len(all))
	gaps := make([][]time.Duration, len(all))
	rounds := cfg.Warmup + cfg.Runs
	for round := range rounds {
		measured := round >= cfg.Warmup
		var line strings.Builder
		if measured {
			fmt.Fprintf(&line, "bench: run %d/%d:", round-cfg.Warmup+1, cfg.Runs)
		} else {
			fmt.Fprintf(&line, "bench: warm-up %d/%d:", round+1, cfg.Warmup)
		}
		for i, t := range all {
			if failed[i] != nil {
				continue
			}
			if err := ctx.Err(); err != nil {
				return nil, fmt.Errorf("bench: %w", err)
			}
			if round == cfg.Warmup && t.Pool != nil {
				pools[i] = t.Pool()
			}
			start := cfg.now()
			if measured && round > 0 {
				gaps[i] = append(gaps[i], start.Sub(lastEnd[i]))
			}
			err := t.Run(ctx)
			lastEnd[i] = cfg.now()
			d := lastEnd[i].Sub(start)
			if err != nil {
				if ctxErr := ctx.Err(); ctxErr != nil {
					return nil, fmt.Errorf("bench: %s: %w", t.Name, ctxErr)
				}
				if i == 0 {
					return nil, fmt.Errorf("bench: baseline %s failed: %w", t.Name, err)
				}
				failed[i] = err
				progress(cfg.Progress, "%v (target dropped)\n", err)
				continue
			}
			if measured {
				samples[i] = append(samples[i], d)
			}
			fmt.Fprintf(&line, " %s %sms", t.Name, formatMS(d))
		}
		progress(cfg.Progress, "%s\n", line.String())
	}

	rep := &Report{Rows: make([]Row, len(all))}
	for i, t := range all {
		row := Row{Name: t.Name, Level: t.Level, Note: t.Note}
		if failed[i] != nil {
			row.Runs = len(samples[i])
			row.Err = failed[i].Error()
		} else {
			row.setStats(samples[i])
		}
		row.Samples = samples[i]
		if len(gaps[i]) > 0 {
			row.MinGap = summarize(gaps[i]).Min
		}
		if t.Pool != nil {
			now := t.Pool()
			row.Pool = &PoolUse{Size: now.Size, Max: now.Max, Hits: now.Hits - pools[i].Hits, Misses: now.Misses - pools[i].Misses,
				Recycled: now.Recycled - pools[i].Recycled}
		}
		rep.Rows[i] = row
	}
	base := rep.Rows[0].Median
	for i := range rep.Rows {
		if rep.Rows[i].Err == "" {
			rep.Rows[i].Ratio = ratio(rep.Rows[i].Median, base)
		}
	}
	return rep, nil
}

// checkTargets rejects unnamed targets, targets without Run and duplicate
// names.
func checkTargets(all []Target) error {
	seen := make(map[string]bool, len(all))
	for i, t := range all {
		if t.Name == "" {
			return fmt.Errorf("bench: target %d has no name: %w", i, moat.ErrInvalid)
		}
		if t.Run == nil {
			return fmt.Errorf("bench: target %s has no Run function: %w", t.Name, moat.ErrInvalid)
		}
		if seen[t.Name] {
			return fmt.Errorf("bench: two targets are named %s: %w", t.Name, moat.ErrInvalid)
		}
		seen[t.Name] = true
	}
	return nil
}

// ratio returns d/base, or 0 when base is not positive.
func ratio(d, base time.Duration) float64 {
	if base <= 0 {
		return 0
	}
	return float64(d) / float64(base)
}

func progress(w io.Writer, format string, args ...any) {
	if w != nil {
		fmt.Fprintf(w, format, args...)
	}
}
