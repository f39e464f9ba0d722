package policy_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// linearProfile is a cost model whose numbers can be checked by hand: a
// prefill costs 1 ms per new token, and an iteration that does any work costs
// 5 ms plus 1 ms per decoding sequence plus 1 ms per new prompt token (so the
// marginal decode cost of one more sequence in a running batch is 1 ms).
type linearProfile struct{ kv int }

var _ costmodel.Profile = linearProfile{}

func (linearProfile) Name() string { return "linear-test" }

func (linearProfile) Prefill(newTokens, seqTokens int) time.Duration {
	return time.Duration(max(newTokens, 0)) * time.Millisecond
}

func (linearProfile) Iteration(b costmodel.Batch) time.Duration {
	ms := b.DecodeSeqs
	for _, c := range b.Prefill {
		ms += max(c.New, 0)
	}
	if ms == 0 {
		return 0
	}
	return time.Duration(5+ms) * time.Millisecond
}

func (p linearProfile) KVCapacity() int { return p.kv }

const bt = 16 // tokens per block in these tests

// toks returns n distinct-looking token ids drawn from seed; prompts built
// from the same seed share their tokens.
func toks(seed uint64, n int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 99))
	t := make([]uint32, n)
	for i := range t {
		t[i] = rng.Uint32N(1 << 20)
	}
	return t
}

func cat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// cluster is a hand-built cluster for driving a policy without the router:
// a tree, replica snapshots whose load figures the test sets directly, and a
// mirror (the chosen replica caches the prompt).
type cluster struct {
	t    *testing.T
	tree *prefixtree.Tree
	reps []policy.Replica
	m    prefixtree.Match
	prof costmodel.Profile
	rng  *rand.Rand
	id   uint64
}

func newCluster(t *testing.T, n, kvTokens int) *cluster {
	t.Helper()
	tr, err := prefixtree.New(prefixtree.Config{BlockTokens: bt}, n)
	if err != nil {
		t.Fatal(err)
	}
	c := &cluster{t: t, tree: tr, prof: linearProfile{kv: kvTokens}, rng: rand.New(rand.NewPCG(1, 2))}
	for i := 0; i < n; i++ {
		c.reps = append(c.reps, policy.Replica{ID: i, Up: true, Waiting: -1, Running: -1, KVUsage: -1})
	}
	return c
}

// cache marks the prompt tokens as cached on replica r (as KV events would).
func (c *cluster) cache(tokens []uint32, r int, now time.Time) {
	c.tree.Insert(blocks.Keys(nil, tokens, bt), now, &c.m)
	c.tree.SetPathCached(c.m.Path, r, now)
}

// node returns the node holding the last full block of tokens.
func (c *cluster) node(tokens []uint32) *prefixtree.Node {
	keys := blocks.Keys(nil, tokens, bt)
	n, _, ok := c.tree.Find(keys[len(keys)-1])
	if !ok {
		c.t.Fatalf("prompt of %d tokens is not in the tree", len(tokens))
	}
	return n
}

// request inserts the prompt into the tree and returns the request and the
// view a policy decides on.
func (c *cluster) request(tokens []uint32, now time.Time) (*policy.Request, *policy.View) {
	c.id++
	req := &policy.Request{ID: c.id, Keys: blocks.Keys(nil, tokens, bt), PromptTokens: len(tokens), OutputTokens: 100}
	c.tree.Insert(req.Keys, now, &c.m)
	return req, &policy.View{Replicas: c.reps, Tree: c.tree, Match: &c.m, Profile: c.prof, Rand: c.rng}
}

// hold puts a request for tokens in flight on replica r (its path
// referenced, as the router does when it commits a decision).
func (c *cluster) hold(tokens []uint32, r int, now time.Time) {
	c.tree.Insert(blocks.Keys(nil, tokens, bt), now, &c.m)
	c.tree.AddRef(c.m.Path, r, 1)
}

// route decides, commits the decision to an Observer, and mirrors the
// prompt into the chosen replica's cache. It fails the test on an error.
func (c *cluster) route(p policy.Policy, tokens []uint32, now time.Time) (policy.Decision, uint64) {
	c.t.Helper()
	req, v := c.request(tokens, now)
	d, err := p.Route(req, v, now)
	if err != nil {
		c.t.Fatalf("Route: %v", err)
	}
	if o, ok := p.(policy.Observer); ok {
		o.Routed(req, &d, v, now)
	}
	c.tree.SetPathCached(c.m.Path, d.Replica, now)
	return d, req.ID
}

func members(s *prefixtree.Set) []int {
	out := []int{}
	s.Each(func(r int) { out = append(out, r) })
	return out
}

func mustE2(t *testing.T, cfg policy.E2Config) *policy.E2 {
	t.Helper()
	p, err := policy.NewE2(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

var t0 = time.Unix(1_700_000_000, 0)

func at(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
