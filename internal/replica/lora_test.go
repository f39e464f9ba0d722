package replica

import (
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// loraLinear is the linear test profile with an adapter load of 1 GB/s plus
// 5 ms: a 10 MB adapter loads in 15 ms.
type loraLinear struct{ linear }

func (loraLinear) AdapterLoad() costmodel.AdapterLoad {
	return costmodel.AdapterLoad{HostToDeviceBytesPerSecond: 1e9, FixedMS: 5}
}

const adapterBytes = 10_000_000 // 15 ms on loraLinear

func loraReq(id uint64, adapter string, prompt, output int, keys ...blocks.Key) *Request {
	r := req(id, prompt, output, keys...)
	r.Adapter, r.AdapterBytes = adapter, adapterBytes
	return r
}

// runLoRA submits arrivals on a virtual clock and steps the replica until
// it is idle, returning every event.
func runLoRA(t *testing.T, r *Replica, arrivals []arrival) []Event {
	t.Helper()
	now, next := t0, 0
	var all []Event
	for steps := 0; steps < 100_000; steps++ {
		for next < len(arrivals) && !t0.Add(arrivals[next].at).After(now) {
			if err := r.Submit(arrivals[next].req, now); err != nil {
				t.Fatalf("Submit: %v", err)
			}
			next++
		}
		end, ev, busy := r.Step(now, nil)
		all = append(all, ev...)
		switch {
		case busy:
			now = end
		case next < len(arrivals):
			now = t0.Add(arrivals[next].at)
		default:
			return all
		}
	}
	t.Fatal("replica never went idle")
	return nil
}

// firstTokens returns each request's first-token time, relative to t0.
func firstTokens(ev []Event) map[uint64]time.Duration {
	m := map[uint64]time.Duration{}
	for _, e := range ev {
		if e.Kind == FirstToken {
			m[e.RequestID] = e.At.Sub(t0)
		}
	}
	return m
}

func newLoRAReplica(t *testing.T, maxLoras int) *Replica {
	return newReplica(t, Config{Profile: loraLinear{linear{kv: 16 * 1024}}, MaxLoras: maxLoras, ChunkBudget: 4096, MaxRunning: 64})
}

// TestAdapterLoadWait: a request whose adapter is not loaded waits for the
// load (15 ms) on top of its prefill (1 ms + 160·10 µs); once loaded, the
// next request of that adapter does not, nor does a base-model request.
func TestAdapterLoadWait(t *testing.T) {
	r := newLoRAReplica(t, 2)
	ev := runLoRA(t, r, []arrival{
		{0, loraReq(1, "a", 160, 1)},
		{100 * time.Millisecond, loraReq(2, "a", 160, 1)},
		{200 * time.Millisecond, req(3, 160, 1)},
	})
	got := firstTokens(ev)
	want := map[uint64]time.Duration{1: ms(2.6 + 15), 2: 100*time.Millisecond + ms(2.6), 3: 200*time.Millisecond + ms(2.6)}
	for id, w := range want {
		if got[id] != w {
			t.Errorf("request %d: first token at %v, want %v", id, got[id], w)
		}
	}
	st := r.Stats()
	if st.AdapterLoads != 1 || st.AdapterEvictions != 0 || st.AdapterLoadTime != 15*time.Millisecond {
		t.Errorf("stats: %d loads, %d evictions, %v load time; want 1, 0, 15ms", st.AdapterLoads, st.AdapterEvictions, st.AdapterLoadTime)
	}
}

// TestAdapterLRU: with two slots, a, b, a, c evicts b (a was used since);
// then b evicts a (c is more recent).
func TestAdapterLRU(t *testing.T) {
	r := newLoRAReplica(t, 2)
	var arr []arrival
	for i, a := range []string{"a", "b", "a", "c", "b"} {
		arr = append(arr, arrival{time.Duration(i) * 100 * time.Millisecond, loraReq(uint64(i), a, 32, 1)})
	}
	ev := runLoRA(t, r, arr)
	var got []string
	for _, e := range ev {
		switch e.Kind {
		case AdapterLoaded:
			got = append(got, "load "+e.Adapter)
		case AdapterEvicted:
			got = append(got, "evict "+e.Adapter)
		}
	}
	want := []string{"load a", "load b", "evict b", "load c", "evict a", "load b"}
	if !slices.Equal(got, want) {
		t.Errorf("adapter events %q, want %q", got, want)
	}
	if got, want := r.Adapters(nil), []string{"b", "c"}; !slices.Equal(got, want) {
		t.Errorf("Adapters() = %q, want %q (most recently used first)", got, want)
	}
}

// TestAdapterInUseNotEvicted: with one slot held by a running request of
// adapter a, a request for b waits (it is skipped, not blocking the queue:
// a later request for a is admitted past it) until no request of a runs.
func TestAdapterInUseNotEvicted(t *testing.T) {
	r := newLoRAReplica(t, 1)
	ev := runLoRA(t, r, []arrival{
		{0, loraReq(1, "a", 32, 20)},
		{time.Millisecond, loraReq(2, "b", 32, 1)},
		{time.Millisecond, loraReq(3, "a", 32, 1)},
	})
	var order []uint64
	admitted := map[uint64]time.Time{}
	finished := map[uint64]time.Time{}
	for _, e := range ev {
		switch e.Kind {
		case Admitted:
			order = append(order, e.RequestID)
			admitted[e.RequestID] = e.At
		case Finished:
			finished[e.RequestID] = e.At
		}
	}
	if want := []uint64{1, 3, 2}; !slices.Equal(order, want) {
		t.Errorf("admission order %v, want %v", order, want)
	}
	if admitted[2].Before(finished[1]) || admitted[2].Before(finished[3]) {
		t.Errorf("b admitted at %v, before a's requests finished (%v, %v)", admitted[2].Sub(t0), finished[1].Sub(t0), finished[3].Sub(t0))
	}
	if st := r.Stats(); st.AdapterLoads != 2 || st.AdapterEvictions != 1 {
		t.Errorf("%d loads and %d evictions, want 2 and 1", st.AdapterLoads, st.AdapterEvictions)
	}
}

// TestAdapterCacheApart: the same block keys under two adapters and the base
// model never hit each other's cache; they do hit their own.
func TestAdapterCacheApart(t *testing.T) {
	r := newLoRAReplica(t, 4)
	keys := []blocks.Key{11, 12, 13, 14}
	mk := func(id uint64, adapter string) *Request {
		q := loraReq(id, adapter, 80, 1, keys...)
		if adapter == "" {
			q.AdapterBytes = 0
		}
		return q
	}
	ev := runLoRA(t, r, []arrival{
		{0, mk(1, "a")},
		{100 * time.Millisecond, mk(2, "b")},
		{200 * time.Millisecond, mk(3, "")},
		{300 * time.Millisecond, mk(4, "a")},
		{400 * time.Millisecond, mk(5, "")},
	})
	hits := map[uint64]int{}
	for _, e := range ev {
		if e.Kind == Admitted {
			hits[e.RequestID] = e.HitTokens
		}
	}
	want := map[uint64]int{1: 0, 2: 0, 3: 0, 4: 64, 5: 64}
	for id, w := range want {
		if hits[id] != w {
			t.Errorf("request %d: hit %d tokens, want %d", id, hits[id], w)
		}
	}
	if got := r.CachedPrefixFor("b", keys); got != 4 {
		t.Errorf("CachedPrefixFor(b) = %d, want 4", got)
	}
	if got := r.CachedPrefixFor("zzz", keys); got != 0 {
		t.Errorf("CachedPrefixFor(zzz) = %d, want 0", got)
	}
	for _, e := range ev {
		if e.Kind == BlocksStored && e.Keys[0] != 11 {
			t.Errorf("BlocksStored reports %v, want the request's keys", e.Keys)
		}
	}
}

// TestAdapterUnlimited: MaxLoras 0 loads nothing and waits for nothing, but
// keeps caches apart.
func TestAdapterUnlimited(t *testing.T) {
	r := newLoRAReplica(t, 0)
	ev := runLoRA(t, r, []arrival{{0, loraReq(1, "a", 160, 1)}})
	if got := firstTokens(ev)[1]; got != ms(2.6) {
		t.Errorf("first token at %v, want 2.6ms", got)
	}
	if st := r.Stats(); st.AdapterLoads != 0 {
		t.Errorf("%d adapter loads, want 0", st.AdapterLoads)
	}
}

func TestAdapterConfig(t *testing.T) {
	for _, c := range []Config{
		{Profile: linear{kv: 1024}, MaxLoras: -1},
		{Profile: linear{kv: 1024}, MaxLoras: 2, Slots: 2, ChunkBudget: 64},
	} {
		if _, err := New(c); err == nil {
			t.Errorf("New(MaxLoras %d, Slots %d): no error", c.MaxLoras, c.Slots)
		}
	}
	r := newReplica(t, Config{Profile: linear{kv: 1024}, Slots: 2, ChunkBudget: 64})
	if err := r.Submit(loraReq(1, "a", 16, 1), t0); err == nil {
		t.Error("Submit of an adapter request to a slot cache: no error")
	}
}

// TestRunningWaitingAdapters: what vllm:lora_requests_info would report
// while adapter a's request runs in the only slot: a running, and the
// waiting requests' adapters b and c (each once, in queue order, the base
// model left out); with MaxLoras 0 nothing.
func TestRunningWaitingAdapters(t *testing.T) {
	r := newLoRAReplica(t, 1)
	for _, q := range []*Request{loraReq(1, "a", 32, 20), loraReq(2, "b", 32, 1), req(3, 32, 1), loraReq(4, "c", 32, 1), loraReq(5, "b", 32, 1)} {
		if err := r.Submit(q, t0); err != nil {
			t.Fatal(err)
		}
	}
	if _, _, busy := r.Step(t0, nil); !busy {
		t.Fatal("idle after submits")
	}
	if got := r.RunningAdapters(nil); !slices.Equal(got, []string{"a"}) {
		t.Errorf("running %q, want [a]", got)
	}
	if got := r.WaitingAdapters([]string{"x"}); !slices.Equal(got, []string{"x", "b", "c"}) {
		t.Errorf("waiting (appended to [x]) %q, want [x b c]", got)
	}
	u := newLoRAReplica(t, 0)
	if err := u.Submit(loraReq(1, "a", 32, 1), t0); err != nil {
		t.Fatal(err)
	}
	if got := u.WaitingAdapters(nil); len(got) != 0 {
		t.Errorf("MaxLoras 0: waiting %q, want none", got)
	}
}
