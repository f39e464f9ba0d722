package policy_test

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

const bigKV = 1 << 30 // a cache that never fills: M = 0

// paperCost is E2 routing by the paper's L + M + P over every replica, with
// prefixlb's L (in-flight decode at its marginal cost plus the prefill queued
// now) and no other term, whatever the tuned defaults are.
func paperCost() policy.E2Config {
	c := policy.PrebleE2Config()
	c.Name = "e2-test"
	c.ExploitAssignedOnly = false
	c.IncludePrefill, c.MarginalDecode = true, true
	c.HistoryWeight, c.PendingWeight, c.DecodeWeight, c.PrefillWeight = 0, 1, 1, 1
	c.SelfDecodeWeight, c.InterferenceWeight = 0, 0
	c.EvictionRecompute, c.EvictionWeight = false, 1
	return c
}

// isolated returns cfg with rebalancing, replication and mixing off, so that
// one rule can be tested alone.
func isolated(cfg policy.E2Config) policy.E2Config {
	cfg.Rebalance, cfg.Replicate, cfg.Mixing = false, false, false
	return cfg
}

// TestE2ExploitAssignedCheapestByID: with the paper's exploit rule, a request
// whose cached part exceeds its miss goes to the cheapest replica of the
// assigned set of the deepest matched node that has one, ties to the lowest
// ID, and to every replica when none of that set is up (ALGORITHMS §3).
func TestE2ExploitAssignedCheapestByID(t *testing.T) {
	sys := toks(1, 1024) // 64 blocks, cached on 0, 1, 2
	q := toks(2, 256)    // 16 more blocks, cached on 0 after sys
	prompt := cat(sys, toks(3, 16))
	tests := []struct {
		name     string
		assigned []int
		decode   []int // DecodeTokens per replica (L = DecodeTokens·6 ms TPOT)
		down     []int
		deeper   bool // sys+q is cached on 0 and assigned to 0
		want     int
		cands    int
	}{
		{"tie goes to the lowest assigned id, not the cheaper unassigned", []int{1, 2, 3}, []int{0, 0, 0, 0}, nil, false, 1, 3},
		{"cheapest assigned", []int{1, 2, 3}, []int{0, 100, 50, 10}, nil, false, 3, 3},
		{"tie among the cheapest by id", []int{1, 2, 3}, []int{0, 100, 10, 10}, nil, false, 2, 3},
		{"down member skipped", []int{1, 2, 3}, []int{0, 0, 0, 0}, []int{1}, false, 2, 2},
		{"whole set down: every up replica", []int{3}, []int{10, 0, 0, 0}, []int{3}, false, 1, 3},
		{"no set: every replica", nil, []int{10, 5, 0, 0}, nil, false, 2, 4},
		{"deepest matched node's set", []int{1, 2, 3}, []int{100, 0, 0, 0}, nil, true, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 4, bigKV)
			p := mustE2(t, isolated(policy.PrebleE2Config()))
			for r := 0; r < 3; r++ {
				c.cache(sys, r, at(0))
			}
			for _, r := range tt.assigned {
				c.node(sys).Assigned.Add(r)
			}
			req := prompt
			if tt.deeper {
				c.cache(cat(sys, q), 0, at(0))
				c.node(cat(sys, q)).Assigned.Add(0)
				req = cat(sys, q, toks(3, 16))
			}
			for r, d := range tt.decode {
				c.reps[r].DecodeTokens = d
			}
			for _, r := range tt.down {
				c.reps[r].Up = false
			}
			r, v := c.request(req, at(1))
			d, err := p.Route(r, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			if d.Branch != "exploit" || d.Replica != tt.want || len(d.Candidates) != tt.cands {
				t.Errorf("got %s → %d with %d candidates, want exploit → %d with %d (%s)", d.Branch, d.Replica, len(d.Candidates), tt.want, tt.cands, d.Explain())
			}
		})
	}
}

// TestE2ExploreArgminCost checks L + M + P by hand on a miss-heavy request
// (1600 tokens; replica 2 caches 640 of them, less than the miss, so E2
// explores) under prefixlb's e2 terms: L = in-flight decode at its marginal
// cost + prefill queued now, M = windowed work of what the request would
// evict, P = this request's own prefill on the replica.
func TestE2ExploreArgminCost(t *testing.T) {
	prompt := toks(10, 1600)
	victim := toks(11, 2400) // 150 blocks cached on replica 3
	tests := []struct {
		name      string
		pending2  time.Duration
		victimHot bool // the victim prefix has two recent misses in E2's window
		want      int
		wantL     []float64
		wantM     []float64
		wantP     []float64
	}{
		{
			name: "decode-light replica wins", pending2: time.Second, victimHot: true, want: 1,
			wantL: []float64{0.5, 0.3, 1.0, 0}, wantM: []float64{0, 0, 0, 4.8}, wantP: []float64{1.6, 1.6, 0.96, 1.6},
		},
		{
			name: "cache credit in P wins", pending2: 900 * time.Millisecond, victimHot: true, want: 2,
			wantL: []float64{0.5, 0.3, 0.9, 0}, wantM: []float64{0, 0, 0, 4.8}, wantP: []float64{1.6, 1.6, 0.96, 1.6},
		},
		{
			name: "idle replica wins when what it evicts is cold", pending2: time.Second, victimHot: false, want: 3,
			wantL: []float64{0.5, 0.3, 1.0, 0}, wantM: []float64{0, 0, 0, 0}, wantP: []float64{1.6, 1.6, 0.96, 1.6},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 4, 3200) // 200 blocks of KV per replica
			p := mustE2(t, isolated(paperCost()))
			c.cache(prompt[:640], 2, at(0))
			c.cache(victim, 3, at(0))
			if tt.victimHot {
				for i := 0; i < 2; i++ {
					req, v := c.request(victim, at(0))
					p.Routed(req, &policy.Decision{Replica: 3}, v, at(0))
				}
			}
			c.reps[0].PendingPrefill = 500 * time.Millisecond
			c.reps[1].InFlight, c.reps[1].Decoding, c.reps[1].DecodeContextTokens, c.reps[1].DecodeTokens = 3, 3, 3000, 300
			c.reps[2].PendingPrefill = tt.pending2
			req, v := c.request(prompt, at(1))
			d, err := p.Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			if d.Branch != "explore" || d.Replica != tt.want || len(d.Candidates) != 4 {
				t.Fatalf("got %s → %d, want explore → %d (%s)", d.Branch, d.Replica, tt.want, d.Explain())
			}
			best := math.Inf(1)
			for _, cd := range d.Candidates {
				r := cd.Replica
				for _, term := range []struct {
					name      string
					got, want float64
				}{{"L", cd.Load, tt.wantL[r]}, {"M", cd.Eviction, tt.wantM[r]}, {"P", cd.Prefill, tt.wantP[r]}, {"score", cd.Score, tt.wantL[r] + tt.wantM[r] + tt.wantP[r]}} {
					if math.Abs(term.got-term.want) > 1e-9 {
						t.Errorf("replica %d: %s = %.6f, want %.6f", r, term.name, term.got, term.want)
					}
				}
				best = math.Min(best, cd.Score)
			}
			if d.Candidates[d.Replica].Score != best {
				t.Errorf("chosen replica %d is not the argmin", d.Replica)
			}
		})
	}
}

// TestE2BranchBoundary: exploit needs strictly more matched than missed.
func TestE2BranchBoundary(t *testing.T) {
	for _, tt := range []struct {
		cached, prompt int
		want           string
	}{{512, 1024, "explore"}, {528, 1024, "exploit"}, {0, 1024, "explore"}, {1024, 1024, "exploit"}} {
		c := newCluster(t, 2, bigKV)
		p := mustE2(t, isolated(policy.PrebleE2Config()))
		prompt := toks(20, tt.prompt)
		if tt.cached > 0 {
			c.cache(prompt[:tt.cached], 1, at(0))
		}
		req, v := c.request(prompt, at(1))
		d, err := p.Route(req, v, at(1))
		if err != nil || d.Branch != tt.want {
			t.Errorf("%d of %d cached: branch %s (err %v), want %s", tt.cached, tt.prompt, d.Branch, err, tt.want)
		}
	}
}

// TestE2MixingHitRatio: a miss-heavy request goes to a replica whose hit
// ratio over the last 30 s is at least 0.7 (the highest such, ties to the
// lowest ID); below 0.7, down, or aged out, E2 explores.
func TestE2MixingHitRatio(t *testing.T) {
	type hist struct {
		r           int
		prompt, hit int
		at          float64
	}
	tests := []struct {
		name   string
		hist   []hist
		down   []int
		when   float64
		branch string
		want   int
	}{
		{"exactly 0.7 mixes", []hist{{1, 1000, 700, 0}}, nil, 1, "mixing", 1},
		{"0.69 explores", []hist{{1, 1000, 690, 0}}, nil, 1, "explore", 0},
		{"the highest ratio wins", []hist{{1, 1000, 700, 0}, {2, 1000, 900, 0}}, nil, 1, "mixing", 2},
		{"ties to the lowest id", []hist{{2, 1000, 800, 0}, {1, 1000, 800, 0}}, nil, 1, "mixing", 1},
		{"a down replica is not a target", []hist{{1, 1000, 700, 0}, {2, 1000, 900, 0}}, []int{2}, 1, "mixing", 1},
		{"ratio over the window, not per request", []hist{{1, 1000, 1000, 0}, {1, 1000, 400, 0}}, nil, 1, "mixing", 1},
		{"aged out after 30 s", []hist{{1, 1000, 900, 0}}, nil, 31, "explore", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := isolated(policy.PrebleE2Config())
			cfg.Mixing = true
			p := mustE2(t, cfg)
			c := newCluster(t, 3, bigKV)
			for i, h := range tt.hist {
				req, v := c.request(toks(uint64(100+i), 64), at(h.at))
				req.PromptTokens = h.prompt
				p.Routed(req, &policy.Decision{Replica: h.r, MatchedTokens: h.hit}, v, at(h.at))
			}
			for _, r := range tt.down {
				c.reps[r].Up = false
			}
			// Make replica 0 the cheapest, so explore is told apart from mixing.
			c.reps[1].DecodeTokens, c.reps[2].DecodeTokens = 1000, 1000
			req, v := c.request(toks(7, 1024), at(tt.when))
			d, err := p.Route(req, v, at(tt.when))
			if err != nil {
				t.Fatal(err)
			}
			if d.Branch != tt.branch || d.Replica != tt.want {
				t.Errorf("got %s → %d, want %s → %d", d.Branch, d.Replica, tt.branch, tt.want)
			}
		})
	}
	// An exploit request never takes the mixing branch.
	cfg := isolated(policy.PrebleE2Config())
	cfg.Mixing = true
	p := mustE2(t, cfg)
	c := newCluster(t, 2, bigKV)
	prompt := toks(8, 1024)
	c.cache(prompt, 0, at(0))
	req, v := c.request(toks(9, 64), at(0))
	p.Routed(req, &policy.Decision{Replica: 1, MatchedTokens: 64}, v, at(0))
	if _, ratio := p.Window(1); ratio != 1 {
		t.Errorf("Window(1) hit ratio = %v, want 1", ratio)
	}
	req, v = c.request(prompt, at(1))
	if d, _ := p.Route(req, v, at(1)); d.Branch != "exploit" || d.Replica != 0 {
		t.Errorf("hit request: %s → %d, want exploit → 0", d.Branch, d.Replica)
	}
}

// TestE2ReplicatesLoneHotPrefix: a lone hot prefix on the heaviest replica
// whose TTFT doubles across the window gains the lightest replica; later
// requests for it choose between the two by cost; and the extra replica
// leaves the set once its requests for the prefix age out of the window.
func TestE2ReplicatesLoneHotPrefix(t *testing.T) {
	tests := []struct {
		name      string
		ttft      func(i int) time.Duration // of request i = 1..8
		replicate bool
	}{
		{"TTFT doubles", func(i int) time.Duration { return time.Duration(100*(1+(i-1)/4)) * time.Millisecond }, true},
		{"TTFT steady", func(int) time.Duration { return 100 * time.Millisecond }, false},
		{"TTFT up 1.9x", func(i int) time.Duration { return time.Duration(100+90*((i-1)/4)) * time.Millisecond }, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := policy.PrebleE2Config()
			cfg.WarmupPerReplica, cfg.Mixing = 0, false
			p := mustE2(t, cfg)
			c := newCluster(t, 3, bigKV)
			c.reps[2].DecodeTokens = 1 // replica 1 is the lightest
			hot := toks(30, 1024)
			req := func(i int) []uint32 { return cat(hot, toks(uint64(300+i), 16)) }
			for i := 1; i <= 9; i++ {
				if i == 9 {
					if got := members(&c.node(hot).Assigned); !slices.Equal(got, []int{0}) {
						t.Fatalf("before request 9 the prefix is assigned to %v, want [0]", got)
					}
				}
				d, id := c.route(p, req(i), at(float64(i)))
				if d.Replica != 0 {
					t.Fatalf("request %d went to %d (%s), want 0", i, d.Replica, d.Explain())
				}
				ttft := 50 * time.Millisecond
				if i <= 8 {
					ttft = tt.ttft(i)
				}
				p.FirstToken(id, 0, ttft, at(float64(i)).Add(ttft))
			}
			got := members(&c.node(hot).Assigned)
			if !tt.replicate {
				if !slices.Equal(got, []int{0}) || p.Replications != 0 {
					t.Fatalf("replicated without overload: assigned %v", got)
				}
				return
			}
			if !slices.Equal(got, []int{0, 1}) || p.Replications != 1 {
				t.Fatalf("after TTFT doubled: assigned %v (%d replications), want [0 1]", got, p.Replications)
			}
			// The next request for the prefix picks the cheaper replica of
			// the two: replica 1 has no windowed load.
			d, id := c.route(p, req(10), at(10))
			if d.Branch != "exploit" || d.Replica != 1 {
				t.Fatalf("request 10: %s → %d, want exploit → 1", d.Branch, d.Replica)
			}
			p.FirstToken(id, 1, 50*time.Millisecond, at(10.05))
			// Replica 1 becomes expensive: the prefix's traffic stays on 0.
			c.reps[1].DecodeTokens = 1_000_000
			if d, _ := c.route(p, req(11), at(100)); d.Replica != 0 {
				t.Fatalf("request 11 went to %d, want 0", d.Replica)
			}
			// Just inside the window of request 10, replica 1 keeps the prefix;
			// once request 10 ages out (window 3 min), the set shrinks to 0.
			c.route(p, toks(31, 1024), at(189))
			if got := members(&c.node(hot).Assigned); !slices.Equal(got, []int{0, 1}) {
				t.Fatalf("at 189 s assigned %v, want [0 1]", got)
			}
			c.route(p, toks(32, 1024), at(191))
			if got := members(&c.node(hot).Assigned); !slices.Equal(got, []int{0}) || p.Shrinks != 1 {
				t.Fatalf("at 191 s assigned %v (%d shrinks), want [0]", got, p.Shrinks)
			}
			// And once its last request ages out, the prefix loses its placement.
			c.route(p, toks(33, 1024), at(281))
			if got := members(&c.node(hot).Assigned); len(got) != 0 {
				t.Fatalf("an idle prefix is still assigned to %v", got)
			}
		})
	}
}

// placeOnZero routes each prompt twice onto replica 0 while replica 1 is
// made expensive, then makes replica 1 idle again.
func placeOnZero(c *cluster, p *policy.E2, prompts [][]uint32, expensive func(on bool)) float64 {
	c.t.Helper()
	expensive(true)
	s := 1.0
	for _, pr := range prompts {
		for k := 0; k < 2; k++ {
			if d, _ := c.route(p, pr, at(s)); d.Replica != 0 {
				c.t.Fatalf("placement went to %d, want 0 (%s)", d.Replica, d.Explain())
			}
			s++
		}
	}
	expensive(false)
	return s
}

// TestE2MigratesCheapestFirst: several hot prefixes on a heavy replica
// (windowed prefill loads 1.024, 2.048 and 4.096 s) move to the idle one
// cheapest first, exclusively, and stop before the move that would invert the
// imbalance: A and B move (7.168 → 4.096 vs 3.072), C stays.
func TestE2MigratesCheapestFirst(t *testing.T) {
	cfg := policy.PrebleE2Config()
	cfg.WarmupPerReplica, cfg.Mixing = 0, false
	p := mustE2(t, cfg)
	c := newCluster(t, 2, bigKV)
	a, b, cc := toks(40, 1024), toks(41, 2048), toks(42, 4096)
	s := placeOnZero(c, p, [][]uint32{a, b, cc}, func(on bool) {
		c.reps[1].DecodeTokens = map[bool]int{true: 1_000_000, false: 0}[on]
	})
	if p.Moves != 0 {
		t.Fatalf("%d moves during placement", p.Moves)
	}
	// Any decision now runs rebalancing: the heavy replica is 0, the light 1.
	if d, _ := c.route(p, toks(43, 512), at(s)); d.Replica != 1 {
		t.Fatalf("trigger request went to %d, want 1", d.Replica)
	}
	for _, tt := range []struct {
		name   string
		prompt []uint32
		want   []int
	}{{"A", a, []int{1}}, {"B", b, []int{1}}, {"C", cc, []int{0}}} {
		if got := members(&c.node(tt.prompt).Assigned); !slices.Equal(got, tt.want) {
			t.Errorf("prefix %s assigned to %v, want %v", tt.name, got, tt.want)
		}
	}
	if p.Moves != 2 {
		t.Errorf("%d moves, want 2", p.Moves)
	}
	// A request for a moved prefix follows it, though replica 0 caches it.
	if d, _ := c.route(p, a, at(s+1)); d.Replica != 1 {
		t.Errorf("moved prefix A routed to %d, want 1", d.Replica)
	}
}

// TestE2MigrationMovesSubtree: a prefix moves "with its subtree" (ALGORITHMS
// §4): a repeated prompt below the moved prefix follows it.
func TestE2MigrationMovesSubtree(t *testing.T) {
	cfg := policy.PrebleE2Config()
	cfg.WarmupPerReplica, cfg.Mixing = 0, false
	p := mustE2(t, cfg)
	c := newCluster(t, 2, bigKV)
	a := toks(50, 1024)
	a1, a2 := cat(a, toks(51, 16)), cat(a, toks(52, 16))
	b, cc := toks(53, 2048), toks(54, 4096)
	expensive := func(on bool) { c.reps[1].DecodeTokens = map[bool]int{true: 1_000_000, false: 0}[on] }
	expensive(true)
	s := 1.0
	for _, pr := range [][]uint32{a1, a2, b, b, cc, cc} {
		if d, _ := c.route(p, pr, at(s)); d.Replica != 0 {
			t.Fatalf("placement went to %d", d.Replica)
		}
		s++
	}
	expensive(false)
	c.route(p, toks(55, 512), at(s))
	if got := members(&c.node(a).Assigned); !slices.Equal(got, []int{1}) {
		t.Fatalf("prefix A assigned to %v, want [1]", got)
	}
	d, _ := c.route(p, a1, at(s+1))
	if d.Replica != 1 {
		t.Fatalf("a repeat of a prompt below moved prefix A went to %d, want 1 (a stale Assigned copy below the prefix unit must not override the move)", d.Replica)
	}
}

// TestE2RebalanceInterval: rebalancing at most once per interval must still
// rebalance: requests 1 s apart with a 1 s interval move exactly what
// rebalancing after every decision moves.
func TestE2RebalanceInterval(t *testing.T) {
	moves := map[time.Duration]int{}
	for _, interval := range []time.Duration{0, time.Second} {
		cfg := paperCost()
		cfg.Mixing, cfg.Rebalance, cfg.Replicate, cfg.MovableLoadOnly = false, true, true, true
		cfg.WarmupPerReplica, cfg.RebalanceInterval, cfg.MoveCooldown = 0, interval, 30*time.Second
		p := mustE2(t, cfg)
		c := newCluster(t, 2, bigKV)
		c.reps[1].PendingPrefill = time.Hour
		a, b := toks(60, 1024), toks(61, 2048)
		for i, pr := range [][]uint32{cat(a, toks(62, 16)), cat(a, toks(63, 16)), cat(b, toks(64, 16)), cat(b, toks(65, 16))} {
			if d, _ := c.route(p, pr, at(float64(i+1))); d.Replica != 0 {
				t.Fatalf("placement went to %d", d.Replica)
			}
		}
		moves[interval] = p.Moves
	}
	if moves[0] == 0 {
		t.Fatalf("no move with rebalancing after every decision")
	}
	if moves[time.Second] != moves[0] {
		t.Fatalf("with rebalance_interval=1s E2 made %d moves, %d with 0", moves[time.Second], moves[0])
	}
}

func TestE2ConfigValidate(t *testing.T) {
	base := policy.DefaultE2Config()
	if err := base.Validate(); err != nil {
		t.Fatalf("DefaultE2Config: %v", err)
	}
	if err := policy.PrebleE2Config().Validate(); err != nil {
		t.Fatalf("PrebleE2Config: %v", err)
	}
	tests := []struct {
		field string
		edit  func(c *policy.E2Config)
	}{
		{"name", func(c *policy.E2Config) { c.Name = "" }},
		{"window", func(c *policy.E2Config) { c.Window = 0 }},
		{"mix_window", func(c *policy.E2Config) { c.MixWindow = 0 }},
		{"mix_window", func(c *policy.E2Config) { c.MixWindow = c.Window + 1 }},
		{"balance_threshold", func(c *policy.E2Config) { c.BalanceThreshold = 0.5 }},
		{"balance_threshold", func(c *policy.E2Config) { c.BalanceThreshold = math.NaN() }},
		{"mix_hit_ratio", func(c *policy.E2Config) { c.MixHitRatio = 1.5 }},
		{"mix_hit_ratio", func(c *policy.E2Config) { c.MixHitRatio = -0.1 }},
		{"warmup_per_replica", func(c *policy.E2Config) { c.WarmupPerReplica = -1 }},
		{"min_hot_count", func(c *policy.E2Config) { c.MinHotCount = 0 }},
		{"replicate_ttft_ratio", func(c *policy.E2Config) { c.ReplicateTTFTRatio = 0.9 }},
		{"replicate_ttft_ratio", func(c *policy.E2Config) { c.ReplicateTTFTRatio = math.Inf(1) }},
		{"tpot_samples", func(c *policy.E2Config) { c.TPOTSamples = 0 }},
		{"history_weight", func(c *policy.E2Config) { c.HistoryWeight = -1 }},
		{"pending_weight", func(c *policy.E2Config) { c.PendingWeight = math.NaN() }},
		{"decode_weight", func(c *policy.E2Config) { c.DecodeWeight = -1 }},
		{"interference_weight", func(c *policy.E2Config) { c.InterferenceWeight = math.Inf(-1) }},
		{"eviction_weight", func(c *policy.E2Config) { c.EvictionWeight = -0.5 }},
		{"rebalance_interval", func(c *policy.E2Config) { c.RebalanceInterval = -time.Second }},
		{"move_cooldown", func(c *policy.E2Config) { c.MoveCooldown = -time.Second }},
	}
	for _, tt := range tests {
		c := base
		tt.edit(&c)
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("invalid %s: err %v, want one naming %s", tt.field, err, tt.field)
		}
		if _, err := policy.NewE2(c); err == nil {
			t.Errorf("NewE2 accepted an invalid %s", tt.field)
		}
	}
}

// TestE2SlotWait: on slot-cache replicas (llama.cpp), a replica whose every
// slot is taken makes a request wait for one; e2 prices that wait, so a
// cached prefix on a replica with a long queue of decodes loses to a
// recompute on an idle one, and wins when a slot is free.
func TestE2SlotWait(t *testing.T) {
	doc := toks(1, 320)
	for _, tt := range []struct {
		name     string
		inFlight int
		want     int
	}{
		{"slot free", 1, 0},
		{"all slots busy", 2, 1},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := newCluster(t, 2, 1<<20)
			c.cache(doc, 0, at(0))
			for i := range c.reps {
				c.reps[i].Slots = 2
			}
			// Replica 0 holds the prefix and has requests in flight, each
			// still owing 1,000 output tokens (1 s of decode at 1 ms/step
			// per sequence in the linear profile, 7 ms a step of 2).
			r0 := &c.reps[0]
			r0.InFlight, r0.Decoding, r0.DecodeTokens, r0.DecodeContextTokens = tt.inFlight, tt.inFlight, 1000*tt.inFlight, 400*tt.inFlight
			p := mustE2(t, policy.DefaultE2Config())
			req, v := c.request(cat(doc, toks(2, 32)), at(1))
			d, err := p.Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			if d.Replica != tt.want {
				t.Errorf("chose replica %d, want %d: %s", d.Replica, tt.want, d.Explain())
			}
		})
	}
	// The same replica with a block cache never waits for a slot.
	cfg := policy.DefaultE2Config()
	cfg.SlotWait = false
	c := newCluster(t, 2, 1<<20)
	c.cache(doc, 0, at(0))
	r0 := &c.reps[0]
	r0.Slots = 2
	r0.InFlight, r0.Decoding, r0.DecodeTokens, r0.DecodeContextTokens = 2, 2, 2000, 800
	req, v := c.request(cat(doc, toks(2, 32)), at(1))
	d, err := mustE2(t, cfg).Route(req, v, at(1))
	if err != nil {
		t.Fatal(err)
	}
	if d.Replica != 0 {
		t.Errorf("slot_wait=false: chose %d, want the cached replica 0: %s", d.Replica, d.Explain())
	}
}

// learning is a profile that remembers its own figures (costmodel.Memoizer,
// as a calibrated model does) and whose decode step the test changes, as
// calibration does when it refits.
type learning struct {
	linearProfile
	step *time.Duration
}

func (l learning) Iteration(b costmodel.Batch) time.Duration {
	if len(b.Prefill) == 0 && b.DecodeSeqs > 0 {
		return *l.step
	}
	return l.linearProfile.Iteration(b)
}

func (learning) Memoized() bool { return true }

// TestE2TPOTSeedFollowsTheProfile: a replica with no observed time per
// output token is charged its profile's decode step as the profile prices
// it now; when a calibrated profile learns a slower step, the decode term
// of L follows (it used to keep the figure of the first decision).
func TestE2TPOTSeedFollowsTheProfile(t *testing.T) {
	step := 10 * time.Millisecond
	c := newCluster(t, 2, bigKV)
	c.prof = learning{linearProfile{kv: bigKV}, &step}
	cfg := isolated(paperCost())
	cfg.MarginalDecode = false
	p := mustE2(t, cfg)
	c.reps[1].InFlight, c.reps[1].Decoding, c.reps[1].DecodeTokens = 1, 1, 100
	load := func(tokens []uint32, now time.Time) float64 {
		req, v := c.request(tokens, now)
		d, err := p.Route(req, v, now)
		if err != nil {
			t.Fatal(err)
		}
		for _, cd := range d.Candidates {
			if cd.Replica == 1 {
				return cd.Load
			}
		}
		t.Fatalf("replica 1 is not a candidate: %s", d.Explain())
		return 0
	}
	first := load(toks(40, 512), at(0))
	step = 30 * time.Millisecond
	second := load(toks(41, 512), at(1))
	if math.Abs(first-1.0) > 1e-9 || math.Abs(second-3.0) > 1e-9 {
		t.Errorf("replica 1's L with 100 tokens to decode: %.4g s at a 10 ms step, then %.4g s at 30 ms; want 1 and 3", first, second)
	}
}
