package prefixtree

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// naive is the obviously-correct model the tree is checked against: the set of
// keys present (every prefix of every inserted prompt), per replica the set of
// keys cached, and per replica the in-flight count through each key.
type naive struct {
	present map[blocks.Key]bool
	cached  []map[blocks.Key]bool
	refs    []map[blocks.Key]int
	// stamps[r][k] is the stamp (SetStamp) of cached key k on r, if any.
	stamps []map[blocks.Key]int64
}

func newNaive(reps int) *naive {
	m := &naive{present: map[blocks.Key]bool{}}
	for i := 0; i < reps; i++ {
		m.cached = append(m.cached, map[blocks.Key]bool{})
		m.refs = append(m.refs, map[blocks.Key]int{})
		m.stamps = append(m.stamps, map[blocks.Key]int64{})
	}
	return m
}

func (m *naive) match(keys []blocks.Key) (int, []int) {
	n := 0
	for n < len(keys) && m.present[keys[n]] {
		n++
	}
	per := make([]int, len(m.cached))
	for r, c := range m.cached {
		for per[r] < len(keys) && c[keys[per[r]]] {
			per[r]++
		}
	}
	return n, per
}

// fuzzPrompt derives a prompt of 1..8 tokens over {0,1,2} (block size 1, so
// prompts collide often) from two bytes.
func fuzzPrompt(op, arg byte) []blocks.Key {
	ln := int(arg%8) + 1
	toks := make([]uint32, ln)
	x := uint32(op)*7 + uint32(arg)
	for j := range toks {
		toks[j] = x % 3
		x = x*1103515245 + 12345
		x >>= 3
	}
	return blocks.Keys(nil, toks, 1)
}

type hold struct {
	keys []blocks.Key
	r    int
}

// runTreeOps drives the tree and the naive model with the operations encoded
// in data and checks them against each other after every operation. With
// maxBlocks = 0 the tree is unbounded and must agree with the model exactly;
// with a small bound it may have dropped keys nobody holds, so it must hold a
// subset of the model's keys, stay prefix-closed, keep every cached and
// referenced key, and respect the bound whenever nothing is held.
func runTreeOps(t *testing.T, data []byte, maxBlocks int) {
	const reps = 3
	if len(data) > 400 {
		data = data[:400] // every check is O(prompts): keep inputs quick
	}
	tr, err := New(Config{BlockTokens: 1, MaxBlocks: maxBlocks}, reps)
	if err != nil {
		t.Fatal(err)
	}
	bounded := maxBlocks > 0
	m := newNaive(reps)
	var prompts [][]blocks.Key
	var holds []hold
	var mt Match
	now := time.Unix(0, 0)
	// cachePath marks path cached on r in the tree and the model. A bounded
	// tree may have evicted the tail of the path it just inserted.
	cachePath := func(path []*Node, r int) {
		tr.SetPathCached(path, r, now)
		for _, n := range path {
			if n.Evicted() {
				continue
			}
			for _, k := range n.Keys() {
				m.cached[r][k] = true
			}
		}
	}
	for i := 0; i+1 < len(data); i += 2 {
		op, arg := data[i], data[i+1]
		r := int(arg>>4) % reps
		switch op % 8 {
		case 0, 1: // insert a prompt, and on odd ops cache it on r
			keys := fuzzPrompt(op, arg)
			tr.Insert(keys, now, &mt)
			if !bounded && (mt.Blocks != len(keys) || len(mt.Path) == 0) {
				t.Fatalf("op %d: Insert of %d keys left a path of %d blocks", i/2, len(keys), mt.Blocks)
			}
			for _, k := range keys {
				m.present[k] = true
			}
			if op%8 == 1 {
				cachePath(mt.Path, r)
				if arg&8 != 0 {
					// Stamp the path as the router's speculation does.
					for _, n := range mt.Path {
						tr.SetStamp(n, r, int64(op)+1)
						if n.Evicted() {
							continue
						}
						for _, k := range n.Keys() {
							m.stamps[r][k] = int64(op) + 1
						}
					}
				}
			}
			prompts = append(prompts, keys)
		case 2: // remove one cached block of an earlier prompt from r (op&0x40: a run of its node's blocks)
			if len(prompts) == 0 {
				continue
			}
			p := prompts[int(arg)%len(prompts)]
			k := p[int(arg)%len(p)]
			if n, off, ok := tr.Find(k); ok && op&0x40 != 0 {
				// Remove a run of one node's blocks from r in one cut, as
				// the router's expiry of a speculative run does.
				c := 1 + int(op>>3&7)%(n.Own()-off)
				run := slices.Clone(n.Keys()[off : off+c])
				x := tr.IsolateRunAt(n, off, c)
				if !slices.Equal(x.Keys(), run) {
					t.Fatalf("op %d: IsolateRunAt(%d, %d) returned keys %v, want %v", i/2, off, c, x.Keys(), run)
				}
				tr.SetCached(x, r, false)
				for _, k := range run {
					delete(m.cached[r], k)
				}
			} else if n, ok := tr.Isolate(k); ok {
				if n.Own() != 1 || n.Keys()[0] != k {
					t.Fatalf("op %d: Isolate returned a node of %d keys", i/2, n.Own())
				}
				tr.SetCached(n, r, false)
			}
			delete(m.cached[r], k)
		case 3:
			if arg&1 == 1 && len(prompts) > 0 {
				// A slot cache overwrote the tail of an earlier prompt on r.
				p := prompts[int(arg>>1)%len(prompts)]
				from := int(arg>>2) % (len(p) + 1)
				tr.UncacheFrom(p, from, r)
				for _, k := range p[from:] {
					delete(m.cached[r], k)
				}
			} else {
				tr.ClearReplica(r)
				m.cached[r] = map[blocks.Key]bool{}
			}
		case 4: // an engine reports storing a prompt's tail below its head
			keys := fuzzPrompt(op, arg)
			j := int(arg>>3) % (len(keys) + 1)
			if j == len(keys) {
				j = 0
			}
			var parent blocks.Key
			if j > 0 {
				parent = keys[j-1]
			}
			_, _, parentIn := tr.Find(parent)
			err := tr.InsertBelow(parent, j > 0, keys[j:], now, &mt)
			if j > 0 && !parentIn {
				if !errors.Is(err, ErrUnknownParent) {
					t.Fatalf("op %d: InsertBelow under a missing parent: err %v, want ErrUnknownParent", i/2, err)
				}
				if !bounded && m.present[parent] {
					t.Fatalf("op %d: the tree lost parent key %x", i/2, parent)
				}
				continue
			}
			if err != nil {
				t.Fatalf("op %d: InsertBelow: %v", i/2, err)
			}
			own := 0
			for _, n := range mt.Path {
				own += n.Own()
			}
			if mt.Blocks != len(keys) || own != len(keys) {
				t.Fatalf("op %d: InsertBelow path holds %d blocks (Blocks=%d), want %d", i/2, own, mt.Blocks, len(keys))
			}
			for _, k := range keys {
				m.present[k] = true
			}
			// Cache the stored tail: nodes end exactly where keys[j:] starts.
			need := len(keys) - j
			var tail []*Node
			for x := len(mt.Path) - 1; x >= 0 && need > 0; x-- {
				tail = append(tail, mt.Path[x])
				need -= mt.Path[x].Own()
			}
			if need != 0 {
				t.Fatalf("op %d: stored keys do not start at a node boundary (%d left)", i/2, need)
			}
			slices.Reverse(tail)
			cachePath(tail, r)
			// Settle the stored tail's stamps, as the router's CacheStored does.
			for _, n := range tail {
				tr.SetStamp(n, r, 0)
				for _, k := range n.Keys() {
					delete(m.stamps[r], k)
				}
			}
			prompts = append(prompts, keys)
		case 5: // a request on r holds an earlier prompt's path
			if len(prompts) == 0 {
				continue
			}
			// As the router does: Insert (which splits the path to end at the
			// prompt's last block), then reference the path.
			p := prompts[int(arg)%len(prompts)]
			tr.Insert(p, now, &mt)
			evicted := false
			for _, n := range mt.Path {
				evicted = evicted || n.Evicted()
			}
			if evicted {
				continue // the bound dropped what it just inserted: nothing to hold
			}
			tr.AddRef(mt.Path, r, 1)
			for _, k := range p {
				m.refs[r][k]++
			}
			holds = append(holds, hold{p, r})
		case 6: // a held request finishes; its path is looked up again
			if len(holds) == 0 {
				continue
			}
			x := int(arg) % len(holds)
			h := holds[x]
			holds = append(holds[:x], holds[x+1:]...)
			tr.Lookup(h.keys, &mt)
			if mt.Blocks != len(h.keys) {
				t.Fatalf("op %d: a held prompt lost keys: %d of %d present", i/2, mt.Blocks, len(h.keys))
			}
			tr.AddRef(mt.Path, h.r, -1)
			for _, k := range h.keys {
				m.refs[h.r][k]--
			}
		case 7: // the mirror evicts blocks of r, LRU first
			want := int(arg%8) + 1
			before := len(m.cached[r])
			freed := tr.EvictLRU(r, want, now)
			for k := range m.cached[r] {
				n, _, ok := tr.Find(k)
				if !ok {
					t.Fatalf("op %d: cached key %x left the tree", i/2, k)
				}
				if !n.Cached(r) {
					if m.refs[r][k] > 0 {
						t.Fatalf("op %d: EvictLRU uncached key %x held by %d requests", i/2, k, m.refs[r][k])
					}
					delete(m.cached[r], k)
				}
			}
			if got := before - len(m.cached[r]); got != freed {
				t.Fatalf("op %d: EvictLRU reports %d blocks freed, %d were", i/2, freed, got)
			}
			if freed < want {
				// It stops short only when nothing evictable is left.
				tr.EachLRU(r, func(n *Node) bool {
					if n.Ref(r) == 0 && n.ChildCount() == 0 {
						t.Fatalf("op %d: EvictLRU stopped at %d of %d blocks with an evictable leaf left", i/2, freed, want)
					}
					return true
				})
			}
		}
		now = now.Add(time.Millisecond)
		for r := range m.stamps {
			for k := range m.stamps[r] {
				if !m.cached[r][k] {
					delete(m.stamps[r], k) // an uncached block loses its stamp
				}
			}
		}
		checkTree(t, i/2, tr, m, prompts, holds, maxBlocks)
		checkStamps(t, i/2, tr, m)
	}
}

func checkTree(t *testing.T, op int, tr *Tree, m *naive, prompts [][]blocks.Key, holds []hold, maxBlocks int) {
	t.Helper()
	var mt Match
	for _, p := range prompts {
		tr.Lookup(p, &mt)
		wantN, wantPer := m.match(p)
		// Prefix-closed: the keys present are a prefix of the prompt.
		present := 0
		for present < len(p) {
			if _, _, ok := tr.Find(p[present]); !ok {
				break
			}
			present++
		}
		for _, k := range p[present:] {
			if _, _, ok := tr.Find(k); ok {
				t.Fatalf("op %d: key %x present below a missing key (not prefix-closed)", op, k)
			}
		}
		if mt.Blocks != present {
			t.Fatalf("op %d: Lookup matches %d blocks, %d leading keys are present", op, mt.Blocks, present)
		}
		if maxBlocks == 0 && mt.Blocks != wantN {
			t.Fatalf("op %d: match %d blocks, want %d", op, mt.Blocks, wantN)
		}
		if mt.Blocks > wantN {
			t.Fatalf("op %d: match %d blocks, more than the %d ever inserted", op, mt.Blocks, wantN)
		}
		// Cached blocks are never dropped, so per-replica matches are exact.
		for r := range wantPer {
			if mt.PerReplica[r] != wantPer[r] {
				t.Fatalf("op %d: replica %d matches %d, want %d", op, r, mt.PerReplica[r], wantPer[r])
			}
		}
		// Path and depth bookkeeping.
		depth := 0
		for x, n := range mt.Path {
			if n.Depth() != depth || n.Evicted() {
				t.Fatalf("op %d: path node %d has depth %d (evicted %v), want %d", op, x, n.Depth(), n.Evicted(), depth)
			}
			depth += n.Own()
		}
		if len(mt.Path) > 0 && depth-mt.Path[len(mt.Path)-1].Own()+mt.LastBlocks != mt.Blocks {
			t.Fatalf("op %d: path covers %d blocks with LastBlocks %d, want %d", op, depth, mt.LastBlocks, mt.Blocks)
		}
		for _, k := range p[:present] {
			n, _, _ := tr.Find(k)
			for r := range m.refs {
				if got, want := n.Ref(r), m.refs[r][k]; got != want {
					t.Fatalf("op %d: key %x: Ref(%d) = %d, want %d", op, k, r, got, want)
				}
			}
		}
	}
	checkCachedKids(t, tr)
	checkUnreferenced(t, tr)
	checkActiveBlocks(t, op, tr, m)
	for r := range m.cached {
		if got, want := tr.CachedBlocks(r), len(m.cached[r]); got != want {
			t.Fatalf("op %d: replica %d caches %d blocks, want %d", op, r, got, want)
		}
		n := 0
		tr.EachLRU(r, func(nd *Node) bool {
			if !nd.Cached(r) {
				t.Fatalf("op %d: an uncached node is in replica %d's LRU list", op, r)
			}
			n += nd.Own()
			return true
		})
		if n != len(m.cached[r]) {
			t.Fatalf("op %d: replica %d's LRU list holds %d blocks, want %d", op, r, n, len(m.cached[r]))
		}
	}
	if maxBlocks == 0 {
		if got, want := tr.Blocks(), len(m.present); got != want {
			t.Fatalf("op %d: tree holds %d blocks, want %d", op, got, want)
		}
		return
	}
	idle := len(holds) == 0
	for r := range m.cached {
		idle = idle && len(m.cached[r]) == 0
	}
	if idle && tr.Blocks() > maxBlocks {
		t.Fatalf("op %d: tree holds %d blocks with nothing held, bound %d", op, tr.Blocks(), maxBlocks)
	}
}

// checkActiveBlocks recounts each replica's active blocks two ways — the
// model's keys with an in-flight request on the replica, and the tree's
// nodes the replica references, walked from the root — and checks
// ActiveBlocks against both.
func checkActiveBlocks(t *testing.T, op int, tr *Tree, m *naive) {
	t.Helper()
	walked := make([]int, tr.Replicas())
	var walk func(n *Node)
	walk = func(n *Node) {
		for r := range walked {
			if n.Ref(r) > 0 {
				walked[r] += n.Own()
			}
		}
		for c := n.kid; c != nil; c = c.nextSib {
			walk(c)
		}
	}
	walk(tr.root)
	for r := range m.refs {
		want := 0
		for _, c := range m.refs[r] {
			if c > 0 {
				want++
			}
		}
		if got := tr.ActiveBlocks(r); got != want || got != walked[r] {
			t.Fatalf("op %d: replica %d: ActiveBlocks = %d, the model holds %d referenced keys, the tree's referenced nodes %d blocks", op, r, got, want, walked[r])
		}
	}
}

// FuzzTreeAgainstNaive drives an unbounded tree and the naive model with the
// same operations (Insert, SetPathCached, Isolate, IsolateRunAt, ClearReplica,
// InsertBelow, AddRef, EvictLRU) over a 3-token alphabet and checks that they agree.
// Seeds live in testdata/fuzz/FuzzTreeAgainstNaive.
func FuzzTreeAgainstNaive(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 1, 1, 3, 0, 2, 1, 0})
	f.Add([]byte{0, 0, 0, 0, 16, 0, 0, 1, 32, 2, 48, 1})
	f.Add([]byte{5, 5, 5, 5, 5, 21, 37, 53, 69, 85, 101, 117})
	f.Fuzz(func(t *testing.T, data []byte) { runTreeOps(t, data, 0) })
}

// FuzzTreeBounded runs the same operations on a tree bounded at 1..12
// blocks (the first byte) and checks the invariants that eviction must keep.
func FuzzTreeBounded(f *testing.F) {
	f.Add([]byte{3, 0, 7, 0, 5, 1, 23, 5, 0, 6, 0, 0, 3, 7, 4})
	f.Add([]byte{0, 1, 7, 0, 6, 0, 5, 1, 22, 7, 16, 0, 4, 4, 40})
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		runTreeOps(t, data[1:], int(data[0]%12)+1)
	})
}

// checkCachedKids verifies every node's count of cached children against
// its children, the links between them, that a node keeps per-replica state
// only while it says something (else the bound could not evict the node), and
// the node table against the nodes reached from the root.
func checkCachedKids(t *testing.T, tr *Tree) {
	t.Helper()
	seen := 0
	var walk func(n *Node)
	walk = func(n *Node) {
		if n != tr.root {
			seen++
			if n.id == 0 || int(n.id) >= len(tr.nodes) || tr.nodes[n.id] != n {
				t.Fatalf("node at depth %d: id %d does not name it in the node table", n.depth, n.id)
			}
		}
		for r := 0; r < tr.Replicas(); r++ {
			want := 0
			for c := n.kid; c != nil; c = c.nextSib {
				if c.Cached(r) {
					want++
				}
			}
			got := 0
			if r < len(n.rs) {
				got = int(n.rs[r].cachedKids)
			}
			if got != want {
				t.Fatalf("node at depth %d: cachedKids[%d] = %d, want %d", n.depth, r, got, want)
			}
		}
		if n.rs != nil && n.cachedBy.Empty() {
			idle := true
			for _, s := range n.rs {
				idle = idle && s.ref == 0 && s.cachedKids == 0
			}
			if idle {
				t.Fatalf("node at depth %d keeps per-replica state that says nothing", n.depth)
			}
		}
		var prev *Node
		for c := n.kid; c != nil; c = c.nextSib {
			if c.parent != n || c.prevSib != prev || c.Evicted() {
				t.Fatalf("node at depth %d: child links broken", n.depth)
			}
			prev = c
			walk(c)
		}
	}
	walk(tr.root)
	if seen != tr.Nodes() {
		t.Fatalf("%d nodes reachable from the root, Nodes() = %d", seen, tr.Nodes())
	}
}

// checkUnreferenced checks each replica's unreferenced list against its
// LRU list: exactly the nodes with Ref 0, in the same order, linked both
// ways.
func checkUnreferenced(t *testing.T, tr *Tree) {
	t.Helper()
	for r := range tr.Replicas() {
		var want, got []*Node
		tr.EachLRU(r, func(n *Node) bool {
			if n.Ref(r) == 0 {
				want = append(want, n)
			}
			return true
		})
		tr.EachUnreferencedLRU(r, func(n *Node) bool {
			got = append(got, n)
			return true
		})
		if len(got) != len(want) {
			t.Fatalf("replica %d: %d unreferenced nodes listed, want %d", r, len(got), len(want))
		}
		for i := range want {
			if got[i] != want[i] {
				t.Fatalf("replica %d: unreferenced node %d is %p, want %p (LRU order)", r, i, got[i], want[i])
			}
		}
		i := len(got) - 1
		for n := tr.reps[r].uhead; n != nil; n = n.rs[r].unext {
			if i < 0 || got[i] != n {
				t.Fatalf("replica %d: forward links disagree at %d", r, i)
			}
			i--
		}
		if i != -1 {
			t.Fatalf("replica %d: forward links stop %d nodes early", r, i+1)
		}
	}
}

// checkStamps checks every cached block's stamp and each replica's count of
// stamped blocks against the model.
func checkStamps(t *testing.T, op int, tr *Tree, m *naive) {
	t.Helper()
	for r := range m.cached {
		for k := range m.cached[r] {
			n, _, ok := tr.Find(k)
			if !ok {
				t.Fatalf("op %d: cached key %x left the tree", op, k)
			}
			if got, want := n.Stamp(r), m.stamps[r][k]; got != want {
				t.Fatalf("op %d: key %x on replica %d has stamp %d, want %d", op, k, r, got, want)
			}
		}
		if got, want := tr.StampedBlocks(r), len(m.stamps[r]); got != want {
			t.Fatalf("op %d: StampedBlocks(%d) = %d, want %d", op, r, got, want)
		}
	}
}
