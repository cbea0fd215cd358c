package egress

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the proxy's counters. Several proxies (one per network
// profile) may share a Registerer: they then share the counters.
type metrics struct {
	requests *prometheus.CounterVec
}

// newMetrics registers moat_egress_requests_total{decision,host} with reg
// (nil: counted but not exported). The host label is the Allow entry that
// matched, or "other".
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	requests := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "moat_egress_requests_total",
		Help: "Requests (CONNECT tunnels and forwarded HTTP requests) the egress proxy decided, by decision and by the allow entry that matched (\"other\" when none did).",
	}, []string{"decision", "host"})
	if reg != nil {
		if err := reg.Register(requests); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return nil, fmt.Errorf("egress: register metrics: %w", err)
			}
			existing, ok := are.ExistingCollector.(*prometheus.CounterVec)
			if !ok {
				return nil, fmt.Errorf("egress: register metrics: %w", err)
			}
			requests = existing
		}
	}
	return &metrics{requests: requests}, nil
}

func (m *metrics) count(d decision) {
	decision := "allowed"
	if !d.allowed {
		decision = "denied"
	}
	m.requests.WithLabelValues(decision, d.label()).Inc()
}
