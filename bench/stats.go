package bench

import (
	"slices"
	"time"
)

// stats summarises a set of timings.
//
// Min and Max are the extremes. Median is the middle timing of the sorted
// set when its size n is odd, and the mean of the two middle ones when n is
// even. P90 uses the nearest-rank method: it is the ⌈0.9·n⌉-th smallest
// timing, so the 9th of 10 runs and the 18th of 20; with fewer than 10 runs
// it equals Max.
type stats struct {
	Min, Median, P90, Max time.Duration
}

// summarize returns the statistics of ds, or zeros when ds is empty. It does
// not modify ds.
func summarize(ds []time.Duration) stats {
	n := len(ds)
	if n == 0 {
		return stats{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	med := s[n/2]
	if n%2 == 0 {
		a, b := s[n/2-1], s[n/2]
		med = a + (b-a)/2
	}
	return stats{Min: s[0], Median: med, P90: s[nearestRank(n, 90)-1], Max: s[n-1]}
}

// nearestRank returns the 1-based rank of the p-th percentile of n sorted
// values by the nearest-rank method: ⌈p/100·n⌉, at least 1.
func nearestRank(n, p int) int {
	r := (p*n + 99) / 100
	return max(r, 1)
}
