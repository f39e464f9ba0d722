// Package promtest reads a prefixlb router's Prometheus exposition the way
// a Prometheus server would, for the tests of serve and epp: scrape a
// page, find a series, and hold the calibration series to what the router
// reports of each replica (router.Pricing). It is used by tests only.
package promtest

import (
	"io"
	"net/http"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/prefixlb/prefixlb/internal/router"
)

// Families are a page's metric families by name.
type Families = map[string]*dto.MetricFamily

// Scrape GETs url with client (nil: http.DefaultClient) and parses the
// Prometheus text exposition it serves; any failure fails t.
func Scrape(t testing.TB, client *http.Client, url string) Families {
	t.Helper()
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Get(url)
	if err != nil {
		t.Fatalf("scrape %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: status %d", url, resp.StatusCode)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		t.Fatalf("scrape %s: parse: %v", url, err)
	}
	return fams
}

// labelsOf returns a series' labels as a map.
func labelsOf(m *dto.Metric) map[string]string {
	have := make(map[string]string, len(m.GetLabel()))
	for _, l := range m.GetLabel() {
		have[l.GetName()] = l.GetValue()
	}
	return have
}

// has reports whether have includes labels (name, value pairs).
func has(have map[string]string, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		if v, ok := have[labels[i]]; !ok || v != labels[i+1] {
			return false
		}
	}
	return true
}

// Series returns the value of family name's one gauge or counter series
// whose labels are exactly labels (name, value pairs); ok is false when
// there is none.
func Series(fams Families, name string, labels ...string) (v float64, ok bool) {
	for _, m := range fams[name].GetMetric() {
		if len(m.GetLabel())*2 != len(labels) || !has(labelsOf(m), labels) {
			continue
		}
		switch {
		case m.Gauge != nil:
			return m.GetGauge().GetValue(), true
		case m.Counter != nil:
			return m.GetCounter().GetValue(), true
		}
	}
	return 0, false
}

// Sum returns the sum of family name's series whose labels include labels
// (pairs); a histogram counts its samples. ok is false when no series
// matched.
func Sum(fams Families, name string, labels ...string) (v float64, ok bool) {
	for _, m := range fams[name].GetMetric() {
		if !has(labelsOf(m), labels) {
			continue
		}
		ok = true
		switch {
		case m.Counter != nil:
			v += m.GetCounter().GetValue()
		case m.Gauge != nil:
			v += m.GetGauge().GetValue()
		case m.Histogram != nil:
			v += float64(m.GetHistogram().GetSampleCount())
		}
	}
	return v, ok
}

// CheckPricing holds replica's calibration series (internal/calmetrics) to
// p, what the router reports of it (serve's GET /debug/replicas, epp's
// /debug/replicas): the speed and the profile's always, the errors,
// observations and skipped counts only while it is calibrated, each series
// of the right type and exact labels.
func CheckPricing(t testing.TB, fams Families, replica string, p router.Pricing) {
	t.Helper()
	sp := p.Speed
	type want struct {
		metric string
		v      float64
		labels []string
	}
	ws := []want{
		{"prefixlb_replica_prefill_seconds_per_1k_tokens", sp.PrefillSecondsPer1K, nil},
		{"prefixlb_replica_decode_step_seconds", sp.DecodeStepSeconds, nil},
		{"prefixlb_replica_profile_prefill_seconds_per_1k_tokens", sp.PriorPrefillSecondsPer1K, nil},
		{"prefixlb_replica_profile_decode_step_seconds", sp.PriorDecodeStepSeconds, nil},
	}
	if st := p.Learnt; p.Calibrated && st != nil {
		ws = append(ws,
			want{"prefixlb_replica_calibration_error_ratio", sp.PrefillError, []string{"phase", "prefill"}},
			want{"prefixlb_replica_calibration_error_ratio", sp.DecodeError, []string{"phase", "decode"}},
			want{"prefixlb_replica_calibration_profile_error_ratio", sp.PriorPrefillError, []string{"phase", "prefill"}},
			want{"prefixlb_replica_calibration_profile_error_ratio", sp.PriorDecodeError, []string{"phase", "decode"}},
			want{"prefixlb_replica_calibration_observations_total", float64(st.PrefillPeriods), []string{"phase", "prefill", "source", "period"}},
			want{"prefixlb_replica_calibration_observations_total", float64(st.PrefillTimings), []string{"phase", "prefill", "source", "timings"}},
			want{"prefixlb_replica_calibration_observations_total", float64(st.DecodeITL), []string{"phase", "decode", "source", "itl"}},
			want{"prefixlb_replica_calibration_observations_total", float64(st.DecodeTimings), []string{"phase", "decode", "source", "timings"}},
			want{"prefixlb_replica_calibration_observations_total", float64(st.DecodeRequests), []string{"phase", "decode", "source", "clock"}})
		for reason, n := range st.Skipped {
			ws = append(ws, want{"prefixlb_replica_calibration_skipped_total", float64(n), []string{"reason", reason}})
		}
	}
	for _, w := range ws {
		typ := dto.MetricType_GAUGE
		if strings.HasSuffix(w.metric, "_total") {
			typ = dto.MetricType_COUNTER
		}
		if f := fams[w.metric]; f != nil && f.GetType() != typ {
			t.Errorf("/metrics %s is a %v, want a %v", w.metric, f.GetType(), typ)
		}
		labels := append([]string{"replica", replica}, w.labels...)
		got, ok := Series(fams, w.metric, labels...)
		switch {
		case !ok:
			t.Errorf("/metrics has no %s%v", w.metric, labels)
		case got != w.v:
			t.Errorf("/metrics %s%v = %v, want %v (what the router reports)", w.metric, labels, got, w.v)
		}
	}
}
