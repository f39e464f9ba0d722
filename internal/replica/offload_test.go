package replica

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// tierLinear is the linear test profile (10 µs per computed token) with
// 2000 KV bytes per token and a 1 GB/s CPU tier: a token loads in 2 µs, a
// fifth of its recompute.
type tierLinear struct{ linear }

func (tierLinear) KVBytesPerToken() float64 { return 2000 }

func (tierLinear) TierBandwidth(medium string) float64 {
	if medium == costmodel.MediumCPU {
		return 1e9
	}
	return 0
}

const loadPerToken = 2 * time.Microsecond

// keysFrom returns n consecutive keys from first (a test chain).
func keysFrom(first, n int) []blocks.Key {
	out := make([]blocks.Key, n)
	for i := range out {
		out[i] = blocks.Key(first + i)
	}
	return out
}

// admittedOf returns request id's first Admitted event.
func admittedOf(t *testing.T, ev []Event, id uint64) Event {
	t.Helper()
	for _, e := range ev {
		if e.Kind == Admitted && e.RequestID == id {
			return e
		}
	}
	t.Fatalf("request %d never admitted", id)
	return Event{}
}

// TestOffloadHitCost: request 3 repeats request 1's 96-token prompt after
// request 2 pushed it out of an 8-block GPU cache. With a CPU tier its
// blocks after the GPU hit are loaded (2 µs a token) and the rest
// computed; without one they are recomputed (10 µs a token); on a GPU big
// enough to keep them they are a plain hit. Its TTFT is exactly the load
// plus the iteration, and lies strictly between the other two.
func TestOffloadHitCost(t *testing.T) {
	run := func(gpuBlocks, cpuTokens int) (Event, time.Duration, []Event) {
		r := newReplica(t, Config{Profile: tierLinear{linear{kv: gpuBlocks * 16}}, CPUOffloadTokens: cpuTokens,
			ChunkBudget: 4096, MaxRunning: 16})
		ev := runLoRA(t, r, []arrival{
			{0, req(1, 96, 1, keysFrom(1, 6)...)},
			{ms(10), req(2, 96, 1, keysFrom(100, 6)...)},
			{ms(20), req(3, 96, 1, keysFrom(1, 6)...)},
		})
		return admittedOf(t, ev, 3), firstTokens(ev)[3] - ms(20), ev
	}
	tierAd, tierTTFT, ev := run(8, 32*16)
	missAd, missTTFT, _ := run(8, 0)
	hitAd, hitTTFT, _ := run(64, 0)

	if tierAd.TierTokens == 0 {
		t.Fatalf("no CPU-tier hit: %s", show(tierAd))
	}
	if got := tierAd.HitTokens + tierAd.TierTokens; got != 80 {
		t.Errorf("GPU + CPU hit = %d tokens, want 80 (the prompt's first 5 blocks)", got)
	}
	computed := 96 - tierAd.HitTokens - tierAd.TierTokens
	want := time.Duration(tierAd.TierTokens)*loadPerToken + time.Millisecond + time.Duration(computed)*10*time.Microsecond
	if tierTTFT != want {
		t.Errorf("CPU-tier hit TTFT = %v, want the load plus one iteration, %v", tierTTFT, want)
	}
	if missAd.TierTokens != 0 || hitAd.HitTokens != 80 {
		t.Fatalf("baselines: %s, %s", show(missAd), show(hitAd))
	}
	if !(hitTTFT < tierTTFT && tierTTFT < missTTFT) {
		t.Errorf("TTFT: GPU hit %v, CPU-tier hit %v, recompute %v; want them in that order", hitTTFT, tierTTFT, missTTFT)
	}
	// The loaded blocks entered the GPU cache when the load landed.
	land := ms(20) + time.Duration(tierAd.TierTokens)*loadPerToken
	found := false
	for _, e := range ev {
		if e.Kind == BlocksStored && e.Medium == "" && e.At.Sub(t0) == land {
			found = true
		}
	}
	if !found {
		t.Errorf("no GPU BlocksStored at the load's end (%v)", land)
	}
}

// TestOffloadLRU: a 4-block CPU tier on a large GPU. Requests of 2 blocks
// each (plus a partial block) are written through; the third evicts the
// least recently used pair. Re-admitting a request touches its blocks, so
// the pair evicted is then the other one.
func TestOffloadLRU(t *testing.T) {
	r := newReplica(t, Config{Profile: tierLinear{linear{kv: 64 * 16}}, CPUOffloadTokens: 4 * 16,
		ChunkBudget: 4096, MaxRunning: 16})
	a, b, c := keysFrom(1, 2), keysFrom(10, 2), keysFrom(20, 2)
	ev := runLoRA(t, r, []arrival{
		{0, req(1, 40, 1, a...)},
		{ms(5), req(2, 40, 1, b...)},
		{ms(10), req(3, 40, 1, a...)}, // a GPU hit, but it touches a in the tier
		{ms(15), req(4, 40, 1, c...)}, // evicts b, the least recently used
	})
	var cpu []string
	for _, e := range ev {
		if e.Medium != "" {
			cpu = append(cpu, fmt.Sprintf("%s %s %v", e.At.Sub(t0), e.Kind, e.Keys))
		}
	}
	diff(t, cpu, []string{
		"1.4ms BlocksStored [1 2]",
		"6.4ms BlocksStored [10 11]",
		"16.4ms BlocksRemoved [11 10]", // a touch leaves a prompt's first block the most recent
		"16.4ms BlocksStored [20 21]",
	})
	if r.OffloadedPrefix(a) != 2 || r.OffloadedPrefix(b) != 0 || r.OffloadedPrefix(c) != 2 {
		t.Errorf("tier holds a %d, b %d, c %d blocks; want 2, 0, 2", r.OffloadedPrefix(a), r.OffloadedPrefix(b), r.OffloadedPrefix(c))
	}
	st := r.Stats()
	if st.OffloadBlocks != 4 || st.OffloadStoredBlocks != 6 || st.OffloadEvictedBlocks != 2 || st.OffloadLoads != 0 {
		t.Errorf("stats: %+v", st)
	}
}

// TestOffloadLoadInFlight: two requests for the same evicted prompt arrive
// together. The first loads its blocks from the CPU tier; the second, whose
// blocks that load is reading, waits for it instead of loading them again,
// and finds them in the GPU cache; a third request with other blocks is
// not held up behind it.
func TestOffloadLoadInFlight(t *testing.T) {
	r := newReplica(t, Config{Profile: tierLinear{linear{kv: 16 * 16}}, CPUOffloadTokens: 64 * 16,
		ChunkBudget: 4096, MaxRunning: 16})
	ev := runLoRA(t, r, []arrival{
		{0, req(1, 160, 1, keysFrom(1, 10)...)},
		{ms(10), req(2, 160, 1, keysFrom(100, 10)...)}, // pushes request 1's blocks out of the GPU
		{ms(20), req(3, 160, 1, keysFrom(1, 10)...)},
		{ms(20), req(4, 160, 1, keysFrom(1, 10)...)},
		{ms(20), req(5, 40, 1, keysFrom(300, 2)...)},
	})
	a3, a4, a5 := admittedOf(t, ev, 3), admittedOf(t, ev, 4), admittedOf(t, ev, 5)
	if a3.TierTokens == 0 {
		t.Fatalf("request 3 loaded nothing: %s", show(a3))
	}
	if a4.TierTokens != 0 || a4.HitTokens != 144 || !a4.At.After(a3.At) {
		t.Errorf("request 4: %s; want it admitted after request 3's load with a 144-token GPU hit", show(a4))
	}
	if !a5.At.Equal(a3.At) {
		t.Errorf("request 5 admitted at %v, request 3 at %v: the waiting request held the queue up", a5.At.Sub(t0), a3.At.Sub(t0))
	}
	if st := r.Stats(); st.OffloadLoads != 1 || st.OffloadLoadedTokens != int64(a3.TierTokens) {
		t.Errorf("stats: %d loads of %d tokens, want 1 of %d", st.OffloadLoads, st.OffloadLoadedTokens, a3.TierTokens)
	}
}

// TestOffloadLinkSerial: loads share the replica's host-to-device link:
// two requests loading different prompts at once finish their loads one
// after the other.
func TestOffloadLinkSerial(t *testing.T) {
	r := newReplica(t, Config{Profile: tierLinear{linear{kv: 24 * 16}}, CPUOffloadTokens: 64 * 16,
		ChunkBudget: 4096, MaxRunning: 16})
	ev := runLoRA(t, r, []arrival{
		{0, req(1, 160, 1, keysFrom(1, 10)...)},
		{ms(10), req(2, 160, 1, keysFrom(100, 10)...)},
		{ms(20), req(3, 160, 1, keysFrom(200, 10)...)}, // evicts 1's blocks
		{ms(30), req(4, 160, 1, keysFrom(300, 10)...)}, // and 2's
		{ms(40), req(5, 160, 1, keysFrom(1, 10)...)},
		{ms(40), req(6, 160, 1, keysFrom(100, 10)...)},
	})
	a5, a6 := admittedOf(t, ev, 5), admittedOf(t, ev, 6)
	if a5.TierTokens == 0 || a6.TierTokens == 0 {
		t.Fatalf("no loads: %s, %s", show(a5), show(a6))
	}
	// When the loaded blocks entered the GPU cache: request 5's when its
	// load ended, request 6's at the first step after its own, which
	// waited for request 5's on the link.
	landed := map[blocks.Key]time.Duration{}
	for _, e := range ev {
		if k := e.Keys; e.Kind == BlocksStored && e.Medium == "" && e.At.Sub(t0) > ms(40) && len(k) > 0 && (k[0] == 1 || k[0] == 100) {
			if _, ok := landed[k[0]]; !ok {
				landed[k[0]] = e.At.Sub(t0)
			}
		}
	}
	l5 := time.Duration(a5.TierTokens) * loadPerToken
	l6 := time.Duration(a6.TierTokens) * loadPerToken
	if landed[1] != ms(40)+l5 || landed[100] < ms(40)+l5+l6 {
		t.Errorf("loads landed at %v (request 5) and %v (request 6); want %v and at least %v (one load after the other)",
			landed[1], landed[100], ms(40)+l5, ms(40)+l5+l6)
	}
}

// TestOffloadOffByDefault: without CPUOffloadTokens no event has a medium
// and no request loads, on the same load that loads with a tier.
func TestOffloadOffByDefault(t *testing.T) {
	r := newReplica(t, Config{Profile: tierLinear{linear{kv: 8 * 16}}, ChunkBudget: 4096, MaxRunning: 16})
	ev := drive(t, r, []arrival{
		{0, req(1, 96, 1, keysFrom(1, 6)...)},
		{ms(10), req(2, 96, 1, keysFrom(100, 6)...)},
		{ms(20), req(3, 96, 1, keysFrom(1, 6)...)},
	})
	for _, e := range ev {
		if e.Medium != "" || e.TierTokens != 0 {
			t.Fatalf("tier event without a tier: %s (medium %q, tier tokens %d)", show(e), e.Medium, e.TierTokens)
		}
	}
	if st := r.Stats(); st.OffloadBlocks != 0 || st.OffloadStoredBlocks != 0 {
		t.Errorf("stats: %+v", st)
	}
}

// TestOffloadConfig: CPUOffloadTokens is validated.
func TestOffloadConfig(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"negative", Config{Profile: tierLinear{linear{kv: 1024}}, CPUOffloadTokens: -1}},
		{"under a block", Config{Profile: tierLinear{linear{kv: 1024}}, CPUOffloadTokens: 8}},
		{"slots", Config{Profile: tierLinear{linear{kv: 1024}}, CPUOffloadTokens: 1024, Slots: 2}},
		{"no KV bytes", Config{Profile: linear{kv: 1024}, CPUOffloadTokens: 1024}},
	} {
		if _, err := New(tc.cfg); !errors.Is(err, ErrInvalidConfig) {
			t.Errorf("%s: New = %v, want ErrInvalidConfig", tc.name, err)
		}
	}
}

// TestOffloadReset: ResetPrefixCache empties the CPU tier too, as the
// AllCleared event it returns says.
func TestOffloadReset(t *testing.T) {
	r := newReplica(t, Config{Profile: tierLinear{linear{kv: 64 * 16}}, CPUOffloadTokens: 64 * 16,
		ChunkBudget: 4096, MaxRunning: 16})
	runLoRA(t, r, []arrival{{0, req(1, 40, 1, keysFrom(1, 2)...)}})
	if r.OffloadedPrefix(keysFrom(1, 2)) != 2 {
		t.Fatal("nothing offloaded")
	}
	if _, ok := r.ResetPrefixCache(t0.Add(time.Second)); !ok {
		t.Fatal("reset refused")
	}
	if n := r.OffloadedPrefix(keysFrom(1, 2)); n != 0 || r.Stats().OffloadBlocks != 0 {
		t.Errorf("after a reset the tier holds %d blocks", r.Stats().OffloadBlocks)
	}
}

// TestRandomizedOffload is TestRandomized with a CPU tier smaller and
// larger than the GPU cache: the tier's events mirror it exactly, it never
// exceeds its size, and the loads' references match the requests loading.
func TestRandomizedOffload(t *testing.T) {
	seeds := 6
	if testing.Short() {
		seeds = 2
	}
	for _, cpuBlocks := range []int{8, 200} {
		for _, local := range []string{LocalFCFS, LocalLPM, LocalPriority} {
			for seed := range seeds {
				t.Run(fmt.Sprintf("cpu=%d/%s/seed=%d", cpuBlocks, local, seed), func(t *testing.T) {
					r := newReplica(t, Config{Profile: tierLinear{linear{kv: 48 * 16}}, Local: local,
						ChunkBudget: 512, MaxRunning: 16, CPUOffloadTokens: cpuBlocks * 16})
					randomRun(t, r, rand.New(rand.NewPCG(uint64(seed), 13)), 300)
					if r.Stats().OffloadLoads == 0 {
						t.Error("no load from the CPU tier")
					}
				})
			}
		}
	}
}

// checkTier checks the CPU tier against the mirror its events built and
// its own accounting: its size, its LRU list, and the load references.
func checkTier(t *testing.T, r *Replica, m map[blocks.Key]bool) {
	t.Helper()
	c := r.cpu
	if len(m) != c.len() {
		t.Fatalf("tier mirror holds %d keys, tier %d", len(m), c.len())
	}
	if c.len() > c.capBlocks {
		t.Fatalf("tier holds %d blocks, more than its %d", c.len(), c.capBlocks)
	}
	exts := map[blocks.Key]bool{}
	n := 0
	for i := c.head; i != nilEntry; i = c.ents[i].next {
		exts[c.ents[i].ext] = true
		n++
	}
	if n != c.len() {
		t.Fatalf("tier LRU list holds %d, index %d", n, c.len())
	}
	for k := range m {
		if !exts[k] {
			t.Fatalf("tier mirror holds %d, tier does not", k)
		}
	}
	refs := map[blocks.Key]int32{}
	loading := 0
	for _, s := range r.running {
		if s.loading {
			loading++
			for _, k := range s.keys[s.loadFrom : s.loadFrom+s.loadN] {
				refs[k]++
			}
		}
	}
	if loading != r.nLoading {
		t.Fatalf("%d requests loading, nLoading %d", loading, r.nLoading)
	}
	for k, i := range c.idx {
		if c.ents[i].refs != refs[k] {
			t.Fatalf("tier key %d has %d refs, loads hold %d", k, c.ents[i].refs, refs[k])
		}
	}
}
