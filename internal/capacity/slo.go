// Package capacity measures what a team chooses a router by: the capacity
// of a cluster at a service-level objective — the highest request rate at
// which chosen latency percentiles stay within their limits — and the
// goodput along the way, the requests per second that met every limit.
//
// It is pure: ParseSLO reads an objective, SLO.Judge judges one run's
// per-request records, and Search finds the capacity over any "run at
// rate r" function by doubling then bisection. The simulator
// (internal/sim/sweep), the live load generator (internal/bench) and
// `prefixlb advise` drive it.
package capacity

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/report"
)

// Metric is a per-request latency an SLO can bound.
type Metric string

// The metrics, named as vLLM's benchmark_serving.py --goodput names them
// (ttft, tpot; its e2el is e2e here).
const (
	// TTFT is the time to first token.
	TTFT Metric = "ttft"
	// TPOT is the time per output token after the first
	// (report.TPOT); requests of one output token have none.
	TPOT Metric = "tpot"
	// E2E is the end-to-end latency, from sending to the last token.
	E2E Metric = "e2e"
)

// Metrics lists the metrics ParseSLO accepts.
func Metrics() []Metric { return []Metric{TTFT, TPOT, E2E} }

// ErrSLO is wrapped by every error of ParseSLO.
var ErrSLO = errors.New("slo")

// Target bounds one percentile of one metric: the Percentile-th percentile
// of Metric over a run's requests must not exceed Limit.
type Target struct {
	Metric Metric
	// Percentile is in (0, 100]: 90 for p90.
	Percentile float64
	Limit      time.Duration
}

// String renders t as ParseSLO reads it: ttft_p90=2s.
func (t Target) String() string {
	return fmt.Sprintf("%s_p%s=%v", t.Metric, strconv.FormatFloat(t.Percentile, 'f', -1, 64), t.Limit)
}

// SLO is a service-level objective: every target must hold.
type SLO []Target

// String renders s as ParseSLO reads it, targets comma-separated.
func (s SLO) String() string {
	parts := make([]string, len(s))
	for i, t := range s {
		parts[i] = t.String()
	}
	return strings.Join(parts, ",")
}

// maxSLOLen bounds ParseSLO's input: an objective is a few targets.
const maxSLOLen = 1024

// ParseSLO reads an objective: comma-separated targets METRIC_pP=LIMIT,
// METRIC one of ttft, tpot, e2e, P a percentile in (0, 100] (90, 99, 99.9)
// and LIMIT a positive Go duration, e.g. "ttft_p90=2s,tpot_p90=100ms".
// Each metric and percentile may appear once. Spaces around a target are
// ignored; anything else unexpected is an error naming it.
func ParseSLO(s string) (SLO, error) {
	if len(s) > maxSLOLen {
		return nil, fmt.Errorf("%w: %d characters, want at most %d", ErrSLO, len(s), maxSLOLen)
	}
	if strings.TrimSpace(s) == "" {
		return nil, fmt.Errorf("%w: empty; want targets like ttft_p90=2s,tpot_p90=100ms", ErrSLO)
	}
	var out SLO
	for part := range strings.SplitSeq(s, ",") {
		t, err := parseTarget(strings.TrimSpace(part))
		if err != nil {
			return nil, err
		}
		for _, o := range out {
			if o.Metric == t.Metric && o.Percentile == t.Percentile {
				return nil, fmt.Errorf("%w: %s_p%s given twice", ErrSLO, t.Metric, strconv.FormatFloat(t.Percentile, 'f', -1, 64))
			}
		}
		out = append(out, t)
	}
	return out, nil
}

func parseTarget(s string) (Target, error) {
	if s == "" {
		return Target{}, fmt.Errorf("%w: empty target (a stray comma?)", ErrSLO)
	}
	key, val, ok := strings.Cut(s, "=")
	if !ok {
		return Target{}, fmt.Errorf("%w: target %q: want METRIC_pP=LIMIT, e.g. ttft_p90=2s", ErrSLO, s)
	}
	name, pct, ok := strings.Cut(key, "_p")
	if !ok {
		return Target{}, fmt.Errorf("%w: target %q: want METRIC_pP before =, e.g. ttft_p90", ErrSLO, s)
	}
	m := Metric(name)
	if !slices.Contains(Metrics(), m) {
		return Target{}, fmt.Errorf("%w: target %q: unknown metric %q (known: ttft, tpot, e2e)", ErrSLO, s, name)
	}
	p, err := strconv.ParseFloat(pct, 64)
	if err != nil || !plainNumber(pct) {
		return Target{}, fmt.Errorf("%w: target %q: percentile %q is not a plain number", ErrSLO, s, pct)
	}
	if !(p > 0 && p <= 100) {
		return Target{}, fmt.Errorf("%w: target %q: percentile %g: want in (0, 100]", ErrSLO, s, p)
	}
	d, err := time.ParseDuration(val)
	if err != nil {
		return Target{}, fmt.Errorf("%w: target %q: limit: %v", ErrSLO, s, err)
	}
	if d <= 0 {
		return Target{}, fmt.Errorf("%w: target %q: limit %v: want > 0", ErrSLO, s, d)
	}
	return Target{Metric: m, Percentile: p, Limit: d}, nil
}

// Verdict is an SLO's judgement of one run.
type Verdict struct {
	// Met says every target held.
	Met bool
	// Observed is each target's percentile over the run in milliseconds,
	// in the SLO's order; +Inf when failed requests fill that percentile.
	Observed []float64
	// Good counts the requests that succeeded within every limit; Total
	// every request of the run.
	Good, Total int
	// GoodputRPS is Good per second of the run.
	GoodputRPS float64
	// Sustained is the requests completed in the middle half of the run's
	// arrivals (between its first and third quartile arrival times) per
	// request that arrived in it: about 1 when the cluster keeps up with
	// the offered load, the ratio of its service rate to the arrival rate
	// when it does not (Sustain).
	Sustained float64
}

// MinSustained is the least Verdict.Sustained of a run that meets an SLO.
// A bounded run at a rate past what the cluster can complete can still
// meet a TTFT target: on a decode-bound workload every request starts at
// once and the backlog grows in the running batches as decode slows, and
// a policy that starts most requests at once can leave the rest to wait
// past the run's end (docs/capacity.md, round four). In steady state the
// requests completed in a window equal those that arrive in it (the flow
// balance behind Little's law); 0.9 leaves room for the Poisson
// fluctuation of the requests in flight at the window's two ends.
const MinSustained = 0.9

// Sustain returns the requests that completed between the first and
// third quartile of the records' arrival times per request that arrived
// between them (1 when none arrived in between). A failed request never
// completes.
func Sustain(recs []report.RequestRecord) float64 {
	arr := make([]float64, 0, len(recs))
	for _, r := range recs {
		arr = append(arr, arrival(r))
	}
	slices.Sort(arr)
	if len(arr) < 4 {
		return 1
	}
	lo, hi := arr[len(arr)/4], arr[3*len(arr)/4]
	arrived, done := 0, 0
	for _, r := range recs {
		a := arrival(r)
		if a >= lo && a < hi {
			arrived++
		}
		if r.Failed() {
			continue
		}
		if c := a + r.LatencyMs/1000; c >= lo && c < hi {
			done++
		}
	}
	if arrived == 0 {
		return 1
	}
	return float64(done) / float64(arrived)
}

// arrival is when r was sent, in seconds since the run's start.
func arrival(r report.RequestRecord) float64 {
	if r.SentS > 0 {
		return r.SentS
	}
	return r.ArrivalS
}

// value returns r's measure of m in milliseconds and whether it has one: a
// failed request has +Inf for every metric, a request of one output token
// no TPOT.
func value(r report.RequestRecord, m Metric) (float64, bool) {
	if r.Failed() {
		return math.Inf(1), true
	}
	switch m {
	case TTFT:
		return r.TTFTMs, true
	case TPOT:
		if r.OutputTokens <= 1 {
			return 0, false
		}
		return report.TPOT(r.TTFTMs, r.LatencyMs, r.OutputTokens), true
	default:
		return r.LatencyMs, true
	}
}

// Judge judges a run of records lasting spanS seconds (report.Result's
// DurationS, the span its throughput is computed over).
//
// Each target's percentile is taken over every request of the run that has
// the metric, failed ones counting as infinitely slow (so a run that
// fails more than 100−P percent of its requests misses a pP target), by
// report.Percentile's method (numpy's, as vLLM's benchmark). Goodput is
// the definition of vLLM's benchmark_serving.py --goodput (after
// DistServe, Zhong et al., OSDI 2024): the requests that met every limit
// per second of the run. A run also misses when the cluster did not keep
// up with it (Sustain below MinSustained). With no records nothing is met.
func (s SLO) Judge(recs []report.RequestRecord, spanS float64) Verdict {
	v := Verdict{Total: len(recs), Met: len(recs) > 0 && len(s) > 0, Observed: make([]float64, len(s))}
	vals := make([]float64, 0, len(recs))
	for i, t := range s {
		vals = vals[:0]
		for _, r := range recs {
			if x, ok := value(r, t.Metric); ok {
				vals = append(vals, x)
			}
		}
		slices.Sort(vals)
		v.Observed[i] = percentile(vals, t.Percentile)
		if !(v.Observed[i] <= ms(t.Limit)) {
			v.Met = false
		}
	}
	for _, r := range recs {
		if r.Failed() {
			continue
		}
		good := true
		for _, t := range s {
			if x, ok := value(r, t.Metric); ok && x > ms(t.Limit) {
				good = false
				break
			}
		}
		if good {
			v.Good++
		}
	}
	if spanS > 0 {
		v.GoodputRPS = float64(v.Good) / spanS
	}
	v.Sustained = Sustain(recs)
	if v.Sustained < MinSustained {
		v.Met = false
	}
	return v
}

// percentile is report.Percentile's method (numpy's linear) letting +Inf
// through: a rank on a failed request, or between a value and one, is +Inf
// (report.Percentile would compute 0·Inf or Inf − Inf = NaN).
func percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	h := float64(n-1) * p / 100
	lo := int(math.Floor(h))
	if lo >= n-1 {
		return sorted[n-1]
	}
	frac := h - float64(lo)
	if frac == 0 {
		return sorted[lo]
	}
	if math.IsInf(sorted[lo+1], 1) {
		return math.Inf(1)
	}
	return sorted[lo] + frac*(sorted[lo+1]-sorted[lo])
}

// plainNumber reports whether s is digits with at most one inner decimal
// point ("90", "99.9"): no sign, exponent, hex or underscores.
func plainNumber(s string) bool {
	digits, dot := 0, false
	for i, c := range s {
		switch {
		case c >= '0' && c <= '9':
			digits++
		case c == '.' && !dot && i > 0 && i < len(s)-1:
			dot = true
		default:
			return false
		}
	}
	return digits > 0
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Annotate writes v, s's verdict of r's run, into r: the objective, whether
// it was met, each target's percentile and the goodput.
func (s SLO) Annotate(r *report.Result, v Verdict) {
	r.SLO = s.String()
	met, good, sus := v.Met, v.GoodputRPS, v.Sustained
	r.SLOMet, r.GoodputRPS, r.SLOSustained = &met, &good, &sus
	r.SLOObserved = make([]report.SLOObservation, len(s))
	for i, t := range s {
		o := report.SLOObservation{Target: t.String(), Met: v.Observed[i] <= ms(t.Limit)}
		if x := v.Observed[i]; !math.IsInf(x, 0) && !math.IsNaN(x) {
			o.ObservedMs = &x
		}
		r.SLOObserved[i] = o
	}
}
