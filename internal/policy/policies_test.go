package policy_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

func newPolicy(t *testing.T, name string) policy.Policy {
	t.Helper()
	p, err := policy.New(name, policy.DefaultOptions())
	if err != nil {
		t.Fatalf("New(%q): %v", name, err)
	}
	if p.Name() != name {
		t.Fatalf("New(%q).Name() = %q", name, p.Name())
	}
	return p
}

// conformanceRun routes 300 requests over 5 replicas whose up/down state and
// load figures change at random (from seed), and returns the decisions.
func conformanceRun(t *testing.T, name string, seed uint64) []string {
	p := newPolicy(t, name)
	c := newCluster(t, 5, 200*bt)
	rng := rand.New(rand.NewPCG(seed, 7))
	var out []string
	for i := 0; i < 300; i++ {
		for r := range c.reps {
			rp := &c.reps[r]
			rp.Up = rng.IntN(4) > 0
			rp.InFlight = rng.IntN(100)
			rp.Prefilling, rp.Decoding = rp.InFlight/2, rp.InFlight-rp.InFlight/2
			rp.PendingPrefill = time.Duration(rng.IntN(1000)) * time.Millisecond
			rp.PendingPrefillTokens, rp.DecodeTokens, rp.DecodeContextTokens = rng.IntN(5000), rng.IntN(5000), rng.IntN(50000)
			rp.Waiting, rp.Running, rp.KVUsage = rng.IntN(10)-1, rng.IntN(10)-1, rng.Float64()*1.2-0.1
		}
		if c.reps[0].Up || c.reps[1].Up || c.reps[2].Up || c.reps[3].Up {
			c.reps[4].Up = c.reps[4].Up && rng.IntN(2) == 0
		} else {
			c.reps[4].Up = true
		}
		prompt := cat(toks(uint64(rng.IntN(4)), 64*rng.IntN(8)), toks(uint64(1000+rng.IntN(30)), rng.IntN(200)))
		if len(prompt) == 0 {
			prompt = toks(5, 3)
		}
		now := at(float64(i) / 10)
		req, v := c.request(prompt, now)
		req.Session = fmt.Sprint("s", rng.IntN(20))
		d, err := p.Route(req, v, now)
		if err != nil {
			t.Fatalf("%s: request %d: %v", name, i, err)
		}
		if d.Replica < 0 || d.Replica >= len(c.reps) || !c.reps[d.Replica].Up {
			t.Fatalf("%s: request %d went to replica %d, which is not up", name, i, d.Replica)
		}
		// llmd-approx reports what its own history believes is cached.
		if want := v.MatchedTokens(d.Replica, req); d.MatchedTokens != want && name != "llmd-approx" {
			t.Fatalf("%s: decision reports %d matched tokens, replica %d caches %d", name, d.MatchedTokens, d.Replica, want)
		}
		if o, ok := p.(policy.Observer); ok {
			o.Routed(req, &d, v, now)
			if i%3 == 0 {
				o.FirstToken(req.ID, d.Replica, 100*time.Millisecond, now)
				o.Finished(req.ID, d.Replica, 50, true, now)
			}
			if i%50 == 49 {
				o.ReplicaDown(rng.IntN(5), now)
			}
		}
		c.tree.SetPathCached(c.m.Path, d.Replica, now)
		if over := c.tree.CachedBlocks(d.Replica) - 200; over > 0 {
			c.tree.EvictLRU(d.Replica, over, now)
		}
		out = append(out, fmt.Sprintf("%d/%s", d.Replica, d.Branch))
	}
	return out
}

// TestConformance is the suite every policy passes: it never picks a
// replica that is down, says ErrNoReplica when none is up, and decides the
// same way under the same seed. (Concurrency: policies are documented as not
// safe for concurrent use; the router serialises them, and
// internal/router's TestConcurrentRouter runs every policy behind a mutex
// under -race.)
func TestConformance(t *testing.T) {
	for _, name := range policy.Names() {
		t.Run(name, func(t *testing.T) {
			a := conformanceRun(t, name, 1)
			b := conformanceRun(t, name, 1)
			if !slices.Equal(a, b) {
				t.Errorf("two runs with the same seed decided differently")
			}
			for _, n := range []int{0, 3} {
				p := newPolicy(t, name)
				c := newCluster(t, n, 200*bt)
				for r := range c.reps {
					c.reps[r].Up = false
				}
				req, v := c.request(toks(1, 64), at(0))
				if _, err := p.Route(req, v, at(0)); !errors.Is(err, policy.ErrNoReplica) {
					t.Errorf("%d replicas, none up: err %v, want ErrNoReplica", n, err)
				}
			}
		})
	}
}

func TestNewUnknownAndParse(t *testing.T) {
	_, err := policy.New("nope", policy.DefaultOptions())
	if !errors.Is(err, policy.ErrUnknownPolicy) || !strings.Contains(err.Error(), `"nope"`) || !strings.Contains(err.Error(), "round-robin") || !strings.Contains(err.Error(), "e2-preble") {
		t.Errorf("New(nope): %v, want ErrUnknownPolicy naming it and the known policies", err)
	}
	for _, name := range policy.Names() {
		if p, err := policy.Parse(" "+name+" ", policy.DefaultOptions()); err != nil || p.Name() != name {
			t.Errorf("Parse(%q): %v", name, err)
		}
	}
	p, err := policy.Parse("e2-preble:mixing=false:window=1m:balance_threshold=2", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	cfg := p.(*policy.E2).Config()
	if cfg.Mixing || cfg.Window != time.Minute || cfg.BalanceThreshold != 2 || cfg.Name != "e2-preble:mixing=false:window=1m:balance_threshold=2" || !cfg.ExploitAssignedOnly {
		t.Errorf("parsed config %+v", cfg)
	}
	bad := []struct{ spec, want string }{
		{"nope", "unknown policy"},
		{"round-robin:x=1", "only e2, e2-preble, e2-pd, llmd-precise and llmd-approx take settings"},
		{"e2:window", "not field=value"},
		{"e2:nosuch=1", `unknown e2 field "nosuch" (known: `},
		{"llmd-precise:nosuch=1", `unknown llmd-precise setting "nosuch" (known: kv_weight, prefix_weight, queue_weight, speculative)`},
		{"llmd-approx:speculative=true", `unknown llmd-approx setting "speculative" (known: kv_weight, prefix_weight, queue_weight)`},
		{"llmd-precise:kv_weight=-1", "kv_weight must be a finite number ≥ 0"},
		{"llmd-approx:prefix_weight=NaN", "prefix_weight must be a finite number ≥ 0"},
		{"llmd-precise:queue_weight=lots", "queue_weight"},
		{"llmd-precise:speculative=maybe", "speculative"},
		{"llmd-precise:prefix_weight", "not field=value"},
		{"e2:window=abc", "window"},
		{"e2:mixing=maybe", "mixing"},
		{"e2:window=-1s", "window must be > 0"},
		{"e2:warmup_per_replica=1.5", "warmup_per_replica"},
		{"e2:mix_hit_ratio=NaN", "mix_hit_ratio"},
		{"e2:name=", "name must not be empty"},
	}
	for _, tt := range bad {
		t.Run(tt.spec, func(t *testing.T) {
			_, err := policy.Parse(tt.spec, policy.DefaultOptions())
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Parse(%q): err %v, want one containing %q", tt.spec, err, tt.want)
			}
		})
	}
	// Options that no policy could use are refused by its constructor.
	o := policy.DefaultOptions()
	o.ApproxCapacityBlocks = -1
	for _, name := range []string{"llmd-approx", "sglang"} {
		if _, err := policy.New(name, o); err == nil || !strings.Contains(err.Error(), "capacity") {
			t.Errorf("New(%s) with a negative history capacity: %v", name, err)
		}
	}
}

func TestRoundRobinSkipsDown(t *testing.T) {
	c := newCluster(t, 4, bigKV)
	c.reps[1].Up = false
	p := newPolicy(t, "round-robin")
	var got []int
	for i := 0; i < 6; i++ {
		d, _ := c.route(p, toks(1, 32), at(0))
		got = append(got, d.Replica)
		if i == 2 {
			c.reps[3].Up = false
		}
	}
	if want := []int{0, 2, 3, 0, 2, 0}; !slices.Equal(got, want) {
		t.Errorf("round-robin order %v, want %v", got, want)
	}
}

func TestLeastLoadAndPowerOfTwo(t *testing.T) {
	tests := []struct {
		inflight []int
		down     []int
		want     int
	}{
		{[]int{3, 1, 1, 2}, nil, 1},
		{[]int{3, 1, 1, 2}, []int{1}, 2},
		{[]int{0, 0, 0, 0}, []int{0}, 1},
		{[]int{5, 5, 9, 5}, []int{0, 1}, 3},
	}
	for _, tt := range tests {
		c := newCluster(t, 4, bigKV)
		for r, n := range tt.inflight {
			c.reps[r].InFlight = n
		}
		for _, r := range tt.down {
			c.reps[r].Up = false
		}
		if d, _ := c.route(newPolicy(t, "least-load"), toks(1, 32), at(0)); d.Replica != tt.want {
			t.Errorf("least-load on %v down %v → %d, want %d", tt.inflight, tt.down, d.Replica, tt.want)
		}
	}
	// Power of two: with two up replicas it always takes the less loaded;
	// with one, that one; and it never takes the most loaded of several.
	c := newCluster(t, 4, bigKV)
	c.reps[0].InFlight, c.reps[1].Up, c.reps[2].InFlight, c.reps[3].Up = 5, false, 1, false
	p := newPolicy(t, "power-of-two")
	for i := 0; i < 50; i++ {
		if d, _ := c.route(p, toks(1, 32), at(0)); d.Replica != 2 {
			t.Fatalf("power-of-two between loads 5 and 1 chose %d", d.Replica)
		}
	}
	c.reps[2].Up = false
	if d, _ := c.route(p, toks(1, 32), at(0)); d.Replica != 0 {
		t.Fatalf("power-of-two with one up replica chose %d", d.Replica)
	}
	c = newCluster(t, 4, bigKV)
	for r := range c.reps {
		c.reps[r].InFlight = []int{1, 2, 3, 9}[r]
	}
	seen := map[int]int{}
	for i := 0; i < 400; i++ {
		d, _ := c.route(p, toks(1, 32), at(0))
		seen[d.Replica]++
	}
	if seen[3] != 0 || seen[2] == 0 || seen[0] <= seen[1] {
		t.Errorf("power-of-two choices over loads 1,2,3,9: %v", seen)
	}
}

func TestSessionAffinity(t *testing.T) {
	c := newCluster(t, 5, bigKV)
	p := newPolicy(t, "session")
	route := func(session string, prompt []uint32) policy.Decision {
		req, v := c.request(prompt, at(0))
		req.Session = session
		d, err := p.Route(req, v, at(0))
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	before := map[string]int{}
	counts := map[int]int{}
	for i := 0; i < 200; i++ {
		s := fmt.Sprint("user-", i)
		before[s] = route(s, toks(uint64(i), 32)).Replica
		if again := route(s, toks(uint64(i+1000), 32)).Replica; again != before[s] {
			t.Fatalf("session %s moved from %d to %d with all replicas up", s, before[s], again)
		}
		counts[before[s]]++
	}
	for r := 0; r < 5; r++ {
		if counts[r] < 20 {
			t.Errorf("replica %d holds %d of 200 sessions: not spread", r, counts[r])
		}
	}
	c.reps[2].Up = false
	for s, r := range before {
		got := route(s, toks(1, 32)).Replica
		if r != 2 && got != r {
			t.Errorf("session %s moved from %d to %d when replica 2 left", s, r, got)
		}
		if got == 2 {
			t.Errorf("session %s still on the down replica", s)
		}
	}
	// No session: keyed by the first block, else round-robin.
	a := route("", toks(9, 64)).Replica
	if b := route("", cat(toks(9, 16), toks(10, 100))); b.Replica != a || b.Branch != "session" {
		t.Errorf("same first block: %d then %d (%s)", a, b.Replica, b.Branch)
	}
	if d := route("", toks(9, 8)); d.Branch != "session-none" {
		t.Errorf("no session and no full block: branch %s", d.Branch)
	}
}

func TestPrefixThreshold(t *testing.T) {
	prompt := toks(1, 1024)
	tests := []struct {
		threshold float64
		cached    int
		want      int
		branch    string
	}{
		{0.5, 528, 1, "prefix"},
		{0.5, 512, 1, "prefix"},
		{0.5, 496, 0, "least-load"},
		{0.9, 528, 0, "least-load"},
		{0, 0, 0, "least-load"},
		{math.NaN(), 16, 1, "prefix"},
		{7, 1024, 1, "prefix"}, // clamped to 1: the whole prompt cached
	}
	for _, tt := range tests {
		c := newCluster(t, 3, bigKV)
		if tt.cached > 0 {
			c.cache(prompt[:tt.cached], 1, at(0))
		}
		c.reps[1].InFlight = 5
		d, _ := c.route(policy.NewPrefix(tt.threshold), prompt, at(1))
		if d.Replica != tt.want || d.Branch != tt.branch {
			t.Errorf("threshold %v, %d cached: %s → %d, want %s → %d", tt.threshold, tt.cached, d.Branch, d.Replica, tt.branch, tt.want)
		}
	}
}

// TestLLMDPreciseByHand: score = 3·prefix + 2·(1−kv) + 2·queue, with
// prefix min-max normalised over the replicas with a hit and queue over the
// engines' waiting counts (running requests do not count).
func TestLLMDPreciseByHand(t *testing.T) {
	prompt := toks(1, 160) // 10 blocks
	c := newCluster(t, 3, bigKV)
	c.cache(prompt, 0, at(0))
	c.cache(prompt[:80], 1, at(0))
	c.reps[0].KVUsage, c.reps[0].Waiting, c.reps[0].Running = 0.9, 4, 0 // queue 4
	c.reps[1].KVUsage, c.reps[1].Waiting, c.reps[1].Running = 0.2, 1, 9 // queue 1: running does not count
	c.reps[2].Prefilling, c.reps[2].InFlight = 2, 7                     // no scrape: kv 1, queue = not yet started 2
	d, _ := c.route(policy.NewLLMDPrecise(), prompt, at(1))
	// prefix: 10 and 5 blocks among the hits → 1 and 0; queue: (4−q)/3.
	want := []float64{3*1 + 2*0.1 + 2*0, 3*0 + 2*0.8 + 2*1, 3*0 + 2*1 + 2*(2.0/3)}
	if d.Replica != 1 || len(d.Candidates) != 3 {
		t.Fatalf("chose %d, want 1 (%s)", d.Replica, d.Explain())
	}
	for _, cd := range d.Candidates {
		if math.Abs(cd.Score-want[cd.Replica]) > 1e-9 {
			t.Errorf("replica %d scores %v, want %v", cd.Replica, cd.Score, want[cd.Replica])
		}
	}
	if d.MatchedTokens != 80 {
		t.Errorf("matched %d tokens, want 80", d.MatchedTokens)
	}
	// Out-of-range usage clamps; equal queues all score 1; 0 and 1 now
	// both hold the whole prompt (the mirror), so both score prefix 1.
	c.reps[0].KVUsage, c.reps[0].Waiting, c.reps[0].Running = 1.7, 2, 0
	c.reps[1].Waiting = 2
	c.reps[2].Waiting, c.reps[2].Running = 2, 5
	d, _ = c.route(policy.NewLLMDPrecise(), prompt, at(2))
	want = []float64{3 + 0 + 2, 3 + 1.6 + 2, 0 + 2 + 2}
	for _, cd := range d.Candidates {
		if math.Abs(cd.Score-want[cd.Replica]) > 1e-9 {
			t.Errorf("clamped: replica %d scores %v, want %v", cd.Replica, cd.Score, want[cd.Replica])
		}
	}
}

// TestLLMDApproxLearnsFromHistory: the approximate scorer believes a replica
// holds a prompt because it sent it there, not because the tree says so.
func TestLLMDApproxLearnsFromHistory(t *testing.T) {
	p := newPolicy(t, "llmd-approx")
	c := newCluster(t, 3, bigKV)
	prompt := toks(1, 320)
	first, _ := c.route(p, prompt, at(0))
	// The engines' truth (the tree) says another replica holds it; the
	// history says first does.
	other := (first.Replica + 1) % 3
	c.tree.ClearReplica(first.Replica)
	c.cache(prompt, other, at(1))
	for i := 0; i < 5; i++ {
		if d, _ := c.route(p, cat(prompt, toks(uint64(50+i), 32)), at(2)); d.Replica != first.Replica {
			t.Fatalf("repeat %d went to %d, want %d, where the history sent the prompt", i, d.Replica, first.Replica)
		}
	}
	// Forgetting a replica that left drops its history.
	p.(policy.Observer).ReplicaDown(first.Replica, at(3))
	c.reps[other].Waiting = 10
	c.reps[first.Replica].Waiting = 10
	if d, _ := c.route(p, prompt, at(4)); d.Replica == first.Replica || d.Replica == other {
		t.Errorf("after ReplicaDown the forgotten history still scores: chose %d", d.Replica)
	}
}

// TestSGLangImbalance: imbalanced when max−min in-flight > 64 and max >
// 1.5·min: then least loaded; else the best history match above 30%.
func TestSGLangImbalance(t *testing.T) {
	prompt := toks(1, 320)
	tests := []struct {
		load   [2]int
		want   int
		branch string
	}{
		{[2]int{100, 30}, 1, "balance"},
		{[2]int{100, 36}, 0, "cache"},  // max−min = 64: not imbalanced
		{[2]int{200, 134}, 0, "cache"}, // 200 ≤ 1.5·134
		{[2]int{200, 133}, 1, "balance"},
	}
	for _, tt := range tests {
		p := newPolicy(t, "sglang")
		c := newCluster(t, 2, bigKV)
		recordOn(t, p, c, prompt, 0)
		c.reps[0].InFlight, c.reps[1].InFlight = tt.load[0], tt.load[1]
		d, _ := c.route(p, prompt, at(1))
		if d.Replica != tt.want || d.Branch != tt.branch {
			t.Errorf("loads %v: %s → %d, want %s → %d", tt.load, d.Branch, d.Replica, tt.branch, tt.want)
		}
	}
	// Below 30% matched: least loaded.
	p := newPolicy(t, "sglang")
	c := newCluster(t, 2, bigKV)
	recordOn(t, p, c, toks(1, 64), 0)
	c.reps[0].InFlight = 1
	if d, _ := c.route(p, cat(toks(1, 64), toks(2, 256)), at(1)); d.Replica != 1 || d.Branch != "least-load" {
		t.Errorf("20%% match: %s → %d, want least-load → 1", d.Branch, d.Replica)
	}
}

// recordOn makes a history policy believe replica r holds prompt: it routes
// the prompt (as the router does before committing) and reports r.
func recordOn(t *testing.T, p policy.Policy, c *cluster, prompt []uint32, r int) {
	t.Helper()
	req, v := c.request(prompt, at(0))
	if _, err := p.Route(req, v, at(0)); err != nil {
		t.Fatal(err)
	}
	p.(policy.Observer).Routed(req, &policy.Decision{Replica: r}, v, at(0))
}

// TestHistoryRoutedFirst: an Observer may be told of a decision it did not
// make (a replayed or forced route); it must not panic.
func TestHistoryRoutedFirst(t *testing.T) {
	for _, name := range []string{"llmd-approx", "sglang"} {
		t.Run(name, func(t *testing.T) {
			p := newPolicy(t, name)
			c := newCluster(t, 2, bigKV)
			req, v := c.request(toks(1, 64), at(0))
			defer func() {
				if e := recover(); e != nil {
					t.Fatalf("%s.Routed before any Route panics: %v", name, e)
				}
			}()
			p.(policy.Observer).Routed(req, &policy.Decision{Replica: 1}, v, at(0))
		})
	}
}

// TestDynamoByHand: logit = (prompt − cached + active prefill tokens)/B
// + active blocks + the request's blocks not active on the replica. Active
// blocks are distinct: requests sharing a prefix count it once.
func TestDynamoByHand(t *testing.T) {
	prompt := toks(1, 160) // 10 blocks
	c := newCluster(t, 3, bigKV)
	c.cache(prompt, 0, at(0))
	c.cache(prompt[:80], 2, at(0))
	c.hold(toks(9, 64), 0, at(0))                              // replica 0: 4 unrelated active blocks
	c.hold(cat(prompt[:80], toks(7, 80)), 1, at(0))            // replica 1: 10 active blocks, 5 of them the prompt's first 5
	c.hold(prompt[:80], 1, at(0))                              // the same 5 again: still 10 distinct
	c.reps[0].PendingPrefillTokens = 320                       // 20 blocks of prefill owed
	c.reps[2].PendingPrefillTokens = 16                        // 1 block
	c.reps[2].Decoding, c.reps[2].DecodeContextTokens = 3, 800 // not Dynamo's decode term
	d, _ := c.route(policy.NewDynamo(policy.DefaultDynamoConfig()), prompt, at(1))
	want := []struct{ prefill, decode float64 }{
		{0 + 20, 4 + 10}, // all cached; the prompt's 10 blocks are new on 0
		{10 + 0, 10 + 5}, // nothing cached; 5 of its blocks already active on 1
		{5 + 1, 0 + 10},
	}
	if d.Replica != 2 || d.MatchedTokens != 80 {
		t.Fatalf("chose %d with %d matched, want 2 with 80 (%s)", d.Replica, d.MatchedTokens, d.Explain())
	}
	for _, cd := range d.Candidates {
		w := want[cd.Replica]
		if cd.Prefill != w.prefill || cd.Load != w.decode || cd.Score != w.prefill+w.decode {
			t.Errorf("replica %d: prefill %v decode %v logit %v, want %v %v %v", cd.Replica, cd.Prefill, cd.Load, cd.Score, w.prefill, w.decode, w.prefill+w.decode)
		}
	}
	if got := c.tree.ActiveBlocks(1); got != 10 {
		t.Errorf("replica 1 has %d active blocks, want 10", got)
	}
	// The overlap weight scales the prefill term only.
	d, _ = c.route(policy.NewDynamo(policy.DynamoConfig{OverlapWeight: 2}), prompt, at(2))
	for _, cd := range d.Candidates {
		if w := want[cd.Replica]; cd.Score != 2*cd.Prefill+cd.Load || cd.Load != w.decode {
			t.Errorf("weight 2: replica %d logit %v from prefill %v decode %v", cd.Replica, cd.Score, cd.Prefill, cd.Load)
		}
	}
}
