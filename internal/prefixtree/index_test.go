package prefixtree

import (
	"math/rand/v2"
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// TestKeyIndexAgainstMap drives the open-addressing index and a Go map with
// the same random puts and deletes (keys from a small range so that probe
// runs collide and wrap, key 0 included) and checks they always agree.
func TestKeyIndexAgainstMap(t *testing.T) {
	for _, keyRange := range []uint64{8, 300, 5000} {
		rng := rand.New(rand.NewPCG(keyRange, 9))
		ix := newKeyIndex()
		ref := map[blocks.Key]keyEntry{}
		// Keys that share a home slot: multiples of a large power of two
		// collide under the multiplicative hash's top bits often enough.
		key := func() blocks.Key {
			k := rng.Uint64N(keyRange)
			if rng.IntN(4) == 0 {
				return blocks.Key(k << 54)
			}
			return blocks.Key(k * 0x9e3779b97f4a7c15)
		}
		for op := 0; op < 200000; op++ {
			k := key()
			switch rng.IntN(3) {
			case 0, 1:
				v := keyEntry{node: uint32(op % 7), depth: uint32(op)}
				ix.put(k, v)
				ref[k] = v
			case 2:
				ix.del(k)
				delete(ref, k)
			}
			if op%997 == 0 || keyRange == 8 {
				if ix.len() != len(ref) {
					t.Fatalf("range %d op %d: len %d, want %d", keyRange, op, ix.len(), len(ref))
				}
				for rk, rv := range ref {
					if got, ok := ix.get(rk); !ok || got != rv {
						t.Fatalf("range %d op %d: get(%x) = %v %v, want %v", keyRange, op, uint64(rk), got, ok, rv)
					}
				}
			}
			if _, ok := ref[k]; !ok {
				if _, found := ix.get(k); found {
					t.Fatalf("range %d op %d: deleted key %x still found", keyRange, op, uint64(k))
				}
			}
		}
	}
}
