package bench

import (
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"sort"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
)

// EgressCost is what moat's egress proxy adds to a fetch, measured in one
// run against the same fetch made directly, both over the host's loopback.
type EgressCost struct {
	// Requests is how many requests each latency figure is the median of;
	// each opens its own connection, as a sandbox's first request does.
	Requests int `json:"requests"`
	// Direct and Proxied are the median times of one small GET.
	Direct  time.Duration `json:"direct_ns"`
	Proxied time.Duration `json:"proxied_ns"`
	// Added is Proxied less Direct.
	Added time.Duration `json:"added_ns"`
	// Bytes is the size of the body fetched for the throughput figures.
	Bytes int64 `json:"bytes"`
	// DirectMBps and ProxiedMBps are its throughput, in MB/s (10^6).
	DirectMBps  float64 `json:"direct_mbps"`
	ProxiedMBps float64 `json:"proxied_mbps"`
}

// MeasureEgress measures the proxy over loopback: an upstream server on
// 127.0.0.1 pinned by the policy to the name "upstream.bench.test", a
// proxy for that policy serving on a loopback listener, and n small GETs
// and one fetch of size bytes each way. The proxy's decisions, resolution
// and copying are what is measured; how a level carries a connection to
// the proxy (a listener in the run's namespace, a VM's user network) is
// not.
func MeasureEgress(ctx context.Context, n int, size int64) (EgressCost, error) {
	c := EgressCost{Requests: n, Bytes: size}
	if n <= 0 || size <= 0 {
		return c, fmt.Errorf("bench: egress: %d requests of %d bytes: %w", n, size, moat.ErrInvalid)
	}
	body := make([]byte, 1<<20)
	rand.Read(body)
	up, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return c, fmt.Errorf("bench: egress: %w", err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/big" {
			w.Header().Set("Content-Length", fmt.Sprint(size))
			for left := size; left > 0; {
				k := min(left, int64(len(body)))
				if _, err := w.Write(body[:k]); err != nil {
					return
				}
				left -= k
			}
			return
		}
		io.WriteString(w, "ok\n")
	}), ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(up)
	defer srv.Close()
	port := up.Addr().(*net.TCPAddr).Port
	const name = "upstream.bench.test"
	dir, err := os.MkdirTemp("", "moat-bench-egress-")
	if err != nil {
		return c, fmt.Errorf("bench: egress: %w", err)
	}
	defer os.RemoveAll(dir)
	p, err := egress.New(egress.Config{CADir: dir, Egress: moat.Egress{Network: &moat.Network{
		Allow: []string{fmt.Sprintf("%s:%d", name, port)}, Resolve: map[string]string{name: "127.0.0.1"}}}})
	if err != nil {
		return c, fmt.Errorf("bench: egress: %w", err)
	}
	defer p.Close()
	run := p.NewRun()
	defer run.Close()
	pl, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		return c, fmt.Errorf("bench: egress: %w", err)
	}
	go run.Serve(pl)
	proxyURL := &url.URL{Scheme: "http", Host: pl.Addr().String()}

	direct := &http.Client{Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, up.Addr().String())
		}}}
	proxied := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, Proxy: http.ProxyURL(proxyURL)}}
	target := fmt.Sprintf("http://%s:%d", name, port)
	get := func(cl *http.Client, path string) (int64, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, target+path, nil)
		if err != nil {
			return 0, err
		}
		resp, err := cl.Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return 0, fmt.Errorf("status %s", resp.Status)
		}
		return io.Copy(io.Discard, resp.Body)
	}
	var dts, pts []time.Duration
	for i := 0; i < n+1; i++ { // the first of each is a warm-up
		for _, way := range []struct {
			cl  *http.Client
			out *[]time.Duration
		}{{direct, &dts}, {proxied, &pts}} {
			start := time.Now()
			if _, err := get(way.cl, "/"); err != nil {
				return c, fmt.Errorf("bench: egress: a small GET: %w", err)
			}
			if i > 0 {
				*way.out = append(*way.out, time.Since(start))
			}
		}
	}
	c.Direct, c.Proxied = median(dts), median(pts)
	c.Added = c.Proxied - c.Direct
	for _, way := range []struct {
		cl  *http.Client
		out *float64
	}{{direct, &c.DirectMBps}, {proxied, &c.ProxiedMBps}} {
		start := time.Now()
		got, err := get(way.cl, "/big")
		if err != nil || got != size {
			return c, fmt.Errorf("bench: egress: the big fetch: %d of %d bytes: %v", got, size, err)
		}
		*way.out = float64(size) / 1e6 / time.Since(start).Seconds()
	}
	return c, nil
}

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
