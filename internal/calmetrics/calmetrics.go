// Package calmetrics exports what the router has learnt of each replica's
// speed (internal/calibrate) as Prometheus metrics, for every front door
// (`prefixlb serve` and `prefixlb epp`): the one collector both register.
package calmetrics

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/calibrate"
)

// Row is one replica's figures at a scrape.
type Row struct {
	// Replica names the replica (the metrics' replica label).
	Replica string
	// Calibrated says the router learns this replica's speed; Fit and
	// Stats are then its model's. Without calibration Fit still carries
	// the configured profile's figures (its fitted figures equal them).
	Calibrated bool
	Fit        calibrate.Fit
	Stats      calibrate.Stats
}

// Collector is a prometheus.Collector of the calibration metrics. Rows is
// called at every scrape and must return a snapshot (take the router's lock
// inside it, not across the scrape).
type Collector struct {
	Rows func() []Row
}

var _ prometheus.Collector = Collector{}

var (
	descPrefill = prometheus.NewDesc("prefixlb_replica_prefill_seconds_per_1k_tokens",
		"Seconds the router prices a cold 1,000-token prefill at on the replica: its calibrated model when calibrating (learnt online from first tokens, finishes and llama.cpp's timings), else its configured profile.",
		[]string{"replica"}, nil)
	descDecode = prometheus.NewDesc("prefixlb_replica_decode_step_seconds",
		"Seconds the router prices one decode step at on the replica (one sequence with 1,000 tokens of context): calibrated when calibrating, else the configured profile.",
		[]string{"replica"}, nil)
	descProfilePrefill = prometheus.NewDesc("prefixlb_replica_profile_prefill_seconds_per_1k_tokens",
		"The configured profile's cold 1,000-token prefill on the replica, in seconds: the prior calibration starts from.",
		[]string{"replica"}, nil)
	descProfileDecode = prometheus.NewDesc("prefixlb_replica_profile_decode_step_seconds",
		"The configured profile's decode step on the replica (one sequence, 1,000 tokens of context), in seconds.",
		[]string{"replica"}, nil)
	descError = prometheus.NewDesc("prefixlb_replica_calibration_error_ratio",
		"Moving average (about the last 20 observations) of |predicted/observed - 1| of the calibrated model, each prediction made before the model learnt from that observation.",
		[]string{"replica", "phase"}, nil)
	descProfileError = prometheus.NewDesc("prefixlb_replica_calibration_profile_error_ratio",
		"The same moving average for the configured profile on the same observations: what calibration saves.",
		[]string{"replica", "phase"}, nil)
	descObservations = prometheus.NewDesc("prefixlb_replica_calibration_observations_total",
		"Observations the calibrated model learnt from, by phase and source: prefill from busy periods (period) or llama.cpp's timings (timings); decode from the median gap between streamed tokens (itl), timings, or first token to end (clock).",
		[]string{"replica", "phase", "source"}, nil)
	descTimings = prometheus.NewDesc("prefixlb_replica_calibration_timings_ratio",
		"The calibrated model as it is now, predicted over llama.cpp's measured seconds (its timings: prompt_ms; and predicted_ms per step of the requests whose decode ran with no prefill beside it) of the last 256 requests that carried timings; 1: the model reproduces what the engine measured. Only for replicas whose responses carry timings.",
		[]string{"replica", "phase"}, nil)
	descSkipped = prometheus.NewDesc("prefixlb_replica_calibration_skipped_total",
		"Observations calibration could not use, by reason (no_first_token: a non-streamed request; failed; external: other routers' requests on the replica; replica_down; prefill_share: a decode mostly spent beside prefill; short_decode; unusable).",
		[]string{"replica", "reason"}, nil)
)

// Describe implements prometheus.Collector.
func (c Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPrefill, descDecode, descProfilePrefill, descProfileDecode,
		descError, descProfileError, descObservations, descTimings, descSkipped} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c Collector) Collect(ch chan<- prometheus.Metric) {
	if c.Rows == nil {
		return
	}
	g := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	n := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	for _, r := range c.Rows() {
		f := r.Fit
		g(descPrefill, f.PrefillSecondsPer1K, r.Replica)
		g(descDecode, f.DecodeStepSeconds, r.Replica)
		g(descProfilePrefill, f.PriorPrefillSecondsPer1K, r.Replica)
		g(descProfileDecode, f.PriorDecodeStepSeconds, r.Replica)
		if !r.Calibrated {
			continue
		}
		g(descError, f.PrefillError, r.Replica, "prefill")
		g(descError, f.DecodeError, r.Replica, "decode")
		g(descProfileError, f.PriorPrefillError, r.Replica, "prefill")
		g(descProfileError, f.PriorDecodeError, r.Replica, "decode")
		st := r.Stats
		n(descObservations, st.PrefillPeriods, r.Replica, "prefill", "period")
		n(descObservations, st.PrefillTimings, r.Replica, "prefill", "timings")
		n(descObservations, st.DecodeITL, r.Replica, "decode", "itl")
		n(descObservations, st.DecodeTimings, r.Replica, "decode", "timings")
		n(descObservations, st.DecodeRequests, r.Replica, "decode", "clock")
		if st.TimedPrefill.N > 0 {
			g(descTimings, st.TimedPrefill.Ratio(), r.Replica, "prefill")
		}
		if st.TimedDecode.N > 0 {
			g(descTimings, st.TimedDecode.Ratio(), r.Replica, "decode")
		}
		// In any order: the registry sorts a family's series.
		for k, v := range st.Skipped {
			n(descSkipped, v, r.Replica, k)
		}
	}
}
