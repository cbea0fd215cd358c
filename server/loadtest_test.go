package server_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// TestLoad is the load test: by default 200 one-shot runs of print(1) from
// 20 concurrent clients at the subprocess level, over loopback. No request
// may fail other than with an explicit 429 or 503, every run must print 1,
// and nothing may be left afterwards (checked by startServer's cleanup). It
// prints the p50 and p99 latency and the runs per second:
//
//	go test ./server -run TestLoad -count=1 -v
//
// MOAT_LOAD_RUNS and MOAT_LOAD_CLIENTS change the counts.
func TestLoad(t *testing.T) {
	runs, clients := envInt("MOAT_LOAD_RUNS", 200), envInt("MOAT_LOAD_CLIENTS", 20)
	ts := startServer(t, moat.Limits{}, nil)
	// Bounded in time as well as in count.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
	defer client.CloseIdleConnections()

	type outcome struct {
		status  int
		latency time.Duration
		stdout  string
		err     error
	}
	jobs := make(chan int)
	results := make(chan outcome, runs)
	var wg sync.WaitGroup
	body, _ := json.Marshal(map[string]string{"code": "print(1)"})
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range jobs {
				req, _ := http.NewRequestWithContext(ctx, "POST", ts.URL+"/v1/runs", bytes.NewReader(body))
				req.Header.Set("Authorization", "Bearer "+tokenA)
				req.Header.Set("Content-Type", "application/json")
				start := time.Now()
				resp, err := client.Do(req)
				if err != nil {
					results <- outcome{err: err}
					continue
				}
				data, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				o := outcome{status: resp.StatusCode, latency: time.Since(start), err: err}
				var res struct {
					Stdout   string `json:"stdout"`
					ExitCode int    `json:"exit_code"`
				}
				if resp.StatusCode == 200 && json.Unmarshal(data, &res) == nil && res.ExitCode == 0 {
					o.stdout = res.Stdout
				}
				results <- o
			}
		}()
	}
	start := time.Now()
	for i := 0; i < runs; i++ {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	elapsed := time.Since(start)
	close(results)

	var lat []time.Duration
	refused := map[int]int{}
	for o := range results {
		switch {
		case o.err != nil:
			t.Errorf("request failed: %v", o.err)
		case o.status == 429 || o.status == 503:
			refused[o.status]++
		case o.status != 200:
			t.Errorf("status %d", o.status)
		case o.stdout != "1\n":
			t.Errorf("a run printed %q", o.stdout)
		default:
			lat = append(lat, o.latency)
		}
	}
	if len(lat) == 0 {
		t.Fatal("no run succeeded")
	}
	slices.Sort(lat)
	pct := func(p float64) time.Duration { return lat[min(len(lat)-1, int(p*float64(len(lat))))] }
	t.Logf("load: %d runs from %d clients in %v: %d ok, %d refused with 429, %d with 503; p50 %v, p99 %v, %.1f runs/s",
		runs, clients, elapsed.Round(time.Millisecond), len(lat), refused[429], refused[503],
		pct(0.50).Round(time.Millisecond), pct(0.99).Round(time.Millisecond), float64(len(lat))/elapsed.Seconds())
	if refused[429]+refused[503] > runs/2 {
		t.Errorf("most runs were refused: %v", refused)
	}
	if v := metric(t, ts, `moat_runs_total{level="subprocess",reason="none"}`); int(v) != len(lat) {
		t.Errorf("the server counted %v runs, the clients %d", v, len(lat))
	}
	// Every run that got a slot took a prepared instance or made its own.
	hits := metric(t, ts, `moat_pool_hits_total{level="subprocess",profile=""}`)
	misses := metric(t, ts, `moat_pool_misses_total{level="subprocess",profile=""}`)
	t.Logf("pool: %v hits, %v misses", hits, misses)
	if int(hits+misses) != len(lat) || metric(t, ts, `moat_pool_size{level="subprocess",profile=""}`) < 1 {
		t.Errorf("the pool served %v+%v runs, the clients saw %d", hits, misses, len(lat))
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}
