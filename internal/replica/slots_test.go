package replica

import (
	"errors"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// fresh returns n random tokens, the same for the same seed.
func fresh(seed uint64, n int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 99))
	out := make([]uint32, n)
	for i := range out {
		out[i] = 100 + rng.Uint32N(1<<20)
	}
	return out
}

// cat joins token runs into a new slice.
func cat(runs ...[]uint32) []uint32 {
	var out []uint32
	for _, r := range runs {
		out = append(out, r...)
	}
	return out
}

func keysOf(toks []uint32) []blocks.Key { return blocks.Keys(nil, toks, 16) }

// treq is a request for prompt toks (chain keys of 16-token blocks).
func treq(id uint64, toks []uint32, out int) *Request {
	return &Request{ID: id, Keys: keysOf(toks), PromptTokens: len(toks), OutputTokens: out}
}

// hits returns each request's hit tokens from its Admitted event.
func hits(ev []Event) map[uint64]int {
	m := map[uint64]int{}
	for _, e := range ev {
		if e.Kind == Admitted {
			m[e.RequestID] = e.HitTokens
		}
	}
	return m
}

// TestSlotChoice checks llama.cpp's slot selection: by similarity above the
// threshold, else the least recently released idle slot. Two 128-token
// prompts A and B warm slot 0 and slot 1 (A released first); then one
// request arrives.
func TestSlotChoice(t *testing.T) {
	A, B := fresh(1, 128), fresh(2, 128)
	tests := []struct {
		name     string
		sim      float64
		prompt   []uint32
		wantHit  int
		wantA    int // leading blocks of A cached afterwards
		wantB    int
		why      string
		wantSlot int
	}{
		{"similar to B", 0, cat(B[:96], fresh(3, 32)), 96, 8, 6,
			"shares 96 of slot 1's 128 tokens (0.75 > 0.5): slot 1, not the LRU slot 0", 1},
		{"too little of B", 0, cat(B[:48], fresh(3, 80)), 0, 0, 8,
			"shares 48 of 128 (0.375): the LRU slot 0, which holds A, so nothing is reused", 0},
		{"half of B is not more than half", 0, cat(B[:64], fresh(3, 64)), 0, 0, 8,
			"64/128 is not above 0.5: LRU", 0},
		{"similarity off", NoSlotSimilarity, cat(B[:96], fresh(3, 32)), 0, 0, 8,
			"with --slot-prompt-similarity 0 only LRU counts", 0},
		{"stricter threshold", 0.8, cat(B[:112], fresh(3, 16)), 112, 8, 7,
			"112/128 = 0.875 > 0.8", 1},
		{"A extended", 0, cat(A, fresh(3, 64)), 128, 8, 8,
			"all of slot 0: reused whole", 0},
		{"A again", 0, A, 127, 8, 8,
			"all of A, less the last token, recomputed for its logits", 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newReplica(t, Config{Profile: linear{kv: 2 * 1024}, Slots: 2, SlotSimilarity: tt.sim})
			ev := drive(t, r, []arrival{
				{0, treq(1, A, 1)}, {0, treq(2, B, 1)},
				{ms(10), treq(3, tt.prompt, 1)},
			})
			if got := hits(ev)[3]; got != tt.wantHit {
				t.Errorf("hit = %d, want %d: %s", got, tt.wantHit, tt.why)
			}
			if got := r.slots[tt.wantSlot].s; got != nil || !slices.Equal(r.slots[tt.wantSlot].keys, keysOf(tt.prompt)) {
				t.Errorf("slot %d does not hold the request's prompt: %s", tt.wantSlot, tt.why)
			}
			if got := r.CachedPrefix(keysOf(A)); got != tt.wantA {
				t.Errorf("A: %d blocks cached, want %d", got, tt.wantA)
			}
			if got := r.CachedPrefix(keysOf(B)); got != tt.wantB {
				t.Errorf("B: %d blocks cached, want %d", got, tt.wantB)
			}
		})
	}
}

// TestSlotDeferral checks that at most Slots requests run and the rest wait,
// in arrival order, each taking the first slot released.
func TestSlotDeferral(t *testing.T) {
	X := fresh(1, 64)
	r := newReplica(t, Config{Profile: linear{kv: 2 * 512}, Slots: 2, MaxRunning: 256})
	arr := []arrival{
		{0, treq(1, X, 10)}, {0, treq(2, fresh(2, 64), 20)},
		{0, treq(3, fresh(3, 64), 5)}, {0, treq(4, X, 5)},
	}
	for _, a := range arr {
		if err := r.Submit(a.req, t0); err != nil {
			t.Fatal(err)
		}
	}
	end, ev, _ := r.Step(t0, nil)
	if st := r.Stats(); st.Running != 2 || st.Waiting != 2 {
		t.Fatalf("after the first step: %d running, %d waiting; want 2 and 2", st.Running, st.Waiting)
	}
	all := append([]Event(nil), ev...)
	for now := end; ; {
		var busy bool
		now, ev, busy = r.Step(now, nil)
		all = append(all, ev...)
		if !busy {
			break
		}
	}
	running, peak := 0, 0
	admitted := map[uint64]time.Time{}
	finished := map[uint64]time.Time{}
	var order []uint64
	for _, e := range all {
		switch e.Kind {
		case Admitted:
			running++
			peak = max(peak, running)
			admitted[e.RequestID] = e.At
			order = append(order, e.RequestID)
		case Finished:
			running--
			finished[e.RequestID] = e.At
		}
	}
	if peak != 2 {
		t.Errorf("%d requests ran at once, want 2", peak)
	}
	if !slices.Equal(order, []uint64{1, 2, 3, 4}) {
		t.Errorf("admission order %v, want arrival order", order)
	}
	// #1 finishes first (10 tokens): #3 takes its slot at the next
	// iteration's start, which is #1's finish; #4 waits for the next release,
	// #3's (5 tokens after it started).
	if !admitted[3].Equal(finished[1]) {
		t.Errorf("#3 admitted at %v, want at #1's finish %v", admitted[3].Sub(t0), finished[1].Sub(t0))
	}
	if !admitted[4].Equal(finished[3]) {
		t.Errorf("#4 admitted at %v, want at #3's finish %v", admitted[4].Sub(t0), finished[3].Sub(t0))
	}
	// #4 repeats #1's prompt, but #3 overwrote that slot: nothing to reuse.
	if h := hits(all); h[4] != 0 {
		t.Errorf("#4 hit %d, want 0", h[4])
	}
}

// TestSlotsShareNothing checks that a request on one slot cannot use the
// same prefix held by another slot, and that a block stays reported while
// any slot holds it.
func TestSlotsShareNothing(t *testing.T) {
	A := fresh(1, 128)
	r := newReplica(t, Config{Profile: linear{kv: 2 * 1024}, Slots: 2})
	ev := drive(t, r, []arrival{
		{0, treq(1, A, 30)},                  // slot 0, decoding until ~32 ms
		{ms(2), treq(2, A, 30)},              // slot 0 busy: slot 1, computed again
		{ms(100), treq(3, fresh(2, 128), 1)}, // LRU: slot 0, overwriting one copy of A
	})
	if h := hits(ev); h[2] != 0 || h[3] != 0 {
		t.Errorf("hits %v, want none", h)
	}
	stored := 0
	for _, e := range ev {
		switch e.Kind {
		case BlocksStored:
			stored += len(e.Keys)
		case BlocksRemoved:
			t.Errorf("%s: slot 1 still holds A", show(e))
		}
	}
	if stored != 8+8 {
		t.Errorf("%d blocks stored, want A's 8 once and #3's 8", stored)
	}
	if got := r.CachedPrefix(keysOf(A)); got != 8 {
		t.Errorf("A: %d blocks cached, want 8 (slot 1)", got)
	}
	if st := r.Stats(); st.PromptTokensComputed != 3*128 {
		t.Errorf("%d prompt tokens computed, want 384", st.PromptTokensComputed)
	}
}

// TestSlotOverwrite checks the events of a prompt that keeps part of its
// slot's cache: the rest of the old prompt is removed deepest first at the
// iteration's start, the new blocks stored at its end.
func TestSlotOverwrite(t *testing.T) {
	A := fresh(1, 128)
	F := cat(A[:80], fresh(2, 48))
	ka, kf := keysOf(A), keysOf(F)
	r := newReplica(t, Config{Profile: linear{kv: 1024}, Slots: 1})
	ev := drive(t, r, []arrival{{0, treq(1, A, 1)}, {ms(10), treq(2, F, 1)}})
	got := showAll(ev, func(e Event) bool { return e.RequestID == 2 || e.Kind == BlocksRemoved || e.Kind == BlocksStored })
	want := []string{
		// #1: 128 tokens at t0 in 2.28 ms.
		show(Event{Kind: BlocksStored, At: t0.Add(ms(2.28)), Keys: ka}),
		show(Event{Kind: BlocksRemoved, At: t0.Add(ms(10)), Keys: []blocks.Key{ka[7], ka[6], ka[5]}}),
		show(Event{Kind: Admitted, At: t0.Add(ms(10)), RequestID: 2, HitTokens: 80}),
		// 48 new tokens: 1.48 ms.
		show(Event{Kind: BlocksStored, At: t0.Add(ms(11.48)), Keys: kf[5:], Parent: kf[4], HasParent: true}),
		show(Event{Kind: FirstToken, At: t0.Add(ms(11.48)), RequestID: 2}),
		show(Event{Kind: Finished, At: t0.Add(ms(11.48)), RequestID: 2, N: 1}),
	}
	diff(t, got, want)
	if n := r.CachedPrefix(ka); n != 5 {
		t.Errorf("A: %d blocks cached, want 5", n)
	}
}

// TestSlotTruncation checks a prompt longer than the slot's context: it is
// cut to its last part as llama.cpp cuts it (whole halves of the context
// from the front), reported in no cache event, and reused by the same prompt.
func TestSlotTruncation(t *testing.T) {
	T := fresh(1, 1500)
	r := newReplica(t, Config{Profile: linear{kv: 1024}, Slots: 1}) // 1024 tokens per slot
	ev := drive(t, r, []arrival{{0, treq(1, T, 4)}, {ms(100), treq(2, T, 1)}})
	for _, e := range ev {
		if e.Kind == BlocksStored || e.Kind == BlocksRemoved {
			t.Errorf("cache event %s for a truncated prompt", show(e))
		}
	}
	// 1500 − (1500−512)/512·512 = 988 tokens kept; the second reuses all
	// it shares in whole blocks (1,488 − 512 = 976).
	if h := hits(ev); h[1] != 0 || h[2] != 976 {
		t.Errorf("hits %v, want #1 0 and #2 976", h)
	}
	if st := r.Stats(); st.PromptTokensComputed != 988+12 || st.PrefixCacheQueries != 2*988 {
		t.Errorf("computed %d prompt tokens of %d queried, want 1000 of 1976", st.PromptTokensComputed, st.PrefixCacheQueries)
	}
	if n := r.CachedPrefix(keysOf(T)); n != 0 {
		t.Errorf("%d blocks of the truncated prompt reported cached", n)
	}
}

// TestSlotContextShift checks a decode that fills its slot: llama.cpp drops
// the first half of the slot's tokens and goes on; the slot then holds no
// prompt's prefix.
func TestSlotContextShift(t *testing.T) {
	P := fresh(1, 160)
	r := newReplica(t, Config{Profile: linear{kv: 256}, Slots: 1})
	ev := drive(t, r, []arrival{{0, treq(1, P, 120)}, {ms(1000), treq(2, P, 1)}})
	var removed []blocks.Key
	for _, e := range ev {
		if e.Kind == BlocksRemoved {
			removed = append(removed, e.Keys...)
		}
	}
	if len(removed) != 10 {
		t.Errorf("removed %d blocks, want the prompt's 10 at the shift", len(removed))
	}
	if h := hits(ev); h[2] != 0 {
		t.Errorf("#2 hit %d after the shift, want 0", h[2])
	}
	if st := r.Stats(); st.Finished != 2 || st.GenerationTokens != 121 {
		t.Errorf("finished %d, %d tokens; want 2 and 121", st.Finished, st.GenerationTokens)
	}
}

// recorder records the batches it prices (1 ms each).
type recorder struct {
	kv      int
	batches []costmodel.Batch
}

func (p *recorder) Name() string                             { return "recorder" }
func (p *recorder) KVCapacity() int                          { return p.kv }
func (p *recorder) Prefill(newTokens, seq int) time.Duration { return time.Millisecond }
func (p *recorder) Iteration(b costmodel.Batch) time.Duration {
	b.Prefill = slices.Clone(b.Prefill)
	p.batches = append(p.batches, b)
	return time.Millisecond
}

// TestSlotBatchSpan checks how a slot cache's iterations are priced: over
// every used KV cell, as llama.cpp's attention spans its shared buffer.
func TestSlotBatchSpan(t *testing.T) {
	p := &recorder{kv: 2 * 1024}
	r := newReplica(t, Config{Profile: p, Slots: 2, ChunkBudget: 100})
	drive(t, r, []arrival{
		{0, treq(1, fresh(1, 128), 1)},     // slot 0: two chunks (100 + 28)
		{ms(10), treq(2, fresh(2, 64), 3)}, // slot 1 (never used), beside slot 0's 128
	})
	want := []costmodel.Batch{
		{Prefill: []costmodel.Chunk{{New: 100, Seq: 100}}},
		{Prefill: []costmodel.Chunk{{New: 28, Seq: 128}}},
		{Prefill: []costmodel.Chunk{{New: 64, Seq: 128 + 64}}},
		{DecodeSeqs: 1, DecodeContext: 128 + 65},
		{DecodeSeqs: 1, DecodeContext: 128 + 66},
	}
	if len(p.batches) != len(want) {
		t.Fatalf("%d batches %+v, want %d", len(p.batches), p.batches, len(want))
	}
	for i := range want {
		g, w := p.batches[i], want[i]
		if !slices.Equal(g.Prefill, w.Prefill) || g.DecodeSeqs != w.DecodeSeqs || g.DecodeContext != w.DecodeContext {
			t.Errorf("batch %d = %+v, want %+v", i, g, w)
		}
	}
}

func TestSlotValidate(t *testing.T) {
	ok := Config{Profile: linear{kv: 1 << 14}, Slots: 2}
	ok.Default()
	if err := ok.Validate(); err != nil {
		t.Fatalf("slot config: %v", err)
	}
	if ok.SlotSimilarity != DefaultSlotSimilarity {
		t.Errorf("SlotSimilarity default %v, want %v", ok.SlotSimilarity, DefaultSlotSimilarity)
	}
	tests := []struct {
		name   string
		modify func(*Config)
		want   string
	}{
		{"negative", func(c *Config) { c.Slots = -1 }, "Slots must be 0 (a block cache) or positive, got -1"},
		{"tiny slots", func(c *Config) { c.Slots = 600 },
			"KV capacity of 16384 tokens split between 600 slots holds 1 blocks of 16 tokens per slot; need at least 2"},
		{"budget", func(c *Config) { c.Slots, c.ChunkBudget = 8, 4 },
			"ChunkBudget (4) must be at least Slots (8) so every decoding slot fits an iteration"},
		{"local", func(c *Config) { c.Local = LocalLPM },
			`Local must be "fcfs" with Slots (llama.cpp serves waiting requests in arrival order), got "lpm"`},
		{"similarity", func(c *Config) { c.SlotSimilarity = 1 }, "SlotSimilarity must be in [0, 1) or -1 (off), got 1"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := ok
			tt.modify(&c)
			err := c.Validate()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("Validate() = %v, want an ErrInvalidConfig", err)
			}
			if got, want := err.Error(), "replica: invalid config: "+tt.want; got != want {
				t.Errorf("Validate() = %q, want %q", got, want)
			}
		})
	}
	// A slot cache has no ErrTooLong: llama.cpp truncates.
	r := newReplica(t, Config{Profile: linear{kv: 64}, Slots: 1})
	if err := r.Submit(treq(1, fresh(1, 500), 100), t0); err != nil {
		t.Errorf("Submit of a prompt beyond the context: %v", err)
	}
}

// TestSlotCancelAndReset checks that a cancelled request's slot keeps what
// it computed, and that ResetPrefixCache empties every slot.
func TestSlotCancelAndReset(t *testing.T) {
	A := fresh(1, 128)
	r := newReplica(t, Config{Profile: linear{kv: 2048}, Slots: 2, ChunkBudget: 64})
	if err := r.Submit(treq(1, A, 5), t0); err != nil {
		t.Fatal(err)
	}
	now, ev, _ := r.Step(t0, nil) // 64 of 128 prompt tokens
	mirror := map[blocks.Key]bool{}
	applyCacheEvents(mirror, ev)
	if ev := r.Cancel(1, now); len(ev) != 1 || ev[0].Kind != Cancelled {
		t.Fatalf("Cancel = %v", ev)
	}
	if n := r.CachedPrefix(keysOf(A)); n != 4 {
		t.Errorf("%d blocks cached after cancelling at 64 tokens, want 4", n)
	}
	if err := r.Submit(treq(2, A, 1), now); err != nil {
		t.Fatal(err)
	}
	_, ev, _ = r.Step(now, nil)
	applyCacheEvents(mirror, ev)
	checkMirror(t, r, mirror)
	if h := hits(ev); h[2] != 64 {
		t.Errorf("hit %d, want the 64 tokens the cancelled request computed", h[2])
	}
	for {
		var busy bool
		now, ev, busy = r.Step(now, nil)
		applyCacheEvents(mirror, ev)
		if !busy {
			break
		}
	}
	ev, ok := r.ResetPrefixCache(now)
	if !ok {
		t.Fatal("ResetPrefixCache refused with nothing running")
	}
	applyCacheEvents(mirror, ev)
	checkMirror(t, r, mirror)
	if st := r.Stats(); st.CachedBlocks != 0 || st.KVUsage != 0 || st.FreeBlocks != st.TotalBlocks {
		t.Errorf("after reset: %+v", st)
	}
}

// BenchmarkStepSlots measures iterations of a 4-slot cache under a steady
// stream of requests over 8 system prompts: launches that keep or overwrite
// their slot's prefix, batched prefills and decodes, finishes.
func BenchmarkStepSlots(b *testing.B) {
	r := newReplica(b, Config{Profile: linear{kv: 4 * 4096}, Slots: 4, ChunkBudget: LlamaCppBatch})
	var systems [][]uint32
	for i := range 8 {
		systems = append(systems, fresh(uint64(i), 512))
	}
	rng := rand.New(rand.NewPCG(1, 2))
	var reqs []*Request
	for i := range 4096 {
		reqs = append(reqs, treq(uint64(i), cat(systems[rng.IntN(len(systems))], fresh(uint64(1000+i), 200)), 1+rng.IntN(100)))
	}
	now := t0
	ev := make([]Event, 0, 1024)
	next := 0
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if st := r.Stats(); st.Running+st.Waiting < 8 {
			q := reqs[next%len(reqs)]
			q.ID = uint64(next)
			next++
			if err := r.Submit(q, now); err != nil {
				b.Fatal(err)
			}
		}
		now, ev, _ = r.Step(now, ev[:0])
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "steps/s")
}
