package router

import (
	"math"
	"slices"
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// slotRouter returns a router over one replica with a slot cache of n
// slots, mirrored (no KV events).
func slotRouter(t *testing.T, pol policy.Policy, n int) *Router {
	t.Helper()
	r := newRouter(t, pol, 0, false)
	if err := r.SetCacheSlots(0, n); err != nil {
		t.Fatal(err)
	}
	return r
}

// prompt is a shared prefix (seed p, pn tokens) followed by a suffix of its
// own (seed q, qn tokens).
func prompt(p uint64, pn int, q uint64, qn int) []uint32 {
	return append(toks(p, pn), toks(q, qn)...)
}

func route(t *testing.T, r *Router, id uint64, tokens []uint32, ms int) policy.Decision {
	t.Helper()
	d, err := r.Route(req(id, tokens), at(ms))
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func finish(t *testing.T, r *Router, id uint64, cached, ms int) {
	t.Helper()
	if err := r.Finished(id, 10, cached, true, at(ms)); err != nil {
		t.Fatal(err)
	}
}

func TestCommonBlocks(t *testing.T) {
	a := blocks.Keys(nil, prompt(1, 64, 2, 64), bt)
	b := blocks.Keys(nil, prompt(1, 64, 3, 64), bt)
	tests := []struct {
		x, y []blocks.Key
		want int
	}{
		{nil, a, 0},
		{a, a, 8},
		{a, b, 4},
		{a[:2], b, 2},
		{a, blocks.Keys(nil, toks(9, 64), bt), 0},
	}
	for _, tt := range tests {
		if got := commonBlocks(tt.x, tt.y); got != tt.want {
			t.Errorf("commonBlocks(%d keys, %d keys) = %d, want %d", len(tt.x), len(tt.y), got, tt.want)
		}
	}
}

// TestSlotPrediction: a slot replica reuses only what the slot a request
// lands on holds, as llama.cpp does.
func TestSlotPrediction(t *testing.T) {
	r := slotRouter(t, &policy.RoundRobin{}, 2)
	sys := func(q uint64) []uint32 { return prompt(1, 256, q, 32) }

	if d := route(t, r, 1, sys(10), 0); d.MatchedTokens != 0 {
		t.Fatalf("cold: matched %d, want 0", d.MatchedTokens)
	}
	// A second request with the same prefix while the first is running
	// lands on the other, idle slot: the busy slot's cache helps no one.
	if d := route(t, r, 2, sys(11), 1); d.MatchedTokens != 0 {
		t.Errorf("concurrent: matched %d, want 0 (the prefix's slot is busy)", d.MatchedTokens)
	}
	finish(t, r, 1, 0, 2)
	finish(t, r, 2, 0, 3)
	// Both slots now hold the prefix; a third request reuses it.
	if d := route(t, r, 3, sys(12), 4); d.MatchedTokens != 256 {
		t.Errorf("after: matched %d, want 256", d.MatchedTokens)
	}
	finish(t, r, 3, 256, 5)

	// Two new prefixes push both copies of the first one out.
	route(t, r, 4, prompt(2, 256, 20, 32), 6)
	finish(t, r, 4, 0, 7)
	route(t, r, 5, prompt(3, 256, 21, 32), 8)
	finish(t, r, 5, 0, 9)
	if d := route(t, r, 6, sys(13), 10); d.MatchedTokens != 0 {
		t.Errorf("evicted: matched %d, want 0", d.MatchedTokens)
	}
	finish(t, r, 6, 0, 11)
	// The tree holds what the two slots hold, no more: prefixes 1 (just
	// recomputed) and 3 (most recent of the others).
	v, _ := r.CacheView(0)
	if want := (256 + 32) / bt * 2 * bt; v.CachedTokens != want {
		t.Errorf("cached tokens %d, want %d (two slots' prompts)", v.CachedTokens, want)
	}
	if d, err := r.Predict(req(7, prompt(2, 256, 22, 32)), at(12)); err != nil || d.MatchedTokens != 0 {
		t.Errorf("prefix 2: matched %d (%v), want 0 (overwritten)", d.MatchedTokens, err)
	}
	if d, err := r.Predict(req(8, prompt(3, 256, 23, 32)), at(13)); err != nil || d.MatchedTokens != 256 {
		t.Errorf("prefix 3: matched %d (%v), want 256", d.MatchedTokens, err)
	}
}

// TestSlotSimilarity: a slot is chosen by similarity only above the
// threshold; else the least recently used idle slot is overwritten.
func TestSlotSimilarity(t *testing.T) {
	r := slotRouter(t, &policy.RoundRobin{}, 2)
	route(t, r, 1, prompt(1, 64, 10, 192), 0) // slot 0: 64 shared of 256+10
	finish(t, r, 1, 0, 1)
	route(t, r, 2, prompt(2, 256, 11, 16), 2) // slot 1
	finish(t, r, 2, 0, 3)
	// Shares 64 of slot 0's 266 tokens (< 0.5): not chosen by similarity;
	// slot 0 is the least recently used, so it lands there all the same.
	if d := route(t, r, 3, prompt(1, 64, 12, 16), 4); d.MatchedTokens != 64 {
		t.Errorf("LRU slot: matched %d, want 64", d.MatchedTokens)
	}
	finish(t, r, 3, 64, 5)
	// Now slot 1 is LRU. A prompt sharing prefix 1 with slot 0 (64 of
	// 80+10 tokens: above 0.5) goes to slot 0 by similarity.
	if d := route(t, r, 4, prompt(1, 64, 13, 16), 6); d.MatchedTokens != 64 {
		t.Errorf("similar slot: matched %d, want 64", d.MatchedTokens)
	}
	finish(t, r, 4, 64, 7)
	if d, _ := r.Predict(req(5, prompt(2, 256, 14, 16)), at(8)); d.MatchedTokens != 256 {
		t.Errorf("slot 1 kept prefix 2: matched %d, want 256", d.MatchedTokens)
	}
}

// TestSlotDeferred: with every slot busy a request waits, and takes the
// first slot released.
func TestSlotDeferred(t *testing.T) {
	r := slotRouter(t, &policy.RoundRobin{}, 2)
	route(t, r, 1, prompt(1, 128, 10, 16), 0)
	route(t, r, 2, prompt(2, 128, 11, 16), 1)
	d := route(t, r, 3, prompt(1, 128, 12, 16), 2)
	// Predicted from the slot assigned longest ago: slot 0, prefix 1.
	if d.MatchedTokens != 128 {
		t.Errorf("deferred: matched %d, want 128", d.MatchedTokens)
	}
	c := r.cache[0].slots
	if len(c.deferred) != 1 || c.deferred[0] != 3 {
		t.Fatalf("deferred %v, want [3]", c.deferred)
	}
	finish(t, r, 1, 0, 3)
	if len(c.deferred) != 0 {
		t.Fatalf("deferred %v after a slot freed, want none", c.deferred)
	}
	if f := r.inflight[3]; f.slot != 0 {
		t.Errorf("request 3 on slot %d, want 0 (the one released)", f.slot)
	}
	// Request 3 cancelled while waiting would have left the list too.
	route(t, r, 4, prompt(3, 128, 13, 16), 4)
	if err := r.Finished(4, 0, -1, false, at(5)); err != nil {
		t.Fatal(err)
	}
	if len(c.deferred) != 0 {
		t.Errorf("deferred %v after the waiting request failed", c.deferred)
	}
}

// TestSlotFeedback: a report of less than the slot held means the request
// ran on another slot; the model moves it there and keeps what the first
// slot held.
func TestSlotFeedback(t *testing.T) {
	r := slotRouter(t, &policy.RoundRobin{}, 2)
	route(t, r, 1, prompt(1, 256, 10, 16), 0)
	finish(t, r, 1, 0, 1)
	route(t, r, 2, prompt(2, 256, 11, 16), 2)
	finish(t, r, 2, 0, 3)
	// The model puts prefix 1's request on slot 0, but the engine reports
	// no hit: it ran on slot 1 and overwrote prefix 2 there.
	if d := route(t, r, 3, prompt(1, 256, 12, 16), 4); d.MatchedTokens != 256 {
		t.Fatalf("matched %d, want 256", d.MatchedTokens)
	}
	finish(t, r, 3, 0, 5)
	v, _ := r.CacheView(0)
	if v.Corrections != 1 || v.Over != 1 || v.LastErrorTokens != 256 {
		t.Errorf("view %+v, want 1 correction, 1 over-prediction of 256", v)
	}
	if d, _ := r.Predict(req(4, prompt(2, 256, 13, 16)), at(6)); d.MatchedTokens != 0 {
		t.Errorf("prefix 2 after the correction: matched %d, want 0", d.MatchedTokens)
	}
	if d, _ := r.Predict(req(5, prompt(1, 256, 14, 16)), at(6)); d.MatchedTokens != 256 {
		t.Errorf("prefix 1 after the correction: matched %d, want 256", d.MatchedTokens)
	}
	// With feedback off the report is measured only.
	r2 := newRouter(t, &policy.RoundRobin{}, 0, false)
	r2.cfg.NoFeedback = true
	_ = r2.SetCacheSlots(0, 2)
	for i, p := range []uint64{1, 2, 1} {
		route(t, r2, uint64(i+1), prompt(p, 256, uint64(10+i), 16), 2*i)
		finish(t, r2, uint64(i+1), 0, 2*i+1)
	}
	if v, _ := r2.CacheView(0); v.Corrections != 0 || v.Checked != 3 {
		t.Errorf("NoFeedback view %+v, want 3 checked, 0 corrections", v)
	}
}

// TestMirrorCapacityLearned: a mirrored block cache that reports misses on
// prefixes the mirror holds has less cache than configured; the estimate
// shrinks until predictions match, and reports of more grow it back.
func TestMirrorCapacityLearned(t *testing.T) {
	const configured = 64 * 1024
	r := newRouter(t, &policy.RoundRobin{}, configured, false)
	// The real replica holds 4 prompts of 512 tokens (an LRU of 2048
	// tokens); the router believes it holds 64k.
	const real = 4 * 512
	var lru [][]uint32 // the real cache, most recent last
	cached := func(p []uint32) int {
		best := 0
		for _, q := range lru {
			n := 0
			for n < len(p) && n < len(q) && p[n] == q[n] {
				n++
			}
			best = max(best, n/bt*bt)
		}
		return best
	}
	use := func(p []uint32) {
		for i, q := range lru {
			if slices.Equal(p, q) {
				lru = append(lru[:i], lru[i+1:]...)
				break
			}
		}
		lru = append(lru, p)
		for len(lru)*512 > real {
			lru = lru[1:]
		}
	}
	over0 := 0
	for i := 0; i < 400; i++ {
		p := toks(uint64(i%12), 512) // 12 prompts cycling through a 4-prompt cache
		route(t, r, uint64(i+1), p, i)
		finish(t, r, uint64(i+1), cached(p), i)
		use(p)
		if i == 99 {
			v, _ := r.CacheView(0)
			over0 = v.Over
		}
	}
	v, _ := r.CacheView(0)
	if v.CapacityTokens >= configured/4 {
		t.Errorf("capacity estimate %d tokens, want well under the configured %d (the replica holds %d)", v.CapacityTokens, configured, real)
	}
	if late := v.Over - over0; late > 20 {
		t.Errorf("%d over-predictions in the last 300 requests (%d in the first 100): the mirror did not learn", late, over0)
	}
	if v.Corrections == 0 {
		t.Error("no corrections counted")
	}
	// The same reports on a replica with KV events change nothing.
	re := newRouter(t, &policy.RoundRobin{}, configured, true)
	for i := 0; i < 50; i++ {
		route(t, re, uint64(i+1), toks(uint64(i%12), 512), i)
		finish(t, re, uint64(i+1), 0, i)
	}
	if v, _ := re.CacheView(0); v.CapacityTokens != configured || v.Corrections != 0 {
		t.Errorf("events replica: %+v, want the configured capacity and no corrections", v)
	}
}

// TestMirrorChunkUnits: a request keyed by text chunks counts four bytes
// to a token (keying.ChunkKeyer) while the engine counts its own tokens
// (llm-d-inference-sim's word tokenizer: about 1.8 times fewer). A replica
// that serves every predicted prefix from cache reports the cached share of
// its own count, floored to its own 16-token blocks; the router compares it
// in its own units, within a block of each, and keeps the engine's
// capacity. Compared raw, every report looked like an eviction and the
// mirror shrank (docs/peers.md).
func TestMirrorChunkUnits(t *testing.T) {
	const configured = 64 * 1024
	const engine512 = 512 * 11 / 20 // the engine's count of 512 of the router's units
	for _, tc := range []struct {
		name      string
		withCount bool // the engine reports usage.prompt_tokens
		exact     bool // the request was keyed by token ids: not estimated
	}{{"engine count reported", true, false}, {"no engine count", false, false}, {"token ids", true, true}} {
		t.Run(tc.name, func(t *testing.T) {
			r := newRouter(t, &policy.RoundRobin{}, configured, false)
			var predicted, reported int64
			for i := 0; i < 200; i++ {
				p := toks(uint64(i%6), 512) // 6 prompts of 512 units: all fit
				rq := req(uint64(i+1), p)
				rq.Estimated = !tc.exact
				d, err := r.Route(rq, at(i))
				if err != nil {
					t.Fatal(err)
				}
				engine := engine512
				cached := d.MatchedTokens * 11 / 20 / bt * bt
				fin := Finish{OutputTokens: 10, CachedTokens: cached, OK: true}
				if tc.withCount {
					fin.PromptTokens = engine
				}
				if err := r.Finish(uint64(i+1), fin, at(i)); err != nil {
					t.Fatal(err)
				}
				predicted += int64(d.MatchedTokens)
				reported += int64(cached)
			}
			v, _ := r.CacheView(0)
			st := r.Stats()
			if tc.exact {
				// A count of token ids is exact: a report that differs
				// is a real difference, never converted.
				if v.UnitsPerToken != 0 || v.Corrections == 0 {
					t.Errorf("token-id requests: view %+v, want no units learnt and the reports read as evictions", v)
				}
				return
			}
			if !tc.withCount {
				// Without the engine's count the units cannot be told
				// apart: the report reads as evictions (what happened
				// before usage.prompt_tokens was read).
				if v.Corrections == 0 {
					t.Errorf("no corrections without the engine's count: %+v", v)
				}
				return
			}
			// The engine's 64k tokens are 512/281 times as many of the
			// router's units.
			units := 512.0 / float64(engine512)
			want := int(configured * units)
			if v.CapacityTokens < want-1 || v.CapacityTokens > want+1 || v.Corrections != 0 || math.Abs(v.UnitsPerToken-units) > 1e-9 {
				t.Errorf("view %+v: want %d units (the configured %d tokens), %.3f units per token and no corrections", v, want, configured, units)
			}
			if rp, _ := r.Replica(0); rp.KVCapacity != v.CapacityTokens {
				t.Errorf("policies read a capacity of %d, want the mirror's %d units", rp.KVCapacity, v.CapacityTokens)
			}
			if v.Over != 0 || v.Exact != v.Checked {
				t.Errorf("view %+v: want every prediction exact", v)
			}
			if st.ReportedTokens != reported {
				t.Errorf("reported tokens %d, want the engine's %d", st.ReportedTokens, reported)
			}
			if want := predicted * engine512 / 512; st.PredictedTokens < want-int64(st.PredictionsChecked) || st.PredictedTokens > want {
				t.Errorf("predicted tokens %d in the engine's units, want ≈ %d", st.PredictedTokens, want)
			}
		})
	}
}

// TestSlotVictims: the eviction a slot replica would make is the chosen
// slot's prompt less what the request and the other slots share.
func TestSlotVictims(t *testing.T) {
	r := slotRouter(t, &policy.RoundRobin{}, 2)
	route(t, r, 1, prompt(1, 128, 10, 64), 0)
	route(t, r, 2, prompt(1, 128, 11, 64), 1) // slot 1: slot 0 is busy
	finish(t, r, 1, 0, 2)
	finish(t, r, 2, 0, 3)
	// A prompt of a new prefix goes to slot 0 (LRU): it loses its own 64
	// suffix tokens; prefix 1 stays in slot 1.
	keys := blocks.Keys(nil, prompt(5, 128, 12, 64), bt)
	got := 0
	r.slotVictims(0, keys, func(n *prefixtree.Node) bool { got += n.Own(); return true })
	if got != 64/bt {
		t.Errorf("victims %d blocks, want %d (slot 0's own suffix)", got, 64/bt)
	}
	if err := r.SetCacheSlots(0, maxSlots+1); err == nil {
		t.Error("SetCacheSlots beyond the bound: no error")
	}
}
