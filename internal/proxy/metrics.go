package proxy

import (
	"sync"

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
	// refused counts requests the front door refused before routing
	// (reason: refusedBodyMemory, refusedPath); ejections the replicas
	// taken out of routing (replica, reason: ejectHealth, ejectDial,
	// ejectBreaker).
	refused   *prometheus.CounterVec
	ejections *prometheus.CounterVec
	// pd and pdPrefill are prefill/decode disaggregation's (pd.go), with
	// prefill-role replicas only.
	pd        *prometheus.CounterVec // outcome
	pdPrefill prometheus.Histogram
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
			Help: "Client requests by policy, final replica and outcome (HTTP status; \"aborted\": the response failed after its status was sent; \"cancelled\": the client left; \"client_timeout\": the client stopped reading for client_write_timeout).",
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
	m.refused = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "prefixlb_refused_total",
		Help: "Requests refused before routing, by reason: body_memory (max_inflight_body_bytes reached: 429), path_not_allowed (not in allowed_paths: 404).",
	}, []string{"reason"})
	m.ejections = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "prefixlb_replica_ejections_total",
		Help: "Replicas taken out of routing, by replica and reason: health (eject_after failed health checks), dial (a refused connection), breaker (breaker_failures of its last breaker_window requests failed).",
	}, []string{"replica", "reason"})
	for _, r := range []string{refusedBodyMemory, refusedPath} {
		m.refused.WithLabelValues(r)
	}
	m.pd = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "prefixlb_pd_requests_total",
		Help: "Requests of a cluster with prefill replicas by outcome: disaggregated (prefilled on a prefill replica, KV moved), local (the policy kept it on one replica), prefill_failed and no_kv_params (the prefill leg failed, or answered without kv_transfer_params: the decode replica prefilled).",
	}, []string{"outcome"})
	m.pdPrefill = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "prefixlb_pd_prefill_seconds",
		Help:    "Time of a disaggregated request's prefill leg, from sending it to its answer.",
		Buckets: latencyBuckets,
	})
	for _, c := range []prometheus.Collector{m.requests, m.inflight, m.ttft, m.latency, m.retries, m.health, m.refused, m.ejections} {
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
		m.latency.MetricVec, m.retries.MetricVec, m.health.MetricVec, m.ejections.MetricVec} {
		v.DeletePartialMatch(l)
	}
}

// Reasons of prefixlb_refused_total and prefixlb_replica_ejections_total.
const (
	refusedBodyMemory = "body_memory"
	refusedPath       = "path_not_allowed"
	ejectHealth       = "health"
	ejectDial         = "dial"
	ejectBreaker      = "breaker"
)

// bodyBytesGauge exports the request-body bytes held (budget b; nil: none
// counted) as prefixlb_inflight_body_bytes.
func (m *metrics) bodyBytesGauge(b *byteBudget) error {
	return m.Reg.Register(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "prefixlb_inflight_body_bytes",
		Help: "Request-body bytes held in memory now, as reserved against max_inflight_body_bytes (0 when it is 0: not counted).",
	}, func() float64 { return float64(b.held()) }))
}

// backendMetrics are one replica's children of the request-path metric
// vectors, each looked up once (WithLabelValues hashes its labels and
// takes the vector's lock on every call) and created when first used, as
// WithLabelValues would create it.
type backendMetrics struct {
	inflight      prometheus.Gauge
	ttft, latency func() prometheus.Observer
	policy, name  string
	requests      *prometheus.CounterVec
	decisionVec   *prometheus.CounterVec
	codes         sync.Map // code → prometheus.Counter
	branches      sync.Map // branch → prometheus.Counter
}

// forBackend returns replica name's metric children, under policy.
func (m *metrics) forBackend(policy, name string) *backendMetrics {
	return &backendMetrics{
		inflight:    m.inflight.WithLabelValues(name),
		ttft:        sync.OnceValue(func() prometheus.Observer { return m.ttft.WithLabelValues(name) }),
		latency:     sync.OnceValue(func() prometheus.Observer { return m.latency.WithLabelValues(name) }),
		policy:      policy,
		name:        name,
		requests:    m.requests,
		decisionVec: m.Decisions,
	}
}

// request is prefixlb_requests_total of a request this replica answered
// last, with outcome code.
func (bm *backendMetrics) request(code string) prometheus.Counter {
	if c, ok := bm.codes.Load(code); ok {
		return c.(prometheus.Counter)
	}
	c := bm.requests.WithLabelValues(bm.policy, bm.name, code)
	bm.codes.Store(code, c)
	return c
}

// decision is the decisions counter of the replica in branch.
func (bm *backendMetrics) decision(branch string) prometheus.Counter {
	if c, ok := bm.branches.Load(branch); ok {
		return c.(prometheus.Counter)
	}
	c := bm.decisionVec.WithLabelValues(bm.policy, branch, bm.name)
	bm.branches.Store(branch, c)
	return c
}
