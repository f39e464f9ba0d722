package policy_test

import (
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// kvProfile is linearProfile with a KV size, so that transfers have bytes.
type kvProfile struct {
	linearProfile
	bytes float64
}

func (p kvProfile) KVBytesPerToken() float64 { return p.bytes }

// pdCluster is n replicas, the first k of them prefill replicas, the rest
// decode replicas.
func pdCluster(t *testing.T, n, k int) *cluster {
	c := newCluster(t, n, bigKV)
	for i := range c.reps {
		c.reps[i].Role = policy.RoleDecode
		if i < k {
			c.reps[i].Role = policy.RolePrefill
		}
	}
	return c
}

var pdPolicies = []string{"round-robin-pd", "llmd-pd", "dynamo-pd", "e2-pd"}

// TestPDRoles: every P/D policy decodes on a replica that decodes and
// prefills a disaggregated request on a prefill replica, whatever the load;
// without prefill replicas up it never disaggregates.
func TestPDRoles(t *testing.T) {
	for _, name := range pdPolicies {
		t.Run(name, func(t *testing.T) {
			p := newPolicy(t, name)
			if d, ok := p.(policy.Disaggregator); !ok || !d.Disaggregates() {
				t.Fatalf("%s is not a Disaggregator", name)
			}
			c := pdCluster(t, 5, 2)
			pd := 0
			for i := 0; i < 60; i++ {
				c.reps[i%5].Waiting = i % 3
				c.reps[(i+2)%5].Decoding = i % 7
				if i == 40 {
					c.reps[0].Up, c.reps[1].Up = false, false
				}
				d, _ := c.route(p, cat(toks(uint64(i%4), 2000), toks(uint64(100+i), 300)), at(float64(i)))
				if c.reps[d.Replica].Role == policy.RolePrefill || !c.reps[d.Replica].Up {
					t.Fatalf("decision %d decodes on replica %d (%v, up %v)", i, d.Replica, c.reps[d.Replica].Role, c.reps[d.Replica].Up)
				}
				if !d.Disaggregated {
					continue
				}
				pd++
				if i >= 40 {
					t.Fatalf("decision %d disaggregated with no prefill replica up", i)
				}
				if pr := d.PrefillReplica; c.reps[pr].Role != policy.RolePrefill || !c.reps[pr].Up {
					t.Fatalf("decision %d prefills on replica %d (%v)", i, pr, c.reps[pr].Role)
				}
			}
			if pd == 0 && name != "e2-pd" {
				t.Errorf("%s never disaggregated", name)
			}
		})
	}
}

// TestPullAndTransfer: the KV a decode replica must receive excludes the
// blocks it caches, and a transfer shares its link with those already on
// either end.
func TestPullAndTransfer(t *testing.T) {
	c := pdCluster(t, 3, 1)
	c.prof = kvProfile{linearProfile{kv: bigKV}, 1000}
	prompt := toks(1, 5*bt)
	c.cache(prompt[:3*bt], 1, at(0))
	req, v := c.request(prompt, at(1))
	v.KVLink = policy.KVLink{BytesPerSecond: 1e6, Latency: 2 * time.Millisecond}
	if got := v.PullTokens(1, req); got != 2*bt {
		t.Errorf("PullTokens on the replica caching 3 of 5 blocks = %d, want %d", got, 2*bt)
	}
	if got := v.PullTokens(2, req); got != 5*bt {
		t.Errorf("PullTokens on an empty replica = %d, want %d", got, 5*bt)
	}
	// 32 tokens · 1000 bytes at 1 MB/s: 32 ms, plus 2 ms.
	if got := v.TransferSeconds(0, 1, req); math.Abs(got-0.034) > 1e-9 {
		t.Errorf("TransferSeconds alone = %v, want 0.034", got)
	}
	// Two transfers already from the prefill replica: a third of the link.
	c.reps[0].Transfers = 2
	if got := v.TransferSeconds(0, 1, req); math.Abs(got-(0.002+3*0.032)) > 1e-9 {
		t.Errorf("TransferSeconds sharing with 2 = %v, want %v", got, 0.002+3*0.032)
	}
	// A whole prompt cached: only the last block moves (it is recomputed).
	c.cache(prompt, 2, at(2))
	req, v = c.request(prompt, at(3))
	if got := v.PullTokens(2, req); got != bt {
		t.Errorf("PullTokens with the prompt cached = %d, want %d", got, bt)
	}
}

// TestE2PDConditional: e2-pd prefills locally when the decode replica holds
// the prompt, and when it holds nothing but runs no decodes (a transfer
// then costs more than it saves); it disaggregates a long uncached prompt
// when the decode replicas are busy decoding, whose streams a local prefill
// would stall. The choice is the cost comparison, not a token count: the
// same uncached prompt goes both ways.
func TestE2PDConditional(t *testing.T) {
	prompt := toks(7, 4000)
	for _, tc := range []struct {
		name     string
		cached   bool // replica 2 holds the prompt
		decoding int  // requests decoding on each decode replica
		wantPD   bool
	}{
		{"decode replica holds the prompt, busy", true, 100, false},
		{"uncached, decode replicas idle", false, 0, false},
		{"uncached, decode replicas busy", false, 100, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := pdCluster(t, 4, 1)
			c.prof = kvProfile{linearProfile{kv: bigKV}, 1000}
			if tc.cached {
				c.cache(prompt, 2, at(0))
			}
			for r := 1; r < 4; r++ {
				c.reps[r].Decoding = tc.decoding
				c.reps[r].InFlight = tc.decoding
				c.reps[r].DecodeContextTokens = tc.decoding * 2000
				c.reps[r].DecodeTokens = tc.decoding * 100
			}
			p := newPolicy(t, "e2-pd")
			req, v := c.request(prompt, at(1))
			v.KVLink = policy.KVLink{BytesPerSecond: 50e9 / 8, Latency: time.Millisecond}
			d, err := p.Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			if d.Disaggregated != tc.wantPD {
				t.Errorf("Disaggregated = %v (branch %s, decode on %d), want %v\n%s", d.Disaggregated, d.Branch, d.Replica, tc.wantPD, d.Explain())
			}
			if tc.cached && d.Replica != 2 {
				t.Errorf("decode on %d, want 2 (it holds the prompt)", d.Replica)
			}
			if d.Disaggregated && d.PrefillReplica != 0 {
				t.Errorf("prefill on %d, want 0", d.PrefillReplica)
			}
		})
	}
}

// TestLLMDPDThreshold: llm-d's decider disaggregates when at least 16
// prompt tokens are not cached on the chosen decode pod; the prefill pod is
// the one with the best prefix score.
func TestLLMDPDThreshold(t *testing.T) {
	c := pdCluster(t, 4, 2)
	base := toks(3, 20*bt)
	c.cache(base, 1, at(0))
	c.cache(base, 3, at(0))
	p := newPolicy(t, "llmd-pd")
	// 8 tokens past what replica 3 caches: decode only, on 3.
	d, _ := c.route(p, cat(base, toks(4, 8)), at(1))
	if d.Disaggregated || d.Replica != 3 {
		t.Errorf("8 uncached tokens: decode %d disaggregated %v, want 3, false", d.Replica, d.Disaggregated)
	}
	// 40 past it: prefill on 1, which holds the prefix, decode on 3.
	d, _ = c.route(p, cat(base, toks(5, 40)), at(2))
	if !d.Disaggregated || d.Replica != 3 || d.PrefillReplica != 1 {
		t.Errorf("40 uncached tokens: decode %d prefill %d disaggregated %v, want 3, 1, true", d.Replica, d.PrefillReplica, d.Disaggregated)
	}
}

// TestDynamoPD: Dynamo's prefill router follows the cache; its decode
// router ignores it and takes the least active blocks.
func TestDynamoPD(t *testing.T) {
	c := pdCluster(t, 4, 2)
	prompt := toks(9, 30*bt)
	c.cache(prompt, 1, at(0))
	c.cache(prompt, 2, at(0))
	c.hold(toks(10, 10*bt), 2, at(0)) // replica 2 has active blocks
	p := newPolicy(t, "dynamo-pd")
	d, _ := c.route(p, prompt, at(1))
	if !d.Disaggregated || d.PrefillReplica != 1 || d.Replica != 3 {
		t.Errorf("prefill %d decode %d disaggregated %v, want 1, 3 (the idle one, though 2 caches the prompt), true", d.PrefillReplica, d.Replica, d.Disaggregated)
	}
}

// ctxProfile is kvProfile whose decode step reads every sequence's context
// (1 ms per 1,000 tokens of it), as an engine's attention does.
type ctxProfile struct{ kvProfile }

func (p ctxProfile) Iteration(b costmodel.Batch) time.Duration {
	return p.kvProfile.Iteration(b) + time.Duration(b.DecodeContext)*time.Microsecond
}

// TestE2PDCrowding: a long prompt that decode replica 2 holds stays there
// while 2 is idle, and is disaggregated (prefilled on 0, which holds it too,
// decoded on an idle replica) when 2 runs streams that its 40k tokens of
// context would slow at every step; E2's terms alone keep it on 2 (its
// prefill there is one block, and its own decode, priced at the batch's
// short context, looks cheap).
func TestE2PDCrowding(t *testing.T) {
	prompt := toks(11, 40000)
	for _, tc := range []struct {
		name     string
		decoding int // short-context streams decoding on replica 2
		wantPD   bool
	}{
		{"holder idle", 0, false},
		{"holder crowded", 10, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := pdCluster(t, 4, 1)
			c.prof = ctxProfile{kvProfile{linearProfile{kv: bigKV}, 1000}}
			c.cache(prompt, 0, at(0))
			c.cache(prompt, 2, at(0))
			c.reps[0].PendingPrefill = time.Second // the prefill leg is not free
			rp := &c.reps[2]
			rp.Decoding, rp.InFlight = tc.decoding, tc.decoding
			rp.DecodeContextTokens, rp.DecodeTokens = tc.decoding*1000, tc.decoding*1000
			p := newPolicy(t, "e2-pd")
			req, v := c.request(prompt, at(1))
			req.OutputTokens = 200
			v.KVLink = policy.KVLink{BytesPerSecond: 50e9 / 8, Latency: time.Millisecond}
			d, err := p.Route(req, v, at(1))
			if err != nil {
				t.Fatal(err)
			}
			if d.Disaggregated != tc.wantPD {
				t.Fatalf("Disaggregated = %v (decode on %d), want %v\n%s", d.Disaggregated, d.Replica, tc.wantPD, d.Explain())
			}
			if tc.wantPD && (d.Replica == 2 || d.PrefillReplica != 0) {
				t.Errorf("prefill %d decode %d, want prefill 0, decode off 2", d.PrefillReplica, d.Replica)
			}
			if !tc.wantPD && d.Replica != 2 {
				t.Errorf("decode on %d, want 2 (it holds the prompt)", d.Replica)
			}
		})
	}
}

// TestExplainLegs: a disaggregating decision's explanation names the leg
// each candidate's cost was priced for, so both costs read apart.
func TestExplainLegs(t *testing.T) {
	d := policy.Decision{Branch: "pd", Disaggregated: true, Candidates: []policy.Candidate{
		{Replica: 0, Leg: "prefill", Score: 1}, {Replica: 2, Leg: "decode", Score: 2}, {Replica: 2, Score: 3}}}
	got := d.Explain()
	for _, want := range []string{"; prefill:r0=1(", "; decode:r2=2(", "; r2=3("} {
		if !strings.Contains(got, want) {
			t.Errorf("Explain() = %q, lacks %q", got, want)
		}
	}
}
