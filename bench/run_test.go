package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// fakeClock is a clock that only moves when a fake target runs.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { return c.t }

// recorder makes fake targets that advance the clock by a set duration per
// call and record the order of calls.
type recorder struct {
	clock *fakeClock
	calls []string
}

// target returns a fake target whose i-th call (0-based) takes durs[i %
// len(durs)] and fails when fail(i) is true.
func (r *recorder) target(name string, level moat.Level, durs []time.Duration, fail func(i int) bool) Target {
	n := 0
	return Target{
		Name:  name,
		Level: level,
		Note:  "note of " + name,
		Run: func(ctx context.Context) error {
			i := n
			n++
			r.calls = append(r.calls, fmt.Sprintf("%s#%d", name, i))
			r.clock.t = r.clock.t.Add(durs[i%len(durs)])
			if fail != nil && fail(i) {
				return errors.New("fake failure")
			}
			return nil
		},
	}
}

func newRecorder() *recorder {
	return &recorder{clock: &fakeClock{t: time.Unix(1e9, 0)}}
}

func TestRunRoundRobin(t *testing.T) {
	r := newRecorder()
	one := msList(1)
	cfg := Config{Runs: 3, Warmup: 2, now: r.clock.now}
	_, err := Run(context.Background(), cfg,
		r.target("base", "", one, nil),
		r.target("a", moat.LevelSubprocess, one, nil),
		r.target("b", moat.LevelContainer, one, nil))
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for i := range 5 {
		for _, name := range []string{"base", "a", "b"} {
			want = append(want, fmt.Sprintf("%s#%d", name, i))
		}
	}
	if !slices.Equal(r.calls, want) {
		t.Errorf("call order:\n got %v\nwant %v", r.calls, want)
	}
}

func TestRunDefaultsAndNoWarmup(t *testing.T) {
	tests := []struct {
		cfg       Config
		wantCalls int
		wantRuns  int
	}{
		{Config{}, DefaultRuns + DefaultWarmup, DefaultRuns},
		{Config{Warmup: -1}, DefaultRuns, DefaultRuns},
		{Config{Runs: 4, Warmup: 3}, 7, 4},
	}
	for _, tt := range tests {
		r := newRecorder()
		tt.cfg.now = r.clock.now
		rep, err := Run(context.Background(), tt.cfg, r.target("base", "", msList(1), nil))
		if err != nil {
			t.Fatal(err)
		}
		if len(r.calls) != tt.wantCalls || rep.Rows[0].Runs != tt.wantRuns {
			t.Errorf("Run(%+v): %d calls and %d runs, want %d and %d", tt.cfg, len(r.calls), rep.Rows[0].Runs, tt.wantCalls, tt.wantRuns)
		}
	}
}

func TestRunStatsAndRatio(t *testing.T) {
	r := newRecorder()
	// The warm-up call (index 0) is slow and must not count.
	base := r.target("python3", "", msList(1000, 10, 12, 8, 11), nil)
	fast := r.target("fast", moat.LevelSubprocess, msList(1000, 15, 18, 12, 16), nil)
	slow := r.target("slow", moat.LevelGVisor, msList(1000, 200, 260, 240, 180), nil)
	rep, err := Run(context.Background(), Config{Runs: 4, now: r.clock.now}, base, fast, slow)
	if err != nil {
		t.Fatal(err)
	}
	want := []Row{
		{Name: "python3", Runs: 4, Min: 8 * time.Millisecond, Median: 10500 * time.Microsecond, P90: 12 * time.Millisecond, Max: 12 * time.Millisecond, Ratio: 1, Note: "note of python3", MinGap: 215 * time.Millisecond, Samples: msList(10, 12, 8, 11)},
		{Name: "fast", Level: moat.LevelSubprocess, Runs: 4, Min: 12 * time.Millisecond, Median: 15500 * time.Microsecond, P90: 18 * time.Millisecond, Max: 18 * time.Millisecond, Ratio: 15.5 / 10.5, Note: "note of fast", MinGap: 212 * time.Millisecond, Samples: msList(15, 18, 12, 16)},
		{Name: "slow", Level: moat.LevelGVisor, Runs: 4, Min: 180 * time.Millisecond, Median: 220 * time.Millisecond, P90: 260 * time.Millisecond, Max: 260 * time.Millisecond, Ratio: 220 / 10.5, Note: "note of slow", MinGap: 20 * time.Millisecond, Samples: msList(200, 260, 240, 180)},
	}
	// MinGap: the least time between one run's end and the next run's
	// start of the same row, the other rows' runs of the round between:
	// python3's is fast's 15ms and slow's 200ms of the second round.
	if !reflect.DeepEqual(rep.Rows, want) {
		t.Errorf("rows:\n got %+v\nwant %+v", rep.Rows, want)
	}
	if err := rep.Err(); err != nil {
		t.Errorf("Err() = %v, want nil", err)
	}
}

func TestRunFailingTargetKeepsOthers(t *testing.T) {
	r := newRecorder()
	one := msList(1)
	var progress bytes.Buffer
	rep, err := Run(context.Background(), Config{Runs: 3, Warmup: -1, Progress: &progress, now: r.clock.now},
		r.target("base", "", one, nil),
		r.target("bad", moat.LevelSubprocess, one, func(i int) bool { return i == 1 }),
		r.target("good", moat.LevelContainer, msList(2), nil))
	if err != nil {
		t.Fatal(err)
	}
	// bad is not called again after its failure in round 2.
	want := []string{"base#0", "bad#0", "good#0", "base#1", "bad#1", "good#1", "base#2", "good#2"}
	if !slices.Equal(r.calls, want) {
		t.Errorf("call order:\n got %v\nwant %v", r.calls, want)
	}
	bad := rep.Rows[1]
	if bad.Err == "" || !strings.Contains(bad.Err, "fake failure") {
		t.Errorf("failed row Err = %q, want the failure", bad.Err)
	}
	if bad.Median != 0 || bad.Ratio != 0 || bad.Runs != 1 {
		t.Errorf("failed row has statistics: %+v", bad)
	}
	good := rep.Rows[2]
	if good.Err != "" || good.Runs != 3 || good.Median != 2*time.Millisecond || good.Ratio != 2 {
		t.Errorf("good row = %+v, want 3 runs, 2ms median, ratio 2", good)
	}
	if err := rep.Err(); err == nil || err.Error() != bad.Err {
		t.Errorf("Err() = %v, want the failed row's error %q", err, bad.Err)
	}
	if !strings.Contains(progress.String(), "fake failure (target dropped)") {
		t.Errorf("progress does not report the failure:\n%s", progress.String())
	}
	var table bytes.Buffer
	if err := rep.WriteTable(&table); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(table.String(), "FAILED: ") {
		t.Errorf("table does not show the failure:\n%s", table.String())
	}
}

func TestRunFailingBaselineFails(t *testing.T) {
	r := newRecorder()
	one := msList(1)
	rep, err := Run(context.Background(), Config{Runs: 3, now: r.clock.now},
		r.target("base", "", one, func(i int) bool { return i == 2 }),
		r.target("a", moat.LevelSubprocess, one, nil))
	if err == nil || !strings.Contains(err.Error(), "baseline base failed") {
		t.Fatalf("Run with a failing baseline: err = %v, want the baseline's failure", err)
	}
	if rep != nil {
		t.Errorf("Run returned a report with an error: %+v", rep)
	}
}

func TestRunCanceled(t *testing.T) {
	r := newRecorder()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := Target{Name: "stop", Run: func(ctx context.Context) error {
		cancel()
		return ctx.Err()
	}}
	_, err := Run(ctx, Config{now: r.clock.now}, r.target("base", "", msList(1), nil), stop)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if len(r.calls) != 1 {
		t.Errorf("baseline ran %d times after cancel, want 1 in all", len(r.calls))
	}
}

func TestRunInvalid(t *testing.T) {
	ok := Target{Name: "ok", Run: func(context.Context) error { return nil }}
	tests := []struct {
		name    string
		cfg     Config
		targets []Target
	}{
		{"negative runs", Config{Runs: -1}, []Target{ok}},
		{"warm-up below -1", Config{Warmup: -2}, []Target{ok}},
		{"no name", Config{}, []Target{ok, {Run: ok.Run}}},
		{"no run", Config{}, []Target{ok, {Name: "x"}}},
		{"duplicate", Config{}, []Target{ok, ok}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Run(context.Background(), tt.cfg, tt.targets[0], tt.targets[1:]...)
			if !errors.Is(err, moat.ErrInvalid) {
				t.Errorf("err = %v, want ErrInvalid", err)
			}
		})
	}
}

func TestWriteJSONShape(t *testing.T) {
	rep := &Report{Rows: []Row{
		{Name: "python3", Runs: 10, Min: 12345678, Median: 13 * time.Millisecond, P90: 14 * time.Millisecond, Max: 15 * time.Millisecond, Ratio: 1, Note: "n"},
		{Name: "subprocess", Level: moat.LevelSubprocess, Runs: 10, Min: 16 * time.Millisecond, Median: 17 * time.Millisecond, P90: 18 * time.Millisecond, Max: 19 * time.Millisecond, Ratio: 17.0 / 13},
		{Name: "bad", Level: moat.LevelContainer, Runs: 2, Err: "boom"},
	}}
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var got struct {
		Rows []map[string]json.RawMessage `json:"rows"`
	}
	dec := json.NewDecoder(bytes.NewReader(buf.Bytes()))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("decode %s: %v", buf.String(), err)
	}
	if len(got.Rows) != 3 {
		t.Fatalf("got %d rows, want 3: %s", len(got.Rows), buf.String())
	}
	fields := []string{"name", "level", "runs", "min_ms", "median_ms", "p90_ms", "max_ms", "ratio", "note", "min_gap_ms", "samples_ms"}
	for i, row := range got.Rows {
		keys := make([]string, 0, len(row))
		for k := range row {
			keys = append(keys, k)
		}
		want := slices.Clone(fields)
		if rep.Rows[i].Err != "" {
			want = append(want, "error")
		}
		slices.Sort(keys)
		slices.Sort(want)
		if !slices.Equal(keys, want) {
			t.Errorf("row %d has fields %v, want %v", i, keys, want)
		}
	}
	for key, want := range map[string]string{
		"name": `"python3"`, "level": `""`, "runs": `10`, "min_ms": `12.35`, "median_ms": `13.00`,
		"p90_ms": `14.00`, "max_ms": `15.00`, "ratio": `1.00`, "note": `"n"`,
	} {
		if got := string(got.Rows[0][key]); got != want {
			t.Errorf("baseline %s = %s, want %s", key, got, want)
		}
	}
	if got := string(got.Rows[1]["ratio"]); got != "1.31" {
		t.Errorf("subprocess ratio = %s, want 1.31", got)
	}
	if got := string(got.Rows[2]["error"]); got != `"boom"` {
		t.Errorf("failed row error = %s, want \"boom\"", got)
	}
}

func TestWriteTable(t *testing.T) {
	rep := &Report{Rows: []Row{
		{Name: "python3", Runs: 10, Median: 13 * time.Millisecond, Ratio: 1},
		{Name: "subprocess", Level: moat.LevelSubprocess, Runs: 10, Median: 17 * time.Millisecond, Ratio: 17.0 / 13, Note: "a note"},
	}}
	var buf bytes.Buffer
	if err := rep.WriteTable(&buf); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(buf.String(), "\n"), "\n")
	if len(lines) != 3 {
		t.Fatalf("table has %d lines, want a header and 2 rows:\n%s", len(lines), buf.String())
	}
	for i, want := range [][]string{
		{"TARGET", "LEVEL", "RUNS", "MEDIAN", "RATIO", "NOTE"},
		{"python3", "-", "10", "13.00", "1.00x"},
		{"subprocess", "subprocess", "10", "17.00", "1.31x", "a note"},
	} {
		for _, w := range want {
			if !strings.Contains(lines[i], w) {
				t.Errorf("line %d %q lacks %q", i, lines[i], w)
			}
		}
	}
	// Columns are aligned: RATIO starts at the same offset on every line.
	col := strings.Index(lines[0], "RATIO")
	if strings.Index(lines[1], "1.00x") != col || strings.Index(lines[2], "1.31x") != col {
		t.Errorf("columns not aligned:\n%s", buf.String())
	}
}

// A row whose target has a pool says how many of its measured runs found
// an instance ready: the warm-up's take is not counted.
func TestRunPoolUse(t *testing.T) {
	r := newRecorder()
	var st moat.PoolStats
	st.Size = 1
	n := 0
	pooled := r.target("pooled", moat.LevelSubprocess, msList(5, 5, 5, 5, 5), nil)
	run := pooled.Run
	pooled.Run = func(ctx context.Context) error {
		// The first two runs (the warm-up and one measured) find one
		// ready, the rest miss.
		if n++; n <= 2 {
			st.Hits++
		} else {
			st.Misses++
		}
		return run(ctx)
	}
	pooled.Pool = func() moat.PoolStats { return st }
	rep, err := Run(context.Background(), Config{Runs: 4, now: r.clock.now}, r.target("base", "", msList(1), nil), pooled)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := rep.Rows[1].Pool, (&PoolUse{Size: 1, Hits: 1, Misses: 3}); got == nil || *got != *want {
		t.Errorf("pool use %+v, want %+v", got, want)
	}
	if rep.Rows[0].Pool != nil {
		t.Errorf("the baseline has a pool: %+v", rep.Rows[0].Pool)
	}
	var buf bytes.Buffer
	rep.WriteTable(&buf)
	if !strings.Contains(buf.String(), "pool of 1: 1/4 runs found one ready") {
		t.Errorf("the table does not say the pool use:\n%s", buf.String())
	}
}
