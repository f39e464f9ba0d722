package policy_test

import (
	"math"
	"testing"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestReplicaQueue: the queue the llm-d scorers read is the engine's
// waiting count, else the requests routed and not yet started; running
// requests never count.
func TestReplicaQueue(t *testing.T) {
	tests := []struct {
		name                                   string
		waiting, running, prefilling, inflight int
		want                                   int
	}{
		{"scraped", 3, 50, 7, 60, 3},
		{"scraped, nothing waiting", 0, 12, 4, 16, 0},
		{"no scrape: not yet started", -1, -1, 2, 9, 2},
		{"no scrape, idle", -1, -1, 0, 0, 0},
	}
	for _, tt := range tests {
		r := policy.Replica{Waiting: tt.waiting, Running: tt.running, Prefilling: tt.prefilling, InFlight: tt.inflight}
		if got := r.Queue(); got != tt.want {
			t.Errorf("%s: Queue() = %d, want %d", tt.name, got, tt.want)
		}
	}
}

// onlyWeights returns llmd-precise scoring with just the given weights.
func onlyWeights(prefix, kv, queue float64) *policy.LLMDPrecise {
	p := policy.NewLLMDPrecise()
	p.PrefixWeight, p.KVWeight, p.QueueWeight = prefix, kv, queue
	return p
}

// TestLLMDQueueScorerWaitingOnly: a replica with a long running batch but
// a short waiting queue is the less loaded to GIE's queue scorer.
func TestLLMDQueueScorerWaitingOnly(t *testing.T) {
	c := newCluster(t, 2, bigKV)
	c.reps[0].Waiting, c.reps[0].Running = 1, 40
	c.reps[1].Waiting, c.reps[1].Running = 3, 0
	for i := range 20 {
		d, _ := c.route(onlyWeights(0, 0, 1), toks(uint64(i), 64), at(0))
		if d.Replica != 0 {
			t.Fatalf("queue scorer chose %d (%s), want 0: 1 waiting beats 3", d.Replica, d.Explain())
		}
	}
}

// TestLLMDPreciseNormalisation: llm-d's precise prefix scores are min-max
// normalised over the up replicas with any hit; no hit scores 0.
func TestLLMDPreciseNormalisation(t *testing.T) {
	prompt := toks(1, 160) // 10 blocks
	tests := []struct {
		name   string
		cached []int // blocks each replica holds
		down   int   // a replica that is down, or -1
		want   []float64
	}{
		{"one replica with any hit gets 1", []int{0, 3, 0}, -1, []float64{0, 1, 0}},
		{"the fewest hits among those with hits score 0", []int{10, 5, 2}, -1, []float64{1, 3.0 / 8, 0}},
		{"equal hits all score 1", []int{4, 4, 0}, -1, []float64{1, 1, 0}},
		{"no hits anywhere", []int{0, 0, 0}, -1, []float64{0, 0, 0}},
		{"a replica that is down sets no bound", []int{10, 0, 5}, 0, []float64{0, 0, 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 3, bigKV)
			for r, n := range tt.cached {
				if n > 0 {
					c.cache(prompt[:n*bt], r, at(0))
				}
			}
			if tt.down >= 0 {
				c.reps[tt.down].Up = false
			}
			req, v := c.request(prompt, at(1))
			d, err := onlyWeights(1, 0, 0).Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			for _, cd := range d.Candidates {
				if math.Abs(cd.Score-tt.want[cd.Replica]) > 1e-12 {
					t.Errorf("replica %d: prefix score %v, want %v", cd.Replica, cd.Score, tt.want[cd.Replica])
				}
			}
		})
	}
}

// TestLLMDPreciseSettings: the spec sets the weights and speculative
// indexing; the default does not speculate.
func TestLLMDPreciseSettings(t *testing.T) {
	if policy.NewLLMDPrecise().Speculative() {
		t.Error("llmd-precise speculates by default (the plugin's speculativeIndexing is off)")
	}
	spec := "llmd-precise:prefix_weight=2:kv_weight=1:queue_weight=1:speculative=true"
	p, err := policy.Parse(spec, policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	q := p.(*policy.LLMDPrecise)
	if q.PrefixWeight != 2 || q.KVWeight != 1 || q.QueueWeight != 1 || !q.Speculative() || q.Name() != spec {
		t.Errorf("parsed %+v named %q", *q, q.Name())
	}
	// The weights are the ones scored with.
	c := newCluster(t, 2, bigKV)
	c.cache(toks(1, 32), 0, at(0))
	c.reps[0].KVUsage, c.reps[1].KVUsage = 0.5, 0
	c.reps[0].Waiting, c.reps[1].Waiting = 4, 0
	d, _ := c.route(p, toks(1, 32), at(1))
	want := []float64{2*1 + 1*0.5 + 0, 0 + 1 + 1}
	for _, cd := range d.Candidates {
		if math.Abs(cd.Score-want[cd.Replica]) > 1e-12 {
			t.Errorf("2/1/1: replica %d scores %v, want %v", cd.Replica, cd.Score, want[cd.Replica])
		}
	}
	a, err := policy.Parse("llmd-approx:prefix_weight=3", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	if q := a.(*policy.LLMDApprox); q.PrefixWeight != 3 || q.KVWeight != 1 || q.QueueWeight != 1 || q.Name() != "llmd-approx:prefix_weight=3" {
		t.Errorf("llmd-approx parsed %+v", *q)
	}
	if _, ok := a.(policy.Speculator); ok {
		t.Error("llmd-approx asks for speculative entries")
	}
}

// TestLLMDTiesAtRandom: equal scores are broken at random, not by ID.
func TestLLMDTiesAtRandom(t *testing.T) {
	c := newCluster(t, 3, bigKV)
	seen := map[int]int{}
	p := policy.NewLLMDPrecise()
	for i := range 300 {
		req, v := c.request(toks(uint64(i), 64), at(0))
		d, _ := p.Route(req, v, at(0))
		seen[d.Replica]++
	}
	for r := range 3 {
		if seen[r] < 50 {
			t.Errorf("ties: replica %d chosen %d of 300 times (%v)", r, seen[r], seen)
		}
	}
}

// approx builds llmd-approx from options.
func approx(t *testing.T, capacityBlocks int) *policy.LLMDApprox {
	t.Helper()
	o := policy.DefaultOptions()
	o.BlockTokens, o.ApproxCapacityBlocks = bt, capacityBlocks
	p, err := policy.New("llmd-approx", o)
	if err != nil {
		t.Fatal(err)
	}
	return p.(*policy.LLMDApprox)
}

// approxMatched routes prompt without recording it and returns the blocks
// each replica is credited with.
func approxMatched(t *testing.T, p *policy.LLMDApprox, c *cluster, prompt []uint32, profiles []costmodel.Profile) []int {
	t.Helper()
	req, v := c.request(prompt, at(5))
	v.Profiles = profiles
	d, err := p.Route(req, v, at(5))
	if err != nil {
		t.Fatal(err)
	}
	out := make([]int, len(c.reps))
	for _, cd := range d.Candidates {
		out[cd.Replica] = cd.MatchedTokens / bt
	}
	return out
}

// recordAt makes p record prompt on replica r, with the view's profiles.
func recordAt(t *testing.T, p policy.Policy, c *cluster, prompt []uint32, r int, profiles []costmodel.Profile) {
	t.Helper()
	req, v := c.request(prompt, at(0))
	v.Profiles = profiles
	p.(policy.Observer).Routed(req, &policy.Decision{Replica: r}, v, at(0))
}

// TestLLMDApproxCapacityFromProfile: by default each replica's history
// holds as many blocks as its KV capacity (GIE's AutoTune reads the pod's
// CacheNumGPUBlocks); an explicit capacity overrides it for every replica.
func TestLLMDApproxCapacityFromProfile(t *testing.T) {
	a, b := toks(1, 4*bt), toks(2, 4*bt) // 4 blocks each
	// Replica 0 has the cluster's profile (6 blocks of KV), replica 1 its
	// own (100 blocks).
	profiles := []costmodel.Profile{nil, linearProfile{kv: 100 * bt}}
	tests := []struct {
		capacity int
		want     [2]int // blocks of a credited after a, then b, went to both
	}{
		// 8 blocks into replica 0's 6: a's first two went out. Replica 1
		// holds all of a, so the walk runs through a's 4 blocks.
		{0, [2]int{2, 4}},
		{100, [2]int{4, 4}},
	}
	for _, tt := range tests {
		c := newCluster(t, 2, 6*bt)
		p := approx(t, tt.capacity)
		for _, prompt := range [][]uint32{a, b} {
			recordAt(t, p, c, prompt, 0, profiles)
			recordAt(t, p, c, prompt, 1, profiles)
		}
		if got := approxMatched(t, p, c, a, profiles); got[0] != tt.want[0] || got[1] != tt.want[1] {
			t.Errorf("capacity %d: a credited %v blocks, want %v", tt.capacity, got, tt.want)
		}
	}
}

// TestLLMDApproxGIEMatch: GIE's match walks the request's blocks until one
// no replica holds, crediting each replica with every block it holds on the
// way; a prompt's blocks enter a replica's LRU first block first, so the
// head of an old prompt is evicted before its tail.
func TestLLMDApproxGIEMatch(t *testing.T) {
	a, b := toks(1, 4*bt), toks(2, 4*bt)
	c := newCluster(t, 3, bigKV)
	p := approx(t, 6)
	recordAt(t, p, c, a, 0, nil)
	recordAt(t, p, c, b, 0, nil) // evicts a's blocks 0 and 1 from replica 0
	if got := approxMatched(t, p, c, a, nil); got[0] != 0 {
		t.Errorf("a's head evicted everywhere: replica 0 credited %d blocks, want 0 (the walk stops at block 0)", got[0])
	}
	recordAt(t, p, c, a[:2*bt], 1, nil) // replica 1 holds a's head
	got := approxMatched(t, p, c, a, nil)
	if want := []int{2, 2, 0}; got[0] != want[0] || got[1] != want[1] || got[2] != want[2] {
		t.Errorf("a credited %v blocks, want %v (0 holds a's tail, 1 its head)", got, want)
	}
	// Only the first 256 blocks are hashed: a prompt that shares them with
	// one sent before scores 1, however it goes on.
	q := approx(t, 0)
	q.PrefixWeight, q.KVWeight, q.QueueWeight = 1, 0, 0
	long := toks(3, 300*bt)
	recordAt(t, q, c, long, 2, nil)
	req, v := c.request(cat(long[:256*bt], toks(4, 44*bt)), at(6))
	d, _ := q.Route(req, v, at(6))
	for _, cd := range d.Candidates {
		want, wantM := 0.0, 0
		if cd.Replica == 2 {
			want, wantM = 1, 256*bt
		}
		if cd.Score != want || cd.MatchedTokens != wantM {
			t.Errorf("sharing the first 256 of 300 blocks: replica %d scores %v (%d tokens), want %v (%d)", cd.Replica, cd.Score, cd.MatchedTokens, want, wantM)
		}
	}
}

// TestSGLangTies: among replicas with the longest history match SGLang
// takes an arbitrary one, the same every time for a prefix, whatever their
// load; the least-loaded fallback breaks ties by the lowest ID.
func TestSGLangTies(t *testing.T) {
	p := newPolicy(t, "sglang")
	c := newCluster(t, 3, bigKV)
	c.reps[0].InFlight = 5 // balanced (max − min ≤ 64), but 2 is less loaded
	seen := map[int]int{}
	for i := range 40 {
		prompt := toks(uint64(100+i), 64)
		recordOn(t, p, c, prompt, 0)
		recordOn(t, p, c, prompt, 2)
		req, v := c.request(prompt, at(1))
		first, _ := p.Route(req, v, at(1))
		if first.Branch != "cache" || (first.Replica != 0 && first.Replica != 2) {
			t.Fatalf("prompt %d: %s → %d, want cache → 0 or 2", i, first.Branch, first.Replica)
		}
		for range 3 {
			req, v := c.request(prompt, at(2))
			if d, _ := p.Route(req, v, at(2)); d.Replica != first.Replica {
				t.Fatalf("prompt %d moved from %d to %d between equal matches", i, first.Replica, d.Replica)
			}
		}
		seen[first.Replica]++
	}
	if seen[0] == 0 || seen[2] == 0 {
		t.Errorf("equal matches always went to one replica: %v", seen)
	}
	c = newCluster(t, 3, bigKV)
	for i := range 10 {
		if d, _ := c.route(newPolicy(t, "sglang"), toks(uint64(i), 64), at(0)); d.Replica != 0 || d.Branch != "least-load" {
			t.Fatalf("no history, equal loads: %s → %d, want least-load → 0", d.Branch, d.Replica)
		}
	}
}

// TestSGLangDefaultHistory: by default SGLang's history is bounded at its
// max_tree_size (2^26 characters), far beyond a replica's cache: it still
// remembers a prompt after 20k blocks of others went to the same replica.
func TestSGLangDefaultHistory(t *testing.T) {
	p := newPolicy(t, "sglang")
	c := newCluster(t, 2, bigKV)
	first := toks(1, 64*bt)
	recordOn(t, p, c, first, 1)
	for i := range 200 {
		recordOn(t, p, c, toks(uint64(10+i), 100*bt), 1)
	}
	c.reps[1].InFlight = 3
	if d, _ := c.route(p, first, at(1)); d.Replica != 1 || d.Branch != "cache" {
		t.Errorf("after 20k blocks: %s → %d, want cache → 1", d.Branch, d.Replica)
	}
}

// TestDynamoTiesAtRandom: equal logits are broken uniformly at random
// (Dynamo's newest selector), not by ID.
func TestDynamoTiesAtRandom(t *testing.T) {
	c := newCluster(t, 3, bigKV)
	p := policy.NewDynamo(policy.DefaultDynamoConfig())
	seen := map[int]int{}
	for i := range 300 {
		req, v := c.request(toks(uint64(i), 64), at(0))
		d, _ := p.Route(req, v, at(0))
		seen[d.Replica]++
	}
	for r := range 3 {
		if seen[r] < 50 {
			t.Errorf("ties: replica %d chosen %d of 300 times (%v)", r, seen[r], seen)
		}
	}
}

// TestDynamoTemperature: with T > 0 Dynamo samples p ∝ exp(−(v − vmin) /
// ((vmax − vmin)·T)), uniformly when all logits are equal.
func TestDynamoTemperature(t *testing.T) {
	prompt := toks(1, 160)
	c := newCluster(t, 3, bigKV)
	c.cache(prompt, 0, at(0))
	c.reps[0].PendingPrefillTokens = 16 * 18 // logit 18 (prefill) + 10 (decode)
	c.reps[1].Up = false
	// Replica 2: logit 10 + 10. Range 8, T 0.5: p(0) = e^-2/(1+e^-2) ≈ 0.119.
	p := policy.NewDynamo(policy.DynamoConfig{OverlapWeight: 1, Temperature: 0.5})
	const n = 2000
	seen := map[int]int{}
	for range n {
		req, v := c.request(prompt, at(1))
		d, _ := p.Route(req, v, at(1))
		seen[d.Replica]++
	}
	want := math.Exp(-2) / (1 + math.Exp(-2)) * n
	if seen[1] != 0 || math.Abs(float64(seen[0])-want) > 5*math.Sqrt(want) {
		t.Errorf("softmax choices %v, want about %.0f on replica 0", seen, want)
	}
	c.reps[0].PendingPrefillTokens = 0
	c.tree.ClearReplica(0)
	seen = map[int]int{}
	for range 400 {
		req, v := c.request(prompt, at(2))
		d, _ := p.Route(req, v, at(2))
		seen[d.Replica]++
	}
	if seen[0] < 150 || seen[2] < 150 {
		t.Errorf("equal logits with T > 0: %v, want about even", seen)
	}
}
