package bench

import (
	"slices"
	"testing"
	"time"
)

func msList(vs ...int) []time.Duration {
	ds := make([]time.Duration, len(vs))
	for i, v := range vs {
		ds[i] = time.Duration(v) * time.Millisecond
	}
	return ds
}

func TestSummarize(t *testing.T) {
	tests := []struct {
		name string
		in   []time.Duration
		want stats
	}{
		{"empty", nil, stats{}},
		{"one", msList(7), stats{Min: 7 * time.Millisecond, Median: 7 * time.Millisecond, P90: 7 * time.Millisecond, Max: 7 * time.Millisecond}},
		{"odd unsorted", msList(5, 1, 4, 2, 3), stats{Min: 1 * time.Millisecond, Median: 3 * time.Millisecond, P90: 5 * time.Millisecond, Max: 5 * time.Millisecond}},
		{"even mean of middle", msList(4, 1, 2, 10), stats{Min: 1 * time.Millisecond, Median: 3 * time.Millisecond, P90: 10 * time.Millisecond, Max: 10 * time.Millisecond}},
		{"ten runs p90 is 9th", msList(10, 9, 8, 7, 6, 5, 4, 3, 2, 100), stats{Min: 2 * time.Millisecond, Median: 6500 * time.Microsecond, P90: 10 * time.Millisecond, Max: 100 * time.Millisecond}},
		{"twenty runs p90 is 18th", msList(20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1), stats{Min: 1 * time.Millisecond, Median: 10500 * time.Microsecond, P90: 18 * time.Millisecond, Max: 20 * time.Millisecond}},
		{"eleven runs", msList(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11), stats{Min: 1 * time.Millisecond, Median: 6 * time.Millisecond, P90: 10 * time.Millisecond, Max: 11 * time.Millisecond}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := slices.Clone(tt.in)
			if got := summarize(in); got != tt.want {
				t.Errorf("summarize(%v) = %+v, want %+v", tt.in, got, tt.want)
			}
			if !slices.Equal(in, tt.in) {
				t.Errorf("summarize reordered its input: %v", in)
			}
		})
	}
}

func TestNearestRank(t *testing.T) {
	for _, tt := range []struct{ n, p, want int }{
		{1, 90, 1}, {5, 90, 5}, {9, 90, 9}, {10, 90, 9}, {11, 90, 10}, {20, 90, 18}, {100, 90, 90}, {10, 50, 5}, {1, 0, 1},
	} {
		if got := nearestRank(tt.n, tt.p); got != tt.want {
			t.Errorf("nearestRank(%d, %d) = %d, want %d", tt.n, tt.p, got, tt.want)
		}
	}
}
