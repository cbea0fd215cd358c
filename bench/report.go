package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/moatsandbox/moat"
)

// Row is the outcome of one target.
type Row struct {
	Name  string
	Level moat.Level // empty for the baseline
	// Runs is the number of measured runs: the configured number, or for a
	// failed row the number that succeeded before the failure.
	Runs int
	// The statistics of the measured runs, as described for [Run]: median
	// of an even number of runs is the mean of the two middle ones, P90 is
	// the nearest-rank 90th percentile. They are zero when Err is set.
	Min, Median, P90, Max time.Duration
	// Ratio is Median divided by the baseline's Median, measured in the
	// same Run; the baseline's own ratio is 1. It is zero when Err is set.
	Ratio float64
	Note  string
	// Err says why the target failed, or is empty.
	Err string
	// MinGap is the shortest time from the end of one of the row's runs
	// to the start of its next (the other rows ran in between): the least
	// time its pool had to refill. Zero with fewer than two runs.
	MinGap time.Duration
	// Pool says how the row's measured runs found the sandbox's pool, or
	// is nil for a target without one (the baseline, a command).
	Pool *PoolUse
	// Samples are the measured runs' times, in the order they ran.
	Samples []time.Duration
}

// PoolUse is what a row's measured runs found in its sandbox's pool of
// prepared instances: Hits took one, Misses prepared their own on the
// run's path (and are timed as such). Size is how many the pool keeps.
type PoolUse struct {
	Size   int   `json:"size"`
	Max    int   `json:"max"`
	Hits   int64 `json:"hits"`
	Misses int64 `json:"misses"`
	// Recycled counts the runs served by an instance an earlier run of
	// the same tenant used (the level's recycle setting); they took
	// nothing from the pool.
	Recycled int64 `json:"recycled,omitempty"`
}

// poolNote is the row's pool, as the table prints it.
func (r Row) poolNote() string {
	if r.Pool == nil {
		return ""
	}
	if r.Pool.Size == 0 {
		return "no pool"
	}
	size := strconv.Itoa(r.Pool.Size)
	if r.Pool.Max > r.Pool.Size {
		size += fmt.Sprintf(" (up to %d)", r.Pool.Max)
	}
	note := fmt.Sprintf("pool of %s: %d/%d runs found one ready (refill gap >= %sms)",
		size, r.Pool.Hits, r.Pool.Hits+r.Pool.Misses+r.Pool.Recycled, formatMS(r.MinGap))
	if r.Pool.Recycled > 0 {
		note += fmt.Sprintf(", %d recycled", r.Pool.Recycled)
	}
	return note
}

func (r *Row) setStats(ds []time.Duration) {
	s := summarize(ds)
	r.Runs = len(ds)
	r.Min, r.Median, r.P90, r.Max = s.Min, s.Median, s.P90, s.Max
}

// MarshalJSON prints the row as `moat bench --json` does: the name, the
// level, the number of runs, the timings in milliseconds rounded to 0.01,
// the ratio rounded to 0.01, the note, and "error" when the row failed.
func (r Row) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Name     string     `json:"name"`
		Level    moat.Level `json:"level"`
		Runs     int        `json:"runs"`
		MinMS    fixed2     `json:"min_ms"`
		MedianMS fixed2     `json:"median_ms"`
		P90MS    fixed2     `json:"p90_ms"`
		MaxMS    fixed2     `json:"max_ms"`
		Ratio    fixed2     `json:"ratio"`
		Note     string     `json:"note"`
		Err      string     `json:"error,omitempty"`
		MinGapMS fixed2     `json:"min_gap_ms"`
		Pool     *PoolUse   `json:"pool,omitempty"`
		Samples  []fixed2   `json:"samples_ms"`
	}{
		Name: r.Name, Level: r.Level, Runs: r.Runs,
		MinMS: ms(r.Min), MedianMS: ms(r.Median), P90MS: ms(r.P90), MaxMS: ms(r.Max),
		Ratio: fixed2(r.Ratio), Note: r.Note, Err: r.Err, MinGapMS: ms(r.MinGap), Pool: r.Pool,
		Samples: samplesMS(r.Samples),
	})
}

func samplesMS(ds []time.Duration) []fixed2 {
	out := make([]fixed2, len(ds))
	for i, d := range ds {
		out[i] = ms(d)
	}
	return out
}

// Report is the outcome of a [Run]: one row per target, the baseline first.
type Report struct {
	Rows []Row `json:"rows"`
}

// Err returns the errors of the failed rows joined, or nil when all
// succeeded.
// The CLI uses it to exit non-zero after printing the report.
func (r *Report) Err() error {
	var errs []error
	for _, row := range r.Rows {
		if row.Err != "" {
			errs = append(errs, errors.New(row.Err))
		}
	}
	return errors.Join(errs...)
}

// WriteJSON writes the report as one indented JSON object,
// {"rows":[{"name", "level", "runs", "min_ms", "median_ms", "p90_ms",
// "max_ms", "ratio", "note", "min_gap_ms", "samples_ms" (every measured
// run), and "pool": {"size", "hits", "misses"} for a sandbox's row}, ...]},
// followed by a newline.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(r); err != nil {
		return fmt.Errorf("bench: write json: %w", err)
	}
	return nil
}

// WriteTable writes the report as an aligned text table, timings in
// milliseconds. A failed row shows its error in place of its timings.
func (r *Report) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "TARGET\tLEVEL\tRUNS\tMIN ms\tMEDIAN ms\tP90 ms\tMAX ms\tRATIO\tNOTE")
	for _, row := range r.Rows {
		level := string(row.Level)
		if level == "" {
			level = "-"
		}
		if row.Err != "" {
			fmt.Fprintf(tw, "%s\t%s\t%d\t-\t-\t-\t-\t-\tFAILED: %s\n", row.Name, level, row.Runs, row.Err)
			continue
		}
		note := row.Note
		if p := row.poolNote(); p != "" {
			note = strings.TrimPrefix(note+"; "+p, "; ")
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%.2fx\t%s\n", row.Name, level, row.Runs,
			formatMS(row.Min), formatMS(row.Median), formatMS(row.P90), formatMS(row.Max), row.Ratio, note)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("bench: write table: %w", err)
	}
	return nil
}

// fixed2 is a number printed in JSON with exactly two decimals.
type fixed2 float64

func (f fixed2) MarshalJSON() ([]byte, error) {
	return strconv.AppendFloat(nil, float64(f), 'f', 2, 64), nil
}

// ms returns d in milliseconds.
func ms(d time.Duration) fixed2 { return fixed2(float64(d) / float64(time.Millisecond)) }

// formatMS prints d in milliseconds with two decimals, without a unit.
func formatMS(d time.Duration) string {
	return strconv.FormatFloat(float64(d)/float64(time.Millisecond), 'f', 2, 64)
}
