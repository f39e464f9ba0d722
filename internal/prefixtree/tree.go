// Package prefixtree is prefixlb's global prefix tree: one radix tree over the
// block keys of every prompt the router has seen, with per-replica state on its
// nodes (Preble, Srivatsa et al., ICLR 2025, §3.1 "global radix tree").
//
// A node holds a run of consecutive block keys. For each replica it records
// whether the replica caches the node's blocks and how many in-flight
// requests on the replica pass through it; replicas that cache a node are
// linked into a per-replica LRU list (which is how recently the replica used
// it) so that eviction (real, in the router's mirror of a replica's cache, or
// pretended, for E2's eviction cost) costs time proportional to what it
// evicts.
//
// Keys are chained (internal/blocks): key i stands for the whole prefix of i+1
// blocks. The tree is prefix-closed (a key is present only if every key before
// it is), so the longest match of a prompt is found by binary search over its
// keys in a key index, in O(log n) map lookups instead of a walk over n keys.
//
// A Tree is not safe for concurrent use. It has one owner (the router core,
// internal/router), which serialises writers and lets readers in under its lock.
package prefixtree

import (
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// ErrBadReplica reports a replica index outside [0, Replicas()).
var ErrBadReplica = errors.New("prefixtree: replica index out of range")

// Config sizes a Tree.
type Config struct {
	// BlockTokens is the number of tokens one key stands for (the engines' KV
	// block size, 16 in vLLM by default).
	BlockTokens int
	// MaxBlocks bounds the number of keys the tree holds. When an insertion
	// exceeds it, leaf nodes that no replica caches and no request references
	// are evicted, least recently used first. 0 means DefaultMaxBlocks.
	MaxBlocks int
}

// DefaultMaxBlocks bounds a tree at about 2M blocks: 32M tokens at B=16.
// What a block costs depends on how many blocks share a node (a node costs
// ~250 bytes with its per-replica state, a key 16–32 bytes in the key index):
// BenchmarkTreeMemory in internal/router measures it on realistic workloads
// (docs/performance.md, "Memory").
const DefaultMaxBlocks = 2 << 20

// Validate reports the first invalid field.
func (c Config) Validate() error {
	if c.BlockTokens < 1 {
		return fmt.Errorf("prefixtree: block_tokens must be ≥ 1, got %d", c.BlockTokens)
	}
	if c.MaxBlocks < 0 {
		return fmt.Errorf("prefixtree: max_blocks must be ≥ 0, got %d", c.MaxBlocks)
	}
	return nil
}

// repState is one replica's view of one node. Whether the replica caches
// the node is Node.cachedBy's bit, not a field here: 48 bytes a replica.
type repState struct {
	ref int32 // in-flight requests on the replica through the node
	// cachedKids counts the node's children the replica caches, so that an
	// LRU eviction can check "no cached child" without walking the children.
	cachedKids int32
	prev, next *Node // links in the replica's LRU list while cached
	// uprev, unext link the node in the replica's list of unreferenced
	// cached nodes (cached, ref 0), in the LRU list's order.
	uprev, unext *Node
	// stamp is the owner's mark on the replica's copy of the node while
	// the replica caches it (0: none; Tree.SetStamp).
	stamp int64
}

// Node is a run of consecutive block keys shared by every prompt that passes
// through it. Its fields are read by policies; only the Tree changes them.
//
// Memory: a tree holds up to millions of nodes, so a Node is kept to 160
// bytes (a size class of Go's allocator) and allocates nothing else but its
// keys and, while a replica refers to it, its per-replica state. Children are
// a linked list, not a map: the key index finds nodes by key, so children are
// only added, removed and walked, and most nodes have one or two.
type Node struct {
	parent *Node
	// kid is the first child; prevSib and nextSib link the children of
	// parent, in no particular order.
	kid, prevSib, nextSib *Node
	keys                  []blocks.Key
	depth                 int32  // blocks above this node
	id                    uint32 // slot in Tree.nodes; 0: the root, or evicted
	// rs[r] is replica r's view of the node. It is nil while no replica
	// caches the node, has a request through it or caches one of its
	// children (most nodes of a churning tree), else as long as the tree's
	// replica count when it was allocated.
	rs       []repState
	cachedBy Set // replicas that cache the node, for one-word tests

	lastAccess   int64
	gprev, gnext *Node // links in the tree's global LRU list

	// Assigned is the set of replicas this prefix is assigned to: routing state
	// kept by E2, distinct from caching (an assigned replica may have evicted
	// the blocks). On a split the upper half keeps it and the lower half starts
	// empty (a copy there would go stale when the prefix moves); the tree
	// never reads it.
	Assigned Set
	// Ext is a policy's own data about this node (E2's windowed statistics).
	// On a split the upper half keeps it (the node keeps its identity) and the
	// lower half starts with nil; the tree drops it with the node.
	Ext any
}

// Parent is the node above n (nil for the root).
func (n *Node) Parent() *Node { return n.parent }

// Own is the number of blocks in n's run.
func (n *Node) Own() int { return len(n.keys) }

// Depth is the number of blocks above n (ALGORITHMS §1 contextBefore, in blocks).
func (n *Node) Depth() int { return int(n.depth) }

// Keys is n's run of keys. Do not modify it.
func (n *Node) Keys() []blocks.Key { return n.keys }

// Evicted reports whether the tree has dropped n. Policies holding node
// pointers across calls check it.
func (n *Node) Evicted() bool { return n.id == 0 && n.parent != nil }

// IsRoot reports whether n is the tree's root (holds no keys).
func (n *Node) IsRoot() bool { return n.parent == nil }

// Important reports Preble's "prefix unit" rule: a node whose own run is longer
// than everything above it (own > contextBefore).
func (n *Node) Important() bool { return n.parent != nil && len(n.keys) > int(n.depth) }

// Cached reports whether replica r caches all of n's blocks.
func (n *Node) Cached(r int) bool { return n.cachedBy.Has(r) }

// CachedCount is the number of replicas that cache all of n's blocks.
func (n *Node) CachedCount() int { return n.cachedBy.Len() }

// Ref is the number of in-flight requests on replica r that pass through n.
func (n *Node) Ref(r int) int {
	if r < 0 || r >= len(n.rs) {
		return 0
	}
	return int(n.rs[r].ref)
}

// RefTotal is the number of in-flight requests through n on all replicas.
func (n *Node) RefTotal() int {
	t := 0
	for i := range n.rs {
		t += int(n.rs[i].ref)
	}
	return t
}

// LastAccess is when any request last passed through n (ns on the tree's clock).
func (n *Node) LastAccess() int64 { return n.lastAccess }

// ChildCount is the number of children of n. It walks them: O(children).
func (n *Node) ChildCount() int {
	c := 0
	for k := n.kid; k != nil; k = k.nextSib {
		c++
	}
	return c
}

// Important returns the prefix unit a request ending at n belongs to: the
// nearest node at or above n that is Important, or nil if none is.
func ImportantAncestor(n *Node) *Node {
	for ; n != nil && n.parent != nil; n = n.parent {
		if n.Important() {
			return n
		}
	}
	return nil
}

type replicaInfo struct {
	head, tail *Node // LRU list of nodes this replica caches: head = MRU
	// uhead, utail: the sublist of the cached nodes no in-flight request
	// references, in the same order (EachUnreferencedLRU).
	uhead, utail *Node
	cachedBlocks int
	// stampedBlocks sums Own over the cached nodes with a stamp.
	stampedBlocks int
	// activeBlocks sums Own over the nodes that at least one in-flight
	// request on the replica references (ref > 0): AddRef counts a node when
	// its ref goes 0→1 and uncounts it on 1→0. A split gives both halves the
	// node's ref and keys are never merged, and the bound evicts only nodes
	// no request references, so the sum stays exact without a walk.
	activeBlocks int
}

// Tree is the global prefix tree. See the package comment for ownership.
type Tree struct {
	cfg   Config
	root  *Node
	index keyIndex
	reps  []replicaInfo
	// nodes[id] is the node with that id (nodes[0] is unused: id 0 marks the
	// root and evicted nodes), so that the key index can name a node in 4
	// bytes; freeIDs are the ids of evicted nodes, for reuse.
	nodes   []*Node
	freeIDs []uint32
	// spare holds released per-replica states (each as long as reps), for
	// rep to reuse.
	spare     [][]repState
	ghead     *Node // global LRU: head = MRU
	gtail     *Node
	evictions int
}

// New returns an empty tree for replicas replica slots (indexes 0..replicas-1;
// more can be added with AddReplica).
func New(cfg Config, replicas int) (*Tree, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if replicas < 0 {
		return nil, fmt.Errorf("prefixtree: replicas must be ≥ 0, got %d", replicas)
	}
	if cfg.MaxBlocks == 0 {
		cfg.MaxBlocks = DefaultMaxBlocks
	}
	t := &Tree{
		cfg:   cfg,
		root:  &Node{},
		index: newKeyIndex(),
		reps:  make([]replicaInfo, replicas),
		nodes: make([]*Node, 1, 64),
	}
	return t, nil
}

// BlockTokens is the number of tokens per key.
func (t *Tree) BlockTokens() int { return t.cfg.BlockTokens }

// Root is the tree's root node (no keys).
func (t *Tree) Root() *Node { return t.root }

// Replicas is the number of replica slots.
func (t *Tree) Replicas() int { return len(t.reps) }

// AddReplica adds a replica slot and returns its index.
func (t *Tree) AddReplica() int {
	t.reps = append(t.reps, replicaInfo{})
	return len(t.reps) - 1
}

// Blocks is the number of keys the tree holds.
func (t *Tree) Blocks() int { return t.index.len() }

// Nodes is the number of nodes, root excluded.
func (t *Tree) Nodes() int { return len(t.nodes) - 1 - len(t.freeIDs) }

// Evictions is the number of nodes the size bound has evicted so far.
func (t *Tree) Evictions() int { return t.evictions }

// CachedBlocks is the number of blocks replica r caches, as the tree knows it.
func (t *Tree) CachedBlocks(r int) int {
	if r < 0 || r >= len(t.reps) {
		return 0
	}
	return t.reps[r].cachedBlocks
}

// ActiveBlocks is the number of distinct blocks that in-flight requests on
// replica r pass through (the blocks of the nodes r references): NVIDIA
// Dynamo's active blocks of a worker, the prompt blocks of its requests
// counted once however many requests share them. O(1).
func (t *Tree) ActiveBlocks(r int) int {
	if r < 0 || r >= len(t.reps) {
		return 0
	}
	return t.reps[r].activeBlocks
}

// rep returns replica r's state on n, allocating n's per-replica state (for
// every replica the tree has) if it has none. The pointer is valid until the
// next call of rep or release on n.
func (t *Tree) rep(n *Node, r int) *repState {
	if len(n.rs) <= r {
		if k := len(t.spare); k > 0 && len(t.spare[k-1]) != len(t.reps) {
			clear(t.spare) // sized before AddReplica: let them go
			t.spare = t.spare[:0]
		}
		var rs []repState
		if k := len(t.spare); k > 0 && n.rs == nil && r < len(t.reps) {
			rs, t.spare[k-1] = t.spare[k-1], nil
			t.spare = t.spare[:k-1]
		} else {
			rs = make([]repState, max(len(t.reps), r+1))
			copy(rs, n.rs)
		}
		n.rs = rs
	}
	return &n.rs[r]
}

// maxSpare bounds the per-replica states kept for reuse: enough to absorb
// the release and reallocation a routing decision causes (a mirror's LRU
// eviction uncaches nodes that the next decision caches again) without
// allocating, a few hundred KiB at most.
const maxSpare = 256

// release drops n's per-replica state once it says nothing: no replica
// caches n or one of its children, and no request passes through it. Most
// nodes of a tree that churns are in that state, waiting for the bound to
// evict them.
func (t *Tree) release(n *Node) {
	if n.rs == nil || !n.cachedBy.Empty() {
		return
	}
	for i := range n.rs {
		if n.rs[i].ref != 0 || n.rs[i].cachedKids != 0 {
			return
		}
	}
	if len(t.spare) < maxSpare && len(n.rs) == len(t.reps) {
		clear(n.rs) // the LRU links are nil already; drop nothing stale
		t.spare = append(t.spare, n.rs)
	}
	n.rs = nil
}

// node returns the node with id (the key index's reference).
func (t *Tree) node(id uint32) *Node { return t.nodes[id] }

// keyEntry is what the key index holds for a key: its node and its block
// position in its prompt.
func (t *Tree) entry(n *Node, i int) keyEntry {
	return keyEntry{node: n.id, depth: uint32(int(n.depth) + i)}
}

// Match is the result of looking a prompt up in the tree. The zero value is
// ready to use; reuse one Match across calls to avoid allocation.
type Match struct {
	// Blocks is the number of leading keys present in the tree.
	Blocks int
	// Path lists the nodes those keys pass through, top down (root excluded).
	// The last node may be matched only partly: see LastBlocks.
	Path []*Node
	// LastBlocks is how many keys of the last node on Path are matched.
	LastBlocks int
	// PerReplica[r] is the number of leading keys replica r caches.
	PerReplica []int
}

// Lookup finds the longest prefix of keys present in the tree, and how much of
// it each replica caches. It does not change the tree.
func (t *Tree) Lookup(keys []blocks.Key, m *Match) {
	m.Blocks, m.LastBlocks = 0, 0
	m.Path = m.Path[:0]
	if cap(m.PerReplica) < len(t.reps) {
		m.PerReplica = make([]int, len(t.reps))
	}
	m.PerReplica = m.PerReplica[:len(t.reps)]
	for i := range m.PerReplica {
		m.PerReplica[i] = 0
	}
	// Binary search for the number of present keys: the tree is prefix-closed.
	lo, hi := 0, len(keys) // invariant: keys[:lo] present, keys[hi:] absent
	if n := len(keys); n > 0 {
		// A prompt seen whole before (the common case: repeats, and the
		// re-lookup when a request finishes) costs one probe.
		if e, ok := t.index.get(keys[n-1]); ok && int(e.depth) == n-1 {
			lo = n
		}
	}
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if e, ok := t.index.get(keys[mid]); ok && int(e.depth) == mid {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	if lo == 0 {
		return
	}
	m.Blocks = lo
	e, _ := t.index.get(keys[lo-1])
	last := t.node(e.node)
	m.LastBlocks = lo - int(last.depth)
	for n := last; n.parent != nil; n = n.parent {
		m.Path = append(m.Path, n)
	}
	for i, j := 0, len(m.Path)-1; i < j; i, j = i+1, j-1 {
		m.Path[i], m.Path[j] = m.Path[j], m.Path[i]
	}
	if len(m.PerReplica) <= 64 {
		// One pass down the path with a word of still-matching replicas.
		live := uint64(1)<<uint(len(m.PerReplica)) - 1
		if len(m.PerReplica) == 64 {
			live = ^uint64(0)
		}
		for i, n := range m.Path {
			live &= n.cachedBy.w0
			if live == 0 {
				break
			}
			own := len(n.keys)
			if i == len(m.Path)-1 {
				own = m.LastBlocks
			}
			for w := live; w != 0; w &= w - 1 {
				m.PerReplica[bits.TrailingZeros64(w)] += own
			}
		}
		return
	}
	for r := range m.PerReplica {
		got := 0
		for i, n := range m.Path {
			if !n.Cached(r) {
				break
			}
			if i == len(m.Path)-1 {
				got += m.LastBlocks
			} else {
				got += len(n.keys)
			}
		}
		m.PerReplica[r] = got
	}
}

// ErrUnknownParent reports an extension of a prefix the tree does not hold.
var ErrUnknownParent = errors.New("prefixtree: parent block is not in the tree")

// Insert makes every key of keys present, splitting nodes so that the prompt's
// path ends exactly at a node boundary, records an access at now, and returns
// the path, top down (root excluded), in m.Path (m.Blocks = len(keys)).
// PerReplica is filled as by Lookup, before the insertion.
func (t *Tree) Insert(keys []blocks.Key, now time.Time, m *Match) {
	t.Lookup(keys, m)
	if len(keys) == 0 {
		return
	}
	_ = t.insertFrom(nil, keys, m.Blocks, now, m)
}

// InsertBelow inserts keys as the continuation of the block parent (the
// root when hasParent is false), the way an engine reports newly stored
// blocks. Nodes are split so that keys start and end at node boundaries; m.Path
// receives the whole path from the root, m.Blocks its length in blocks, and
// m.LastBlocks the length of its last node. It fails with ErrUnknownParent when
// the tree does not hold parent.
func (t *Tree) InsertBelow(parent blocks.Key, hasParent bool, keys []blocks.Key, now time.Time, m *Match) error {
	m.Path = m.Path[:0]
	if !hasParent {
		t.Lookup(keys, m)
		if len(keys) == 0 {
			return nil
		}
		return t.insertFrom(nil, keys, m.Blocks, now, m)
	}
	e, ok := t.index.get(parent)
	if !ok {
		return ErrUnknownParent
	}
	pn := t.node(e.node)
	if off := int(e.depth) + 1 - int(pn.depth); off < len(pn.keys) {
		t.split(pn, off)
	}
	base := int(pn.depth) + len(pn.keys)
	lo, hi := 0, len(keys)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if ke, ok := t.index.get(keys[mid]); ok && int(ke.depth) == base+mid {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return t.insertFrom(pn, keys, lo, now, m)
}

// insertFrom completes an insertion of keys below anchor (nil: the root) of
// which the first present are already in the tree, and fills m with the full
// path from the root.
func (t *Tree) insertFrom(anchor *Node, keys []blocks.Key, present int, now time.Time, m *Match) error {
	parent := anchor
	if parent == nil {
		parent = t.root
	}
	if present > 0 {
		e, _ := t.index.get(keys[present-1])
		n := t.node(e.node)
		if off := int(e.depth) + 1 - int(n.depth); off < len(n.keys) {
			t.split(n, off)
		}
		parent = n
	}
	last := parent
	if present < len(keys) {
		last = t.newNode(parent, keys[present:])
	}
	// Collect the path and touch it in one walk up from last, pushing the
	// deepest node to the global LRU list's front first, as the separate
	// touch pass did (so the order is the same), without a second pass
	// over a path of hundreds of nodes (an event batch's path runs from the
	// root; docs/performance.md, "E2 on full caches").
	m.Path = m.Path[:0]
	ns := now.UnixNano()
	for n := last; n.parent != nil; n = n.parent {
		m.Path = append(m.Path, n)
		n.lastAccess = ns
		t.gunlink(n)
		t.gpushFront(n)
	}
	slices.Reverse(m.Path)
	m.Blocks = int(last.depth) + len(last.keys)
	m.LastBlocks = len(last.keys)
	t.enforceBound()
	return nil
}

func (t *Tree) newNode(parent *Node, keys []blocks.Key) *Node {
	n := &Node{
		parent: parent,
		keys:   append([]blocks.Key(nil), keys...),
		depth:  parent.depth + int32(len(parent.keys)),
	}
	t.assignID(n)
	addKid(parent, n)
	for i, k := range n.keys {
		t.index.put(k, t.entry(n, i))
	}
	t.gpushFront(n)
	return n
}

// assignID gives n a slot in t.nodes, reusing an evicted node's.
func (t *Tree) assignID(n *Node) {
	if k := len(t.freeIDs); k > 0 {
		n.id = t.freeIDs[k-1]
		t.freeIDs = t.freeIDs[:k-1]
		t.nodes[n.id] = n
		return
	}
	n.id = uint32(len(t.nodes))
	t.nodes = append(t.nodes, n)
}

// addKid links c into p's children.
func addKid(p, c *Node) {
	c.prevSib, c.nextSib = nil, p.kid
	if p.kid != nil {
		p.kid.prevSib = c
	}
	p.kid = c
}

// removeKid unlinks c from its parent's children.
func removeKid(c *Node) {
	if c.prevSib != nil {
		c.prevSib.nextSib = c.nextSib
	} else {
		c.parent.kid = c.nextSib
	}
	if c.nextSib != nil {
		c.nextSib.prevSib = c.prevSib
	}
	c.prevSib, c.nextSib = nil, nil
}

// split cuts n after its first at keys; n keeps the upper part (and its
// identity, so statistics attached to a prefix stay with it), a new node
// takes the lower part with n's children, caching, refs and assignment.
func (t *Tree) split(n *Node, at int) *Node {
	low := &Node{
		parent:     n,
		kid:        n.kid,
		keys:       n.keys[at:],
		depth:      n.depth + int32(at),
		lastAccess: n.lastAccess,
	}
	t.assignID(low)
	n.keys = n.keys[:at:at]
	for c := low.kid; c != nil; c = c.nextSib {
		c.parent = low
	}
	n.kid = low
	for i, k := range low.keys {
		t.index.put(k, t.entry(low, i))
	}
	low.cachedBy = n.cachedBy.Clone()
	if n.rs != nil {
		// low takes n's refs and its children (with their counts); n's only
		// child is low, cached wherever n is.
		low.rs = make([]repState, len(n.rs))
		for r := range n.rs {
			s := &n.rs[r]
			low.rs[r] = repState{ref: s.ref, cachedKids: s.cachedKids, stamp: s.stamp}
			s.cachedKids = 0
			if n.cachedBy.Has(r) {
				s.cachedKids = 1
				t.linkAfter(r, n, low)
				if s.ref == 0 {
					// n is in the unreferenced list, low right after it.
					t.ulinkBefore(r, low, s.unext)
				}
			}
		}
		t.release(n)
		t.release(low)
	}
	t.ginsertAfter(n, low)
	return low
}

// AddRef adds delta to replica r's in-flight count on every node of path
// (a count never goes below 0), keeping ActiveBlocks(r) up to date. A
// replica index outside [0, Replicas()) is ignored.
//
// A release (delta < 0) goes up the path, deepest node first: a path's
// nodes sit in r's LRU list parent before child (Touch), so each node
// released finds the child released just before it as its older neighbour
// in the unreferenced list (uplace) instead of stepping over the rest of
// its own, still referenced, path. The lists end the same in either order.
func (t *Tree) AddRef(path []*Node, r int, delta int) {
	if r < 0 || r >= len(t.reps) || delta == 0 {
		return
	}
	for i := range path {
		n := path[i]
		if delta < 0 {
			n = path[len(path)-1-i]
		}
		if n.Evicted() {
			continue
		}
		if delta < 0 && r >= len(n.rs) {
			continue // no count to take from
		}
		s := t.rep(n, r)
		was := s.ref
		s.ref += int32(delta)
		if s.ref < 0 {
			s.ref = 0
		}
		switch {
		case was == 0 && s.ref > 0:
			t.reps[r].activeBlocks += len(n.keys)
			if n.cachedBy.Has(r) {
				t.uunlink(r, n)
			}
		case was > 0 && s.ref == 0:
			t.reps[r].activeBlocks -= len(n.keys)
			if n.cachedBy.Has(r) {
				t.uplace(r, n)
			}
		}
		if s.ref == 0 {
			t.release(n)
		}
	}
}

// Touch records that replica r used path: the nodes it caches move to the
// front of its LRU list, deepest first, so that a parent is never evicted
// before its children. The list's order is all the tree keeps of when a
// replica used a node; now is not stored.
func (t *Tree) Touch(path []*Node, r int, now time.Time) {
	for i := len(path) - 1; i >= 0; i-- {
		n := path[i]
		if n.Evicted() || !n.cachedBy.Has(r) {
			continue
		}
		t.unlink(r, n)
		t.pushFront(r, n)
	}
}

// SetCached marks whether replica r holds all of n's blocks. A newly cached
// node goes to the front of r's LRU list.
func (t *Tree) SetCached(n *Node, r int, cached bool) {
	if n.Evicted() || n.parent == nil || r < 0 || n.cachedBy.Has(r) == cached {
		return
	}
	if cached {
		t.addCachedKid(n.parent, r, 1)
		t.rep(n, r)
		n.cachedBy.Add(r)
		t.pushFront(r, n)
		t.reps[r].cachedBlocks += len(n.keys)
	} else {
		t.clearStamp(n, r)
		t.unlink(r, n)
		n.cachedBy.Remove(r)
		t.reps[r].cachedBlocks -= len(n.keys)
		t.release(n)
		t.addCachedKid(n.parent, r, -1)
	}
}

// SetPathCached marks every node of path as cached on r and touches it.
func (t *Tree) SetPathCached(path []*Node, r int, now time.Time) {
	for _, n := range path {
		t.SetCached(n, r, true)
	}
	t.Touch(path, r, now)
}

// Find returns the node holding key and the key's offset in its run.
func (t *Tree) Find(key blocks.Key) (*Node, int, bool) {
	e, ok := t.index.get(key)
	if !ok {
		return nil, 0, false
	}
	n := t.node(e.node)
	return n, int(e.depth) - int(n.depth), true
}

// Isolate splits the tree so that the block key is a node of its own (its
// run holds just key) and returns that node; ok=false if key is unknown. It
// is how a single-block removal reported by an engine is applied.
func (t *Tree) Isolate(key blocks.Key) (*Node, bool) {
	n, off, ok := t.Find(key)
	if !ok {
		return nil, false
	}
	n, _ = t.IsolateAt(n, off)
	return n, true
}

// IsolateRunAt cuts n's run so that its keys [off, off+c) form a node of
// their own, and returns that node: at most two splits (none when the run
// is the whole node), where Isolate would cut c one-block nodes. It is how
// the router unmarks an expired speculative run (router.expireSpan). The
// upper half of a split keeps Ext and Assigned, as in every split.
// Requires 0 ≤ off, 1 ≤ c and off+c ≤ n.Own().
func (t *Tree) IsolateRunAt(n *Node, off, c int) *Node {
	if off > 0 {
		n = t.split(n, off)
	}
	if c < len(n.keys) {
		t.split(n, c)
	}
	return n
}

// IsolateAt is Isolate for the key at offset off of n's run (Find's
// answer), without looking the key up again: it returns the node that
// holds just that key and the node that now holds the rest of n's run
// after it (nil when the key was the run's last), so that a caller
// isolating consecutive keys steps from one to the next without a lookup.
// off must be in [0, n.Own()).
func (t *Tree) IsolateAt(n *Node, off int) (key, rest *Node) {
	if off > 0 {
		n = t.split(n, off)
	}
	if len(n.keys) > 1 {
		rest = t.split(n, 1)
	}
	return n, rest
}

// EachLRU calls fn for the nodes replica r caches, least recently used first,
// until fn returns false. fn must not change the tree.
func (t *Tree) EachLRU(r int, fn func(n *Node) bool) {
	if r < 0 || r >= len(t.reps) {
		return
	}
	for n := t.reps[r].tail; n != nil; {
		prev := n.rs[r].prev
		if !fn(n) {
			return
		}
		n = prev
	}
}

// EachUnreferencedLRU calls fn for the nodes replica r caches that no
// in-flight request on r references (Ref(r) == 0), least recently used
// first, until fn returns false: EachLRU's order without the referenced
// nodes, which it does not visit (a loaded replica's LRU end is full of
// the prefixes of its queued requests). fn must not change the tree.
func (t *Tree) EachUnreferencedLRU(r int, fn func(n *Node) bool) {
	if r < 0 || r >= len(t.reps) {
		return
	}
	for n := t.reps[r].utail; n != nil; {
		prev := n.rs[r].uprev
		if !fn(n) {
			return
		}
		n = prev
	}
}

// EvictLRU uncaches nodes of replica r that no in-flight request on r
// references, least recently used first, until at least blocks blocks are
// freed or none is left; it returns the blocks freed. It models the engine's
// LRU eviction in the router's mirror of a replica that publishes no events.
func (t *Tree) EvictLRU(r int, blocks int, now time.Time) int {
	freed := 0
	if r < 0 || r >= len(t.reps) {
		return 0
	}
	for n := t.reps[r].tail; n != nil && freed < blocks; {
		prev := n.rs[r].prev
		if n.rs[r].ref == 0 && !t.hasCachedChild(n, r) {
			freed += len(n.keys)
			t.SetCached(n, r, false)
		}
		n = prev
	}
	return freed
}

func (t *Tree) hasCachedChild(n *Node, r int) bool {
	return r < len(n.rs) && n.rs[r].cachedKids > 0
}

// addCachedKid adjusts n's count of children cached on r.
func (t *Tree) addCachedKid(n *Node, r int, d int32) {
	if d < 0 && r >= len(n.rs) {
		return // unreachable: a cached child was counted
	}
	s := t.rep(n, r)
	s.cachedKids += d
	if s.cachedKids <= 0 {
		s.cachedKids = 0
		t.release(n)
	}
}

// ClearReplica forgets everything replica r caches, in time proportional to
// the number of nodes it caches (vLLM's AllBlocksCleared; a replica removed).
func (t *Tree) ClearReplica(r int) {
	if r < 0 || r >= len(t.reps) {
		return
	}
	for n := t.reps[r].head; n != nil; {
		s := &n.rs[r]
		next := s.next
		s.prev, s.next, s.uprev, s.unext, s.stamp = nil, nil, nil, nil, 0
		n.cachedBy.Remove(r)
		t.release(n)
		t.addCachedKid(n.parent, r, -1)
		n = next
	}
	t.reps[r].head, t.reps[r].tail, t.reps[r].cachedBlocks = nil, nil, 0
	t.reps[r].uhead, t.reps[r].utail = nil, nil
	t.reps[r].stampedBlocks = 0
}

// Stamp is the owner's mark on replica r's copy of n: 0 unless SetStamp
// gave it one while r caches n. A split gives both halves the stamp.
func (n *Node) Stamp(r int) int64 {
	if r < 0 || r >= len(n.rs) {
		return 0
	}
	return n.rs[r].stamp
}

// SetStamp marks replica r's copy of n with v (0 clears the mark). It is
// the router's speculative deadline (internal/router, speculate.go): a
// mark per node and replica, split with the node, and dropped when r
// stops caching n, so that marking a prompt's path costs one store per
// node rather than a map entry per block. A node r does not cache takes
// no mark.
func (t *Tree) SetStamp(n *Node, r int, v int64) {
	if n.Evicted() || r < 0 || r >= len(t.reps) || !n.cachedBy.Has(r) {
		return
	}
	s := &n.rs[r]
	switch {
	case s.stamp == 0 && v != 0:
		t.reps[r].stampedBlocks += len(n.keys)
	case s.stamp != 0 && v == 0:
		t.reps[r].stampedBlocks -= len(n.keys)
	}
	s.stamp = v
}

// clearStamp drops replica r's mark on n, which r caches.
func (t *Tree) clearStamp(n *Node, r int) {
	if s := &n.rs[r]; s.stamp != 0 {
		t.reps[r].stampedBlocks -= len(n.keys)
		s.stamp = 0
	}
}

// StampedBlocks is the number of blocks replica r caches in nodes that
// carry a stamp. O(1).
func (t *Tree) StampedBlocks(r int) int {
	if r < 0 || r >= len(t.reps) {
		return 0
	}
	return t.reps[r].stampedBlocks
}

// ClearStamps drops every mark on replica r, in time proportional to the
// number of nodes r caches.
func (t *Tree) ClearStamps(r int) {
	if r < 0 || r >= len(t.reps) || t.reps[r].stampedBlocks == 0 {
		return
	}
	for n := t.reps[r].head; n != nil; n = n.rs[r].next {
		n.rs[r].stamp = 0
	}
	t.reps[r].stampedBlocks = 0
}

// --- per-replica LRU list ---

func (t *Tree) pushFront(r int, n *Node) {
	s := &n.rs[r]
	ri := &t.reps[r]
	s.prev, s.next = nil, ri.head
	if ri.head != nil {
		ri.head.rs[r].prev = n
	}
	ri.head = n
	if ri.tail == nil {
		ri.tail = n
	}
	if s.ref == 0 {
		t.ulinkBefore(r, n, ri.uhead)
	}
}

func (t *Tree) unlink(r int, n *Node) {
	t.uunlink(r, n)
	s := &n.rs[r]
	ri := &t.reps[r]
	if s.prev != nil {
		s.prev.rs[r].next = s.next
	} else if ri.head == n {
		ri.head = s.next
	}
	if s.next != nil {
		s.next.rs[r].prev = s.prev
	} else if ri.tail == n {
		ri.tail = s.prev
	}
	s.prev, s.next = nil, nil
}

// inUnref reports whether n is in r's unreferenced list.
func (t *Tree) inUnref(r int, n *Node) bool {
	s := &n.rs[r]
	return s.uprev != nil || s.unext != nil || t.reps[r].uhead == n
}

// uunlink takes n out of r's unreferenced list, if it is there.
func (t *Tree) uunlink(r int, n *Node) {
	if !t.inUnref(r, n) {
		return
	}
	s := &n.rs[r]
	ri := &t.reps[r]
	if s.uprev != nil {
		s.uprev.rs[r].unext = s.unext
	} else {
		ri.uhead = s.unext
	}
	if s.unext != nil {
		s.unext.rs[r].uprev = s.uprev
	} else {
		ri.utail = s.uprev
	}
	s.uprev, s.unext = nil, nil
}

// ulinkBefore puts n in r's unreferenced list just before q (towards the
// MRU end); q nil: at the LRU end.
func (t *Tree) ulinkBefore(r int, n, q *Node) {
	s := &n.rs[r]
	ri := &t.reps[r]
	p := ri.utail
	if q != nil {
		p = q.rs[r].uprev
	}
	s.uprev, s.unext = p, q
	if p != nil {
		p.rs[r].unext = n
	} else {
		ri.uhead = n
	}
	if q != nil {
		q.rs[r].uprev = n
	} else {
		ri.utail = n
	}
}

// uplace puts n, cached on r and no longer referenced, in r's unreferenced
// list at its place in the LRU order: before the first unreferenced node
// older than it, which is the one after the first unreferenced node newer
// than it. It looks both ways in the LRU list, a step each in turn, and
// stops at the first unreferenced node either way, so the walk is as short
// as the shorter of the referenced runs around n: a loaded replica's LRU
// list holds long runs of the paths of its queued requests on one side or
// the other.
func (t *Tree) uplace(r int, n *Node) {
	older, newer := n.rs[r].next, n.rs[r].prev
	for {
		if older == nil || older.rs[r].ref == 0 {
			t.ulinkBefore(r, n, older)
			return
		}
		if newer == nil {
			t.ulinkBefore(r, n, t.reps[r].uhead)
			return
		}
		if newer.rs[r].ref == 0 {
			t.ulinkBefore(r, n, newer.rs[r].unext)
			return
		}
		older, newer = older.rs[r].next, newer.rs[r].prev
	}
}

// linkAfter puts low right after n (towards the LRU end) in r's list.
func (t *Tree) linkAfter(r int, n, low *Node) {
	ls := &low.rs[r]
	ns := &n.rs[r]
	ls.prev, ls.next = n, ns.next
	if ns.next != nil {
		ns.next.rs[r].prev = low
	} else {
		t.reps[r].tail = low
	}
	ns.next = low
}

// --- global LRU and the size bound ---

func (t *Tree) gpushFront(n *Node) {
	n.gprev, n.gnext = nil, t.ghead
	if t.ghead != nil {
		t.ghead.gprev = n
	}
	t.ghead = n
	if t.gtail == nil {
		t.gtail = n
	}
}

func (t *Tree) gunlink(n *Node) {
	if n.gprev != nil {
		n.gprev.gnext = n.gnext
	} else if t.ghead == n {
		t.ghead = n.gnext
	}
	if n.gnext != nil {
		n.gnext.gprev = n.gprev
	} else if t.gtail == n {
		t.gtail = n.gprev
	}
	n.gprev, n.gnext = nil, nil
}

func (t *Tree) ginsertAfter(n, low *Node) {
	low.gprev, low.gnext = n, n.gnext
	if n.gnext != nil {
		n.gnext.gprev = low
	} else {
		t.gtail = low
	}
	n.gnext = low
}

// evictScan bounds how many held nodes one insertion may step over while
// looking for something to evict, so that a tree full of cached prefixes
// costs O(1) per insertion and is allowed to grow past its bound instead.
const evictScan = 256

func (t *Tree) enforceBound() {
	scanned := 0
	for n := t.gtail; t.index.len() > t.cfg.MaxBlocks && n != nil && scanned < evictScan; {
		prev := n.gprev
		if t.evictable(n) {
			// The parent may just have become an evictable leaf; it sits
			// before n in LRU order (touched after n), so the scan reaches it.
			t.remove(n)
		} else {
			scanned++
		}
		n = prev
	}
}

func (t *Tree) evictable(n *Node) bool {
	// A node with per-replica state is cached, referenced or has a cached
	// child (release drops it otherwise).
	return n.kid == nil && n.parent != nil && n.rs == nil
}

func (t *Tree) remove(n *Node) {
	removeKid(n)
	for _, k := range n.keys {
		t.index.del(k)
	}
	t.gunlink(n)
	t.nodes[n.id] = nil
	t.freeIDs = append(t.freeIDs, n.id)
	n.id = 0 // with parent set: evicted
	n.Ext = nil
	t.evictions++
}

// UncacheFrom marks the blocks keys[from:] of one prompt's path not cached
// on replica r, splitting the nodes that hold keys[from] and the last key
// so that the blocks before and after them keep their state. Keys the tree no longer holds are skipped. It
// is how the router drops the tail of a prompt that a slot cache (llama.cpp)
// overwrote: the caller must make sure no other prompt cached on r passes
// through keys[from:].
func (t *Tree) UncacheFrom(keys []blocks.Key, from int, r int) {
	if from < 0 {
		from = 0
	}
	if from >= len(keys) || r < 0 || r >= len(t.reps) {
		return
	}
	n, off, ok := t.Find(keys[from])
	if !ok {
		return // the tree is prefix-closed: nothing deeper is held either
	}
	if off > 0 {
		n = t.split(n, off)
	}
	// Walk down from n along the path of keys, then uncache deepest first
	// so that a node never loses its cached bit before its children do.
	var path []*Node
	for i := from; n != nil; {
		// How much of n's run is this prompt's: a node may run on past the
		// prompt's end (a longer prompt shares it) or diverge from it (the
		// prompt's next block lives on another branch, or nowhere). Keys
		// are chained, so the run matches up to its first differing key.
		own := 0
		for own < len(n.keys) && i+own < len(keys) && n.keys[own] == keys[i+own] {
			own++
		}
		if own < len(n.keys) {
			// Keep the state of the run's tail, which is not this prompt's.
			t.split(n, own)
			path = append(path, n)
			break
		}
		path = append(path, n)
		i += own
		if i >= len(keys) {
			break
		}
		next, noff, ok := t.Find(keys[i])
		if !ok || noff != 0 || next.parent != n {
			break
		}
		n = next
	}
	for i := len(path) - 1; i >= 0; i-- {
		t.SetCached(path[i], r, false)
	}
}
