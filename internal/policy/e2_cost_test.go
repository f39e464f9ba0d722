package policy_test

import (
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// e2CostVariants are e2 settings that between them turn every term of the
// cost on and off (and change each weight).
var e2CostVariants = []string{
	"e2",
	"e2-preble",
	"e2:self_decode_weight=0.3",
	"e2:self_decode_weight=1:decode_batch_in_flight=false:decode_prefill_rate=false",
	"e2:decode_weight=1:history_weight=0.5:marginal_decode=false",
	"e2:decode_weight=0.5:pending_weight=1:prefill_slowdown=false",
	"e2:include_prefill=false:interference_weight=0.5",
	"e2:eviction_recompute=true:eviction_weight=2:prefill_weight=1.5",
	"e2:tie_break_in_flight=false:slot_wait=false",
	"e2-preble:mixing=false:include_prefill=true:pending_weight=0.7",
	"e2-preble:mix_hit_ratio=0.2:eviction_weight=0.5",
}

// e2CostRun routes 400 requests through spec over 6 replicas whose load
// figures change at random (two of them slot caches, replicas on three
// different profiles, a cache small enough to evict), and returns a
// checksum of every decision: branch, choice, and each candidate's
// replica, matched tokens and the bits of its L, M, P and score. It checks
// each candidate's terms (checkTerms) when explain asks for them, and
// returns the terms that were not zero somewhere.
func e2CostRun(t *testing.T, spec string, explain bool) (sum uint64, nonzero uint) {
	t.Helper()
	p, err := policy.Parse(spec, policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	c := newCluster(t, 6, 200*bt)
	mistral, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		t.Fatal(err)
	}
	h100, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	profiles := []costmodel.Profile{nil, mistral, h100, nil, mistral, nil}
	rng := rand.New(rand.NewPCG(42, 7))
	h := fnv.New64a()
	word := func(x uint64) {
		var b [8]byte
		for i := range b {
			b[i] = byte(x >> (8 * i))
		}
		h.Write(b[:])
	}
	for i := 0; i < 400; i++ {
		for r := range c.reps {
			rp := &c.reps[r]
			rp.Up = rng.IntN(6) > 0 || r == 0
			rp.InFlight = rng.IntN(40)
			rp.Prefilling, rp.Decoding = rp.InFlight/3, rp.InFlight-rp.InFlight/3
			rp.PendingPrefill = time.Duration(rng.IntN(2000)) * time.Millisecond / 7
			rp.PendingPrefillTokens, rp.DecodeTokens = rng.IntN(5000), rng.IntN(5000)
			rp.DecodeContextTokens = rp.Decoding * (100 + rng.IntN(3000))
			rp.Slots, rp.SlotSpan = 0, 0
			if r >= 4 {
				rp.Slots = 2 + r - 4
				if rng.IntN(2) == 0 {
					rp.SlotSpan = rng.IntN(4000)
				}
			}
		}
		prompt := cat(toks(uint64(rng.IntN(5)), 64*rng.IntN(8)), toks(uint64(1000+rng.IntN(40)), rng.IntN(300)))
		if len(prompt) == 0 {
			prompt = toks(5, 3)
		}
		now := at(float64(i) / 4)
		req, v := c.request(prompt, now)
		req.OutputTokens = rng.IntN(400)
		req.Explain = explain
		v.Profiles = profiles
		m := c.m
		v.Victims = func(r int, fn func(n *prefixtree.Node) bool) {
			for _, n := range m.Path[:len(m.Path)/(r-2)] {
				if !fn(n) {
					return
				}
			}
		}
		d, err := p.Route(req, v, now)
		if err != nil {
			t.Fatalf("%s: request %d: %v", spec, i, err)
		}
		fmt.Fprintf(h, "%s/%d/%d/%d;", d.Branch, d.Replica, d.MatchedTokens, len(d.Candidates))
		for _, cd := range d.Candidates {
			word(uint64(cd.Replica))
			word(uint64(cd.MatchedTokens))
			for _, x := range []float64{cd.Load, cd.Eviction, cd.Prefill, cd.Score} {
				word(math.Float64bits(x))
			}
			switch {
			case explain:
				nonzero |= checkTerms(t, spec, cd)
			case cd.Terms != nil:
				t.Fatalf("%s: a candidate has terms though the request did not ask", spec)
			}
		}
		o := p.(policy.Observer)
		o.Routed(req, &d, v, now)
		if i%3 == 0 {
			o.FirstToken(req.ID, d.Replica, time.Duration(50+rng.IntN(100))*time.Millisecond, now)
			o.Finished(req.ID, d.Replica, 20+rng.IntN(50), true, now.Add(time.Duration(rng.IntN(3000))*time.Millisecond))
		}
		if i%97 == 96 {
			o.ReplicaDown(1+rng.IntN(5), now)
		}
		c.tree.SetPathCached(c.m.Path, d.Replica, now)
		if over := c.tree.CachedBlocks(d.Replica) - 200; over > 0 {
			c.tree.EvictLRU(d.Replica, over, now)
		}
	}
	return h.Sum64(), nonzero
}

// checkTerms fails the test unless cd's terms add up, in term order, to its
// L and score bit for bit, and its M and P are the last two terms. It
// returns the set of terms that are not zero (bit t for E2Term t).
func checkTerms(t *testing.T, spec string, cd policy.Candidate) (nonzero uint) {
	t.Helper()
	load := 0.0
	for i, x := range cd.Terms {
		if x != 0 {
			nonzero |= 1 << i
		}
		if policy.E2Term(i) < policy.E2Eviction {
			load += x
		}
	}
	score := load + cd.Terms[policy.E2Eviction] + cd.Terms[policy.E2Prefill]
	ae, al, aw := cd.Terms[policy.E2AdapterEviction], cd.Terms[policy.E2AdapterLoad], cd.Terms[policy.E2AdapterWait]
	if ae != 0 || al != 0 || aw != 0 {
		load += aw
		score += ae + al + aw
	}
	if cd.Score == math.MaxFloat64 && (math.IsInf(score, 0) || math.IsNaN(score)) {
		score = math.MaxFloat64
	}
	if math.Float64bits(load) != math.Float64bits(cd.Load) || math.Float64bits(score) != math.Float64bits(cd.Score) ||
		cd.Eviction != cd.Terms[policy.E2Eviction]+ae || cd.Prefill != cd.Terms[policy.E2Prefill]+al {
		t.Errorf("%s: r%d: terms %v sum to L=%v, score %v; the candidate says L=%v M=%v P=%v score %v",
			spec, cd.Replica, *cd.Terms, load, score, cd.Load, cd.Eviction, cd.Prefill, cd.Score)
	}
	return nonzero
}

// TestE2CostUnchanged holds the cost's arithmetic to the bit: the checksums
// are those of the cost before it was split into terms (e2.go's cost() and
// load() of 6106e43). A change that is meant to move a decision or a cost
// updates them, and says so.
func TestE2CostUnchanged(t *testing.T) {
	want := map[string]uint64{
		"e2":                        0xcc7910bca47ef367,
		"e2-preble":                 0x3a6b22acb7ff8d00,
		"e2:self_decode_weight=0.3": 0x326f2f78d1f88c89,
		"e2:self_decode_weight=1:decode_batch_in_flight=false:decode_prefill_rate=false": 0xc7d494670595b24f,
		"e2:decode_weight=1:history_weight=0.5:marginal_decode=false":                    0xc8aed478fbe105db,
		"e2:decode_weight=0.5:pending_weight=1:prefill_slowdown=false":                   0xb0978d43a47de995,
		"e2:include_prefill=false:interference_weight=0.5":                               0x97c5ca252fe2c8d9,
		"e2:eviction_recompute=true:eviction_weight=2:prefill_weight=1.5":                0xedc2c5eaa35d6630,
		"e2:tie_break_in_flight=false:slot_wait=false":                                   0x5525a678d22496e3,
		"e2-preble:mixing=false:include_prefill=true:pending_weight=0.7":                 0x10ad42cd71b9ba71,
		"e2-preble:mix_hit_ratio=0.2:eviction_weight=0.5":                                0x9c2a3839489f682,
	}
	var nonzero uint
	for _, spec := range e2CostVariants {
		for _, explain := range []bool{false, true} {
			got, nz := e2CostRun(t, spec, explain)
			nonzero |= nz
			if w, ok := want[spec]; !ok || got != w {
				t.Errorf("%q (explain %v): checksum %#x, want %#x", spec, explain, got, w)
			}
		}
	}
	for term := range policy.NumE2Terms {
		if term == policy.E2AdapterEviction || term == policy.E2AdapterLoad || term == policy.E2AdapterWait || term == policy.E2AdapterCascade {
			continue // base-model requests only here: TestE2AdapterTerms, TestE2AdapterWait, TestE2AdapterPlacement
		}
		if nonzero&(1<<term) == 0 {
			t.Errorf("term %v is 0 in every decision: the checksums do not cover it", term)
		}
	}
}

// TestE2TermsExplained: asked for an explanation, every e2 candidate lists
// its terms by name, in ExplainTerms and in JSON next to the L/M/P fields,
// and the JSON reads back; unasked, and for the other policies, there are
// none.
func TestE2TermsExplained(t *testing.T) {
	c := newCluster(t, 3, bigKV)
	c.reps[1].PendingPrefill = 300 * time.Millisecond
	c.reps[1].InFlight, c.reps[1].Decoding, c.reps[1].DecodeContextTokens, c.reps[1].DecodeTokens = 2, 2, 4000, 50
	p := mustE2(t, isolated(policy.DefaultE2Config()))
	req, v := c.request(toks(1, 256), at(0))
	req.Explain = true
	d, err := p.Route(req, v, at(0))
	if err != nil {
		t.Fatal(err)
	}
	if len(d.Candidates) != 3 {
		t.Fatalf("%d candidates, want 3: %s", len(d.Candidates), d.Explain())
	}
	req.Explain = false
	plain, err := p.Route(req, v, at(0))
	if err != nil {
		t.Fatal(err)
	}
	for i, cd := range plain.Candidates {
		want := d.Candidates[i]
		want.Terms = nil
		if cd != want || plain.Replica != d.Replica || plain.ExplainTerms() != "" {
			t.Errorf("unexplained: %+v, want %+v without terms", cd, want)
		}
	}
	ex := d.ExplainTerms()
	for _, cd := range d.Candidates {
		if !strings.Contains(ex, fmt.Sprintf("r%d: decode=", cd.Replica)) {
			t.Errorf("ExplainTerms has no r%d: %s", cd.Replica, ex)
		}
	}
	for term := range policy.NumE2Terms {
		if n := strings.Count(ex, " "+term.String()+"="); n != 3 {
			t.Errorf("ExplainTerms names %v %d times, want 3: %s", term, n, ex)
		}
	}
	cd := d.Candidates[1]
	if cd.Terms[policy.E2Pending] != 1.5*c.reps[1].PendingPrefill.Seconds() || cd.Terms[policy.E2SelfDecode] == 0 || cd.Terms[policy.E2Interference] == 0 ||
		cd.Terms[policy.E2PrefillSlowdown] == 0 || cd.Terms[policy.E2Prefill] != cd.Prefill {
		t.Errorf("replica 1's terms: %v (L=%v M=%v P=%v)", *cd.Terms, cd.Load, cd.Eviction, cd.Prefill)
	}

	raw, err := json.Marshal(cd)
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"replica", "matched_tokens", "load", "prefill", "score", "terms"} {
		if _, ok := fields[k]; !ok {
			t.Errorf("JSON has no %q: %s", k, raw)
		}
	}
	if want := `{"decode":0,"history":0,"pending":0.44999999999999996,`; !strings.HasPrefix(string(fields["terms"]), want) {
		t.Errorf("terms in JSON: %s, want them by name in term order (%s...)", fields["terms"], want)
	}
	var back policy.Candidate
	if err := json.Unmarshal(raw, &back); err != nil || back.Terms == nil || *back.Terms != *cd.Terms || back.Score != cd.Score {
		t.Errorf("JSON read back as %+v (%v), want %+v", back, err, cd)
	}

	// Embedded with a name, as /debug/route sends candidates.
	type named struct {
		Name string `json:"name"`
		policy.Candidate
	}
	raw, err = json.Marshal(named{"a", cd})
	var nb named
	if err != nil || json.Unmarshal(raw, &nb) != nil || nb.Name != "a" || nb.Terms == nil || *nb.Terms != *cd.Terms || !strings.Contains(string(raw), `"terms":{`) {
		t.Errorf("named candidate: %s (%v) read back as %+v", raw, err, nb)
	}

	lc := newCluster(t, 2, bigKV)
	ld, _ := lc.route(newPolicy(t, "llmd-precise"), toks(1, 64), at(0))
	raw, err = json.Marshal(ld.Candidates[0])
	if err != nil || strings.Contains(string(raw), "terms") || ld.ExplainTerms() != "" {
		t.Errorf("llmd-precise candidate: %s (%v), ExplainTerms %q: want no terms", raw, err, ld.ExplainTerms())
	}
}
