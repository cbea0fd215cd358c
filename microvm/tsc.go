package microvm

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

// rdtsc reads the CPU's time-stamp counter (rdtsc_amd64.s).
func rdtsc() uint64

// hostTSCkHz returns the frequency of the host's time-stamp counter in kHz,
// measured once per host boot and cached in the state directory.
//
// Under TCG the guest's TSC ticks at the host's rate. The guest kernel
// cannot always calibrate it against the emulated PIT, and given a wrong
// frequency its clock runs fast or slow (and with it the wall time the
// agent enforces), so moat tells it the frequency on the command line.
func hostTSCkHz(stateDir string) int64 {
	boot, _ := os.ReadFile("/proc/sys/kernel/random/boot_id")
	cache := filepath.Join(stateDir, "microvm", "tsc-"+strings.TrimSpace(string(boot)))
	if b, err := os.ReadFile(cache); err == nil {
		if n, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && n > 0 {
			return n
		}
	}
	// The median of three samples, so that one disturbed by preemption
	// does not count.
	var rates []int64
	for range 3 {
		t0, c0 := time.Now(), rdtsc()
		time.Sleep(50 * time.Millisecond)
		t1, c1 := time.Now(), rdtsc()
		rates = append(rates, int64(float64(c1-c0)/float64(t1.Sub(t0).Nanoseconds())*1e6))
	}
	slices.Sort(rates)
	best := rates[1]
	best = (best + 500) / 1000 * 1000 // to the MHz: the same key for the same host
	old, _ := filepath.Glob(filepath.Join(stateDir, "microvm", "tsc-*"))
	for _, o := range old {
		os.Remove(o)
	}
	os.MkdirAll(filepath.Dir(cache), 0o755)
	os.WriteFile(cache, []byte(strconv.FormatInt(best, 10)+"\n"), 0o644)
	return best
}
