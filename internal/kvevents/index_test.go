package kvevents

import (
	"errors"
	"reflect"
	"slices"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// recSink is a Sink that keeps the set of keys each medium holds, as a router
// would, and logs every call.
type recSink struct {
	mu      sync.Mutex // guards all fields
	held    map[string]map[blocks.Key]bool
	calls   []string
	cleared int
	stored  []storedCall
	notify  chan struct{}
}

type storedCall struct {
	parent    blocks.Key
	hasParent bool
	keys      []blocks.Key
	medium    string
}

func newRecSink() *recSink {
	return &recSink{held: map[string]map[blocks.Key]bool{}, notify: make(chan struct{}, 1)}
}

func (s *recSink) poke() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

func (s *recSink) Stored(_ string, parent blocks.Key, hasParent bool, keys []blocks.Key, medium string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held[medium] == nil {
		s.held[medium] = map[blocks.Key]bool{}
	}
	for _, k := range keys {
		s.held[medium][k] = true
	}
	s.calls = append(s.calls, "stored")
	s.stored = append(s.stored, storedCall{parent, hasParent, slices.Clone(keys), medium})
	s.poke()
}

func (s *recSink) Removed(_ string, keys []blocks.Key, medium string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		delete(s.held[medium], k)
	}
	s.calls = append(s.calls, "removed")
	s.poke()
}

func (s *recSink) Cleared(string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	clear(s.held)
	s.cleared++
	s.calls = append(s.calls, "cleared")
	s.poke()
}

func (s *recSink) keys(medium string) []blocks.Key {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []blocks.Key
	for k := range s.held[medium] {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

func toks(start, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(start + i)
	}
	return t
}

func TestIndexStoredChains(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	prompt := toks(100, 12) // three blocks of 4
	want := blocks.Keys(nil, prompt, 4)
	// The first two blocks in one event, the third chained after block 2.
	_, err := ix.Apply("r1", []Event{
		BlockStored{BlockHashes: []uint64{11, 12}, TokenIDs: prompt[:8], BlockSize: 4, Medium: MediumGPU},
		BlockStored{BlockHashes: []uint64{13}, ParentHash: 12, HasParent: true, TokenIDs: prompt[8:], BlockSize: 4},
	}, sink)
	if err != nil {
		t.Fatal(err)
	}
	for i, h := range []uint64{11, 12, 13} {
		got, ok := ix.Lookup("r1", "", h)
		if !ok || got != want[i] {
			t.Errorf("Lookup(%d) = %v, %v; want %v", h, got, ok, want[i])
		}
	}
	if len(sink.stored) != 2 {
		t.Fatalf("stored calls = %d, want 2", len(sink.stored))
	}
	if c := sink.stored[1]; !c.hasParent || c.parent != want[1] || !slices.Equal(c.keys, want[2:]) || c.medium != MediumGPU {
		t.Errorf("second Stored call = %+v, want parent %v keys %v on GPU", c, want[1], want[2:])
	}
	if c := sink.stored[0]; c.hasParent || !slices.Equal(c.keys, want[:2]) {
		t.Errorf("first Stored call = %+v, want keys %v without parent", c, want[:2])
	}
	// The same chain computed by Chain, block by block.
	if k := blocks.Chain(want[1], true, prompt[8:]); k != want[2] {
		t.Errorf("Chain disagrees with Keys: %v vs %v", k, want[2])
	}
	if got := ix.Held("r1"); !reflect.DeepEqual(got, map[string]int{MediumGPU: 3}) {
		t.Errorf("Held = %v", got)
	}
}

func TestIndexRemovedAndRefcounts(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	tok := toks(0, 4)
	key := blocks.Keys(nil, tok, 4)[0]
	// Two engine blocks (say two LoRA adapters) with the same tokens: one key.
	mustApply(t, ix, "r", sink,
		BlockStored{BlockHashes: []uint64{1}, TokenIDs: tok, BlockSize: 4},
		BlockStored{BlockHashes: []uint64{2}, TokenIDs: tok, BlockSize: 4},
		BlockRemoved{BlockHashes: []uint64{1}},
	)
	if got := sink.keys(MediumGPU); !slices.Equal(got, []blocks.Key{key}) {
		t.Fatalf("after removing one of two: keys %v, want %v", got, []blocks.Key{key})
	}
	st, err := ix.Apply("r", []Event{BlockRemoved{BlockHashes: []uint64{2, 99}}}, sink)
	if err != nil {
		t.Fatal(err)
	}
	if st.UnknownRemoved != 1 || st.BlocksRemoved != 1 {
		t.Errorf("stats %+v, want 1 removed and 1 unknown", st)
	}
	if got := sink.keys(MediumGPU); len(got) != 0 {
		t.Errorf("keys after removing both: %v", got)
	}
	if got := ix.Held("r"); len(got) != 0 {
		t.Errorf("Held = %v, want empty", got)
	}
}

func TestIndexUnknownParent(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	st, err := ix.Apply("r", []Event{
		BlockStored{BlockHashes: []uint64{5}, ParentHash: 4, HasParent: true, TokenIDs: toks(0, 4), BlockSize: 4},
		BlockStored{BlockHashes: []uint64{6}, TokenIDs: toks(0, 4), BlockSize: 4},
	}, sink)
	if !errors.Is(err, ErrUnknownParent) {
		t.Fatalf("err = %v, want ErrUnknownParent", err)
	}
	if st.UnknownParent != 1 || st.Stored != 1 {
		t.Errorf("stats %+v: want the orphan skipped and the rest applied", st)
	}
	if _, ok := ix.Lookup("r", "", 5); ok {
		t.Error("orphan block was stored")
	}
	if _, ok := ix.Lookup("r", "", 6); !ok {
		t.Error("block after the orphan was not stored")
	}
}

func TestIndexClearedAndMedia(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	mustApply(t, ix, "r", sink,
		BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: toks(0, 8), BlockSize: 4, Medium: MediumGPU},
		// Offloaded to CPU: chained after a GPU parent.
		BlockStored{BlockHashes: []uint64{3}, ParentHash: 2, HasParent: true, TokenIDs: toks(8, 4), BlockSize: 4, Medium: MediumCPU},
		BlockStored{BlockHashes: []uint64{2}, ParentHash: 1, HasParent: true, TokenIDs: toks(4, 4), BlockSize: 4, Medium: MediumCPU},
	)
	if got := ix.Held("r"); !reflect.DeepEqual(got, map[string]int{MediumGPU: 2, MediumCPU: 2}) {
		t.Errorf("Held = %v", got)
	}
	gpu, cpu := sink.keys(MediumGPU), sink.keys(MediumCPU)
	if len(gpu) != 2 || len(cpu) != 2 {
		t.Errorf("sink keys gpu %v cpu %v", gpu, cpu)
	}
	// The CPU copy of block 2 has the same router key as the GPU one.
	kg, _ := ix.Lookup("r", MediumGPU, 2)
	kc, _ := ix.Lookup("r", MediumCPU, 2)
	if kg != kc {
		t.Errorf("router key depends on medium: %v vs %v", kg, kc)
	}
	// Removing from GPU leaves the CPU copy.
	mustApply(t, ix, "r", sink, BlockRemoved{BlockHashes: []uint64{2}, Medium: MediumGPU})
	if _, ok := ix.Lookup("r", MediumCPU, 2); !ok {
		t.Error("GPU removal removed the CPU copy")
	}
	mustApply(t, ix, "r", sink, AllBlocksCleared{})
	if got := ix.Held("r"); len(got) != 0 {
		t.Errorf("Held after AllBlocksCleared = %v", got)
	}
	if sink.cleared != 1 || len(sink.keys(MediumGPU))+len(sink.keys(MediumCPU)) != 0 {
		t.Errorf("sink after clear: cleared %d, gpu %v, cpu %v", sink.cleared, sink.keys(MediumGPU), sink.keys(MediumCPU))
	}
	// Other replicas are untouched by one's clear.
	mustApply(t, ix, "other", sink, BlockStored{BlockHashes: []uint64{1}, TokenIDs: toks(0, 4), BlockSize: 4})
	ix.Clear("r", nil)
	if got := ix.Held("other"); got[MediumGPU] != 1 {
		t.Errorf("other replica's blocks = %v", got)
	}
}

func TestIndexMalformedAndInferredBlockSize(t *testing.T) {
	ix := NewIndex()
	st, _ := ix.Apply("r", []Event{
		BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: toks(0, 7), BlockSize: 4}, // short
		BlockStored{BlockHashes: []uint64{3, 4}, TokenIDs: toks(0, 8)},               // block_size missing
	}, nil)
	if st.Malformed != 1 || st.BlocksStored != 2 {
		t.Errorf("stats %+v, want 1 malformed and 2 blocks stored", st)
	}
	want := blocks.Keys(nil, toks(0, 8), 4)
	if k, _ := ix.Lookup("r", "", 4); k != want[1] {
		t.Errorf("inferred block size keyed %v, want %v", k, want[1])
	}
}

func TestIndexFoldedHashesAgree(t *testing.T) {
	// The same engine hash sent as uint64, int64 and 32 bytes must name one
	// block: store with one form, remove with another.
	for _, tc := range []struct{ store, remove HashFormat }{
		{HashBytes, HashUint64}, {HashInt64, HashBytes}, {HashUint64, HashString},
	} {
		ix := NewIndex()
		h := uint64(0xfedcba9876543210)
		enc := func(ev Event, f HashFormat) []Event {
			p, err := EncodeBatchOptions(Batch{Events: []Event{ev}}, EncodeOptions{Hashes: f})
			if err != nil {
				t.Fatal(err)
			}
			b, err := DecodeBatch(p)
			if err != nil {
				t.Fatal(err)
			}
			return b.Events
		}
		if _, err := ix.Apply("r", enc(BlockStored{BlockHashes: []uint64{h}, TokenIDs: toks(0, 4), BlockSize: 4}, tc.store), nil); err != nil {
			t.Fatal(err)
		}
		st, _ := ix.Apply("r", enc(BlockRemoved{BlockHashes: []uint64{h}}, tc.remove), nil)
		if st.BlocksRemoved != 1 {
			t.Errorf("stored as %v, removed as %v: %+v", tc.store, tc.remove, st)
		}
	}
}

func mustApply(t *testing.T, ix *Index, replica string, sink Sink, evs ...Event) {
	t.Helper()
	if _, err := ix.Apply(replica, evs, sink); err != nil {
		t.Fatal(err)
	}
}

// TestIndexLoRASeeds: blocks stored under a LoRA adapter get the adapter's
// chain (blocks.AdapterSeed of lora_name, as a request for it is keyed),
// never the base model's keys for the same tokens; a chain continued from
// an adapter's block stays the adapter's; lora_id alone is its own chain.
func TestIndexLoRASeeds(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	prompt := toks(100, 12)
	name := "sql-lora"
	id := int64(3)
	mustApply(t, ix, "r", sink,
		BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: prompt[:8], BlockSize: 4},
		BlockStored{BlockHashes: []uint64{11, 12}, TokenIDs: prompt[:8], BlockSize: 4, LoRAName: &name, LoRAID: &id},
		BlockStored{BlockHashes: []uint64{13}, ParentHash: 12, HasParent: true, TokenIDs: prompt[8:], BlockSize: 4, LoRAName: &name},
		BlockStored{BlockHashes: []uint64{21}, TokenIDs: prompt[:4], BlockSize: 4, LoRAID: &id},
	)
	base := blocks.Keys(nil, prompt, 4)
	lora := blocks.SeededKeys(nil, blocks.AdapterSeed(name), prompt, 4)
	for h, want := range map[uint64]blocks.Key{1: base[0], 2: base[1], 11: lora[0], 12: lora[1], 13: lora[2]} {
		if got, ok := ix.Lookup("r", "", h); !ok || got != want {
			t.Errorf("Lookup(%d) = %v, %v; want %v", h, got, ok, want)
		}
	}
	if got, _ := ix.Lookup("r", "", 21); got == base[0] || got == lora[0] {
		t.Errorf("a lora_id-only block took another chain's key %v", got)
	}
}

// TestIndexTokenlessTierStored: vLLM's OffloadingConnector publishes its CPU
// BlockStored without token ids or parent; each hash takes the router key
// the GPU block of that hash has, survives the GPU block's removal, and is
// removed with a CPU BlockRemoved. A hash no medium maps is skipped and
// counted; a token-less GPU BlockStored is still malformed.
func TestIndexTokenlessTierStored(t *testing.T) {
	ix := NewIndex()
	sink := newRecSink()
	mustApply(t, ix, "r", sink,
		BlockStored{BlockHashes: []uint64{1, 2, 3}, TokenIDs: toks(0, 12), BlockSize: 4, Medium: MediumGPU})
	st, err := ix.Apply("r", []Event{
		BlockStored{BlockHashes: []uint64{1, 3, 99}, TokenIDs: []uint32{}, BlockSize: 4, Medium: MediumCPU},
		BlockStored{BlockHashes: []uint64{7}, TokenIDs: []uint32{}, BlockSize: 4, Medium: MediumGPU},
	}, sink)
	if err != nil {
		t.Fatal(err)
	}
	if st.UnknownRemoved != 1 || st.Malformed != 1 || st.BlocksStored != 2 {
		t.Errorf("stats %+v: want 1 unknown hash, 1 malformed GPU event, 2 CPU blocks", st)
	}
	want := blocks.Keys(nil, toks(0, 12), 4)
	if got := sink.keys(MediumCPU); !slices.Equal(got, sortedKeys(want[0], want[2])) {
		t.Errorf("CPU keys %v, want the GPU blocks' %v", got, sortedKeys(want[0], want[2]))
	}
	mustApply(t, ix, "r", sink, BlockRemoved{BlockHashes: []uint64{1, 2, 3}, Medium: MediumGPU})
	if got := sink.keys(MediumCPU); len(got) != 2 {
		t.Errorf("GPU removal took CPU keys: %v", got)
	}
	mustApply(t, ix, "r", sink, BlockRemoved{BlockHashes: []uint64{3}, Medium: MediumCPU})
	if got := sink.keys(MediumCPU); !slices.Equal(got, []blocks.Key{want[0]}) {
		t.Errorf("after the CPU removal: %v, want [%v]", got, want[0])
	}
}

func sortedKeys(ks ...blocks.Key) []blocks.Key {
	slices.Sort(ks)
	return ks
}
