package epp

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/prefixlb/prefixlb/internal/cluster"
)

// metrics are the picker's Prometheus metrics, on a private registry (so
// that two pickers in one process never collide). Names are prefixlb
// serve's (internal/proxy) where they mean the same; the ext_proc-only ones
// are prefixlb_epp_*. Gauges of the router's state (in flight, readiness,
// tree size, the tokenizer checks' results) are read under the picker's
// lock at scrape time, so they never drift from it and a replica's series
// leave with it; so are the router's cache views (updated by every finished
// request) and the replicas' backend kinds.
type metrics struct {
	*cluster.Metrics                        // the ones serve exports too: decisions, predictions, scrape errors, KV events
	prompt           *prometheus.CounterVec // replica
	matched          *prometheus.CounterVec // replica
	latency          prometheus.Histogram
	immediate        *prometheus.CounterVec // code
	streams          prometheus.Gauge
	streamsN         prometheus.Counter
	errors           *prometheus.CounterVec // kind
}

// decisionBuckets span 25 µs to ~0.8 s: a decision on a short prompt to one
// that waits out the shared state's 100 ms timeout several times over.
var decisionBuckets = prometheus.ExponentialBuckets(25e-6, 2, 16)

// Immediate-response codes, pre-created at 0 so that a rate() works from
// the first scrape.
var immediateCodes = []int{400, 413, 429, 500, 503}

// Error kinds of prefixlb_epp_errors_total.
const (
	errReceive     = "receive"      // reading from Envoy's stream failed
	errSend        = "send"         // writing to Envoy's stream failed
	errSharedRead  = "shared_read"  // reading the other pickers' load failed
	errSharedWrite = "shared_write" // publishing this picker's load failed
	errRoute       = "route"        // the keyer or the router refused the request (500)
)

func newMetrics(p *Picker) *metrics {
	cm, err := cluster.NewMetrics("Routing decisions by policy, branch and primary replica (a request the gateway served elsewhere counts where it was first routed).")
	if err != nil {
		panic(err) // distinct names on a fresh registry: a programming error
	}
	m := &metrics{
		Metrics: cm,
		prompt: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_prompt_tokens_total",
			Help: "Prompt tokens routed, by primary replica (tokens with --tokenizer, else estimated from bytes).",
		}, []string{"replica"}),
		matched: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_matched_tokens_total",
			Help: "Prompt tokens the router predicted cached on the replica it routed to; divided by prefixlb_prompt_tokens_total, the prefix hit ratio.",
		}, []string{"replica"}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "prefixlb_epp_decision_seconds",
			Help:    "Time to pick for one request: parse, key, read the shared state, route, publish. Successful picks only.",
			Buckets: decisionBuckets,
		}),
		immediate: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_epp_immediate_responses_total",
			Help: "Requests answered by the picker itself (ImmediateResponse) by HTTP status: 503 no endpoint, 429 shed, 400 bad body, 413 too large, 500 internal.",
		}, []string{"code"}),
		streams: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "prefixlb_epp_streams",
			Help: "ext_proc streams open (one per HTTP request the gateway is processing).",
		}),
		streamsN: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "prefixlb_epp_streams_total",
			Help: "ext_proc streams opened.",
		}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_epp_errors_total",
			Help: "Errors by kind: receive/send (the stream with Envoy), shared_read/shared_write (Redis), route (the keyer or router refused a request: 500).",
		}, []string{"kind"}),
	}
	m.Reg.MustRegister(m.prompt, m.matched, m.latency, m.immediate, m.streams, m.streamsN, m.errors,
		stateCollector{p})
	for _, c := range immediateCodes {
		m.immediate.WithLabelValues(strconv.Itoa(c))
	}
	for _, k := range []string{errReceive, errSend, errSharedRead, errSharedWrite, errRoute} {
		m.errors.WithLabelValues(k)
	}
	return m
}

// decided records one successful pick.
func (m *metrics) decided(policy string, pick *Pick, promptTokens int, took time.Duration) {
	m.Decisions.WithLabelValues(policy, pick.Decision.Branch, pick.Replica).Inc()
	m.prompt.WithLabelValues(pick.Replica).Add(float64(promptTokens))
	m.matched.WithLabelValues(pick.Replica).Add(float64(pick.Decision.MatchedTokens))
	m.latency.Observe(took.Seconds())
}

// replicaRemoved deletes every series of a replica that left the pool.
func (m *metrics) replicaRemoved(name string) {
	m.ReplicaRemoved(name)
	l := prometheus.Labels{"replica": name}
	m.prompt.DeletePartialMatch(l)
	m.matched.DeletePartialMatch(l)
}

// The router-state gauges, read at scrape time (the pool's own —
// readiness, tree size, tokenizer checks, cache views, calibration — are
// cluster.Pool's).
var (
	descInflight = prometheus.NewDesc("prefixlb_inflight",
		"Requests this picker routed to the replica and has not seen finish.", []string{"replica"}, nil)
	descShared = prometheus.NewDesc("prefixlb_epp_shared_inflight",
		"The other pickers' in-flight requests on the replica, as last read from the shared state (--state).", []string{"replica"}, nil)
)

// stateCollector reads the router's state under the picker's lock.
type stateCollector struct{ p *Picker }

// Describe implements prometheus.Collector.
func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descInflight
	ch <- descShared
}

// Collect implements prometheus.Collector.
func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range p.pool.Members() {
		own, ext := p.inflight(m)
		ch <- prometheus.MustNewConstMetric(descInflight, prometheus.GaugeValue, float64(own), m.Name)
		ch <- prometheus.MustNewConstMetric(descShared, prometheus.GaugeValue, float64(ext), m.Name)
	}
}

// MetricsHandler serves the picker's Prometheus metrics (the text
// exposition format), for --metrics-listen's /metrics.
func (p *Picker) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(p.m.Reg, promhttp.HandlerOpts{})
}

// Registry is the picker's private Prometheus registry, for callers that
// add collectors of their own.
func (p *Picker) Registry() *prometheus.Registry { return p.m.Reg }
