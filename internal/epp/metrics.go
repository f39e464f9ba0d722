package epp

import (
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
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
	reg       *prometheus.Registry
	decisions *prometheus.CounterVec // policy, branch, replica
	prompt    *prometheus.CounterVec // replica
	matched   *prometheus.CounterVec // replica
	latency   prometheus.Histogram
	predicted prometheus.Counter
	reported  prometheus.Counter
	outcomes  *prometheus.CounterVec // outcome
	immediate *prometheus.CounterVec // code
	streams   prometheus.Gauge
	streamsN  prometheus.Counter
	errors    *prometheus.CounterVec // kind
	scrapeErr *prometheus.CounterVec // replica
	kv        *cluster.KV            // the KV-event index, its streams' metrics and prefixlb_kvevents_router_total
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
	m := &metrics{
		reg: prometheus.NewRegistry(),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_decisions_total",
			Help: "Routing decisions by policy, branch and primary replica (a request the gateway served elsewhere counts where it was first routed).",
		}, []string{"policy", "branch", "replica"}),
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
		scrapeErr: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_scrape_errors_total",
			Help: "Failed scrapes of a replica's /metrics.",
		}, []string{"replica"}),
	}
	m.reg.MustRegister(m.decisions, m.prompt, m.matched, m.latency, m.predicted, m.reported, m.outcomes,
		m.immediate, m.streams, m.streamsN, m.errors, m.scrapeErr, stateCollector{p},
		calmetrics.Collector{Rows: p.calibrationRows},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	var err error
	if m.kv, err = cluster.NewKV(m.reg); err != nil {
		panic(err) // distinct names on a fresh registry: a programming error
	}
	for _, o := range []string{"exact", "over", "under"} {
		m.outcomes.WithLabelValues(o)
	}
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
	m.decisions.WithLabelValues(policy, pick.Decision.Branch, pick.Replica).Inc()
	m.prompt.WithLabelValues(pick.Replica).Add(float64(promptTokens))
	m.matched.WithLabelValues(pick.Replica).Add(float64(pick.Decision.MatchedTokens))
	m.latency.Observe(took.Seconds())
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

// replicaAdded creates r's series at 0.
func (m *metrics) replicaAdded(name string, kvEvents bool) {
	m.scrapeErr.WithLabelValues(name)
	if kvEvents {
		for _, o := range cluster.Outcomes {
			m.kv.Applied.WithLabelValues(name, o)
		}
	}
}

// replicaRemoved deletes every series of a replica that left the pool.
func (m *metrics) replicaRemoved(name string) {
	l := prometheus.Labels{"replica": name}
	for _, v := range []*prometheus.MetricVec{m.decisions.MetricVec, m.prompt.MetricVec, m.matched.MetricVec,
		m.scrapeErr.MetricVec, m.kv.Applied.MetricVec} {
		v.DeletePartialMatch(l)
	}
	m.kv.Metrics.Forget(name)
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
	// The router's view of each replica's cache (router.CacheView) and its
	// backend kind; names and help are prefixlb serve's.
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

// stateCollector reads the router's state under the picker's lock.
type stateCollector struct{ p *Picker }

// Describe implements prometheus.Collector.
func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descInflight
	ch <- descShared
	ch <- descUp
	ch <- descTree
	ch <- descPredictionError
	ch <- descCapacity
	ch <- descCorrections
	ch <- descReplicaInfo
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
		v, _ := p.rt.CacheView(r.id)
		ch <- prometheus.MustNewConstMetric(descPredictionError, prometheus.GaugeValue, v.ErrorTokens, r.Name)
		ch <- prometheus.MustNewConstMetric(descCapacity, prometheus.GaugeValue, float64(v.CapacityTokens), r.Name)
		ch <- prometheus.MustNewConstMetric(descCorrections, prometheus.CounterValue, float64(v.Corrections), r.Name)
		ch <- prometheus.MustNewConstMetric(descReplicaInfo, prometheus.GaugeValue, 1, r.Name, string(r.kind))
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
	return promhttp.HandlerFor(p.m.reg, promhttp.HandlerOpts{})
}

// Registry is the picker's private Prometheus registry, for callers that
// add collectors of their own.
func (p *Picker) Registry() *prometheus.Registry { return p.m.reg }

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
