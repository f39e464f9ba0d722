package replica

import "github.com/prefixlb/prefixlb/internal/blocks"

// prefixCache is the replica's prefix cache: the set of prompt blocks whose KV
// is kept for reuse, as vLLM's automatic prefix caching and SGLang's radix
// cache keep them.
//
// Block keys are chained (a key names its whole prefix), so the radix tree
// over prompts is a map from key to entry: a key's parent in the tree is the
// key before it in every prompt holding it. The cache is prefix-closed: a
// block is stored only after its parent (the computing request pins the
// parent) and only leaves are evicted.
//
// Each entry counts the requests that reference it (refs). An entry with no
// references is evictable and sits in an LRU list ordered by release time,
// least recently released first, like vLLM's free block queue. Requests
// release their blocks deepest first, and a request referencing a block
// references all its ancestors, so in the list every block comes after all of
// its cached descendants: the head is always a leaf, and evicting from the
// head evicts unpinned leaves in LRU order.
type prefixCache struct {
	idx   map[blocks.Key]int32
	ents  []entry
	slots []int32 // free indices in ents
	head  int32   // least recently released unreferenced entry, or nil
	tail  int32
	nLRU  int // entries in the LRU list (refs == 0)
}

const nilEntry int32 = -1

// freeRefs marks a free entry slot (evicted, not yet reused), so that an
// entry index kept from an earlier lookup (seq.ents, entry.child) is never
// taken for a live entry holding the same key: see holds.
const freeRefs int32 = -1

type entry struct {
	key        blocks.Key // its key in the cache
	ext        blocks.Key // the key its events report (the request's)
	refs       int32      // references; freeRefs while the slot is free
	prev, next int32      // LRU links while refs == 0
	// child is a hint: the entry last stored below this one, which may
	// have been evicted since (check it with holds), or nilEntry.
	child int32
}

func newPrefixCache() prefixCache {
	return prefixCache{idx: make(map[blocks.Key]int32), head: nilEntry, tail: nilEntry}
}

// len is the number of cached blocks, referenced or not.
func (c *prefixCache) len() int { return len(c.idx) }

// lookup returns the entry holding k, or nilEntry.
func (c *prefixCache) lookup(k blocks.Key) int32 {
	if i, ok := c.idx[k]; ok {
		return i
	}
	return nilEntry
}

// holds reports whether entry i holds key k now: whether lookup(k) is i.
// Indices kept across evictions are checked with it: an evicted entry is
// marked free (freeRefs) and a reused slot holds another key, or the same key
// again, which is then rightly its entry (the map has one entry per key).
func (c *prefixCache) holds(i int32, k blocks.Key) bool {
	e := &c.ents[i]
	return e.key == k && e.refs != freeRefs
}

// prefix is the number of leading keys of a chain that are cached.
func (c *prefixCache) prefix(keys []blocks.Key) int {
	for i, k := range keys {
		if _, ok := c.idx[k]; !ok {
			return i
		}
	}
	return len(keys)
}

// insert adds k, which must be absent, referenced once, below entry parent
// (nilEntry for a chain's first block); its events report it as ext
// (lora.go: an adapter's cache keys differ from its requests').
func (c *prefixCache) insert(k, ext blocks.Key, parent int32) int32 {
	var i int32
	if n := len(c.slots); n > 0 {
		i = c.slots[n-1]
		c.slots = c.slots[:n-1]
	} else {
		i = int32(len(c.ents))
		c.ents = append(c.ents, entry{})
	}
	c.ents[i] = entry{key: k, ext: ext, refs: 1, prev: nilEntry, next: nilEntry, child: nilEntry}
	c.idx[k] = i
	if parent != nilEntry {
		c.ents[parent].child = i
	}
	return i
}

// next returns the entry holding k, the block after entry parent in a chain
// (nilEntry: k is a chain's first block), or nilEntry. It tries parent's
// child hint before the map: a conversation's prompts extend the last one,
// so a chain's cached blocks are mostly each other's last stored children.
func (c *prefixCache) next(parent int32, k blocks.Key) int32 {
	if parent != nilEntry {
		if h := c.ents[parent].child; h != nilEntry && c.holds(h, k) {
			return h
		}
	}
	return c.lookup(k)
}

// pin adds a reference to entry i, taking it off the LRU list.
func (c *prefixCache) pin(i int32) {
	e := &c.ents[i]
	if e.refs == 0 {
		c.unlink(i)
	}
	e.refs++
}

// unpin drops a reference to entry i; at zero it becomes the most recently
// released evictable entry.
func (c *prefixCache) unpin(i int32) {
	e := &c.ents[i]
	e.refs--
	if e.refs > 0 {
		return
	}
	if e.refs < 0 {
		panic("replica: prefix cache entry unpinned more often than pinned")
	}
	e.prev, e.next = c.tail, nilEntry
	if c.tail != nilEntry {
		c.ents[c.tail].next = i
	} else {
		c.head = i
	}
	c.tail = i
	c.nLRU++
}

func (c *prefixCache) unlink(i int32) {
	e := &c.ents[i]
	if e.prev != nilEntry {
		c.ents[e.prev].next = e.next
	} else {
		c.head = e.next
	}
	if e.next != nilEntry {
		c.ents[e.next].prev = e.prev
	} else {
		c.tail = e.prev
	}
	e.prev, e.next = nilEntry, nilEntry
	c.nLRU--
}

// evict removes the least recently released unreferenced block, a leaf, and
// returns the key its events report. There must be one (nLRU > 0).
func (c *prefixCache) evict() blocks.Key {
	i := c.head
	c.unlink(i)
	e := &c.ents[i]
	delete(c.idx, e.key)
	e.refs = freeRefs
	c.slots = append(c.slots, i)
	return e.ext
}
