package router

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// matched is the number of leading blocks of keys cached on replica id.
func matched(r *Router, keys []blocks.Key, id int) int {
	n := 0
	for _, k := range keys {
		nd, _, ok := r.tree.Find(k)
		if !ok || !nd.Cached(id) {
			break
		}
		n++
	}
	return n
}

func TestSpeculativeEntries(t *testing.T) {
	tokens := toks(7, 8*bt)
	keys := blocks.Keys(nil, tokens, bt)
	route := func(t *testing.T, r *Router, id uint64, ms int) {
		t.Helper()
		d, err := r.Route(req(id, tokens), at(ms))
		if err != nil {
			t.Fatal(err)
		}
		if d.Replica != 0 {
			t.Fatalf("routed to %d, want 0", d.Replica)
		}
	}
	tests := []struct {
		name string
		// after routing at 0 ms, run this and then check at checkMS.
		events  func(t *testing.T, r *Router)
		checkMS int
		want    int // blocks cached on replica 0 at checkMS
		wantBlk int // CachedBlocks(0)
		// nodes the prompt is cut into at checkMS: only events and routes
		// cut it, never expiry (docs/performance.md, "Expired runs as
		// one node"); the per-block expiry before cut an expired prompt
		// into 8.
		nodes int
	}{
		{"visible at once", func(*testing.T, *Router) {}, 1, 8, 8, 1},
		{"expires without an event", func(*testing.T, *Router) {}, 2000, 0, 0, 1},
		{"kept when confirmed", func(t *testing.T, r *Router) {
			if err := r.CacheStored(0, 0, false, keys, at(500)); err != nil {
				t.Fatal(err)
			}
		}, 5000, 8, 8, 1},
		{"partly confirmed", func(t *testing.T, r *Router) {
			if err := r.CacheStored(0, 0, false, keys[:3], at(500)); err != nil {
				t.Fatal(err)
			}
		}, 2000, 3, 3, 2},
		{"removed after confirmation", func(t *testing.T, r *Router) {
			if err := r.CacheStored(0, 0, false, keys, at(500)); err != nil {
				t.Fatal(err)
			}
			if err := r.CacheRemoved(0, keys[6:]); err != nil {
				t.Fatal(err)
			}
		}, 3000, 6, 6, 3},
		{"removed while speculative", func(t *testing.T, r *Router) {
			if err := r.CacheRemoved(0, keys[4:]); err != nil {
				t.Fatal(err)
			}
		}, 1, 4, 4, 5},
		{"cleared", func(t *testing.T, r *Router) {
			if err := r.CacheCleared(0); err != nil {
				t.Fatal(err)
			}
		}, 1, 0, 0, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRouter(t, speculating{&policy.RoundRobin{}}, 0, true)
			route(t, r, 1, 0)
			if err := r.Finished(1, 10, -1, true, at(100)); err != nil {
				t.Fatal(err)
			}
			tt.events(t, r)
			r.ExpireSpeculative(at(tt.checkMS))
			if got := matched(r, keys, 0); got != tt.want {
				t.Errorf("matched blocks at %d ms = %d, want %d", tt.checkMS, got, tt.want)
			}
			if got := r.Tree().CachedBlocks(0); got != tt.wantBlk {
				t.Errorf("CachedBlocks = %d, want %d", got, tt.wantBlk)
			}
			if got := r.Tree().Nodes(); got != tt.nodes {
				t.Errorf("Nodes = %d, want %d", got, tt.nodes)
			}
		})
	}
}

// TestExpiryKeepsPrefixUnits: a long prompt whose head an engine stored
// and whose tail expired stays two nodes, the tail still a prefix unit of
// its own (prefixtree.Node.Important, Preble's "large node") with E2's
// statistics where they were; per-block expiry cut the tail into one-block
// nodes, none of them a prefix unit.
func TestExpiryKeepsPrefixUnits(t *testing.T) {
	r := newRouter(t, speculating{&policy.RoundRobin{}}, 0, true)
	tokens := toks(13, 100*bt)
	keys := blocks.Keys(nil, tokens, bt)
	if _, err := r.Route(req(1, tokens), at(0)); err != nil {
		t.Fatal(err)
	}
	if err := r.CacheStored(0, 0, false, keys[:20], at(500)); err != nil {
		t.Fatal(err)
	}
	tail, _, _ := r.tree.Find(keys[20])
	tail.Ext = "stats"
	r.ExpireSpeculative(at(3000))
	if got := matched(r, keys, 0); got != 20 {
		t.Fatalf("matched %d blocks after expiry, want the 20 stored", got)
	}
	if got := r.Tree().Nodes(); got != 2 {
		t.Fatalf("Nodes = %d after expiry, want 2 (head, tail)", got)
	}
	n, off, _ := r.tree.Find(keys[20])
	if n != tail || off != 0 || n.Own() != 80 || !n.Important() || n.Ext != "stats" {
		t.Fatalf("tail after expiry: same node %v, offset %d, %d blocks, important %v, Ext %v", n == tail, off, n.Own(), n.Important(), n.Ext)
	}
}

// TestSpeculativeRenewed: a second request for the prefix before the
// deadline extends it; the first deadline no longer unmarks it.
func TestSpeculativeRenewed(t *testing.T) {
	r := newRouter(t, speculating{&policy.RoundRobin{}}, 0, true)
	tokens := toks(9, 4*bt)
	keys := blocks.Keys(nil, tokens, bt)
	for i, ms := range []int{0, 1500} {
		if _, err := r.Route(req(uint64(i+1), tokens), at(ms)); err != nil {
			t.Fatal(err)
		}
	}
	r.ExpireSpeculative(at(2500))
	if got := matched(r, keys, 0); got != 4 {
		t.Errorf("after the first deadline: matched %d, want 4", got)
	}
	r.ExpireSpeculative(at(3500))
	if got := matched(r, keys, 0); got != 0 {
		t.Errorf("after the second deadline: matched %d, want 0", got)
	}
	if got := r.Speculative(); got != 0 {
		t.Errorf("Speculative() = %d, want 0", got)
	}
}

// TestSpeculativeOff: a negative TTL marks nothing; mirrored replicas are
// not speculative.
func TestSpeculativeOff(t *testing.T) {
	r, err := New(Config{BlockTokens: bt, Profile: profile(t), Policy: &policy.RoundRobin{}, SpeculativeTTL: -1})
	if err != nil {
		t.Fatal(err)
	}
	r.AddReplica("a", true)
	tokens := toks(11, 4*bt)
	if _, err := r.Route(req(1, tokens), at(0)); err != nil {
		t.Fatal(err)
	}
	if got := r.Tree().CachedBlocks(0); got != 0 {
		t.Errorf("CachedBlocks = %d with speculation off, want 0", got)
	}
	m := newRouter(t, &policy.RoundRobin{}, 0, false)
	if _, err := m.Route(req(1, tokens), at(0)); err != nil {
		t.Fatal(err)
	}
	if got := m.Speculative(); got != 0 {
		t.Errorf("mirrored replica: Speculative() = %d, want 0", got)
	}
}

// TestNoSpeculationWithoutOptIn: a policy that does not implement
// policy.Speculator (round-robin; llm-d's precise scorer unless its
// speculative indexing is on) gets no speculative entries.
func TestNoSpeculationWithoutOptIn(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, true)
	a := req(1, toks(1, 64))
	if _, err := r.Route(a, at(0)); err != nil {
		t.Fatal(err)
	}
	if got := matched(r, a.Keys, 0); got != 0 {
		t.Fatalf("a policy without Speculator got %d speculative blocks, want 0", got)
	}
}

// perBlockSpec is the per-block speculation the router kept before its
// marks moved onto the tree's nodes (a map entry per block and replica,
// commit 92f5675's speculate.go), kept here as the reference the node
// stamps must agree with.
type perBlockSpec struct {
	fifo    []perBlockEntry
	pending map[[2]uint64]time.Time
}

type perBlockEntry struct {
	id       int
	keys     []blocks.Key
	deadline time.Time
}

func (s *perBlockSpec) speculate(r *Router, id int, keys []blocks.Key, path []*prefixtree.Node, now time.Time) {
	deadline := now.Add(DefaultSpeculativeTTL)
	var mine []blocks.Key
	off := 0
	for _, n := range path {
		own := min(n.Own(), len(keys)-off)
		for _, k := range keys[off : off+own] {
			sk := [2]uint64{uint64(id), uint64(k)}
			if _, pend := s.pending[sk]; pend || !n.Cached(id) {
				s.pending[sk] = deadline
				mine = append(mine, k)
			}
		}
		off += own
		r.tree.SetCached(n, id, true)
	}
	if len(mine) > 0 {
		s.fifo = append(s.fifo, perBlockEntry{id, mine, deadline})
	}
}

func (s *perBlockSpec) confirm(id int, keys []blocks.Key) {
	for _, k := range keys {
		delete(s.pending, [2]uint64{uint64(id), uint64(k)})
	}
}

func (s *perBlockSpec) expire(r *Router, now time.Time) {
	for len(s.fifo) > 0 && !s.fifo[0].deadline.After(now) {
		e := s.fifo[0]
		s.fifo = s.fifo[1:]
		for _, k := range e.keys {
			sk := [2]uint64{uint64(e.id), uint64(k)}
			if d, ok := s.pending[sk]; ok && d.Equal(e.deadline) {
				delete(s.pending, sk)
				r.uncache(e.id, k)
			}
		}
	}
}

// TestSpeculationMatchesPerBlock drives a speculating router and a
// reference router that keeps the per-block map (perBlockSpec) through the
// same routes, stores, removals, clears and expiries, and checks after
// every step that both trees cache the same blocks on every replica and
// count the same pending blocks. The node shapes differ, on purpose: expiry
// cuts an expired run out as one node, the reference one node per block
// (docs/performance.md, "Expired runs as one node"). So it checks the shape
// one way only: every node boundary of the speculating tree is one of the
// reference's (expiry never cuts finer than the per-block code did), and
// across the seeds the speculating tree is strictly coarser somewhere (the
// run cut is exercised).
func TestSpeculationMatchesPerBlock(t *testing.T) {
	coarser := 0
	for seed := uint64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewPCG(seed, 7))
		const reps = 3
		got := newRouter(t, speculating{&policy.RoundRobin{}}, 0, true, true, true)
		ref, err := New(Config{BlockTokens: bt, Profile: profile(t), Policy: &policy.RoundRobin{}, Seed: 1, SpeculativeTTL: -1})
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < reps; i++ {
			ref.AddReplica(fmt.Sprint("replica-", i), true)
		}
		spec := perBlockSpec{pending: map[[2]uint64]time.Time{}}
		var prompts [][]uint32
		for f := uint64(0); f < 4; f++ {
			head := toks(100+f, (2+int(f))*bt)
			for v := uint64(0); v < 4; v++ {
				prompts = append(prompts, append(slices.Clone(head), toks(seed*1000+f*10+v, (1+int(v))*bt)...))
			}
		}
		now := at(0)
		id := uint64(0)
		for step := 0; step < 300; step++ {
			now = now.Add(time.Duration(rng.IntN(700)) * time.Millisecond)
			spec.expire(ref, now)
			before := got.tree.Nodes()
			got.ExpireSpeculative(now)
			if n := got.tree.Nodes(); n != before {
				t.Fatalf("seed %d step %d: expiry changed the node count %d -> %d", seed, step, before, n)
			}
			p := prompts[rng.IntN(len(prompts))]
			keys := blocks.Keys(nil, p, bt)
			rep := rng.IntN(reps)
			switch op := rng.IntN(10); {
			case op < 5:
				id++
				dg, err := got.Route(req(id, p), now)
				if err != nil {
					t.Fatal(err)
				}
				dr, err := ref.Route(req(id, p), now)
				if err != nil {
					t.Fatal(err)
				}
				if dg.Replica != dr.Replica {
					t.Fatalf("seed %d step %d: routed to %d and %d", seed, step, dg.Replica, dr.Replica)
				}
				spec.speculate(ref, dr.Replica, req(id, p).Keys, ref.match.Path, now)
			case op < 8:
				// Only prompts routed before are in the tree; a store
				// under an unknown parent fails alike on both.
				j := rng.IntN(len(keys))
				k := j + 1 + rng.IntN(len(keys)-j)
				var parent blocks.Key
				if j > 0 {
					parent = keys[j-1]
				}
				eg := got.CacheStored(rep, parent, j > 0, keys[j:k], now)
				er := ref.CacheStored(rep, parent, j > 0, keys[j:k], now)
				if (eg == nil) != (er == nil) {
					t.Fatalf("seed %d step %d: CacheStored errors %v and %v", seed, step, eg, er)
				}
				if er == nil {
					spec.confirm(rep, keys[j:k])
				}
			case op < 10 && rng.IntN(8) > 0:
				j := rng.IntN(len(keys))
				k := j + 1 + rng.IntN(len(keys)-j)
				if err := got.CacheRemoved(rep, keys[j:k]); err != nil {
					t.Fatal(err)
				}
				spec.confirm(rep, keys[j:k])
				if err := ref.CacheRemoved(rep, keys[j:k]); err != nil {
					t.Fatal(err)
				}
			default:
				if err := got.CacheCleared(rep); err != nil {
					t.Fatal(err)
				}
				if err := ref.CacheCleared(rep); err != nil {
					t.Fatal(err)
				}
				for sk := range spec.pending {
					if sk[0] == uint64(rep) {
						delete(spec.pending, sk)
					}
				}
			}
			if g, w := got.Speculative(), len(spec.pending); g != w {
				t.Fatalf("seed %d step %d: Speculative() = %d, per-block reference %d", seed, step, g, w)
			}
			for _, p := range prompts {
				for _, k := range blocks.Keys(nil, p, bt) {
					ng, og, okg := got.tree.Find(k)
					nr, or, okr := ref.tree.Find(k)
					if okg != okr {
						t.Fatalf("seed %d step %d: key %x present %v, reference %v", seed, step, k, okg, okr)
					}
					if !okg {
						break
					}
					if og == 0 && or != 0 {
						t.Fatalf("seed %d step %d: key %x starts a node, but sits at %d of a %d-block node in the per-block reference: expiry cut finer than per block", seed, step, k, or, nr.Own())
					}
					for r := 0; r < reps; r++ {
						if ng.Cached(r) != nr.Cached(r) {
							t.Fatalf("seed %d step %d: key %x cached on %d: %v, reference %v", seed, step, k, r, ng.Cached(r), nr.Cached(r))
						}
					}
				}
			}
			if g, w := got.tree.Nodes(), ref.tree.Nodes(); g > w {
				t.Fatalf("seed %d step %d: %d nodes, per-block reference %d", seed, step, g, w)
			} else if g < w {
				coarser++
			}
		}
	}
	if coarser == 0 {
		t.Fatal("the speculating tree never had fewer nodes than the per-block reference: no multi-block run expired")
	}
	t.Logf("%d of 6000 steps with fewer nodes than the per-block reference", coarser)
}

// BenchmarkSpeculativeExpiry is the overloaded e2 run's pattern in small
// (docs/performance.md, "Expired runs as one node"): a session's prompt
// grows by 64 blocks a turn up to 2,048 blocks; each turn is routed to a
// replica with KV events, its marks expire before the engine stores it, and
// then the engine stores it in 32-block batches (a chunked prefill), each
// batch walking the path from the root. It reports the tree's nodes and the
// mean path length of a batch: expiry cutting a run as one node keeps both
// at what the stores made; per block, every expired block stayed a node.
//
//	go test -run XXX -bench BenchmarkSpeculativeExpiry -benchtime 20x -cpu 1 ./internal/router/
func BenchmarkSpeculativeExpiry(b *testing.B) {
	const turn, maxBlocks, batch = 64, 2048, 32
	tokens := toks(17, maxBlocks*bt)
	keys := blocks.Keys(nil, tokens, bt)
	b.ReportAllocs()
	var pathNodes, batches, nodes int
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		r := newRouter(b, speculating{&policy.RoundRobin{}}, 0, true)
		b.StartTimer()
		ms := 0
		for n := turn; n <= maxBlocks; n += turn {
			id := uint64(n / turn)
			if _, err := r.Route(req(id, tokens[:n*bt]), at(ms)); err != nil {
				b.Fatal(err)
			}
			ms += 3000 // past the TTL: the marks expire unconfirmed
			r.ExpireSpeculative(at(ms))
			for j := 0; j < n; j += batch {
				var parent blocks.Key
				if j > 0 {
					parent = keys[j-1]
				}
				if err := r.CacheStored(0, parent, j > 0, keys[j:min(j+batch, n)], at(ms)); err != nil {
					b.Fatal(err)
				}
				pathNodes += len(r.scratch.Path)
				batches++
			}
			if err := r.Finished(id, 10, -1, true, at(ms)); err != nil {
				b.Fatal(err)
			}
		}
		nodes += r.Tree().Nodes()
	}
	b.ReportMetric(float64(nodes)/float64(b.N), "nodes")
	b.ReportMetric(float64(pathNodes)/float64(batches), "path-nodes/batch")
}
