package prefixtree

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// naive is the obviously-correct model the tree is checked against: the set of
// keys present (every prefix of every inserted prompt) and, per replica, the
// set of keys cached.
type naive struct {
	present map[blocks.Key]bool
	cached  []map[blocks.Key]bool
}

func (m *naive) match(keys []blocks.Key) (int, []int) {
	n := 0
	for n < len(keys) && m.present[keys[n]] {
		n++
	}
	per := make([]int, len(m.cached))
	for r, c := range m.cached {
		for per[r] < n && c[keys[per[r]]] {
			per[r]++
		}
	}
	return n, per
}

// FuzzTreeAgainstNaive drives the tree and the naive model with the same
// operations over a 3-token alphabet (block size 1, so prompts collide often)
// and checks that every lookup agrees.
func FuzzTreeAgainstNaive(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 1, 1, 3, 0, 2, 1, 0})
	f.Add([]byte{0, 0, 0, 0, 16, 0, 0, 1, 32, 2, 48, 1})
	f.Add([]byte{5, 5, 5, 5, 5, 21, 37, 53, 69, 85, 101, 117})
	f.Fuzz(func(t *testing.T, data []byte) {
		const reps = 3
		tr, err := New(Config{BlockTokens: 1}, reps)
		if err != nil {
			t.Fatal(err)
		}
		m := &naive{present: map[blocks.Key]bool{}}
		for i := 0; i < reps; i++ {
			m.cached = append(m.cached, map[blocks.Key]bool{})
		}
		var prompts [][]blocks.Key
		var mt Match
		now := time.Unix(0, 0)
		for i := 0; i+1 < len(data); i += 2 {
			op, arg := data[i], data[i+1]
			r := int(arg>>4) % reps
			switch op % 5 {
			case 0, 1: // insert a prompt of length 1..8 tokens over {0,1,2}
				ln := int(arg%8) + 1
				toks := make([]uint32, ln)
				x := uint32(op)*7 + uint32(arg)
				for j := range toks {
					toks[j] = x % 3
					x = x*1103515245 + 12345
					x >>= 3
				}
				keys := blocks.Keys(nil, toks, 1)
				tr.Insert(keys, now, &mt)
				for _, k := range keys {
					m.present[k] = true
				}
				if op%5 == 1 { // and cache it on r
					tr.SetPathCached(mt.Path, r, now)
					for _, k := range keys {
						m.cached[r][k] = true
					}
				}
				prompts = append(prompts, keys)
			case 2: // remove one cached block of an earlier prompt from r
				if len(prompts) == 0 {
					continue
				}
				p := prompts[int(arg)%len(prompts)]
				k := p[int(arg)%len(p)]
				if n, ok := tr.Isolate(k); ok {
					tr.SetCached(n, r, false)
				}
				delete(m.cached[r], k)
			case 3:
				tr.ClearReplica(r)
				m.cached[r] = map[blocks.Key]bool{}
			case 4: // lookups happen below for every prompt
			}
			now = now.Add(time.Millisecond)
			for _, p := range prompts {
				tr.Lookup(p, &mt)
				wantN, wantPer := m.match(p)
				if mt.Blocks != wantN {
					t.Fatalf("op %d: match %d blocks, want %d", i/2, mt.Blocks, wantN)
				}
				for rr := range wantPer {
					if mt.PerReplica[rr] != wantPer[rr] {
						t.Fatalf("op %d: replica %d matches %d, want %d", i/2, rr, mt.PerReplica[rr], wantPer[rr])
					}
				}
			}
			for rr := 0; rr < reps; rr++ {
				if got, want := tr.CachedBlocks(rr), len(m.cached[rr]); got != want {
					t.Fatalf("op %d: replica %d caches %d blocks, want %d", i/2, rr, got, want)
				}
			}
		}
	})
}
