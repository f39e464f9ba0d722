package chaos

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// The overload burst (issue 18 item 3, docs/overload.md "Chaos suite"):
// three engines of a slower model than the fault matrix's, so that the
// cluster saturates at a request rate two cores can drive; the cluster's
// capacity at the SLO measured by a step search; then a burst at twice that
// capacity for ovBurst, with two priorities and two tenants (a sends 4× b's
// rate), once through serve with --queue=false and once with the queue.
//
// Times and rates are stated in the engines' modelled time (what a real
// cluster of these GPUs would see); the engines run ovTimeScale times
// faster than real, so every real-time figure is the modelled one divided
// by ovTimeScale (rates multiplied).
const (
	ovProfile   = "llama3-70b-h100x2"
	ovTimeScale = 2.0
	ovSLO       = 2 * time.Second  // TTFT SLO (p90 for capacity), modelled
	ovBurst     = 20 * time.Second // burst length, modelled
	ovStep      = 20 * time.Second // length of a capacity-search step, modelled
	// ovGuess is where the capacity search starts, requests/s modelled:
	// `prefixlb sim` on the same workload and profile predicts ~16
	// (docs/overload.md); the search measures the real cluster from there.
	ovGuess   = 16.0
	ovStepUp  = 1.15 // ratio between the rates of successive steps
	ovHighPct = 0.2  // share of high-priority requests
	ovLightB  = 0.2  // share of tenant b (a sends 4× b's rate)
	ovOutput  = 20   // output tokens per request
)

// Request headers of serve's router-side queue (docs/overload.md).
const (
	hdrPriority = "x-prefixlb-priority"
	hdrTenant   = "x-prefixlb-tenant"
	hdrTTFTSLO  = "x-prefixlb-ttft-slo"
)

// realTime converts a modelled duration to the engines' real time.
func realTime(d time.Duration) time.Duration { return time.Duration(float64(d) / ovTimeScale) }

// ovWorkload is n toolbench requests with long, mostly uncached tool
// descriptions (200 tools per 2 replicas, ~3000 tokens each, Zipf 1.1), a
// short answer, Poisson arrivals at rate (modelled requests/s, sent at
// rate×ovTimeScale real), and classes drawn per request: priority high
// (1) for ovHighPct, else low (-1); tenant b for ovLightB, else a.
func ovWorkload(t testing.TB, n int, rate float64, seed int64) []workload.Request {
	t.Helper()
	s := workload.DefaultSpec("toolbench")
	s.Requests, s.Seed, s.Replicas = n, 1, 3 // one tool set for every run: caches carry over
	s.OutputTokens = ovOutput
	s.ToolBench.Tools, s.ToolBench.Zipf = 200, 1.1
	s.ToolBench.DescMedian, s.ToolBench.DescMax = 3000, 3000
	reqs, err := workload.Generate(s)
	if err != nil {
		t.Fatalf("overload: workload: %v", err)
	}
	a := workload.DefaultArrival()
	a.Rate = rate * ovTimeScale
	if err := a.Apply(reqs, seed, false); err != nil {
		t.Fatalf("overload: arrivals: %v", err)
	}
	if err := workload.AssignClasses(reqs, fmt.Sprintf("high:%g,low:%g", ovHighPct, 1-ovHighPct),
		fmt.Sprintf("a:%g,b:%g", 1-ovLightB, ovLightB), seed); err != nil {
		t.Fatalf("overload: classes: %v", err)
	}
	return reqs
}

// shedCounter counts the router's shed answers (429, 503) and those of
// them without Retry-After.
type shedCounter struct {
	base             http.RoundTripper
	shed, noRetryAft atomic.Int64
}

func (c *shedCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err == nil && (resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable) {
		c.shed.Add(1)
		if resp.Header.Get("Retry-After") == "" {
			c.noRetryAft.Add(1)
		}
	}
	return resp, err
}

// ovRecord is one request's outcome and class.
type ovRecord struct {
	report.RequestRecord
	priority int
	tenant   string
}

// runClasses sends reqs to target open-loop, each with its class's
// headers (x-prefixlb-priority, -tenant, -ttft-slo: the SLO in real time):
// one loadgen run per class, all started together on one client.
func runClasses(ctx context.Context, t testing.TB, target string, reqs []workload.Request) ([]ovRecord, *shedCounter) {
	t.Helper()
	type key struct {
		p  int
		tn string
	}
	byClass := map[key][]workload.Request{}
	for _, r := range reqs {
		k := key{r.Priority, r.Tenant}
		byClass[k] = append(byClass[k], r)
	}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 1024
	tr.DisableCompression = true
	sc := &shedCounter{base: tr}
	hc := &http.Client{Transport: sc}
	defer hc.CloseIdleConnections()
	var (
		mu   sync.Mutex
		out  []ovRecord
		errs []error
		wg   sync.WaitGroup
	)
	for k, rs := range byClass {
		cfg := loadgen.DefaultConfig()
		cfg.Target, cfg.Model, cfg.Client, cfg.Policy = target, modelName, hc, "e2"
		cfg.RequestTimeout = 90 * time.Second // past every router timeout: a client timeout is a lost request
		cfg.Header = http.Header{}
		cfg.Header.Set(hdrPriority, strconv.Itoa(k.p))
		cfg.Header.Set(hdrTenant, k.tn)
		cfg.Header.Set(hdrTTFTSLO, realTime(ovSLO).String())
		wg.Add(1)
		go func() {
			defer wg.Done()
			o, err := loadgen.Run(ctx, cfg, rs)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
			for _, rec := range o.Records {
				out = append(out, ovRecord{RequestRecord: rec, priority: k.p, tenant: k.tn})
			}
		}()
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("overload: load: %v", errs)
	}
	slices.SortFunc(out, func(a, b ovRecord) int { return cmp.Compare(a.ID, b.ID) })
	return out, sc
}

// outcome sorts a record: completed (200 and a whole stream), shed (a 429
// or 503 from the router), cancelled (the client's context ended it), or
// another error.
func outcome(rec report.RequestRecord) string {
	switch e := rec.Error; {
	case e == "":
		return "ok"
	case strings.HasPrefix(e, "http 429") || strings.HasPrefix(e, "http 503"):
		return "shed"
	case strings.Contains(e, "context deadline exceeded"):
		return "lost"
	case strings.Contains(e, "context canceled"):
		return "cancelled"
	}
	return "error"
}

// burstStats are the figures of one burst.
type burstStats struct {
	Sent, OK, Shed, Cancelled, Errors, Lost int
	MetSLO                                  int     // completed with TTFT ≤ the SLO
	Goodput                                 float64 // MetSLO / ovBurst, modelled requests/s
	HighP90, LowP90                         float64 // TTFT, modelled ms, of the completed
	HighN, LowN                             int
	DemandB, DispatchedB, Dispatched        int
	FairB                                   float64 // min(DemandB, Dispatched/2)
	ShareB, FairShareB                      float64 // DispatchedB/Dispatched, FairB/Dispatched
	// Bands are the figures per priority (high, low), and FairBandB b's
	// max-min fair share band by band (fairInBand summed): what the queue
	// promises, strict priority between bands and fairness within one.
	Bands     [2]bandStats
	FairBandB float64
	// Throughput is the completions per second (modelled) between the
	// first and the last completion: without the queue, where every
	// engine has a backlog from the first seconds to the end, the rate
	// the cluster serves at during the burst.
	Throughput float64
}

// bandStats are one priority band's demand and dispatched requests by
// tenant.
type bandStats struct{ DemandA, DemandB, DispatchedA, DispatchedB int }

// fairInBand is tenant b's max-min fair share of the requests dispatched in
// a band between two tenants of equal weight: half of them, or all of b's
// demand when less, or what a leaves when a asks for less than half.
func (s bandStats) fairInBand() float64 {
	d := float64(s.DispatchedA + s.DispatchedB)
	return math.Min(float64(s.DemandB), math.Max(d/2, d-float64(s.DemandA)))
}

// p90 of xs (nearest rank), 0 for none.
func p90(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[int(math.Ceil(0.9*float64(len(s))))-1]
}

// burstFigures measures a burst's records. Dispatched requests are the
// ones the router forwarded to a replica: every one not shed and not
// cancelled before it was (completed, or failed at a replica).
func burstFigures(recs []ovRecord) burstStats {
	var s burstStats
	var hi, lo []float64
	first, last := math.Inf(1), math.Inf(-1)
	slo := float64(realTime(ovSLO)) / float64(time.Millisecond)
	for _, r := range recs {
		s.Sent++
		band := &s.Bands[1]
		if r.priority > 0 {
			band = &s.Bands[0]
		}
		if r.tenant == "b" {
			s.DemandB++
			band.DemandB++
		} else {
			band.DemandA++
		}
		switch outcome(r.RequestRecord) {
		case "ok":
			s.OK++
			done := r.SentS + r.LatencyMs/1000
			first, last = math.Min(first, done), math.Max(last, done)
			if r.TTFTMs <= slo {
				s.MetSLO++
			}
			if r.priority > 0 {
				hi = append(hi, r.TTFTMs*ovTimeScale)
			} else {
				lo = append(lo, r.TTFTMs*ovTimeScale)
			}
		case "shed":
			s.Shed++
			continue
		case "cancelled":
			s.Cancelled++
			continue
		case "lost":
			s.Lost++
		default:
			s.Errors++
		}
		s.Dispatched++
		if r.tenant == "b" {
			s.DispatchedB++
			band.DispatchedB++
		} else {
			band.DispatchedA++
		}
	}
	for _, b := range s.Bands {
		s.FairBandB += b.fairInBand()
	}
	if s.OK > 1 && last > first {
		s.Throughput = float64(s.OK-1) / (last - first) / ovTimeScale
	}
	s.Goodput = float64(s.MetSLO) / ovBurst.Seconds()
	s.HighP90, s.LowP90, s.HighN, s.LowN = p90(hi), p90(lo), len(hi), len(lo)
	s.FairB = math.Min(float64(s.DemandB), float64(s.Dispatched)/2)
	if s.Dispatched > 0 {
		s.ShareB = float64(s.DispatchedB) / float64(s.Dispatched)
		s.FairShareB = s.FairB / float64(s.Dispatched)
	}
	return s
}

func (s burstStats) String() string {
	return fmt.Sprintf("sent=%d ok=%d shed=%d cancelled=%d errors=%d lost=%d met_slo=%d goodput=%.2f/s throughput=%.2f/s high_p90=%.0fms (n=%d) low_p90=%.0fms (n=%d) "+
		"b: demand=%d dispatched=%d of %d share=%.1f%% fair=%.1f%% (%.0f%% of fair; %.0f%% of the fair share within bands %.0f) bands high/low %+v",
		s.Sent, s.OK, s.Shed, s.Cancelled, s.Errors, s.Lost, s.MetSLO, s.Goodput, s.Throughput, s.HighP90, s.HighN, s.LowP90, s.LowN,
		s.DemandB, s.DispatchedB, s.Dispatched, 100*s.ShareB, 100*s.FairShareB, 100*float64(s.DispatchedB)/math.Max(s.FairB, 1),
		100*float64(s.DispatchedB)/math.Max(s.FairBandB, 1), s.FairBandB, s.Bands)
}

// ovRouterFlags are the routers' settings on top of routerFlags: the
// router's cost model told the engines' speed (the profile at their time
// scale), timeouts past the collapse's backlog (a request waits silently
// in its engine's queue for seconds), and the queue's time-valued
// defaults (max predicted wait 2 s, engage after 100 ms) in the engines'
// real time; max queued prefill stays at its default (0: not judged), the
// SLO fraction (a ratio) too.
func ovRouterFlags(queue bool) []string {
	return []string{
		"--profile", fmt.Sprintf("%s:time_scale=%g", ovProfile, 1/ovTimeScale),
		"--response-header-timeout", "60s",
		"--idle-timeout", "60s",
		"--request-timeout", "80s",
		"--queue=" + strconv.FormatBool(queue),
		"--queue-max-predicted-wait", realTime(2 * time.Second).String(), // admission.DefaultMaxPredictedWait,
		"--queue-engage-after", realTime(100 * time.Millisecond).String(), // admission.DefaultEngageAfter,
		// The load generator stands for a trusted gateway: its class
		// headers (priority, tenant, TTFT SLO) are believed only from a
		// trusted proxy (issue 26, docs/overload.md).
		"--trusted-proxies", "127.0.0.0/8,::1",
	}
}

// stepMet runs one capacity-search step at rate (modelled requests/s) and
// reports whether every request completed and p90 TTFT met the SLO.
func stepMet(ctx context.Context, t *testing.T, target string, rate float64, seed int64) (bool, float64) {
	n := int(rate * ovStep.Seconds())
	recs, _ := runClasses(ctx, t, target, ovWorkload(t, n, rate, seed))
	var ttft []float64
	failed := 0
	for _, r := range recs {
		if r.Error != "" {
			failed++
			continue
		}
		ttft = append(ttft, r.TTFTMs*ovTimeScale)
	}
	p := p90(ttft)
	met := failed == 0 && p <= float64(ovSLO/time.Millisecond)
	t.Logf("overload: capacity step %.2f req/s (%d requests): p90 TTFT %.0f ms modelled, %d failed → met=%v", rate, len(recs), p, failed, met)
	return met, p
}

// measureCapacity searches the highest rate (modelled requests/s) whose
// step meets the SLO: from ovGuess up by ovStepUp while met, or down while
// not, then one step between the last met and the first missed rate.
func measureCapacity(ctx context.Context, t *testing.T, target string) float64 {
	seed := int64(100)
	step := func(r float64) bool { seed++; met, _ := stepMet(ctx, t, target, r, seed); return met }
	met, missed := 0.0, 0.0
	r := ovGuess
	if step(r) {
		met = r
		for range 4 {
			r *= ovStepUp
			if !step(r) {
				missed = r
				break
			}
			met = r
		}
	} else {
		missed = r
		for range 5 {
			r /= ovStepUp
			if step(r) {
				met = r
				break
			}
			missed = r
		}
	}
	if met == 0 {
		t.Fatalf("overload: no step met the SLO down to %.2f req/s", r)
	}
	if missed > 0 {
		if mid := (met + missed) / 2; step(mid) {
			met = mid
		}
	}
	return met
}

// TestChaosOverload measures the cluster's capacity at the SLO, then sends a
// burst at twice that rate for ovBurst through serve without and with its
// router-side queue, and checks issue 18's targets for the queue: goodput ≥
// 90% of capacity, high-priority p90 TTFT within the SLO, the light
// tenant's share of dispatched requests within 10% of its fair share, no
// request lost (every one completed, shed with 429/503 and Retry-After, or
// cancelled by its client, and the router's counters agree).
func TestChaosOverload(t *testing.T) {
	if testing.Short() {
		t.Skip("overload: starts processes for ~90 s; not under -short")
	}
	dir := t.TempDir()
	var bs []backend
	for i := range 3 {
		e := &engine{name: fmt.Sprintf("engine%d", i), dir: dir, http: freePort(t), kvPort: freePort(t), replay: freePort(t),
			timeScale: ovTimeScale, profile: ovProfile}
		e.start(t)
		bs = append(bs, backend{URL: e.url(), KVEvents: e.kvEndpoint(), KVReplay: e.replayEndpoint()})
	}
	// Both routers watch the engines from the start, so both know their
	// caches; only one takes load at a time.
	noQueue := newRouter(t, dir, bs, ovRouterFlags(false)...)
	withQueue := newRouter(t, dir, bs, ovRouterFlags(true)...)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	// Warm-up: the tool set's popular prefixes cached, at half the guess.
	stepMet(ctx, t, noQueue.url(), ovGuess/2, 99)
	capacity := measureCapacity(ctx, t, noQueue.url())
	t.Logf("overload: capacity at p90 TTFT ≤ %v: %.2f req/s modelled (%.2f real), search took %v",
		ovSLO, capacity, capacity*ovTimeScale, time.Since(start).Round(time.Second))

	rate := 2 * capacity
	n := int(rate * ovBurst.Seconds())
	burst := func(r *router, name string) (burstStats, map[string]float64) {
		before := routerCounts(t, r)
		t0 := time.Now()
		recs, sc := runClasses(ctx, t, r.url(), ovWorkload(t, n, rate, 7))
		after := routerCounts(t, r)
		s := burstFigures(recs)
		errs := map[string]int{}
		for _, rec := range recs {
			if o := outcome(rec.RequestRecord); o == "error" || o == "lost" {
				errs[rec.Error[:min(len(rec.Error), 120)]]++
			}
		}
		if len(errs) > 0 {
			t.Logf("overload: %s: errors: %v", name, errs)
		}
		d := map[string]float64{}
		for k, v := range after {
			d[k] = v - before[k]
		}
		t.Logf("overload: burst %s at %.2f req/s modelled for %v (took %v): %s; router: %v; shed answers %d (without Retry-After %d)",
			name, rate, ovBurst, time.Since(t0).Round(100*time.Millisecond), s, d, sc.shed.Load(), sc.noRetryAft.Load())
		if got := sc.noRetryAft.Load(); got != 0 {
			t.Errorf("overload: %s: %d shed answers without Retry-After", name, got)
		}
		reconcile(t, name, s, d, int(sc.shed.Load()))
		return s, d
	}
	off, _ := burst(noQueue, "--queue=false")
	on, _ := burst(withQueue, "queue")

	t.Logf("\noverload burst (toolbench 200 tools/2 replicas ~3000-token descriptions, %d output tokens, 3 × %s at time scale %g, e2; "+
		"SLO p90 TTFT %v; capacity %.2f req/s; burst %.2f req/s for %v, high %g%%, tenants a:b = 4:1)\n"+
		"| serve | goodput req/s | %% of capacity | high p90 TTFT ms | low p90 TTFT ms | shed | lost | b share / fair |\n"+
		"| --queue=false | %.2f | %.0f%% | %.0f | %.0f | %d | %d | %.1f%% / %.1f%% |\n"+
		"| queue (default) | %.2f | %.0f%% | %.0f | %.0f | %d | %d | %.1f%% / %.1f%% |",
		ovOutput, ovProfile, ovTimeScale, ovSLO, capacity, rate, ovBurst, 100*ovHighPct,
		off.Goodput, 100*off.Goodput/capacity, off.HighP90, off.LowP90, off.Shed, off.Lost+off.Errors, 100*off.ShareB, 100*off.FairShareB,
		on.Goodput, 100*on.Goodput/capacity, on.HighP90, on.LowP90, on.Shed, on.Lost+on.Errors, 100*on.ShareB, 100*on.FairShareB)

	// Issue 18's targets for the queue are performance figures of a loaded
	// 2-core machine whose engines run on real timers: they are measured
	// and reported here (a MET / MISSED line each, in CI's log and in
	// docs/overload.md), not asserted. What the queue must always do is
	// asserted: lose nothing (below), answer every shed with Retry-After
	// (above), count exactly what the client saw (below), and serve more
	// requests within the SLO than the pool without it (measured 1.97× to
	// 3.5× on this machine).
	verdict := func(ok bool) string {
		if ok {
			return "MET"
		}
		return "MISSED"
	}
	t.Logf("overload target: goodput with the queue %.2f req/s = %.0f%% of capacity %.2f (≥ 90%%): %s",
		on.Goodput, 100*on.Goodput/capacity, capacity, verdict(on.Goodput >= 0.9*capacity))
	t.Logf("overload target: high-priority p90 TTFT with the queue %.0f ms (≤ %v): %s",
		on.HighP90, ovSLO, verdict(on.HighP90 <= float64(ovSLO/time.Millisecond)))
	// The queue is strict between priorities and fair between tenants
	// within one (GIE's flow control, as issue 18 asks): b's fair share is
	// its max-min share band by band. The priority-blind share (min(demand,
	// dispatched/2)) is logged beside it; it is b's fair share only when
	// the high band is served in proportion to its demand.
	t.Logf("overload target: tenant b dispatched %d, fair share within priority bands %.0f (within 10%%): %s; priority-blind fair share %.0f (min(demand %d, dispatched %d / 2)): %.0f%% of it",
		on.DispatchedB, on.FairBandB, verdict(math.Abs(float64(on.DispatchedB)-on.FairBandB) <= 0.1*on.FairBandB),
		on.FairB, on.DemandB, on.Dispatched, 100*float64(on.DispatchedB)/math.Max(on.FairB, 1))
	t.Logf("overload: goodput with the queue %.2f req/s = %.2f× without it (%.2f)", on.Goodput, on.Goodput/max(off.Goodput, 1e-9), off.Goodput)
	// What the cluster can serve during a burst on this machine: the
	// client and the router work at twice the rate of the capacity search
	// on the same two cores as the engines' timers.
	t.Logf("overload: the cluster served %.2f req/s during the burst without the queue (%.0f%% of its capacity at 1×); goodput with the queue is %.0f%% of that",
		off.Throughput, 100*off.Throughput/capacity, 100*on.Goodput/max(off.Throughput, 1e-9))
	if on.Goodput <= off.Goodput {
		t.Errorf("overload: goodput with the queue %.2f req/s, without %.2f: the queue must do better than the collapse it exists to prevent", on.Goodput, off.Goodput)
	}
	for name, s := range map[string]burstStats{"--queue=false": off, "queue": on} {
		if s.Lost != 0 || s.Errors != 0 {
			t.Errorf("overload: %s: %d lost and %d failed at a replica, want 0", name, s.Lost, s.Errors)
		}
	}
}

// routerCounts scrapes the router counters the burst reconciles: the
// queue's outcomes and prefixlb_requests_total by code.
func routerCounts(t *testing.T, r *router) map[string]float64 {
	t.Helper()
	m, err := r.metrics()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, k := range []string{"prefixlb_queue_shed_total", "prefixlb_queue_passed_total", "prefixlb_queue_dispatched_total", "prefixlb_queue_cancelled_total", "prefixlb_requests_total"} {
		out[strings.TrimPrefix(k, "prefixlb_")] = m[k]
	}
	for _, code := range []string{"200", "429", "503", "cancelled", "aborted"} {
		c, err := scrapeWhere(r.url()+"/metrics", "code", code)
		if err != nil {
			t.Fatal(err)
		}
		out["requests_"+code] = c["prefixlb_requests_total"]
	}
	for _, reason := range []string{"deadline", "queue_full", "timeout", "pool_down"} {
		c, err := scrapeWhere(r.url()+"/metrics", "reason", reason)
		if err != nil {
			t.Fatal(err)
		}
		out["shed_"+reason] = c["prefixlb_queue_shed_total"]
	}
	return out
}

// reconcile checks that the client's outcomes add up to what it sent and
// agree with the router's counters (d: their increase over the burst).
func reconcile(t *testing.T, name string, s burstStats, d map[string]float64, shedAnswers int) {
	t.Helper()
	if s.OK+s.Shed+s.Cancelled+s.Errors+s.Lost != s.Sent {
		t.Errorf("overload: %s: outcomes do not add up to %d sent", name, s.Sent)
	}
	checks := []struct {
		what        string
		client      int
		router      float64
		routerLabel string
	}{
		{"requests", s.Sent, d["requests_total"], "prefixlb_requests_total"},
		{"completed", s.OK, d["requests_200"], `prefixlb_requests_total{code="200"}`},
		{"shed", s.Shed, d["requests_429"] + d["requests_503"], `prefixlb_requests_total{code=~"429|503"}`},
		{"shed", s.Shed, d["queue_shed_total"], "prefixlb_queue_shed_total"},
		{"shed answers seen", shedAnswers, d["queue_shed_total"], "prefixlb_queue_shed_total"},
		{"cancelled in the queue", s.Cancelled, d["queue_cancelled_total"], "prefixlb_queue_cancelled_total"},
	}
	if strings.Contains(name, "queue=false") {
		checks = checks[:3]
		if v := d["queue_passed_total"] + d["queue_dispatched_total"] + d["queue_shed_total"]; v != 0 {
			t.Errorf("overload: %s: the queue counted %g requests, want 0 (it is off)", name, v)
		}
	} else {
		checks = append(checks, struct {
			what        string
			client      int
			router      float64
			routerLabel string
		}{"dispatched", s.Dispatched, d["queue_passed_total"] + d["queue_dispatched_total"], "prefixlb_queue_passed_total + dispatched_total"})
	}
	for _, c := range checks {
		if float64(c.client) != c.router {
			t.Errorf("overload: %s: client counted %d %s, router's %s rose by %g", name, c.client, c.what, c.routerLabel, c.router)
		}
	}
}
