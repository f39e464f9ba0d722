package router

import (
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// routerState is what the router and its E2 show at now: every replica's
// load figures, E2's windowed load, mix ratio and prefixes, and the
// decision (terms included) it would make for probe.
func routerState(t *testing.T, r *Router, probe policy.Request, now time.Time) string {
	t.Helper()
	e2 := r.Policy().(*policy.E2)
	var b strings.Builder
	for id, rp := range r.Load() {
		hist, ratio := e2.Window(id)
		fmt.Fprintf(&b, "r%d inflight=%d prefilling=%d pending=%v/%d decode=%d hist=%.9f mix=%.9f\n",
			id, rp.InFlight, rp.Prefilling, rp.PendingPrefill, rp.PendingPrefillTokens, rp.DecodeTokens, hist, ratio)
	}
	var prefixes []string
	e2.Prefixes(func(n *prefixtree.Node, count int) {
		var set []int
		n.Assigned.Each(func(r int) { set = append(set, r) })
		prefixes = append(prefixes, fmt.Sprintf("prefix at depth %d: count=%d assigned=%v", n.Depth()+n.Own(), count, set))
	})
	sort.Strings(prefixes)
	b.WriteString(strings.Join(prefixes, "\n"))
	probe.Explain = true
	d, err := r.Predict(probe, now)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&b, "\nprobe: %s\n%s", d.Explain(), d.ExplainTerms())
	return b.String()
}

// TestFailedRequestsLeaveE2Window: requests routed through the router that
// fail before their first token (Finish with OK false: a connection error,
// a 5xx, a cancel while queued) take nothing with them into the next
// decisions: the replicas' in-flight figures, E2's window (windowed
// prefill load, mix ratio, each prefix's count and placement) and the
// terms of the next decision are what they were before them.
func TestFailedRequestsLeaveE2Window(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	for _, spec := range []string{"e2-preble:rebalance=false:replicate=false", "e2"} {
		t.Run(spec, func(t *testing.T) {
			pol, err := policy.Parse(spec, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			// No speculative cache entries: the tree's view of the caches,
			// which KV events keep, is not what this test is about.
			r, err := New(Config{BlockTokens: bt, Profile: prof, Policy: pol, Seed: 1, SpeculativeTTL: -1})
			if err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				r.AddReplica(fmt.Sprint("replica-", i), true)
			}
			hot := toks(1, 512)
			prompt := func(i int) []uint32 { return append(append([]uint32{}, hot...), toks(uint64(10+i%6), 128)...) }
			id := uint64(0)
			for i := range 6 { // warm traffic, finished
				id++
				if _, err := r.Route(req(id, prompt(i)), at(1000*i)); err != nil {
					t.Fatal(err)
				}
				if err := r.FirstToken(id, at(1000*i+50)); err != nil {
					t.Fatal(err)
				}
				if err := r.Finish(id, Finish{OutputTokens: 10, CachedTokens: -1, OK: true}, at(1000*i+1000)); err != nil {
					t.Fatal(err)
				}
			}
			probe := req(1000, append(append([]uint32{}, hot...), toks(2, 256)...))
			before := routerState(t, r, probe, at(10000))
			var failed []uint64
			for i := range 12 {
				p := prompt(i)
				if i%3 == 2 {
					p = toks(uint64(100+i), 1024)
				}
				id++
				if _, err := r.Route(req(id, p), at(10000)); err != nil {
					t.Fatal(err)
				}
				failed = append(failed, id)
			}
			if during := routerState(t, r, probe, at(10000)); during == before {
				t.Fatal("the failing requests changed nothing: the test shows nothing")
			}
			for _, id := range failed {
				if err := r.Finish(id, Finish{CachedTokens: -1}, at(10500)); err != nil {
					t.Fatal(err)
				}
			}
			if after := routerState(t, r, probe, at(10500)); after != before {
				t.Errorf("after the failures, the router is not where it was before them:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			if st := r.Stats(); st.Failed != 12 {
				t.Errorf("Stats().Failed = %d, want 12", st.Failed)
			}
		})
	}
}
