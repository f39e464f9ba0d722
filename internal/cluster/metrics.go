package cluster

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/prefixlb/prefixlb/internal/router"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// Metrics are the Prometheus metrics both front doors export under the
// same names, on a private registry (so that two routers in one process
// never collide); each front door registers its own beside them.
type Metrics struct {
	Reg *prometheus.Registry
	// Decisions counts routing decisions by policy, branch and replica.
	Decisions *prometheus.CounterVec
	// Predicted, Reported and Outcomes check the router's cache
	// predictions against what the replicas report (Prediction).
	Predicted prometheus.Counter
	Reported  prometheus.Counter
	Outcomes  *prometheus.CounterVec // outcome
	// ScrapeErrs counts failed scrapes of a replica's /metrics.
	ScrapeErrs *prometheus.CounterVec // replica
	// KV is the KV-event index and its metrics.
	KV *KV
}

// NewMetrics registers the shared metrics, and Go's and the process's
// collectors, on a new registry. decisionsHelp is prefixlb_decisions_total's
// help: what a decision counts differs between the front doors.
func NewMetrics(decisionsHelp string) (*Metrics, error) {
	m := &Metrics{
		Reg: prometheus.NewRegistry(),
		Decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_decisions_total",
			Help: decisionsHelp,
		}, []string{"policy", "branch", "replica"}),
		Predicted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "prefixlb_cached_tokens_predicted_total",
			Help: "Prompt tokens the router predicted cached, over requests whose replica reported cached tokens.",
		}),
		Reported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "prefixlb_cached_tokens_reported_total",
			Help: "Prompt tokens the replicas reported cached (usage.prompt_tokens_details.cached_tokens, or llama.cpp's usage.prompt_tokens - timings.prompt_n).",
		}),
		Outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_cache_predictions_total",
			Help: "Cache predictions checked against the replica's report: exact (within one block), over or under.",
		}, []string{"outcome"}),
		ScrapeErrs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_scrape_errors_total",
			Help: "Failed scrapes of a replica's /metrics.",
		}, []string{"replica"}),
	}
	for _, c := range []prometheus.Collector{m.Decisions, m.Predicted, m.Reported, m.Outcomes, m.ScrapeErrs,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		if err := m.Reg.Register(c); err != nil {
			return nil, err
		}
	}
	var err error
	if m.KV, err = NewKV(m.Reg); err != nil {
		return nil, err
	}
	for _, o := range []string{"exact", "over", "under"} {
		m.Outcomes.WithLabelValues(o)
	}
	return m, nil
}

// Prediction records one checked cache prediction; blockTokens is the
// tolerance of "exact" (the router's own: one block).
func (m *Metrics) Prediction(predicted, reported, blockTokens int) {
	m.Predicted.Add(float64(predicted))
	m.Reported.Add(float64(reported))
	switch d := predicted - reported; {
	case d > blockTokens:
		m.Outcomes.WithLabelValues("over").Inc()
	case d < -blockTokens:
		m.Outcomes.WithLabelValues("under").Inc()
	default:
		m.Outcomes.WithLabelValues("exact").Inc()
	}
}

// ReplicaAdded creates a replica's series at 0: its scrape errors, and
// with KV events what they did to the router.
func (m *Metrics) ReplicaAdded(name string, kvEvents bool) {
	m.ScrapeErrs.WithLabelValues(name)
	if kvEvents {
		for _, o := range Outcomes {
			m.KV.Applied.WithLabelValues(name, o)
		}
	}
}

// ReplicaRemoved deletes the series of a replica that left the pool.
func (m *Metrics) ReplicaRemoved(name string) {
	l := prometheus.Labels{"replica": name}
	for _, v := range []*prometheus.MetricVec{m.Decisions.MetricVec, m.ScrapeErrs.MetricVec, m.KV.Applied.MetricVec} {
		v.DeletePartialMatch(l)
	}
	m.KV.Metrics.Forget(name)
}

// The router's view of each replica's cache (router.CacheView) and each
// replica's engine, read under the core's lock at scrape time: they are as
// fresh as the last finished request, and never drift from the core.
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
	descKVCapacity = prometheus.NewDesc("prefixlb_replica_kv_capacity_tokens",
		"The replica's KV cache in tokens as the router prices it, labelled with where it came from: engine:vllm-metrics (vllm:cache_config_info), engine:sglang-metrics, engine:sglang-server-info, engine:llamacpp-props, engine:llamacpp-slots, or profile (the engine did not say).",
		[]string{"replica", "source"}, nil)
	descReplicaInfo = prometheus.NewDesc("prefixlb_replica_info",
		"1 for each replica, labelled with its backend kind: vllm, sglang, llamacpp, or unknown (not detected yet, or nothing said).",
		[]string{"replica", "kind"}, nil)
)

// CacheRow is one replica's row of CacheCollector.
type CacheRow struct {
	Name  string
	Cache router.CacheView
	Kind  upstream.Kind
}

// CacheCollector exports the router's cache views and the replicas' kinds.
// Rows snapshots them (under the core's lock); the registry sorts series.
type CacheCollector struct{ Rows func() []CacheRow }

// Describe implements prometheus.Collector.
func (c CacheCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descPredictionError
	ch <- descCapacity
	ch <- descCorrections
	ch <- descKVCapacity
	ch <- descReplicaInfo
}

// Collect implements prometheus.Collector.
func (c CacheCollector) Collect(ch chan<- prometheus.Metric) {
	for _, r := range c.Rows() {
		ch <- prometheus.MustNewConstMetric(descPredictionError, prometheus.GaugeValue, r.Cache.ErrorTokens, r.Name)
		ch <- prometheus.MustNewConstMetric(descCapacity, prometheus.GaugeValue, float64(r.Cache.CapacityTokens), r.Name)
		ch <- prometheus.MustNewConstMetric(descCorrections, prometheus.CounterValue, float64(r.Cache.Corrections), r.Name)
		ch <- prometheus.MustNewConstMetric(descKVCapacity, prometheus.GaugeValue, float64(r.Cache.ConfiguredCapacityTokens), r.Name, r.Cache.ConfiguredCapacitySource)
		ch <- prometheus.MustNewConstMetric(descReplicaInfo, prometheus.GaugeValue, 1, r.Name, string(r.Kind))
	}
}
