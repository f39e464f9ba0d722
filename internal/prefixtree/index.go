package prefixtree

import "github.com/prefixlb/prefixlb/internal/blocks"

// keyEntry is what the key index holds for a key: the id of its node
// (Tree.nodes) and its block position in its prompt.
type keyEntry struct {
	node  uint32
	depth uint32
}

// keyIndex maps every block key in the tree to its node and position. It is
// an open-addressing table with linear probing and backward-shift deletion:
// the tree inserts and deletes keys constantly (new prompts in, LRU nodes
// out), and Go's built-in map slows down under that churn as deleted slots
// accumulate (a quarter of routing time in BenchmarkRouteChurn). Keys are
// already uniform 64-bit hashes, so a multiplicative hash spreads them.
//
// A slot is 16 bytes, key and entry side by side (a probe reads one cache
// line), and the node is named by its 4-byte id rather than an 8-byte
// pointer: at the load factor's bounds (0.35–0.7) that is 23–46 bytes a key,
// often the largest single share of a tree's memory.
// Not safe for concurrent use (the Tree's owner serialises it).
type keyIndex struct {
	slots []indexSlot // key 0 marks an empty slot; key 0 lives in zeroVal
	n     int         // entries, zero included
	shift uint
	mask  int

	hasZero bool
	zeroVal keyEntry
}

type indexSlot struct {
	key uint64
	val keyEntry
}

const minIndexSlots = 1 << 10

func newKeyIndex() keyIndex {
	var ix keyIndex
	ix.resize(minIndexSlots)
	return ix
}

func (ix *keyIndex) resize(slots int) {
	old := ix.slots
	ix.slots = make([]indexSlot, slots)
	ix.mask = slots - 1
	ix.shift = 64
	for s := slots; s > 1; s >>= 1 {
		ix.shift--
	}
	for _, sl := range old {
		if sl.key != 0 {
			j := ix.home(sl.key)
			for ix.slots[j].key != 0 {
				j = (j + 1) & ix.mask
			}
			ix.slots[j] = sl
		}
	}
}

// home is k's preferred slot (Fibonacci hashing).
func (ix *keyIndex) home(k uint64) int { return int((k * 0x9e3779b97f4a7c15) >> ix.shift) }

func (ix *keyIndex) len() int { return ix.n }

func (ix *keyIndex) get(key blocks.Key) (keyEntry, bool) {
	k := uint64(key)
	if k == 0 {
		return ix.zeroVal, ix.hasZero
	}
	for i := ix.home(k); ; i = (i + 1) & ix.mask {
		switch sl := &ix.slots[i]; sl.key {
		case k:
			return sl.val, true
		case 0:
			return keyEntry{}, false
		}
	}
}

func (ix *keyIndex) put(key blocks.Key, v keyEntry) {
	k := uint64(key)
	if k == 0 {
		if !ix.hasZero {
			ix.n++
		}
		ix.hasZero, ix.zeroVal = true, v
		return
	}
	// Keep the load factor under 0.7 so probe runs stay short.
	if (ix.n+1)*10 > len(ix.slots)*7 {
		ix.resize(len(ix.slots) * 2)
	}
	i := ix.home(k)
	for ; ix.slots[i].key != 0; i = (i + 1) & ix.mask {
		if ix.slots[i].key == k {
			ix.slots[i].val = v
			return
		}
	}
	ix.slots[i] = indexSlot{k, v}
	ix.n++
}

// del removes key, shifting later entries of its probe run back so that no
// tombstone is left (Knuth, TAOCP vol. 3, §6.4, Algorithm R).
func (ix *keyIndex) del(key blocks.Key) {
	k := uint64(key)
	if k == 0 {
		if ix.hasZero {
			ix.hasZero, ix.zeroVal = false, keyEntry{}
			ix.n--
		}
		return
	}
	i := ix.home(k)
	for ; ix.slots[i].key != k; i = (i + 1) & ix.mask {
		if ix.slots[i].key == 0 {
			return
		}
	}
	ix.n--
	for {
		ix.slots[i] = indexSlot{}
		j := i
		for {
			j = (j + 1) & ix.mask
			if ix.slots[j].key == 0 {
				return
			}
			h := ix.home(ix.slots[j].key)
			// The entry at j may fill the hole at i only if i lies on its
			// probe path, between its home h and j (cyclically).
			if (i-h)&ix.mask < (j-h)&ix.mask {
				break
			}
		}
		ix.slots[i] = ix.slots[j]
		i = j
	}
}
