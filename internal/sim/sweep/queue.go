package sweep

import (
	"fmt"
	"slices"
	"strings"

	"github.com/prefixlb/prefixlb/internal/admission"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/sim"
)

// QueueLine renders what the router-side queue did in one run, and what
// the run served by class: how many requests were let through at once,
// waited, were shed (by reason) or lost (neither served nor shed); the
// goodput, requests per second of the arrival span whose TTFT met the
// deadline of their priority (slo; the run's TTFT SLO, or every served
// request when none); and per priority the p90 TTFT of the served ones, per
// tenant its share of the served requests.
func QueueLine(name string, rate float64, res *sim.Result, q *sim.QueueConfig) string {
	var b strings.Builder
	st := res.Queue
	if st == nil {
		st = &admission.Stats{}
	}
	var lost, good, served int
	var first, last float64
	ttft := map[int]*report.Samples{}
	tenants := map[string]int{}
	for i, r := range res.Records {
		if i == 0 || r.ArrivalS < first {
			first = r.ArrivalS
		}
		last = max(last, r.ArrivalS)
		switch {
		case strings.HasPrefix(r.Error, "shed: "):
			continue
		case r.Error != "" || r.LatencyMs == 0 && r.TTFTMs == 0:
			lost++
			continue
		}
		served++
		tenants[r.Tenant]++
		s := ttft[r.Priority]
		if s == nil {
			s = &report.Samples{}
			ttft[r.Priority] = s
		}
		s.Add(r.TTFTMs)
		slo := q.TTFTSLO
		if d, ok := q.SLOs[r.Priority]; ok {
			slo = d
		}
		if slo == 0 || r.TTFTMs <= float64(slo.Milliseconds()) {
			good++
		}
	}
	span := last - first
	goodput := 0.0
	if span > 0 {
		goodput = float64(good) / span
	}
	fmt.Fprintf(&b, "  %-16s rate %-6.3g passed %6d queued %6d dispatched %6d shed", name, rate, st.Passed, st.Queued, st.Dispatched)
	for _, r := range admission.Reasons() {
		fmt.Fprintf(&b, " %s=%d", r, st.Shed[r])
	}
	fmt.Fprintf(&b, " lost %d  goodput %.3g req/s", lost, goodput)
	prios := make([]int, 0, len(ttft))
	for p := range ttft {
		prios = append(prios, p)
	}
	slices.Sort(prios)
	slices.Reverse(prios)
	for _, p := range prios {
		fmt.Fprintf(&b, "  p%d ttft p90 %.0f ms", p, ttft[p].Percentile(90))
	}
	names := make([]string, 0, len(tenants))
	for t := range tenants {
		names = append(names, t)
	}
	slices.Sort(names)
	for _, t := range names {
		if t == "" && len(names) == 1 {
			break
		}
		fmt.Fprintf(&b, "  tenant %s %.1f%%", t, 100*float64(tenants[t])/float64(max(served, 1)))
	}
	return b.String()
}
