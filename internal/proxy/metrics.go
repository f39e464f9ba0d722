package proxy

import (
	"github.com/prefixlb/prefixlb/internal/upstream"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/prefixlb/prefixlb/internal/router"
)

// metrics are the router's own Prometheus metrics, on a private registry
// (served at /metrics) so that two proxies in one process never collide.
type metrics struct {
	reg        *prometheus.Registry
	requests   *prometheus.CounterVec   // policy, replica, code
	decisions  *prometheus.CounterVec   // policy, branch, replica
	inflight   *prometheus.GaugeVec     // replica
	ttft       *prometheus.HistogramVec // replica
	latency    *prometheus.HistogramVec // replica
	predicted  prometheus.Counter
	reported   prometheus.Counter
	outcomes   *prometheus.CounterVec // outcome
	up         *prometheus.GaugeVec   // replica
	retries    *prometheus.CounterVec // replica, reason
	health     *prometheus.CounterVec // replica, result
	scrapeErrs *prometheus.CounterVec // replica
	// tokMatch and tokFallback report the tokenizer probe (set only when
	// a tokenizer keys prompts).
	tokMatch    *prometheus.GaugeVec // replica
	tokFallback prometheus.Gauge
}

// latencyBuckets span 5 ms to ~10 min: TTFT of a cached short prompt to a
// long generation.
var latencyBuckets = prometheus.ExponentialBuckets(0.005, 2, 18)

func newMetrics() *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_requests_total",
			Help: "Client requests by policy, final replica and outcome (HTTP status; \"aborted\": the stream failed after its status was sent; \"cancelled\": the client left).",
		}, []string{"policy", "replica", "code"}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_decisions_total",
			Help: "Routing decisions (retries included) by policy, branch and replica.",
		}, []string{"policy", "branch", "replica"}),
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
		predicted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "prefixlb_cached_tokens_predicted_total",
			Help: "Prompt tokens the router predicted cached, over requests whose replica reported cached tokens.",
		}),
		reported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "prefixlb_cached_tokens_reported_total",
			Help: "Prompt tokens the replicas reported cached (usage.prompt_tokens_details.cached_tokens, or llama.cpp's usage.prompt_tokens - timings.prompt_n).",
		}),
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_cache_predictions_total",
			Help: "Cache predictions checked against the replica's report: exact (within one block), over or under.",
		}, []string{"outcome"}),
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
		scrapeErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_scrape_errors_total",
			Help: "Failed scrapes of a replica's /metrics.",
		}, []string{"replica"}),
		tokMatch: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "prefixlb_tokenizer_match",
			Help: "Whether the router's tokenizer gives the replica's /tokenize ids on the probe prompt and chat: 1 yes, 0 no, -1 unknown (not probed yet, or /tokenize failed).",
		}, []string{"replica"}),
		tokFallback: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "prefixlb_tokenizer_fallback",
			Help: "1 while some replica's tokenizer differs from the router's, so text and chat prompts are keyed by text chunks instead of token ids.",
		}),
	}
	m.reg.MustRegister(m.requests, m.decisions, m.inflight, m.ttft, m.latency, m.predicted,
		m.reported, m.outcomes, m.up, m.retries, m.health, m.scrapeErrs, m.tokMatch, m.tokFallback,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, o := range []string{"exact", "over", "under"} {
		m.outcomes.WithLabelValues(o)
	}
	return m
}

// prediction records one checked cache prediction; blockTokens is the
// tolerance of "exact" (the router's own: one block).
func (m *metrics) prediction(predicted, reported, blockTokens int) {
	m.predicted.Add(float64(predicted))
	m.reported.Add(float64(reported))
	switch d := predicted - reported; {
	case d > blockTokens:
		m.outcomes.WithLabelValues("over").Inc()
	case d < -blockTokens:
		m.outcomes.WithLabelValues("under").Inc()
	default:
		m.outcomes.WithLabelValues("exact").Inc()
	}
}

// The router's view of each replica's cache (router.CacheView) and each
// replica's engine, read under the proxy's lock at scrape time: they are
// as fresh as the last finished request, and never drift from the core.
var (
	descPredictionError = prometheus.NewDesc("prefixlb_cache_prediction_error_tokens",
		"Moving average (about the last 32 reports) of the cached prompt tokens the router predicted minus those the replica reported; positive: the router believes the replica caches more than it does.",
		[]string{"replica"}, nil)
	descCapacity = prometheus.NewDesc("prefixlb_cache_capacity_tokens",
		"The router's current estimate of the replica's cache capacity in tokens, learned from the cached tokens it reports (mirrored block caches; the configured capacity otherwise).",
		[]string{"replica"}, nil)
	descCorrections = prometheus.NewDesc("prefixlb_cache_corrections_total",
		"Reports of cached tokens that changed the router's view of the replica's cache (capacity shrunk or grown, slot contents corrected).",
		[]string{"replica"}, nil)
	descReplicaInfo = prometheus.NewDesc("prefixlb_replica_info",
		"1 for each replica, labelled with its backend kind: vllm, sglang, llamacpp, or unknown (not detected yet, or nothing said).",
		[]string{"replica", "kind"}, nil)
)

// cacheCollector exports the router's cache views and the replicas' kinds.
type cacheCollector struct{ p *Proxy }

// Describe implements prometheus.Collector.
func (c cacheCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPredictionError
	ch <- descCapacity
	ch <- descCorrections
	ch <- descReplicaInfo
}

// Collect implements prometheus.Collector.
func (c cacheCollector) Collect(ch chan<- prometheus.Metric) {
	p := c.p
	type row struct {
		v    router.CacheView
		kind upstream.Kind
	}
	rows := make([]row, len(p.backends))
	p.mu.Lock()
	for i, b := range p.backends {
		rows[i].v, _ = p.rt.CacheView(b.id)
		rows[i].kind = p.engines[b.id].kind
	}
	p.mu.Unlock()
	for i, b := range p.backends {
		r := &rows[i]
		ch <- prometheus.MustNewConstMetric(descPredictionError, prometheus.GaugeValue, r.v.ErrorTokens, b.name)
		ch <- prometheus.MustNewConstMetric(descCapacity, prometheus.GaugeValue, float64(r.v.CapacityTokens), b.name)
		ch <- prometheus.MustNewConstMetric(descCorrections, prometheus.CounterValue, float64(r.v.Corrections), b.name)
		ch <- prometheus.MustNewConstMetric(descReplicaInfo, prometheus.GaugeValue, 1, b.name, string(r.kind))
	}
}
