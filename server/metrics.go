package server

import (
	"github.com/moatsandbox/moat"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the server's Prometheus collectors, on a registry of its own
// so that several servers can live in one process.
type metrics struct {
	reg        *prometheus.Registry
	runs       *prometheus.CounterVec
	latency    *prometheus.HistogramVec
	sessions   *prometheus.GaugeVec
	queue      prometheus.Gauge
	running    prometheus.Gauge
	rejected   *prometheus.CounterVec
	recovered  prometheus.Counter
	sessionEnd *prometheus.CounterVec
	overflows  prometheus.Counter
	conns      prometheus.Gauge
	suspends   *prometheus.CounterVec
	resumes    *prometheus.CounterVec

	// By network profile, for the runs and sessions that name one
	// (moat_runs_total and moat_sessions_active count them too).
	profileRuns     *prometheus.CounterVec
	profileSessions *prometheus.GaugeVec
}

func newMetrics(reg *prometheus.Registry) *metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{
		reg: reg,
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "moat_runs_total",
			Help: "Runs finished, by level and reason (none: the code simply exited; error: the sandbox failed).",
		}, []string{"level", "reason"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "moat_run_duration_seconds",
			Help:    "End-to-end run latency as the server sees it, queueing excluded, by level.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"level"}),
		sessions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "moat_sessions_active",
			Help: "Sessions held, in any state (see moat_sessions), by level.",
		}, []string{"level"}),
		queue: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "moat_run_queue_depth",
			Help: "Runs waiting for a slot.",
		}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "moat_runs_in_progress",
			Help: "Runs holding a slot.",
		}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "moat_runs_rejected_total",
			Help: "Runs refused for load: token_busy (the token's queue share full, 429), busy (queue full, 429) or queue_timeout (503).",
		}, []string{"why"}),
		recovered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "moat_sessions_recovered_total",
			Help: "Sessions found in the database at start, left by a server that did not shut down cleanly, and removed.",
		}),
		sessionEnd: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "moat_sessions_ended_total",
			Help: "Sessions ended, by cause: deleted, expired, idle, shutdown, suspend_failed.",
		}, []string{"cause"}),
		overflows: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "moat_stream_overflows_total",
			Help: "Streaming clients that fell more than the stream buffer behind the output, whose live output stopped.",
		}),
		suspends: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "moat_session_suspends_total",
			Help: "Suspends of sessions, by cause (api, idle, shutdown) and result (ok, error).",
		}, []string{"cause", "result"}),
		resumes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "moat_session_resumes_total",
			Help: "Resumes of suspended sessions, by result: ok, broken (the state was refused), error (it stays suspended).",
		}, []string{"result"}),
		conns: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "moat_http_connections",
			Help: "Connections open on the server's listeners.",
		}),
		profileRuns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "moat_network_profile_runs_total",
			Help: "Runs finished under a network profile, by profile and level (runs without one are not counted here).",
		}, []string{"profile", "level"}),
		profileSessions: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "moat_network_profile_sessions_active",
			Help: "Sessions alive under a network profile, by profile.",
		}, []string{"profile"}),
	}
	m.reg.MustRegister(m.profileRuns, m.profileSessions, m.runs, m.latency, m.sessions, m.queue, m.running, m.rejected, m.recovered, m.sessionEnd, m.overflows, m.conns, m.suspends, m.resumes,
		prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	return m
}

// registerStates adds moat_sessions{state}: the sessions held now, by
// state (running, suspended, broken), counted when scraped.
func (m *metrics) registerStates(count func(state string) int) {
	for _, st := range []string{stateRunning, stateSuspended, stateBroken} {
		m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "moat_sessions",
			Help:        "Sessions held, by state: running, suspended (on disk, nothing running), broken (state refused on resume).",
			ConstLabels: prometheus.Labels{"state": st},
		}, func() float64 { return float64(count(st)) }))
	}
}

// poolCollector reports the pools of prepared instances of the sandboxes
// the server serves (moat.PoolReporter), by level and network profile
// (empty for the sandboxes without one), read when scraped.
type poolCollector struct {
	sandboxes                 map[[2]string]moat.PoolReporter // {level, profile}
	size, ready, hits, misses *prometheus.Desc
	recycled, parked          *prometheus.Desc
}

func newPoolCollector(cfg Config) *poolCollector {
	c := &poolCollector{sandboxes: map[[2]string]moat.PoolReporter{}}
	labels := []string{"level", "profile"}
	c.size = prometheus.NewDesc("moat_pool_size", "Instances a level's pool keeps prepared ahead of runs (a python3 started under the run's restrictions, a container, a gVisor sandbox, a VM restored).", labels, nil)
	c.ready = prometheus.NewDesc("moat_pool_ready", "Instances prepared and waiting now.", labels, nil)
	c.hits = prometheus.NewDesc("moat_pool_hits_total", "Runs that took a prepared instance.", labels, nil)
	c.misses = prometheus.NewDesc("moat_pool_misses_total", "Runs that found none ready and prepared their own on their path.", labels, nil)
	c.recycled = prometheus.NewDesc("moat_pool_recycled_total", "Runs served by an instance an earlier run of the same token used, reset between them (the level's recycle setting).", labels, nil)
	c.parked = prometheus.NewDesc("moat_pool_parked", "Instances reset and waiting for their token's next run (the level's recycle setting).", labels, nil)
	add := func(level moat.Level, profile string, sb moat.Sandbox) {
		if pr, ok := sb.(moat.PoolReporter); ok {
			c.sandboxes[[2]string{string(level), profile}] = pr
		}
	}
	for l, sb := range cfg.Sandboxes {
		add(l, "", sb)
	}
	for p, m := range cfg.Profiles {
		for l, sb := range m {
			add(l, p, sb)
		}
	}
	return c
}

func (c *poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.size
	ch <- c.ready
	ch <- c.hits
	ch <- c.misses
	ch <- c.recycled
	ch <- c.parked
}

func (c *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for k, pr := range c.sandboxes {
		st := pr.PoolStats()
		ch <- prometheus.MustNewConstMetric(c.size, prometheus.GaugeValue, float64(st.Size), k[0], k[1])
		ch <- prometheus.MustNewConstMetric(c.ready, prometheus.GaugeValue, float64(st.Ready), k[0], k[1])
		ch <- prometheus.MustNewConstMetric(c.hits, prometheus.CounterValue, float64(st.Hits), k[0], k[1])
		ch <- prometheus.MustNewConstMetric(c.misses, prometheus.CounterValue, float64(st.Misses), k[0], k[1])
		ch <- prometheus.MustNewConstMetric(c.recycled, prometheus.CounterValue, float64(st.Recycled), k[0], k[1])
		ch <- prometheus.MustNewConstMetric(c.parked, prometheus.GaugeValue, float64(st.Parked), k[0], k[1])
	}
}
