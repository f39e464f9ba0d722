package proxy

import (
	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the router's own Prometheus metrics, on a private registry
// (served at /metrics) so that two proxies in one process never collide.
type metrics struct {
	*cluster.Metrics                          // the ones epp exports too: decisions, predictions, scrape errors, KV events
	requests         *prometheus.CounterVec   // policy, replica, code
	inflight         *prometheus.GaugeVec     // replica
	ttft             *prometheus.HistogramVec // replica
	latency          *prometheus.HistogramVec // replica
	retries          *prometheus.CounterVec   // replica, reason
	health           *prometheus.CounterVec   // replica, result
}

// latencyBuckets span 5 ms to ~10 min: TTFT of a cached short prompt to a
// long generation.
var latencyBuckets = prometheus.ExponentialBuckets(0.005, 2, 18)

func newMetrics() (*metrics, error) {
	cm, err := cluster.NewMetrics("Routing decisions (retries included) by policy, branch and replica.")
	if err != nil {
		return nil, err
	}
	m := &metrics{
		Metrics: cm,
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_requests_total",
			Help: "Client requests by policy, final replica and outcome (HTTP status; \"aborted\": the stream failed after its status was sent; \"cancelled\": the client left).",
		}, []string{"policy", "replica", "code"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "prefixlb_inflight",
			Help: "Requests being forwarded to each replica.",
		}, []string{"replica"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "prefixlb_ttft_seconds",
			Help:    "Time from the client's request to the first output token of a streamed response.",
			Buckets: latencyBuckets,
		}, []string{"replica"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "prefixlb_request_latency_seconds",
			Help:    "Time from the client's request to the end of a successful response.",
			Buckets: latencyBuckets,
		}, []string{"replica"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_retries_total",
			Help: "Attempts that failed before any byte reached the client and were retried, by failed replica and reason.",
		}, []string{"replica", "reason"}),
		health: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_health_checks_total",
			Help: "Active health checks by replica and result (ok, fail).",
		}, []string{"replica", "result"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.inflight, m.ttft, m.latency, m.retries, m.health} {
		if err := m.Reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// replicaAdded creates a replica's series at 0.
func (m *metrics) replicaAdded(name string) {
	m.inflight.WithLabelValues(name)
}

// replicaRemoved deletes the series of a replica that left the pool (the
// shared ones go with cluster.Metrics.ReplicaRemoved).
func (m *metrics) replicaRemoved(name string) {
	l := prometheus.Labels{"replica": name}
	for _, v := range []*prometheus.MetricVec{m.requests.MetricVec, m.inflight.MetricVec, m.ttft.MetricVec,
		m.latency.MetricVec, m.retries.MetricVec, m.health.MetricVec} {
		v.DeletePartialMatch(l)
	}
}
