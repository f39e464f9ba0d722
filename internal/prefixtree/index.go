package prefixtree

import "github.com/prefixlb/prefixlb/internal/blocks"

// keyIndex maps every block key in the tree to its node and position. It is
// an open-addressing table with linear probing and backward-shift deletion:
// the tree inserts and deletes keys constantly (new prompts in, LRU nodes
// out), and Go's built-in map slows down under that churn as deleted slots
// accumulate (a quarter of routing time in BenchmarkRouteChurn). Keys are
// already uniform 64-bit hashes, so a multiplicative hash spreads them.
// Not safe for concurrent use (the Tree's owner serialises it).
type keyIndex struct {
	keys  []uint64 // 0 marks an empty slot; key 0 lives in zero/zeroVal
	vals  []keyEntry
	n     int // entries, zero included
	shift uint
	mask  int

	hasZero bool
	zeroVal keyEntry
}

const minIndexSlots = 1 << 10

func newKeyIndex() keyIndex {
	var ix keyIndex
	ix.resize(minIndexSlots)
	return ix
}

func (ix *keyIndex) resize(slots int) {
	oldK, oldV := ix.keys, ix.vals
	ix.keys = make([]uint64, slots)
	ix.vals = make([]keyEntry, slots)
	ix.mask = slots - 1
	ix.shift = 64
	for s := slots; s > 1; s >>= 1 {
		ix.shift--
	}
	for i, k := range oldK {
		if k != 0 {
			j := ix.home(k)
			for ix.keys[j] != 0 {
				j = (j + 1) & ix.mask
			}
			ix.keys[j], ix.vals[j] = k, oldV[i]
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
		switch ix.keys[i] {
		case k:
			return ix.vals[i], true
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
	if (ix.n+1)*10 > len(ix.keys)*7 {
		ix.resize(len(ix.keys) * 2)
	}
	i := ix.home(k)
	for ; ix.keys[i] != 0; i = (i + 1) & ix.mask {
		if ix.keys[i] == k {
			ix.vals[i] = v
			return
		}
	}
	ix.keys[i], ix.vals[i] = k, v
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
	for ; ix.keys[i] != k; i = (i + 1) & ix.mask {
		if ix.keys[i] == 0 {
			return
		}
	}
	ix.n--
	for {
		ix.keys[i], ix.vals[i] = 0, keyEntry{}
		j := i
		for {
			j = (j + 1) & ix.mask
			if ix.keys[j] == 0 {
				return
			}
			h := ix.home(ix.keys[j])
			// The entry at j may fill the hole at i only if i lies on its
			// probe path, between its home h and j (cyclically).
			if (i-h)&ix.mask < (j-h)&ix.mask {
				break
			}
		}
		ix.keys[i], ix.vals[i] = ix.keys[j], ix.vals[j]
		i = j
	}
}
