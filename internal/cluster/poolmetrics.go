package cluster

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/calmetrics"
)

// The pool's gauges, read under the core's lock at scrape time, so that
// they never drift from it and a replica's series leave with it.
var (
	descUp = prometheus.NewDesc("prefixlb_replica_up",
		"1 if the replica is in routing (ready, and passing serve's health checks), 0 if not.", []string{"replica"}, nil)
	descTree = prometheus.NewDesc("prefixlb_tree_blocks",
		"Blocks held by the router's global prefix tree (bounded by tree_max_blocks).", nil, nil)
	// With a tokenizer keyer only.
	descTokMatch = prometheus.NewDesc("prefixlb_tokenizer_match",
		"Whether the router's tokenizer gives the replica's /tokenize ids on the probe prompt and chat: 1 yes, 0 no, -1 unknown (not probed yet, or /tokenize failed).",
		[]string{"replica"}, nil)
	descTokFallback = prometheus.NewDesc("prefixlb_tokenizer_fallback",
		"1 while some replica's tokenizer differs from the router's, so text and chat prompts are keyed by text chunks instead of token ids.",
		nil, nil)
)

// poolCollector exports the pool's replicas: routing state, tokenizer
// checks, the tree's size and each replica's calibration.
type poolCollector struct{ p *Pool }

// Describe implements prometheus.Collector.
func (c poolCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descUp
	ch <- descTree
	if c.p.tok != nil {
		ch <- descTokMatch
		ch <- descTokFallback
	}
	calmetrics.Collector{}.Describe(ch)
}

// Collect implements prometheus.Collector.
func (c poolCollector) Collect(ch chan<- prometheus.Metric) {
	p := c.p
	var rows []calmetrics.Row
	p.Mu.Lock()
	for _, m := range p.slots {
		if m == nil {
			continue
		}
		ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, boolFloat(m.Up()), m.Name)
		if p.tok != nil {
			ch <- prometheus.MustNewConstMetric(descTokMatch, prometheus.GaugeValue, float64(m.tokState), m.Name)
		}
		fit, st, ok := p.Router.Calibration(m.ID)
		rows = append(rows, calmetrics.Row{Replica: m.Name, Calibrated: ok, Fit: fit, Stats: st})
	}
	ch <- prometheus.MustNewConstMetric(descTree, prometheus.GaugeValue, float64(p.Router.Tree().Blocks()))
	if p.tok != nil {
		ch <- prometheus.MustNewConstMetric(descTokFallback, prometheus.GaugeValue, boolFloat(p.tok.Fallback()))
	}
	p.Mu.Unlock()
	calmetrics.Collector{Rows: func() []calmetrics.Row { return rows }}.Collect(ch)
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
