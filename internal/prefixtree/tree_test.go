package prefixtree

import (
	"errors"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// ks keys a prompt of one-token blocks: prompts share keys exactly as far as
// their tokens agree.
func ks(tokens ...uint32) []blocks.Key { return blocks.Keys(nil, tokens, 1) }

func newTree(t *testing.T, reps, maxBlocks int) *Tree {
	t.Helper()
	tr, err := New(Config{BlockTokens: 1, MaxBlocks: maxBlocks}, reps)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func owns(path []*Node) []int {
	var out []int
	for _, n := range path {
		out = append(out, n.Own())
	}
	return out
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		cfg  Config
		reps int
		ok   bool
	}{
		{Config{BlockTokens: 16}, 2, true},
		{Config{BlockTokens: 0}, 2, false},
		{Config{BlockTokens: 16, MaxBlocks: -1}, 2, false},
		{Config{BlockTokens: 16}, -1, false},
	}
	for _, tt := range tests {
		_, err := New(tt.cfg, tt.reps)
		if (err == nil) != tt.ok {
			t.Errorf("New(%+v, %d): err %v, want ok=%v", tt.cfg, tt.reps, err, tt.ok)
		}
	}
}

func TestInsertSplitsAndImportance(t *testing.T) {
	tr := newTree(t, 2, 0)
	var m Match
	now := time.Unix(1, 0)
	// A: 1 2 3 4 5 6 — one node of 6 blocks, important (own 6 > depth 0).
	tr.Insert(ks(1, 2, 3, 4, 5, 6), now, &m)
	a := m.Path[0]
	a.Ext = "stats"
	a.Assigned.Add(1)
	if got := owns(m.Path); !slices.Equal(got, []int{6}) || !a.Important() {
		t.Fatalf("first insert path %v important=%v", got, a.Important())
	}
	// B shares 4 blocks: A splits at 4; A keeps its identity, Ext and
	// Assigned; the lower half starts with neither.
	tr.Insert(ks(1, 2, 3, 4, 9), now, &m)
	if got := owns(m.Path); !slices.Equal(got, []int{4, 1}) {
		t.Fatalf("second insert path owns %v, want [4 1]", got)
	}
	if m.Path[0] != a || a.Ext != "stats" || a.Own() != 4 {
		t.Fatalf("split lost the upper node's identity or Ext")
	}
	lowA, _, _ := tr.Find(ks(1, 2, 3, 4, 5, 6)[5])
	if lowA.Ext != nil || !lowA.Assigned.Empty() || !a.Assigned.Has(1) || lowA.Parent() != a || lowA.Depth() != 4 {
		t.Fatalf("lower half: Ext %v assigned %v parent ok %v depth %d", lowA.Ext, lowA.Assigned.Has(1), lowA.Parent() == a, lowA.Depth())
	}
	// Importance: own > depth.
	if lowA.Important() || m.Path[1].Important() || !a.Important() {
		t.Errorf("importance: upper %v lowA %v B %v, want true false false", a.Important(), lowA.Important(), m.Path[1].Important())
	}
	if got := ImportantAncestor(m.Path[1]); got != a {
		t.Errorf("ImportantAncestor(B's leaf) is not the shared prefix")
	}
	if ImportantAncestor(tr.Root()) != nil || ImportantAncestor(nil) != nil {
		t.Error("ImportantAncestor of the root or nil is not nil")
	}
	// A prefix of an existing path splits it so the path ends on a boundary.
	tr.Insert(ks(1, 2), now, &m)
	if got := owns(m.Path); !slices.Equal(got, []int{2}) || m.Blocks != 2 || m.LastBlocks != 2 {
		t.Fatalf("prefix insert: path %v Blocks %d LastBlocks %d", got, m.Blocks, m.LastBlocks)
	}
	if tr.Blocks() != 7 || tr.Nodes() != 4 {
		t.Errorf("tree holds %d blocks in %d nodes, want 7 in 4", tr.Blocks(), tr.Nodes())
	}
	// Lookup of an unknown continuation matches the known part, partly.
	tr.Lookup(ks(1, 2, 3, 7), &m)
	if m.Blocks != 3 || m.LastBlocks != 1 || len(m.Path) != 2 {
		t.Errorf("Lookup: Blocks %d LastBlocks %d path %v, want 3 1 [2 2]", m.Blocks, m.LastBlocks, owns(m.Path))
	}
}

func TestPerReplicaMatch(t *testing.T) {
	tr := newTree(t, 3, 0)
	var m Match
	now := time.Unix(1, 0)
	tr.Insert(ks(1, 2, 3, 4), now, &m)
	tr.SetPathCached(m.Path, 0, now)
	tr.Insert(ks(1, 2), now, &m)
	tr.SetPathCached(m.Path, 1, now)
	tr.Insert(ks(1, 2, 3, 4, 5, 6), now, &m) // PerReplica is before insertion
	if want := []int{4, 2, 0}; !slices.Equal(m.PerReplica, want) {
		t.Errorf("PerReplica = %v, want %v", m.PerReplica, want)
	}
	if tr.CachedBlocks(0) != 4 || tr.CachedBlocks(1) != 2 || tr.CachedBlocks(2) != 0 || tr.CachedBlocks(9) != 0 {
		t.Errorf("CachedBlocks = %d %d %d", tr.CachedBlocks(0), tr.CachedBlocks(1), tr.CachedBlocks(2))
	}
	// A replica added later has a slot everywhere.
	r := tr.AddReplica()
	tr.Lookup(ks(1, 2, 3), &m)
	if r != 3 || len(m.PerReplica) != 4 || m.PerReplica[3] != 0 || m.PerReplica[0] != 3 {
		t.Errorf("after AddReplica: id %d PerReplica %v", r, m.PerReplica)
	}
}

func TestLRUOrderAndEvict(t *testing.T) {
	tr := newTree(t, 1, 0)
	var m Match
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	// Shared prefix P=1 2 with three children, used at t=1,2,3.
	tr.Insert(ks(1, 2, 3), at(1), &m)
	tr.SetPathCached(m.Path, 0, at(1))
	tr.Insert(ks(1, 2, 4), at(2), &m)
	tr.SetPathCached(m.Path, 0, at(2))
	tr.Insert(ks(1, 2, 5), at(3), &m)
	tr.SetPathCached(m.Path, 0, at(3))
	held := slices.Clone(m.Path)
	tr.AddRef(held, 0, 1) // the request for 1 2 5 is in flight
	var order [][]blocks.Key
	tr.EachLRU(0, func(n *Node) bool { order = append(order, n.Keys()); return true })
	k3, k4, k5 := ks(1, 2, 3)[2], ks(1, 2, 4)[2], ks(1, 2, 5)[2]
	if len(order) != 4 || order[0][0] != k3 || order[1][0] != k4 || order[2][0] != k5 || len(order[3]) != 2 {
		t.Fatalf("LRU order wrong: %v", order)
	}
	// Evicting 2 blocks takes the two oldest leaves; the parent has a
	// cached child left and the held leaf is referenced.
	if freed := tr.EvictLRU(0, 2, at(4)); freed != 2 {
		t.Fatalf("EvictLRU(2) freed %d", freed)
	}
	if freed := tr.EvictLRU(0, 10, at(4)); freed != 0 {
		t.Fatalf("EvictLRU freed %d blocks of a held path", freed)
	}
	tr.AddRef(held, 0, -1)
	if freed := tr.EvictLRU(0, 10, at(4)); freed != 3 || tr.CachedBlocks(0) != 0 {
		t.Fatalf("EvictLRU after release freed %d, %d left", freed, tr.CachedBlocks(0))
	}
	// Evicted from the cache, not from the tree.
	if tr.Blocks() != 5 {
		t.Errorf("tree holds %d blocks, want 5", tr.Blocks())
	}
	if tr.EvictLRU(5, 1, at(4)) != 0 || tr.EvictLRU(-1, 1, at(4)) != 0 {
		t.Error("EvictLRU on a bad replica freed something")
	}
}

func TestRefsSurviveSplitsAndClear(t *testing.T) {
	tr := newTree(t, 2, 0)
	var m Match
	now := time.Unix(1, 0)
	long := ks(1, 2, 3, 4, 5, 6)
	tr.Insert(long, now, &m)
	tr.SetPathCached(m.Path, 1, now)
	tr.AddRef(m.Path, 1, 1)
	tr.Insert(ks(1, 2, 3, 9), now, &m) // splits the held node
	if n, ok := tr.Isolate(long[4]); !ok || n.Own() != 1 {
		t.Fatal("Isolate failed")
	}
	tr.Lookup(long, &m)
	if len(m.Path) != 4 {
		t.Fatalf("long path has %d nodes after splits, want 4", len(m.Path))
	}
	for _, n := range m.Path {
		if n.Ref(1) != 1 || n.RefTotal() != 1 || !n.Cached(1) {
			t.Fatalf("after splits: ref %d total %d cached %v, want 1 1 true", n.Ref(1), n.RefTotal(), n.Cached(1))
		}
	}
	tr.ClearReplica(1)
	for _, n := range m.Path {
		if n.Ref(1) != 1 || n.Cached(1) {
			t.Fatalf("ClearReplica dropped a ref or kept a cache mark")
		}
	}
	tr.AddRef(m.Path, 1, -1)
	tr.AddRef(m.Path, 1, -1) // clamps at 0
	for _, n := range m.Path {
		if n.Ref(1) != 0 || n.Ref(-1) != 0 || n.Ref(7) != 0 {
			t.Fatalf("refs after release: %d", n.Ref(1))
		}
	}
	if _, ok := tr.Isolate(ks(8)[0]); ok {
		t.Error("Isolate of an unknown key succeeded")
	}
}

func TestInsertBelow(t *testing.T) {
	tr := newTree(t, 1, 0)
	var m Match
	now := time.Unix(1, 0)
	full := ks(1, 2, 3, 4, 5)
	if err := tr.InsertBelow(full[1], true, full[2:], now, &m); !errors.Is(err, ErrUnknownParent) {
		t.Fatalf("InsertBelow under an unknown parent: %v", err)
	}
	if err := tr.InsertBelow(0, false, full[:3], now, &m); err != nil || m.Blocks != 3 {
		t.Fatalf("InsertBelow from the root: %v, %d blocks", err, m.Blocks)
	}
	// Continue below block 2 (mid-node): the node splits at the parent.
	if err := tr.InsertBelow(full[1], true, full[2:], now, &m); err != nil {
		t.Fatal(err)
	}
	if got := owns(m.Path); !slices.Equal(got, []int{2, 1, 2}) || m.Blocks != 5 || m.LastBlocks != 2 {
		t.Errorf("path owns %v Blocks %d LastBlocks %d, want [2 1 2] 5 2", got, m.Blocks, m.LastBlocks)
	}
	tr.Lookup(full, &m)
	if m.Blocks != 5 {
		t.Errorf("Lookup after InsertBelow matches %d, want 5", m.Blocks)
	}
	if err := tr.InsertBelow(full[4], true, nil, now, &m); err != nil {
		t.Errorf("empty InsertBelow: %v", err)
	}
}

func TestBoundEvictsLRUUnheld(t *testing.T) {
	tr := newTree(t, 1, 6)
	var m Match
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	a, b, c := ks(1, 2, 3), ks(4, 5, 6), ks(7, 8, 9)
	tr.Insert(a, at(1), &m)
	tr.SetPathCached(m.Path, 0, at(1)) // a is held by replica 0's cache
	tr.Insert(b, at(2), &m)
	tr.Insert(c, at(3), &m) // over the bound: b (unheld, LRU) goes, not a
	if tr.Blocks() != 6 || tr.Evictions() != 1 {
		t.Fatalf("tree holds %d blocks after %d evictions, want 6 after 1", tr.Blocks(), tr.Evictions())
	}
	for _, tt := range []struct {
		keys []blocks.Key
		want int
	}{{a, 3}, {b, 0}, {c, 3}} {
		tr.Lookup(tt.keys, &m)
		if m.Blocks != tt.want {
			t.Errorf("prompt %v matches %d, want %d", tt.keys[0], m.Blocks, tt.want)
		}
	}
	// A node dropped by the bound reports Evicted and loses Ext.
	n, _, _ := tr.Find(c[0])
	n.Ext = 1
	tr.Insert(ks(10, 11, 12), at(4), &m)
	if !n.Evicted() || n.Ext != nil {
		t.Errorf("evicted node: Evicted %v Ext %v", n.Evicted(), n.Ext)
	}
}

func TestSet(t *testing.T) {
	var s Set
	if !s.Empty() || s.Has(0) || s.Has(-1) || s.Has(200) {
		t.Fatal("zero Set is not empty")
	}
	for _, r := range []int{3, 0, 63, 64, 130} {
		s.Add(r)
	}
	var got []int
	s.Each(func(r int) { got = append(got, r) })
	if want := []int{0, 3, 63, 64, 130}; !slices.Equal(got, want) || s.Len() != 5 {
		t.Fatalf("Each = %v (Len %d), want %v", got, s.Len(), want)
	}
	c := s.Clone()
	s.Remove(130)
	s.Remove(3)
	s.Remove(500)
	if !c.Has(130) || !c.Has(3) || s.Has(130) || s.Has(3) || s.Len() != 3 {
		t.Fatal("Clone is not independent or Remove failed")
	}
	s.Clear()
	if !s.Empty() || s.Has(64) {
		t.Fatal("Clear left members")
	}
}

// TestNodeLayout pins the sizes BenchmarkTreeMemory's figures rest on: a
// field added to Node, repState or the index's slot costs every block of a
// tree of millions, so it should be a decision (docs/performance.md,
// "Memory").
func TestNodeLayout(t *testing.T) {
	for _, tt := range []struct {
		name      string
		got, want uintptr
	}{
		{"Node", unsafe.Sizeof(Node{}), 160},
		{"repState", unsafe.Sizeof(repState{}), 48}, // +16: the unreferenced list (EachUnreferencedLRU); +8: the owner's stamp (SetStamp)
		{"Set", unsafe.Sizeof(Set{}), 16},
		{"indexSlot", unsafe.Sizeof(indexSlot{}), 16},
	} {
		if tt.got != tt.want {
			t.Errorf("unsafe.Sizeof(%s) = %d, want %d", tt.name, tt.got, tt.want)
		}
	}
}

// TestPerReplicaStateReleased checks that a node keeps per-replica state
// only while a replica caches it (or a child) or a request passes through
// it, so that once both are gone the bound evicts it; with more than 64
// replicas, so that the spilled words of Set are exercised too.
func TestPerReplicaStateReleased(t *testing.T) {
	const reps = 70
	tr := newTree(t, reps, 3)
	var m Match
	at := func(s int) time.Time { return time.Unix(int64(s), 0) }
	tr.Insert(ks(1, 2, 3), at(1), &m)
	path := slices.Clone(m.Path)
	if len(path) != 1 || path[0].rs != nil {
		t.Fatalf("a new node has per-replica state %v (path %d nodes)", path[0].rs, len(path))
	}
	tr.SetPathCached(path, 65, at(2))
	tr.AddRef(path, 2, 1)
	if n := path[0]; len(n.rs) != reps || !n.Cached(65) || n.Ref(2) != 1 {
		t.Fatalf("cached and referenced node: %d states, cached %v, ref %d", len(n.rs), n.Cached(65), n.Ref(2))
	}
	// Over the bound, but held: it stays.
	tr.Insert(ks(7, 8), at(3), &m)
	if path[0].Evicted() {
		t.Fatal("the bound evicted a cached, referenced node")
	}
	tr.SetCached(path[0], 65, false)
	if path[0].rs == nil {
		t.Fatal("per-replica state dropped while a request holds the node")
	}
	tr.AddRef(path, 2, -1)
	if path[0].rs != nil || tr.CachedBlocks(65) != 0 {
		t.Fatalf("per-replica state kept after the last reference: %v", path[0].rs)
	}
	tr.Insert(ks(9), at(4), &m)
	if !path[0].Evicted() || tr.Blocks() > 3 {
		t.Fatalf("idle node not evicted: evicted %v, tree holds %d blocks", path[0].Evicted(), tr.Blocks())
	}
	if got := tr.Nodes(); got != len(tr.nodes)-1-len(tr.freeIDs) || got < 1 {
		t.Fatalf("Nodes() = %d", got)
	}
}

// TestUncacheFrom: the tail of one prompt's path goes from a replica; what
// comes before it, and other branches, stay.
func TestUncacheFrom(t *testing.T) {
	tr := newTree(t, 2, 0)
	var m Match
	now := time.Unix(1, 0)
	a, b := ks(1, 2, 3, 4, 5, 6), ks(1, 2, 3, 7, 8)
	tr.Insert(a, now, &m)
	tr.SetPathCached(m.Path, 0, now)
	tr.SetPathCached(m.Path, 1, now)
	tr.Insert(b, now, &m)
	tr.SetPathCached(m.Path, 0, now)
	tr.UncacheFrom(a, 4, 0) // keep 1 2 3 4 of a on replica 0
	tr.Lookup(a, &m)
	if got := m.PerReplica; got[0] != 4 || got[1] != 6 {
		t.Errorf("a after UncacheFrom(4): per replica %v, want [4 6]", got)
	}
	tr.Lookup(b, &m)
	if m.PerReplica[0] != 5 {
		t.Errorf("b: replica 0 caches %d, want 5 (another branch)", m.PerReplica[0])
	}
	if got := tr.CachedBlocks(0); got != 6 {
		t.Errorf("replica 0 caches %d blocks, want 6", got)
	}
	tr.UncacheFrom(b, 0, 0)
	tr.UncacheFrom(a, 0, 0)
	tr.UncacheFrom(a, 9, 0)        // past the end: nothing
	tr.UncacheFrom(ks(9, 9), 0, 0) // unknown: nothing
	if got := tr.CachedBlocks(0); got != 0 {
		t.Errorf("replica 0 caches %d blocks after uncaching all, want 0", got)
	}
	tr.Lookup(a, &m)
	if m.PerReplica[1] != 6 {
		t.Errorf("replica 1 lost blocks: %v", m.PerReplica)
	}
}

// TestUncacheFromDiverging: a prompt whose path leaves a node partway (its
// next block is not in the tree) uncaches only its own part of that node;
// the rest of the run belongs to another prompt and stays cached.
func TestUncacheFromDiverging(t *testing.T) {
	tr := newTree(t, 1, 0)
	var m Match
	now := time.Unix(1, 0)
	tr.Insert(ks(1, 2, 3, 4), now, &m) // one node: 1 2 3 4
	tr.SetPathCached(m.Path, 0, now)
	tr.UncacheFrom(ks(1, 2, 9, 9), 1, 0) // shares 1 2; 9 9 were never stored
	tr.Lookup(ks(1, 2, 3, 4), &m)
	if got := m.PerReplica[0]; got != 1 || tr.CachedBlocks(0) != 3 {
		t.Errorf("after uncaching the other prompt's block 2: match %d, cached %d; want 1, 3 (3 4 stay, unreachable until 2 returns)", got, tr.CachedBlocks(0))
	}
	if n, _, _ := tr.Find(ks(1, 2, 3, 4)[2]); n == nil || !n.Cached(0) || n.Own() != 2 {
		t.Errorf("the diverging run's tail lost its state")
	}
}

// TestActiveBlocks: a replica's active blocks count each block that its
// in-flight requests pass through once, however many share it, and stay
// exact across splits of a held node, a second replica, and releases.
func TestActiveBlocks(t *testing.T) {
	tr := newTree(t, 2, 0)
	var m Match
	now := time.Unix(1, 0)
	hold := func(keys []blocks.Key, r int) []*Node {
		tr.Insert(keys, now, &m)
		p := slices.Clone(m.Path)
		tr.AddRef(p, r, 1)
		return p
	}
	hold(ks(1, 2, 3, 4), 0)         // 4 blocks
	hold(ks(1, 2, 3, 9), 0)         // splits the held node after 3 blocks: 1 new block
	c := hold(ks(1, 2, 7, 8, 6), 1) // on replica 1: 5 blocks (2 shared with replica 0's, counted there too)
	steps := []struct {
		name   string
		do     func()
		r0, r1 int
	}{
		{"three held", func() {}, 5, 5},
		{"a held node split again", func() { tr.Isolate(ks(1, 2, 3, 4)[1]) }, 5, 5},
		{"a released", func() { tr.Lookup(ks(1, 2, 3, 4), &m); tr.AddRef(m.Path, 0, -1) }, 4, 5},
		{"b released twice (clamps)", func() {
			tr.Lookup(ks(1, 2, 3, 9), &m)
			tr.AddRef(m.Path, 0, -1)
			tr.AddRef(m.Path, 0, -1)
		}, 0, 5},
		{"bad replicas ignored", func() { tr.AddRef(c, 5, 1); tr.AddRef(c, -1, 1) }, 0, 5},
		{"c released", func() { tr.Lookup(ks(1, 2, 7, 8, 6), &m); tr.AddRef(m.Path, 1, -1) }, 0, 0},
	}
	for _, s := range steps {
		s.do()
		if got0, got1 := tr.ActiveBlocks(0), tr.ActiveBlocks(1); got0 != s.r0 || got1 != s.r1 {
			t.Errorf("%s: ActiveBlocks = %d, %d; want %d, %d", s.name, got0, got1, s.r0, s.r1)
		}
	}
	if tr.ActiveBlocks(2) != 0 || tr.ActiveBlocks(-1) != 0 {
		t.Error("ActiveBlocks of a bad replica is not 0")
	}
}

// TestStamps: a stamp marks a cached node on one replica, splits with the
// node, is counted in StampedBlocks, and goes when the replica stops
// caching the node or is cleared; IsolateAt hands back the rest of the run.
func TestStamps(t *testing.T) {
	tr := newTree(t, 2, 0)
	var m Match
	now := time.Unix(0, 0)
	keys := ks(1, 2, 3, 4, 5, 6)
	tr.Insert(keys, now, &m)
	n := m.Path[0]
	tr.SetStamp(n, 0, 7) // not cached on 0: no mark
	if n.Stamp(0) != 0 || tr.StampedBlocks(0) != 0 {
		t.Fatalf("an uncached node took a stamp: %d, %d blocks", n.Stamp(0), tr.StampedBlocks(0))
	}
	tr.SetPathCached(m.Path, 0, now)
	tr.SetPathCached(m.Path, 1, now)
	tr.SetStamp(n, 0, 7)
	if n.Stamp(0) != 7 || n.Stamp(1) != 0 || tr.StampedBlocks(0) != 6 || tr.StampedBlocks(1) != 0 {
		t.Fatalf("stamps %d/%d, stamped blocks %d/%d; want 7/0, 6/0", n.Stamp(0), n.Stamp(1), tr.StampedBlocks(0), tr.StampedBlocks(1))
	}
	x, rest := tr.IsolateAt(n, 2) // keys[2] alone; keys[3:] after it
	if x.Own() != 1 || x.Keys()[0] != keys[2] || rest == nil || rest.Own() != 3 || rest.Keys()[0] != keys[3] {
		t.Fatalf("IsolateAt(n, 2) = %d keys, rest %v", x.Own(), rest)
	}
	for _, k := range keys {
		if nd, _, _ := tr.Find(k); nd.Stamp(0) != 7 {
			t.Fatalf("key %x lost its stamp in the split: %d", k, nd.Stamp(0))
		}
	}
	if tr.StampedBlocks(0) != 6 {
		t.Fatalf("StampedBlocks after splits = %d, want 6", tr.StampedBlocks(0))
	}
	if last, r := tr.IsolateAt(rest, 2); r != nil || last.Own() != 1 || last.Keys()[0] != keys[5] || last.Stamp(0) != 7 {
		t.Fatalf("IsolateAt of a run's last block: %d keys, rest %v", last.Own(), r)
	}
	tr.SetCached(x, 0, false)
	if x.Stamp(0) != 0 || tr.StampedBlocks(0) != 5 {
		t.Fatalf("uncached node kept stamp %d; StampedBlocks %d, want 5", x.Stamp(0), tr.StampedBlocks(0))
	}
	tr.SetStamp(rest, 0, 0) // keys[3:5] now
	if tr.StampedBlocks(0) != 3 {
		t.Fatalf("StampedBlocks after clearing one node = %d, want 3", tr.StampedBlocks(0))
	}
	tr.SetStamp(n, 1, 9)
	tr.ClearStamps(0)
	if tr.StampedBlocks(0) != 0 || n.Stamp(0) != 0 || n.Stamp(1) != 9 {
		t.Fatalf("ClearStamps(0): %d blocks left, stamps %d/%d", tr.StampedBlocks(0), n.Stamp(0), n.Stamp(1))
	}
	tr.ClearReplica(1)
	if tr.StampedBlocks(1) != 0 || n.Stamp(1) != 0 {
		t.Fatalf("ClearReplica(1) left stamp %d, %d blocks", n.Stamp(1), tr.StampedBlocks(1))
	}
}

// TestIsolateRunAt: the run [off, off+c) of a node becomes a node of its own
// with at most two splits, the keys around it stay whole, and every piece
// keeps the node's caching and stamp; the upper piece keeps Ext.
func TestIsolateRunAt(t *testing.T) {
	tests := []struct {
		name   string
		off, c int
		nodes  int // nodes after the cut
	}{
		{"whole node", 0, 6, 1},
		{"head", 0, 2, 2},
		{"tail", 4, 2, 2},
		{"middle", 2, 3, 3},
		{"one block", 5, 1, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr := newTree(t, 2, 0)
			var m Match
			now := time.Unix(0, 0)
			keys := ks(1, 2, 3, 4, 5, 6)
			tr.Insert(keys, now, &m)
			n := m.Path[0]
			n.Ext = "stats"
			tr.SetPathCached(m.Path, 1, now)
			tr.SetStamp(n, 1, 3)
			x := tr.IsolateRunAt(n, tt.off, tt.c)
			if !slices.Equal(x.Keys(), keys[tt.off:tt.off+tt.c]) {
				t.Fatalf("isolated keys %v, want %v", x.Keys(), keys[tt.off:tt.off+tt.c])
			}
			if got := tr.Nodes(); got != tt.nodes {
				t.Fatalf("Nodes = %d, want %d", got, tt.nodes)
			}
			for i, k := range keys {
				nd, _, ok := tr.Find(k)
				if !ok || !nd.Cached(1) || nd.Stamp(1) != 3 {
					t.Fatalf("key %d: present %v, cached %v, stamp %d after the cut", i, ok, ok && nd.Cached(1), nd.Stamp(1))
				}
			}
			if top, _, _ := tr.Find(keys[0]); top.Ext != "stats" {
				t.Fatalf("the upper piece lost Ext: %v", top.Ext)
			}
			if tr.CachedBlocks(1) != 6 || tr.StampedBlocks(1) != 6 {
				t.Fatalf("CachedBlocks %d, StampedBlocks %d after the cut; want 6, 6", tr.CachedBlocks(1), tr.StampedBlocks(1))
			}
		})
	}
}
