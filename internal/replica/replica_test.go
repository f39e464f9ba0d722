package replica

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// linear is a cost profile simple enough to compute timelines by hand: an
// iteration costs 1 ms plus 10 µs per token computed (prefill tokens plus one
// per decode).
type linear struct{ kv int }

func (linear) Name() string { return "linear" }

func (linear) Prefill(newTokens, seqTokens int) time.Duration {
	return time.Millisecond + time.Duration(newTokens)*10*time.Microsecond
}

func (linear) Iteration(b costmodel.Batch) time.Duration {
	n := b.DecodeSeqs
	for _, c := range b.Prefill {
		n += c.New
	}
	return time.Millisecond + time.Duration(n)*10*time.Microsecond
}

func (p linear) KVCapacity() int { return p.kv }

var _ costmodel.Profile = linear{}

var t0 = time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)

func ms(x float64) time.Duration { return time.Duration(math.Round(x * float64(time.Millisecond))) }

// arrival is a request submitted at t0+at.
type arrival struct {
	at  time.Duration
	req *Request
}

func req(id uint64, prompt, output int, keys ...blocks.Key) *Request {
	return &Request{ID: id, Keys: keys, PromptTokens: prompt, OutputTokens: output}
}

// drive runs a replica on a virtual clock until every arrival is submitted
// and the replica is idle, checking after every call that the cache events
// mirror the cache. It returns every event.
func drive(t *testing.T, r *Replica, arrivals []arrival) []Event {
	t.Helper()
	mirror := map[blocks.Key]bool{}
	now := t0
	var all []Event
	next := 0
	for steps := 0; steps < 1_000_000; steps++ {
		for next < len(arrivals) && !t0.Add(arrivals[next].at).After(now) {
			if err := r.Submit(arrivals[next].req, t0.Add(arrivals[next].at)); err != nil {
				t.Fatalf("Submit: %v", err)
			}
			next++
		}
		end, ev, busy := r.Step(now, nil)
		applyCacheEvents(mirror, ev)
		checkMirror(t, r, mirror)
		all = append(all, ev...)
		if busy {
			now = end
			continue
		}
		if next == len(arrivals) {
			return all
		}
		now = t0.Add(arrivals[next].at)
	}
	t.Fatal("drive: no end")
	return nil
}

// applyCacheEvents applies the GPU cache's events (no Medium) to m.
func applyCacheEvents(m map[blocks.Key]bool, ev []Event) { applyTierEvents(m, ev, "") }

// applyTierEvents applies the events of one tier (medium; "" for the GPU
// cache) to m; AllCleared empties every tier.
func applyTierEvents(m map[blocks.Key]bool, ev []Event, medium string) {
	for _, e := range ev {
		if e.Kind != AllCleared && e.Medium != medium {
			continue
		}
		switch e.Kind {
		case BlocksStored:
			for _, k := range e.Keys {
				m[k] = true
			}
		case BlocksRemoved:
			for _, k := range e.Keys {
				delete(m, k)
			}
		case AllCleared:
			clear(m)
		}
	}
}

func checkMirror(t *testing.T, r *Replica, m map[blocks.Key]bool) {
	t.Helper()
	n, has := r.cache.len(), func(k blocks.Key) bool { return r.cache.lookup(k) != nilEntry }
	if r.slots != nil {
		n, has = len(r.slotRefs), func(k blocks.Key) bool { return r.slotRefs[k] > 0 }
	}
	if len(m) != n {
		t.Fatalf("mirror holds %d keys, cache %d", len(m), n)
	}
	for k := range m {
		if !has(k) {
			t.Fatalf("mirror holds key %d, cache does not", k)
		}
	}
}

// show renders an event compactly, its time relative to t0.
func show(e Event) string {
	at := e.At.Sub(t0).String()
	switch e.Kind {
	case Admitted:
		s := fmt.Sprintf("%s Admitted #%d hit=%d", at, e.RequestID, e.HitTokens)
		if e.Resumed {
			s += " resumed"
		}
		return s
	case FirstToken:
		return fmt.Sprintf("%s FirstToken #%d", at, e.RequestID)
	case Token, Finished, Preempted, Cancelled:
		return fmt.Sprintf("%s %v #%d n=%d", at, e.Kind, e.RequestID, e.N)
	case BlocksStored:
		s := fmt.Sprintf("%s Stored %v", at, e.Keys)
		if e.HasParent {
			s += fmt.Sprintf(" parent=%d", e.Parent)
		}
		return s
	case BlocksRemoved:
		return fmt.Sprintf("%s Removed %v", at, e.Keys)
	}
	return at + " " + e.Kind.String()
}

func showAll(ev []Event, keep func(Event) bool) []string {
	var out []string
	for _, e := range ev {
		if keep == nil || keep(e) {
			out = append(out, show(e))
		}
	}
	return out
}

func newReplica(t testing.TB, cfg Config) *Replica {
	t.Helper()
	r, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return r
}

func diff(t *testing.T, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Errorf("events:\ngot:\n\t%s\nwant:\n\t%s", strings.Join(got, "\n\t"), strings.Join(want, "\n\t"))
	}
}

// TestTimelines checks whole event timelines computed by hand with the linear
// profile (1 ms + 10 µs per token), blocks of 16 tokens.
func TestTimelines(t *testing.T) {
	big := linear{kv: 16 * 1024}
	tests := []struct {
		name     string
		cfg      Config
		arrivals []arrival
		keep     func(Event) bool
		want     []string
	}{{
		// 100 prompt tokens in one 512-token chunk: 1 + 100·0.01 = 2 ms to
		// the first token; each decode then 1.01 ms. 6 full blocks cached.
		name:     "one request",
		cfg:      Config{Profile: big},
		arrivals: []arrival{{0, req(1, 100, 3, 1, 2, 3, 4, 5, 6)}},
		want: []string{
			"0s Admitted #1 hit=0",
			"2ms Stored [1 2 3 4 5 6]",
			"2ms FirstToken #1",
			"3.01ms Token #1 n=2",
			"4.02ms Token #1 n=3",
			"4.02ms Finished #1 n=3",
		},
	}, {
		// #2 shares 4 blocks (64 tokens) with #1: it prefills 36 tokens in
		// 1.36 ms. #3 is #1's prompt exactly (96 tokens, all cached): the
		// last block is recomputed (hit 80, vLLM caps the hit at 95 tokens,
		// block-aligned) and, already cached, not stored again.
		name: "two sharing a prefix",
		cfg:  Config{Profile: big},
		arrivals: []arrival{
			{0, req(1, 100, 1, 1, 2, 3, 4, 5, 6)},
			{ms(5), req(2, 100, 1, 1, 2, 3, 4, 15, 16)},
			{ms(10), req(3, 96, 1, 1, 2, 3, 4, 5, 6)},
		},
		want: []string{
			"0s Admitted #1 hit=0",
			"2ms Stored [1 2 3 4 5 6]",
			"2ms FirstToken #1",
			"2ms Finished #1 n=1",
			"5ms Admitted #2 hit=64",
			"6.36ms Stored [15 16] parent=4",
			"6.36ms FirstToken #2",
			"6.36ms Finished #2 n=1",
			"10ms Admitted #3 hit=80",
			"11.16ms FirstToken #3",
			"11.16ms Finished #3 n=1",
		},
	}, {
		// Two identical prompts admitted together both miss; the second's
		// blocks are already cached by the first when it completes.
		name: "same prompt together",
		cfg:  Config{Profile: big},
		arrivals: []arrival{
			{0, req(1, 40, 1, 21, 22)},
			{0, req(2, 40, 1, 21, 22)},
		},
		want: []string{
			"0s Admitted #1 hit=0",
			"0s Admitted #2 hit=0",
			"1.8ms Stored [21 22]",
			"1.8ms FirstToken #1",
			"1.8ms Finished #1 n=1",
			"1.8ms FirstToken #2",
			"1.8ms Finished #2 n=1",
		},
	}, {
		// 8 blocks. #1 and #2 fill them (4 + 4 cached, unreferenced); LRU
		// order is 4 3 2 1 14 13 12 11 (released deepest first). #3 hits
		// 1 2 (32 tokens), needs one block: evicts leaf 4, and touches 1 2.
		// #4 needs 4 blocks with 1 free: evicts 3, then 14 13.
		name: "eviction under pressure",
		cfg:  Config{Profile: linear{kv: 8 * 16}},
		arrivals: []arrival{
			{0, req(1, 64, 1, 1, 2, 3, 4)},
			{ms(10), req(2, 64, 1, 11, 12, 13, 14)},
			{ms(15), req(3, 40, 1, 1, 2)},
			{ms(20), req(4, 64, 1, 21, 22, 23, 24)},
		},
		want: []string{
			"0s Admitted #1 hit=0",
			"1.64ms Stored [1 2 3 4]",
			"1.64ms FirstToken #1",
			"1.64ms Finished #1 n=1",
			"10ms Admitted #2 hit=0",
			"11.64ms Stored [11 12 13 14]",
			"11.64ms FirstToken #2",
			"11.64ms Finished #2 n=1",
			"15ms Removed [4]",
			"15ms Admitted #3 hit=32",
			"16.08ms FirstToken #3",
			"16.08ms Finished #3 n=1",
			"20ms Removed [3 14 13]",
			"20ms Admitted #4 hit=0",
			"21.64ms Stored [21 22 23 24]",
			"21.64ms FirstToken #4",
			"21.64ms Finished #4 n=1",
		},
	}, {
		// 6 blocks; two 16-token prompts generating 40 tokens each need 4
		// blocks apiece at the end. Prefill both: 1.32 ms. 32 decodes of
		// two: 1.02 ms each, to 33.96 ms, where both hold 3 blocks and #1
		// needs a 4th: #2, the youngest, is preempted after 33 tokens. #1
		// decodes alone (1.01 ms) 7 more times and finishes at 41.03 ms; #2
		// recomputes its prompt (block 2 still cached: hit 16) and 33 output
		// tokens, 1.33 ms, producing token 34, then 6 decodes to 48.42 ms.
		name: "preemption",
		cfg:  Config{Profile: linear{kv: 6 * 16}},
		arrivals: []arrival{
			{0, req(1, 16, 40, 1)},
			{0, req(2, 16, 40, 2)},
		},
		keep: func(e Event) bool { return e.Kind != Token || e.N >= 33 && e.RequestID == 2 },
		want: []string{
			"0s Admitted #1 hit=0",
			"0s Admitted #2 hit=0",
			"1.32ms Stored [1]",
			"1.32ms FirstToken #1",
			"1.32ms Stored [2]",
			"1.32ms FirstToken #2",
			"33.96ms Token #2 n=33",
			"33.96ms Preempted #2 n=33",
			"41.03ms Finished #1 n=40",
			"41.03ms Admitted #2 hit=16 resumed",
			"42.36ms Token #2 n=34",
			"43.37ms Token #2 n=35",
			"44.38ms Token #2 n=36",
			"45.39ms Token #2 n=37",
			"46.4ms Token #2 n=38",
			"47.41ms Token #2 n=39",
			"48.42ms Token #2 n=40",
			"48.42ms Finished #2 n=40",
		},
	}, {
		// 4 blocks. #1 (1 block) and #2 (2 blocks) leave 1 free, which #1's
		// first decode takes (its sequence reaches 17 tokens). At 9.56 ms
		// (prefill 1.40 ms, 8 decodes of two) #2, the youngest, needs a
		// third block and preempts itself; #1 finishes alone (1.01 ms); #2
		// recomputes 33 - 16 cached = 17 tokens (1.17 ms) for token 10,
		// then decodes 10 more tokens.
		name: "self-preemption",
		cfg:  Config{Profile: linear{kv: 4 * 16}},
		arrivals: []arrival{
			{0, req(1, 16, 10, 1)},
			{0, req(2, 24, 20, 2)},
		},
		keep: func(e Event) bool { return e.Kind != Token || e.RequestID == 2 && (e.N == 9 || e.N == 10) },
		want: []string{
			"0s Admitted #1 hit=0",
			"0s Admitted #2 hit=0",
			"1.4ms Stored [1]",
			"1.4ms FirstToken #1",
			"1.4ms Stored [2]",
			"1.4ms FirstToken #2",
			"9.56ms Token #2 n=9",
			"9.56ms Preempted #2 n=9",
			"10.57ms Finished #1 n=10",
			"10.57ms Admitted #2 hit=16 resumed",
			"11.74ms Token #2 n=10",
			"21.84ms Finished #2 n=20",
		},
	}, {
		// 1000 prompt tokens in chunks of 512: 6.12 + 5.88 ms.
		name:     "chunked",
		cfg:      Config{Profile: big, ChunkBudget: 512},
		arrivals: []arrival{{0, req(1, 1000, 2)}},
		want: []string{
			"0s Admitted #1 hit=0",
			"12ms FirstToken #1",
			"13.01ms Token #1 n=2",
			"13.01ms Finished #1 n=2",
		},
	}, {
		name:     "unchunked",
		cfg:      Config{Profile: big, ChunkBudget: NoChunking},
		arrivals: []arrival{{0, req(1, 1000, 2)}},
		want: []string{
			"0s Admitted #1 hit=0",
			"11ms FirstToken #1",
			"12.01ms Token #1 n=2",
			"12.01ms Finished #1 n=2",
		},
	}, {
		// #2 arrives while #1 decodes. Chunked: each iteration carries #1's
		// decode and 511 then 489 prompt tokens (6.12, 5.90 ms), so #1 keeps
		// producing tokens; unchunked (next case) stalls #1 for 11.01 ms.
		name: "chunked prefill beside a decode",
		cfg:  Config{Profile: big, ChunkBudget: 512},
		arrivals: []arrival{
			{0, req(1, 16, 10)},
			{ms(2), req(2, 1000, 1)},
		},
		keep: func(e Event) bool { return e.Kind != Token || e.N <= 4 },
		want: []string{
			"0s Admitted #1 hit=0",
			"1.16ms FirstToken #1",
			"2.17ms Token #1 n=2",
			"2.17ms Admitted #2 hit=0",
			"8.29ms Token #1 n=3",
			"14.19ms Token #1 n=4",
			"14.19ms FirstToken #2",
			"14.19ms Finished #2 n=1",
			"20.25ms Finished #1 n=10",
		},
	}, {
		name: "unchunked prefill beside a decode",
		cfg:  Config{Profile: big, ChunkBudget: NoChunking},
		arrivals: []arrival{
			{0, req(1, 16, 10)},
			{ms(2), req(2, 1000, 1)},
		},
		keep: func(e Event) bool { return e.Kind != Token || e.N <= 4 },
		want: []string{
			"0s Admitted #1 hit=0",
			"1.16ms FirstToken #1",
			"2.17ms Token #1 n=2",
			"2.17ms Admitted #2 hit=0",
			"13.18ms Token #1 n=3",
			"13.18ms FirstToken #2",
			"13.18ms Finished #2 n=1",
			"14.19ms Token #1 n=4",
			"20.25ms Finished #1 n=10",
		},
	}}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newReplica(t, tt.cfg)
			got := showAll(drive(t, r, tt.arrivals), tt.keep)
			diff(t, got, tt.want)
			if st := r.Stats(); st.Running != 0 || st.Waiting != 0 || st.KVUsage != 0 {
				t.Errorf("after the run: %+v, want idle with no blocks held", st)
			}
		})
	}
}

func TestEvictionLeavesCache(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 8 * 16}})
	drive(t, r, []arrival{
		{0, req(1, 64, 1, 1, 2, 3, 4)},
		{ms(10), req(2, 64, 1, 11, 12, 13, 14)},
		{ms(15), req(3, 40, 1, 1, 2)},
		{ms(20), req(4, 64, 1, 21, 22, 23, 24)},
	})
	for _, tc := range []struct {
		keys []blocks.Key
		want int
	}{
		{[]blocks.Key{1, 2, 3, 4}, 2},
		{[]blocks.Key{11, 12, 13, 14}, 2},
		{[]blocks.Key{21, 22, 23, 24}, 4},
	} {
		if got := r.CachedPrefix(tc.keys); got != tc.want {
			t.Errorf("CachedPrefix(%v) = %d, want %d", tc.keys, got, tc.want)
		}
	}
	st := r.Stats()
	if st.CachedBlocks != 8 || st.EvictableBlocks != 8 || st.FreeBlocks != 0 {
		t.Errorf("Stats = %+v, want 8 cached evictable blocks, none free", st)
	}
	if st.PrefixCacheQueries != 232 || st.PrefixCacheHits != 32 {
		t.Errorf("prefix cache queries/hits = %d/%d, want 232/32", st.PrefixCacheQueries, st.PrefixCacheHits)
	}
}

func TestPreemptionStats(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 6 * 16}})
	drive(t, r, []arrival{{0, req(1, 16, 40, 1)}, {0, req(2, 16, 40, 2)}})
	st := r.Stats()
	want := Stats{TotalBlocks: 6, FreeBlocks: 4, CachedBlocks: 2, EvictableBlocks: 2,
		PrefixCacheQueries: 16 + 16 + 49, PrefixCacheHits: 16, Preemptions: 1, Admissions: 3,
		Finished: 2, Iterations: 1 + 32 + 7 + 1 + 6, PromptTokensComputed: 16 + 16 + 33,
		GenerationTokens: 80, BusyTime: ms(48.42)} // no token is produced twice
	if st != want {
		t.Errorf("Stats =\n%+v, want\n%+v", st, want)
	}
}

// TestLocalOrder checks the order in which each local scheduler admits
// requests waiting together. The cache holds blocks 1 2 3 4.
func TestLocalOrder(t *testing.T) {
	warm := arrival{0, req(100, 64, 1, 1, 2, 3, 4)} // done at 1.64 ms
	admissions := func(ev []Event) []string {
		return showAll(ev, func(e Event) bool { return e.Kind == Admitted && e.RequestID != 100 })
	}
	t.Run("lpm", func(t *testing.T) {
		// #9 holds the only running slot from 2 ms to 7.2 ms (1.16 + 4·1.01);
		// #1, #2, #3 match 0, 2 and 3 cached blocks.
		for _, tc := range []struct {
			local string
			want  []string
		}{
			{LocalLPM, []string{"2ms Admitted #9 hit=0", "7.2ms Admitted #3 hit=48",
				"8.36ms Admitted #2 hit=32", "9.68ms Admitted #1 hit=0"}},
			{LocalFCFS, []string{"2ms Admitted #9 hit=0", "7.2ms Admitted #1 hit=0",
				"8.84ms Admitted #2 hit=32", "10.16ms Admitted #3 hit=48"}},
		} {
			t.Run(tc.local, func(t *testing.T) {
				r := newReplica(t, Config{Profile: linear{kv: 16 * 64}, Local: tc.local, MaxRunning: 1})
				ev := drive(t, r, []arrival{warm,
					{ms(2), req(9, 16, 5, 90)},
					{ms(3), req(1, 64, 1, 51, 52, 53, 54)},
					{ms(3), req(2, 64, 1, 1, 2, 61, 62)},
					{ms(3), req(3, 64, 1, 1, 2, 3, 71)},
				})
				diff(t, admissions(ev), tc.want)
			})
		}
	})
	t.Run("priority", func(t *testing.T) {
		// Hit ratios 0, 64/128 and 64/65: groups 0, 4 and 9. The turn is
		// at 9 (the warm-up was served from group 0): #3 (1 token, 1.01 ms),
		// then #2 (64 tokens, 1.64 ms), then #1. FCFS admits all at once.
		arr := []arrival{warm,
			{ms(5), req(1, 64, 1, 81, 82, 83, 84)},
			{ms(5), req(2, 128, 1, 1, 2, 3, 4, 31, 32, 33, 34)},
			{ms(5), req(3, 65, 1, 1, 2, 3, 4)},
		}
		r := newReplica(t, Config{Profile: linear{kv: 16 * 64}, Local: LocalPriority})
		diff(t, admissions(drive(t, r, arr)), []string{
			"5ms Admitted #3 hit=64", "6.01ms Admitted #2 hit=64", "7.65ms Admitted #1 hit=0"})
		r = newReplica(t, Config{Profile: linear{kv: 16 * 64}})
		diff(t, admissions(drive(t, r, arr)), []string{
			"5ms Admitted #1 hit=0", "5ms Admitted #2 hit=64", "5ms Admitted #3 hit=64"})
	})
	t.Run("priority quota", func(t *testing.T) {
		// Group 0 admits at most 10 on its turn: 10 at 0 (160 tokens, 2.6
		// ms), then the turn comes round to group 0 again for the last 2.
		var arr []arrival
		for i := range 12 {
			arr = append(arr, arrival{0, req(uint64(i+1), 16, 1)})
		}
		r := newReplica(t, Config{Profile: linear{kv: 16 * 64}, Local: LocalPriority})
		var at []string
		for _, e := range drive(t, r, arr) {
			if e.Kind == Admitted {
				at = append(at, e.At.Sub(t0).String())
			}
		}
		want := slices.Repeat([]string{"0s"}, 10)
		want = append(want, "2.6ms", "2.6ms")
		if !slices.Equal(at, want) {
			t.Errorf("admission times %v, want %v", at, want)
		}
	})
}

func TestPriorityGroup(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 16 * 64}, Local: LocalPriority})
	keys := []blocks.Key{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for _, tc := range []struct {
		cached, prompt, want int // cached blocks of 16 tokens
	}{
		{0, 160, 0},
		{1, 160, 0}, // 0.1
		{3, 160, 2}, // exactly 0.3: ceil(3) - 1
		{4, 159, 4}, // 64/159 = 0.40…: ceil(4.02) - 1
		{9, 160, 8},
		{10, 160, 9},
		{10, 161, 9},
	} {
		r.cache = newPrefixCache()
		for _, k := range keys[:tc.cached] {
			r.cache.unpin(r.cache.insert(k, k, nilEntry))
		}
		s := &seq{req: &Request{Keys: keys, PromptTokens: tc.prompt}, keys: keys}
		if got := r.groupOf(s); got != tc.want {
			t.Errorf("%d cached blocks of a %d-token prompt: group %d, want %d", tc.cached, tc.prompt, got, tc.want)
		}
	}
}

func TestCancel(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 16 * 16}, MaxRunning: 1})
	if err := r.Submit(req(1, 64, 100, 1, 2, 3, 4), t0); err != nil {
		t.Fatal(err)
	}
	if err := r.Submit(req(2, 64, 100, 5, 6, 7, 8), t0); err != nil {
		t.Fatal(err)
	}
	now := t0
	for range 3 {
		now, _, _ = r.Step(now, nil)
	}
	st := r.Stats()
	if st.Running != 1 || st.Waiting != 1 || st.KVUsage != 5.0/16 {
		t.Fatalf("before Cancel: %+v, want #1 running on 5 of 16 blocks and #2 waiting", st)
	}
	got := r.Cancel(1, now)
	want := []Event{{Kind: Cancelled, At: now, RequestID: 1, N: 3}}
	if !slices.EqualFunc(got, want, func(a, b Event) bool { return show(a) == show(b) }) {
		t.Errorf("Cancel(1) = %v, want %v", got, want)
	}
	st = r.Stats()
	if st.Running != 0 || st.KVUsage != 0 || st.EvictableBlocks != 4 || st.FreeBlocks != 12 {
		t.Errorf("after Cancel(1): %+v, want nothing held, 4 cached blocks evictable", st)
	}
	if got := r.Cancel(2, now); len(got) != 1 || got[0].N != 0 {
		t.Errorf("Cancel(2) = %v, want one Cancelled event with N=0", got)
	}
	if got := r.Cancel(2, now); got != nil {
		t.Errorf("Cancel(2) twice = %v, want nil", got)
	}
	if _, ev, busy := r.Step(now, nil); busy || len(ev) != 0 {
		t.Errorf("Step after cancelling everything: busy=%v events=%v, want idle", busy, ev)
	}
	if st := r.Stats(); st.Cancelled != 2 || st.Waiting != 0 {
		t.Errorf("Stats = %+v, want 2 cancelled, none waiting", st)
	}
}

func TestResetPrefixCache(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 16 * 16}})
	if err := r.Submit(req(1, 32, 2, 1, 2), t0); err != nil {
		t.Fatal(err)
	}
	end, _, _ := r.Step(t0, nil)
	if _, ok := r.ResetPrefixCache(end); ok {
		t.Error("ResetPrefixCache succeeded with a request running")
	}
	end, _, _ = r.Step(end, nil)
	ev, ok := r.ResetPrefixCache(end)
	if !ok || len(ev) != 1 || ev[0].Kind != AllCleared {
		t.Fatalf("ResetPrefixCache = %v, %v; want one AllCleared event", ev, ok)
	}
	if st := r.Stats(); st.CachedBlocks != 0 || st.FreeBlocks != 16 {
		t.Errorf("after reset: %+v, want an empty cache", st)
	}
}

func TestSubmitErrors(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 16 * 8}})
	if err := r.Submit(req(1, 16, 1), t0); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req  *Request
		want error
	}{
		{req(2, 16, 0), ErrInvalidRequest},
		{req(2, 0, 1), ErrInvalidRequest},
		{req(2, 31, 1, 1, 2), ErrInvalidRequest},
		{req(1, 16, 1), ErrDuplicateID},
		{req(2, 100, 14), ErrTooLong}, // 113 tokens of KV: 8 blocks, + 1 > 8
		{req(2, 100, 13), nil},
	} {
		if err := r.Submit(tc.req, t0); !errors.Is(err, tc.want) {
			t.Errorf("Submit(%+v) = %v, want %v", *tc.req, err, tc.want)
		}
	}
}

func TestValidate(t *testing.T) {
	ok := DefaultConfig()
	ok.Profile = linear{kv: 1 << 20}
	ok.Default()
	if err := ok.Validate(); err != nil {
		t.Fatalf("default config with a profile: %v", err)
	}
	tests := []struct {
		name   string
		modify func(*Config)
		want   string
	}{
		{"no profile", func(c *Config) { c.Profile = nil }, "Profile is nil"},
		{"block size", func(c *Config) { c.BlockSize = 0 }, "BlockSize must be at least 1, got 0"},
		{"capacity", func(c *Config) { c.KVCapacity = -1 }, "KVCapacity must be 0 (the profile's) or positive, got -1"},
		{"tiny capacity", func(c *Config) { c.KVCapacity = 31 }, "KV capacity of 31 tokens holds 1 blocks of 16 tokens; need at least 2"},
		{"tiny profile", func(c *Config) { c.Profile = linear{kv: 16} }, "KV capacity of 16 tokens holds 1 blocks of 16 tokens; need at least 2"},
		{"max running", func(c *Config) { c.MaxRunning = 0 }, "MaxRunning must be at least 1, got 0"},
		{"budget", func(c *Config) { c.ChunkBudget = -2 }, "ChunkBudget must be positive or -1 (no chunking), got -2"},
		{"budget below max running", func(c *Config) { c.ChunkBudget = 100 }, "ChunkBudget (100) must be at least MaxRunning (256) so every running decode fits an iteration"},
		{"local", func(c *Config) { c.Local = "sjf" }, `Local must be "fcfs", "lpm" or "priority", got "sjf"`},
		{"groups", func(c *Config) { c.PriorityGroups = 0 }, "PriorityGroups must be at least 1, got 0"},
		{"quota", func(c *Config) { c.PriorityQuota = -1 }, "PriorityQuota must be at least 1, got -1"},
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
	if _, err := New(Config{}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("New(Config{}) = %v, want ErrInvalidConfig", err)
	}
	r, err := New(Config{Profile: linear{kv: 1000}, ChunkBudget: NoChunking})
	if err != nil {
		t.Fatal(err)
	}
	if c := r.Config(); c.BlockSize != 16 || c.MaxRunning != 256 || c.Local != LocalFCFS || c.ChunkBudget != NoChunking {
		t.Errorf("defaults not filled: %+v", c)
	}
	if st := r.Stats(); st.TotalBlocks != 62 {
		t.Errorf("TotalBlocks = %d, want 1000/16 = 62", st.TotalBlocks)
	}
}

// BenchmarkStep measures one decode iteration of 64 running requests (64
// tokens appended to a reused event buffer, a block taken every 16 steps).
func BenchmarkStep(b *testing.B) {
	r := newReplica(b, Config{Profile: linear{kv: 1 << 30}})
	for i := range 64 {
		keys := []blocks.Key{blocks.Key(1000 + i), blocks.Key(2000 + i)}
		if err := r.Submit(req(uint64(i), 40, 1<<22, keys...), t0); err != nil {
			b.Fatal(err)
		}
	}
	now := t0
	ev := make([]Event, 0, 256)
	now, ev, _ = r.Step(now, ev[:0]) // the prefill
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		now, ev, _ = r.Step(now, ev[:0])
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "steps/s")
}

// BenchmarkStepChurn measures iterations under a steady stream of requests
// sharing prefixes on a cache small enough to evict: admissions, chunked
// prefills, stored and removed blocks, finishes.
func BenchmarkStepChurn(b *testing.B) {
	r := newReplica(b, Config{Profile: linear{kv: 2048 * 16}, Local: LocalLPM})
	rng := rand.New(rand.NewPCG(1, 2))
	var systems [][]uint32
	for range 8 {
		tok := make([]uint32, 512)
		for i := range tok {
			tok[i] = rng.Uint32()
		}
		systems = append(systems, tok)
	}
	var reqs []*Request
	for i := range 4096 {
		tok := append([]uint32(nil), systems[rng.IntN(len(systems))]...)
		for range 200 {
			tok = append(tok, rng.Uint32())
		}
		reqs = append(reqs, req(uint64(i), len(tok), 1+rng.IntN(100), blocks.Keys(nil, tok, 16)...))
	}
	now := t0
	ev := make([]Event, 0, 1024)
	next := 0
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if st := r.Stats(); st.Running+st.Waiting < 96 {
			q := reqs[next%len(reqs)]
			q.ID = uint64(next)
			next++
			if err := r.Submit(q, now); err != nil {
				b.Fatal(err)
			}
		}
		now, ev, _ = r.Step(now, ev[:0])
	}
}
