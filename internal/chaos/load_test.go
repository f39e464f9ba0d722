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
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// retryHeader is the router's response header counting the replicas that
// failed a request before the one that answered it.
const retryHeader = "x-prefixlb-retries"

// countingTransport counts the responses the router retried.
type countingTransport struct {
	base             http.RoundTripper
	retried, retries atomic.Int64 // responses with retries; retries in all
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err == nil {
		if n, _ := strconv.Atoi(resp.Header.Get(retryHeader)); n > 0 {
			c.retried.Add(1)
			c.retries.Add(int64(n))
		}
	}
	return resp, err
}

// newLoadClient returns the load's HTTP client and its retry counter.
func newLoadClient() (*http.Client, *countingTransport) {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 512
	t.DisableCompression = true
	ct := &countingTransport{base: t}
	return &http.Client{Transport: ct}, ct
}

// genWorkload generates n requests of workload name, sized for 3 replicas
// and small enough that prefixes repeat within a short run, arriving as a
// Poisson process at rate.
func genWorkload(t testing.TB, name string, n int, rate float64, seed int64) []workload.Request {
	t.Helper()
	s := workload.DefaultSpec(name)
	s.Requests, s.Seed, s.Replicas = n, seed, 3
	s.OutputTokens = 100 // streams long enough to be in flight when a fault strikes
	switch name {
	case "toolbench":
		s.ToolBench.Tools, s.ToolBench.Zipf = 8, 1.1
	case "shared-prefix":
		s.SharedPrefix = workload.SharedPrefixParams{Groups: 6, SystemTokens: 1500, Questions: 4, QuestionTokens: 200, Output: 40}
	case "agent":
		s.Agent.Environments = 10
	}
	reqs, err := workload.Generate(s)
	if err != nil {
		t.Fatalf("chaos: workload %s: %v", name, err)
	}
	a := workload.DefaultArrival()
	a.Rate = rate
	if err := a.Apply(reqs, seed, false); err != nil {
		t.Fatalf("chaos: arrivals: %v", err)
	}
	return reqs
}

// class is what became of one request.
type class int

const (
	classOK       class = iota // completed
	classClean                 // an HTTP error or an in-stream error event that names the replica or the cause
	classRouterGo              // a connection error from the router while the router itself was the fault
	classLost                  // no answer: the client's own timeout ran out
	classUnclean               // any other failure: a cut stream without an error event, a bare error
)

// classify sorts a loadgen record's error text. routerFault says the
// router itself was restarted, so connection errors from it are expected.
func classify(errText string, routerFault bool) class {
	if errText == "" {
		return classOK
	}
	if msg, ok := strings.CutPrefix(errText, "stream error: "); ok {
		return attributable(msg)
	}
	if strings.HasPrefix(errText, "http ") {
		_, msg, _ := strings.Cut(errText, ": ")
		return attributable(msg)
	}
	if strings.Contains(errText, "context deadline exceeded") {
		return classLost
	}
	if routerFault {
		return classRouterGo
	}
	return classUnclean
}

// attributable reports an error message as clean when it names a replica
// (its loopback address) or comes from the router ("proxy: ...").
func attributable(msg string) class {
	if strings.Contains(msg, "127.0.0.1:") || strings.Contains(msg, "proxy: ") {
		return classClean
	}
	return classUnclean
}

// window is the routing quality of the requests completed in a span.
type window struct {
	n        int
	hit      float64 // cached prompt tokens / prompt tokens
	ttftP50  float64 // ms
	complete bool    // n is enough to judge
}

// minWindow is the fewest completed requests a window is judged on.
const minWindow = 8

// quality measures the completed requests sent in [from, to).
func quality(recs []report.RequestRecord, from, to time.Duration) window {
	var prompt, cached int
	var ttft []float64
	for _, r := range recs {
		at := time.Duration(r.SentS * float64(time.Second))
		if r.Error != "" || at < from || at >= to {
			continue
		}
		prompt += r.PromptTokens
		cached += r.CachedTokens
		ttft = append(ttft, r.TTFTMs)
	}
	w := window{n: len(ttft), complete: len(ttft) >= minWindow}
	if prompt > 0 {
		w.hit = float64(cached) / float64(prompt)
	}
	if len(ttft) > 0 {
		slices.Sort(ttft)
		w.ttftP50 = ttft[len(ttft)/2]
	}
	return w
}

// within says w is back to base: hit ratio at least 80% of it, median TTFT
// at most 20% (or 5 ms, for TTFTs of a few ms) above it.
func (w window) within(base window) bool {
	return w.complete && w.hit >= 0.8*base.hit && w.ttftP50 <= math.Max(1.2*base.ttftP50, base.ttftP50+5)
}

// recovery returns the time from heal to the start of the first sliding
// window (width win, step 250 ms) whose quality is back to base, or -1.
func recovery(recs []report.RequestRecord, base window, heal, end, win time.Duration) time.Duration {
	for at := heal; at+win <= end; at += 250 * time.Millisecond {
		if quality(recs, at, at+win).within(base) {
			return at - heal
		}
	}
	return -1
}

// row is one line of the fault matrix.
type row struct {
	Scenario               string
	Sent, Completed        int
	Retried, RetriesMetric int // responses retried (header); attempts retried (router metric)
	Clean, RouterConn      int // clean errors; connection errors from a restarting router
	Lost, Unclean          int
	Base, During, After    window
	HealTook               time.Duration // time the heal action took (a restart: until healthy)
	Recovery               time.Duration // -1: not back within the run
	FaultFor               time.Duration
	Notes                  string
	Errors                 map[string]int // error text (first 120 bytes) → count, for the log
}

func (r row) String() string {
	rec := "not within run"
	if r.Recovery >= 0 {
		rec = r.Recovery.Round(10 * time.Millisecond).String()
	}
	return fmt.Sprintf("%-19s sent=%d completed=%d retried=%d (metric %d) clean_errors=%d router_conn_errors=%d lost=%d unclean=%d "+
		"hit %.2f→%.2f→%.2f ttft_p50 %.1f→%.1f→%.1f ms recovery=%s heal_took=%s %s",
		r.Scenario, r.Sent, r.Completed, r.Retried, r.RetriesMetric, r.Clean, r.RouterConn, r.Lost, r.Unclean,
		r.Base.hit, r.During.hit, r.After.hit, r.Base.ttftP50, r.During.ttftP50, r.After.ttftP50, rec,
		r.HealTook.Round(10*time.Millisecond), r.Notes)
}

// tally classifies the records of a run into r.
func (r *row) tally(recs []report.RequestRecord, routerFault bool) {
	r.Errors = map[string]int{}
	r.Sent = len(recs)
	for _, rec := range recs {
		switch classify(rec.Error, routerFault) {
		case classOK:
			r.Completed++
			continue
		case classClean:
			r.Clean++
		case classRouterGo:
			r.RouterConn++
		case classLost:
			r.Lost++
		case classUnclean:
			r.Unclean++
		}
		e := rec.Error
		if len(e) > 120 {
			e = e[:120]
		}
		r.Errors[e]++
	}
}

// errorList renders r.Errors, most frequent first.
func (r row) errorList() string {
	type kv struct {
		k string
		n int
	}
	var l []kv
	for k, n := range r.Errors {
		l = append(l, kv{k, n})
	}
	slices.SortFunc(l, func(a, b kv) int { return cmp.Or(cmp.Compare(b.n, a.n), strings.Compare(a.k, b.k)) })
	var b strings.Builder
	for _, e := range l {
		fmt.Fprintf(&b, "\n    %4d × %s", e.n, e.k)
	}
	return b.String()
}

// runLoad runs reqs against target in a goroutine it owns; wait returns the
// output once the run has ended, and stop cancels and waits (a cleanup).
func runLoad(ctx context.Context, target string, reqs []workload.Request, maxDuration time.Duration) (client *countingTransport, start time.Time, wait func() (loadgen.Output, error)) {
	return runLoadHeader(ctx, target, reqs, maxDuration, nil)
}

// runLoadHeader is runLoad with header sent on every request (an API key).
func runLoadHeader(ctx context.Context, target string, reqs []workload.Request, maxDuration time.Duration, header http.Header) (client *countingTransport, start time.Time, wait func() (loadgen.Output, error)) {
	hc, ct := newLoadClient()
	cfg := loadgen.DefaultConfig()
	cfg.Target, cfg.Model, cfg.Client, cfg.Header = target, modelName, hc, header
	cfg.Policy = "e2"
	cfg.RequestTimeout = 40 * time.Second // past the router's 20s request timeout: a client timeout is a lost request
	cfg.MaxDuration = maxDuration
	type res struct {
		out loadgen.Output
		err error
	}
	ch := make(chan res, 1)
	start = time.Now()
	go func() {
		out, err := loadgen.Run(ctx, cfg, reqs)
		hc.CloseIdleConnections()
		ch <- res{out, err}
	}()
	var got *res
	return ct, start, func() (loadgen.Output, error) {
		if got == nil {
			r := <-ch
			got = &r
		}
		return got.out, got.err
	}
}

// sleepUntil waits until t (the fault schedule's timing) or ctx's end.
func sleepUntil(ctx context.Context, t time.Time) {
	d := time.Until(t)
	if d <= 0 {
		return
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
	case <-ctx.Done():
	}
}
