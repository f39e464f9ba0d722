package replica

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// TestAdmitAfterSlotReuse retries the admission of a waiting request after
// the tail of the cached prefix its first try found was evicted between the
// two tries, and its entry slot freed or reused (prefixCache.slots): the
// second try must see the cache as it is now, as a lookup of every key would
// (scanPrefix keeps the first try's entries in seq.ents and must not trust a
// stale one). A scan trusting the kept indices admits with a 4-block hit and
// pins the wrong entry in the first two cases.
func TestAdmitAfterSlotReuse(t *testing.T) {
	const k0, k1, k2, k3, k4, x, y blocks.Key = 100, 101, 102, 103, 104, 900, 901
	cases := []struct {
		name    string
		between func(c *prefixCache, e []int32) // after the first try, k3 (entry e[3]) the LRU head
		hit     int                             // blocks the second try finds cached
	}{
		// k2's child hint then names k3's old slot, holding x.
		{"slot reused by another key", func(c *prefixCache, e []int32) {
			c.evict()
			c.unpin(c.insert(x, x, e[2]))
		}, 3},
		{"slot left free", func(c *prefixCache, e []int32) { c.evict() }, 3},
		{"same key stored again in the same slot", func(c *prefixCache, e []int32) {
			c.evict()
			c.unpin(c.insert(k3, k3, e[2]))
		}, 4},
		// The kept index holds y, k3 is found below k2 by the hint.
		{"same key stored again in another slot", func(c *prefixCache, e []int32) {
			c.evict()
			c.unpin(c.insert(y, y, e[2]))
			c.unpin(c.insert(k3, k3, e[2]))
		}, 4},
		// k2's child hint names y: k3 is found in the map.
		{"same key stored again, not below its parent", func(c *prefixCache, e []int32) {
			c.evict()
			c.unpin(c.insert(y, y, e[2]))
			c.unpin(c.insert(k3, k3, nilEntry))
		}, 4},
		{"nothing evicted, the next block stored", func(c *prefixCache, e []int32) {
			c.unpin(c.insert(k4, k4, e[3]))
		}, 5},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r := newReplica(t, Config{Profile: linear{kv: 32 * 16}})
			B := r.cfg.BlockSize
			c := &r.cache
			var ents []int32
			parent := nilEntry
			for _, k := range []blocks.Key{k0, k1, k2, k3} {
				parent = c.insert(k, k, parent)
				ents = append(ents, parent)
			}
			for j := len(ents) - 1; j >= 0; j-- { // deepest first: k3 is the LRU head
				c.unpin(ents[j])
			}
			// 6 blocks with a 5-block hit at best, 1 free and 4 evictable:
			// its first try finds k0..k3 and does not fit.
			id := uint64(7)
			if err := r.Submit(req(id, 6*B, 4, k0, k1, k2, k3, k4), t0); err != nil {
				t.Fatal(err)
			}
			s := r.byID[id]
			r.privAll = r.nBlocks - c.len() - 1
			var ev []Event
			budget := NoChunking
			if r.tryAdmit(s, t0, &ev, &budget) {
				t.Fatal("first try admitted")
			}
			if got := len(s.ents); got != 4 {
				t.Fatalf("first try kept %d entries, want 4", got)
			}
			tc.between(c, ents)
			r.privAll = 0
			if !r.tryAdmit(s, t0, &ev, &budget) {
				t.Fatal("second try not admitted")
			}
			if e := ev[len(ev)-1]; e.Kind != Admitted || e.RequestID != id || e.HitTokens != tc.hit*B {
				t.Fatalf("got %+v, want request %d admitted with %d hit tokens", e, id, tc.hit*B)
			}
			if want := c.prefix(s.keys[:5]); tc.hit != want {
				t.Fatalf("case expects a %d-block hit, the cache holds %d", tc.hit, want)
			}
			for j, k := range s.keys[:s.pinned] {
				if i := s.ents[j]; i != c.lookup(k) || c.ents[i].refs != 1 {
					t.Fatalf("block %d: entry %d (refs %d), key %d is entry %d", j, i, c.ents[i].refs, k, c.lookup(k))
				}
			}
			for k, i := range c.idx {
				if k == x || k == y {
					if c.ents[i].refs != 0 {
						t.Fatalf("key %d pinned by the request", k)
					}
				}
			}
		})
	}
}

// BenchmarkAdmitRetry measures steps of an overloaded replica whose waiting
// request, a 3,100-block prompt with its first 3,000 blocks cached and
// evictable, does not fit beside a long decode: every step retries its
// admission (vLLM's scheduler does), and prefix caching makes that a scan of
// its 3,000 cached blocks. The decode's growth evicts the cached prefix's
// deepest block every 16 steps once the free blocks run out (from the
// 1,473rd step); the replica is rebuilt, outside the timer, every 2,000 steps.
func BenchmarkAdmitRetry(b *testing.B) {
	const (
		nBlocks = 8192
		cached  = 3000
		decode  = 5100 // the running request's blocks: free 92, evictable 3,000
	)
	build := func() (*Replica, time.Time) {
		r := newReplica(b, Config{Profile: linear{kv: nBlocks * 16}, ChunkBudget: NoChunking})
		keys := make([]blocks.Key, cached+100)
		for i := range keys {
			keys[i] = blocks.Key(1_000_000 + i)
		}
		now := t0
		ev := make([]Event, 0, 64)
		step := func() {
			var busy bool
			for busy = true; busy; {
				now, ev, busy = r.Step(now, ev[:0])
			}
		}
		if err := r.Submit(req(1, cached*16, 1, keys[:cached]...), now); err != nil {
			b.Fatal(err)
		}
		step() // its prompt cached, unreferenced
		if err := r.Submit(req(2, decode*16-1, 3000), now); err != nil {
			b.Fatal(err)
		}
		now, ev, _ = r.Step(now, ev[:0]) // its prefill
		if err := r.Submit(req(3, len(keys)*16, 1, keys...), now); err != nil {
			b.Fatal(err)
		}
		return r, now
	}
	r, now := build()
	ev := make([]Event, 0, 64)
	b.ReportAllocs()
	b.ResetTimer()
	for n := range b.N {
		if n > 0 && n%2000 == 0 {
			b.StopTimer()
			r, now = build()
			b.StartTimer()
		}
		now, ev, _ = r.Step(now, ev[:0])
	}
	b.StopTimer()
	if st := r.Stats(); st.Waiting != 1 || st.Running != 1 {
		b.Fatalf("%d waiting, %d running: the retry scenario broke", st.Waiting, st.Running)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "steps/s")
}
