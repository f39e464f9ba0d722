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
	up               *prometheus.GaugeVec     // replica
	retries          *prometheus.CounterVec   // replica, reason
	health           *prometheus.CounterVec   // replica, result
	// tokMatch and tokFallback report the tokenizer probe (set only when
	// a tokenizer keys prompts).
	tokMatch    *prometheus.GaugeVec // replica
	tokFallback prometheus.Gauge
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
		up: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "prefixlb_replica_up",
			Help: "1 if the replica is in routing, 0 if ejected.",
		}, []string{"replica"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_retries_total",
			Help: "Attempts that failed before any byte reached the client and were retried, by failed replica and reason.",
		}, []string{"replica", "reason"}),
		health: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_health_checks_total",
			Help: "Active health checks by replica and result (ok, fail).",
		}, []string{"replica", "result"}),
		tokMatch: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "prefixlb_tokenizer_match",
			Help: "Whether the router's tokenizer gives the replica's /tokenize ids on the probe prompt and chat: 1 yes, 0 no, -1 unknown (not probed yet, or /tokenize failed).",
		}, []string{"replica"}),
		tokFallback: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "prefixlb_tokenizer_fallback",
			Help: "1 while some replica's tokenizer differs from the router's, so text and chat prompts are keyed by text chunks instead of token ids.",
		}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.inflight, m.ttft, m.latency, m.up, m.retries, m.health,
		m.tokMatch, m.tokFallback} {
		if err := m.Reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// cacheRows snapshots the router's cache view and the engine of each
// replica, under the core's lock (cluster.CacheCollector).
func (p *Proxy) cacheRows() []cluster.CacheRow {
	rows := make([]cluster.CacheRow, len(p.backends))
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, b := range p.backends {
		rows[i].Name = b.name
		rows[i].Cache, _ = p.rt.CacheView(b.id)
		rows[i].Kind = p.engines[b.id].kind
	}
	return rows
}
