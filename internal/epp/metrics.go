package epp

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/prefixlb/prefixlb/internal/calmetrics"
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
		stateCollector{p}, cluster.CacheCollector{Rows: p.cacheRows}, calmetrics.Collector{Rows: p.calibrationRows})
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

// The router-state gauges, read at scrape time.
var (
	descInflight = prometheus.NewDesc("prefixlb_inflight",
		"Requests this picker routed to the replica and has not seen finish.", []string{"replica"}, nil)
	descShared = prometheus.NewDesc("prefixlb_epp_shared_inflight",
		"The other pickers' in-flight requests on the replica, as last read from the shared state (--state).", []string{"replica"}, nil)
	descUp = prometheus.NewDesc("prefixlb_replica_up",
		"1 if the replica takes requests (its pod is ready), 0 if not.", []string{"replica"}, nil)
	descTree = prometheus.NewDesc("prefixlb_tree_blocks",
		"Blocks held by the router's global prefix tree (bounded by tree_max_blocks).", nil, nil)
	// The tokenizer check's (tokenizer.go), with a tokenizer keyer only;
	// names and help are prefixlb serve's.
	descTokMatch = prometheus.NewDesc("prefixlb_tokenizer_match",
		"Whether the router's tokenizer gives the replica's /tokenize ids on the probe prompt and chat: 1 yes, 0 no, -1 unknown (not probed yet, or /tokenize failed).",
		[]string{"replica"}, nil)
	descTokFallback = prometheus.NewDesc("prefixlb_tokenizer_fallback",
		"1 while some replica's tokenizer differs from the router's, so text and chat prompts are keyed by text chunks instead of token ids.",
		nil, nil)
)

// stateCollector reads the router's state under the picker's lock.
type stateCollector struct{ p *Picker }

// Describe implements prometheus.Collector.
func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descInflight
	ch <- descShared
	ch <- descUp
	ch <- descTree
	if c.p.tok != nil {
		ch <- descTokMatch
		ch <- descTokFallback
	}
}

// Collect implements prometheus.Collector.
func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	p := c.p
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, r := range p.slots {
		if r == nil {
			continue
		}
		st, _ := p.rt.Replica(r.id)
		ext := p.rt.ExternalLoad(r.id).InFlight
		up := 0.0
		if r.Ready {
			up = 1
		}
		ch <- prometheus.MustNewConstMetric(descInflight, prometheus.GaugeValue, float64(st.InFlight-ext), r.Name)
		ch <- prometheus.MustNewConstMetric(descShared, prometheus.GaugeValue, float64(ext), r.Name)
		ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, up, r.Name)
		if p.tok != nil {
			ch <- prometheus.MustNewConstMetric(descTokMatch, prometheus.GaugeValue, float64(r.tokState), r.Name)
		}
	}
	ch <- prometheus.MustNewConstMetric(descTree, prometheus.GaugeValue, float64(p.rt.Tree().Blocks()))
	if p.tok != nil {
		fallback := 0.0
		if p.tok.keyer.Fallback() {
			fallback = 1
		}
		ch <- prometheus.MustNewConstMetric(descTokFallback, prometheus.GaugeValue, fallback)
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

// cacheRows snapshots the router's cache view and the engine of each
// replica, under the picker's lock (cluster.CacheCollector).
func (p *Picker) cacheRows() []cluster.CacheRow {
	p.mu.Lock()
	defer p.mu.Unlock()
	rows := make([]cluster.CacheRow, 0, len(p.byName))
	for _, r := range p.byName {
		v, _ := p.rt.CacheView(r.id)
		rows = append(rows, cluster.CacheRow{Name: r.Name, Cache: v, Kind: r.kind})
	}
	return rows
}

// calibrationRows snapshots each replica's calibration for the metrics
// (calmetrics, the same series as prefixlb serve's).
func (p *Picker) calibrationRows() []calmetrics.Row {
	p.mu.Lock()
	defer p.mu.Unlock()
	rows := make([]calmetrics.Row, 0, len(p.byName))
	for _, r := range p.byName {
		fit, st, ok := p.rt.Calibration(r.id)
		rows = append(rows, calmetrics.Row{Replica: r.Name, Calibrated: ok, Fit: fit, Stats: st})
	}
	return rows // in any order: the registry sorts a family's series
}
