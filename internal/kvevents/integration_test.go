package kvevents

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// engineModel is a replica's prefix cache as the engine sees it: it makes
// random mixed loads of stores (new prompts and continuations), evictions and
// CPU offloads, and knows the router keys the index should end up with.
type engineModel struct {
	rng    *rand.Rand
	bs     int
	next   uint64                           // next engine hash
	blocks map[string]map[uint64]modelBlock // medium → engine hash → block
}

type modelBlock struct {
	prefix []uint32 // every token up to and including this block
	key    blocks.Key
}

func newEngineModel(seed uint64) *engineModel {
	return &engineModel{rng: rand.New(rand.NewPCG(seed, 1)), bs: 4, next: 1000,
		blocks: map[string]map[uint64]modelBlock{MediumGPU: {}, MediumCPU: {}}}
}

// step makes one batch of 1–4 events.
func (m *engineModel) step() []Event {
	var evs []Event
	for range 1 + m.rng.IntN(4) {
		gpu := m.blocks[MediumGPU]
		switch r := m.rng.IntN(10); {
		case r < 6 || len(gpu) == 0: // store 1–3 blocks, half the time continuing a held block
			var parent uint64
			var prefix []uint32
			hasParent := len(gpu) > 0 && m.rng.IntN(2) == 0
			if hasParent {
				parent = m.pick(gpu)
				prefix = gpu[parent].prefix
			}
			n := 1 + m.rng.IntN(3)
			ev := BlockStored{ParentHash: parent, HasParent: hasParent, BlockSize: m.bs, Medium: MediumGPU}
			for range n {
				blk := make([]uint32, m.bs)
				for i := range blk {
					blk[i] = m.rng.Uint32N(50000)
				}
				prefix = append(slices.Clip(prefix), blk...)
				h := m.next
				m.next++
				keys := blocks.Keys(nil, prefix, m.bs)
				gpu[h] = modelBlock{prefix: prefix, key: keys[len(keys)-1]}
				ev.BlockHashes = append(ev.BlockHashes, h)
				ev.TokenIDs = append(ev.TokenIDs, blk...)
			}
			evs = append(evs, ev)
		case r < 9: // evict a GPU block
			h := m.pick(gpu)
			delete(gpu, h)
			evs = append(evs, BlockRemoved{BlockHashes: []uint64{h}, Medium: MediumGPU})
		default: // offload a GPU block whose parent is still held to CPU
			h := m.pick(gpu)
			b := gpu[h]
			parentHash, hasParent := m.parentOf(b)
			if hasParent && !m.held(parentHash) {
				continue
			}
			m.blocks[MediumCPU][h] = b
			evs = append(evs, BlockStored{BlockHashes: []uint64{h}, ParentHash: parentHash, HasParent: hasParent,
				TokenIDs: b.prefix[len(b.prefix)-m.bs:], BlockSize: m.bs, Medium: MediumCPU})
		}
	}
	return evs
}

func (m *engineModel) pick(set map[uint64]modelBlock) uint64 {
	hs := make([]uint64, 0, len(set))
	for h := range set {
		hs = append(hs, h)
	}
	slices.Sort(hs)
	return hs[m.rng.IntN(len(hs))]
}

func (m *engineModel) parentOf(b modelBlock) (uint64, bool) {
	if len(b.prefix) == m.bs {
		return 0, false
	}
	want := b.prefix[:len(b.prefix)-m.bs]
	for _, set := range m.blocks {
		for h, o := range set {
			if slices.Equal(o.prefix, want) {
				return h, true
			}
		}
	}
	return 0, true // evicted: report as held nowhere
}

func (m *engineModel) held(h uint64) bool {
	_, g := m.blocks[MediumGPU][h]
	_, c := m.blocks[MediumCPU][h]
	return g || c
}

func (m *engineModel) clear() []Event {
	clear(m.blocks[MediumGPU])
	clear(m.blocks[MediumCPU])
	return []Event{AllBlocksCleared{}}
}

func (m *engineModel) keys(medium string) []blocks.Key {
	var out []blocks.Key
	for _, b := range m.blocks[medium] {
		out = append(out, b.key)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// harness runs publishers and one subscriber on loopback with bounded waits.
type harness struct {
	t       *testing.T
	ctx     context.Context
	sink    *recSink
	index   *Index
	sub     *Subscriber
	changed chan struct{}
	wg      sync.WaitGroup
}

func newHarness(t *testing.T) *harness {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	h := &harness{t: t, ctx: ctx, sink: newRecSink(), index: NewIndex(), changed: make(chan struct{}, 1)}
	t.Cleanup(func() {
		cancel()
		h.wg.Wait()
	})
	return h
}

// startPublisher runs a publisher until the returned stop is called.
func (h *harness) startPublisher(cfg PublisherConfig) (*Publisher, func()) {
	h.t.Helper()
	p := NewPublisher(cfg)
	ctx, cancel := context.WithCancel(h.ctx)
	done := make(chan error, 1)
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		done <- p.Run(ctx)
	}()
	select {
	case <-p.Ready():
	case <-h.ctx.Done():
		h.t.Fatal("publisher never became ready")
	}
	stop := func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				h.t.Errorf("publisher Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			h.t.Fatal("publisher Run did not return")
		}
	}
	return p, stop
}

func (h *harness) startSubscriber(p *Publisher, topic string) {
	h.startSubscriberWith(p, topic, nil)
}

// startSubscriberWith is startSubscriber with edit applied to the
// subscriber (its cfg or test hooks) before it runs.
func (h *harness) startSubscriberWith(p *Publisher, topic string, edit func(*Subscriber)) {
	h.sub = NewSubscriber(SubscriberConfig{
		Replica:        "r1",
		Endpoint:       p.Endpoint(),
		ReplayEndpoint: p.ReplayEndpoint(),
		Topic:          topic,
		Index:          h.index,
		Sink:           h.sink,
		Metrics:        NewMetrics(),
		PollInterval:   100 * time.Millisecond,
		ReplayTimeout:  2 * time.Second,
		MinBackoff:     10 * time.Millisecond,
		MaxBackoff:     100 * time.Millisecond,
	})
	if edit != nil {
		edit(h.sub)
	}
	h.sub.changed = func() {
		select {
		case h.changed <- struct{}{}:
		default:
		}
	}
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		if err := h.sub.Run(h.ctx); err != nil {
			h.t.Errorf("subscriber Run: %v", err)
		}
	}()
}

// waitFor waits, on the subscriber's change notifications, until cond holds.
func (h *harness) waitFor(what string, cond func() bool) {
	h.t.Helper()
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	for !cond() {
		select {
		case <-h.changed:
		case <-h.sink.notify:
		case <-deadline.C:
			h.t.Fatalf("timed out waiting for %s; stats %+v", what, h.sub.Stats())
		}
	}
}

// waitSynced waits until the subscriber applied seq and the index and the
// sink agree with the model.
func (h *harness) waitSynced(p *Publisher, m *engineModel) {
	h.t.Helper()
	last := int64(p.NextSeq()) - 1
	h.waitFor(fmt.Sprintf("seq %d", last), func() bool { return h.sub.Stats().LastSeq == last })
	for _, medium := range []string{MediumGPU, MediumCPU} {
		want := m.keys(medium)
		if got := h.index.Keys("r1", medium); !slices.Equal(got, want) {
			h.t.Fatalf("%s: index holds %d keys, engine %d\n got %v\nwant %v", medium, len(got), len(want), got, want)
		}
		if got := h.sink.keys(medium); !slices.Equal(got, want) {
			h.t.Fatalf("%s: sink holds %d keys, engine %d", medium, len(got), len(want))
		}
		if got := h.index.Held("r1")[medium]; got != len(m.blocks[medium]) {
			h.t.Fatalf("%s: index holds %d blocks, engine %d", medium, got, len(m.blocks[medium]))
		}
	}
}

func publishSteps(t *testing.T, p *Publisher, m *engineModel, n int) {
	t.Helper()
	for range n {
		if _, err := p.Publish(m.step(), float64(time.Now().UnixNano())/1e9); err != nil {
			t.Fatal(err)
		}
	}
}

const loopback = "tcp://127.0.0.1:0"

func TestLiveMixedLoad(t *testing.T) {
	for _, enc := range []Encoding{EncodingArray, EncodingMap} {
		t.Run(enc.String(), func(t *testing.T) {
			h := newHarness(t)
			m := newEngineModel(1)
			p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback,
				Topic: "kv@10.0.0.1:8000@llama", Encoding: enc})
			defer stop()
			// Some history before the subscriber exists: caught up by replay.
			publishSteps(t, p, m, 50)
			h.startSubscriber(p, "kv@10.0.0.1:8000")
			h.waitSynced(p, m)
			publishSteps(t, p, m, 500)
			h.waitSynced(p, m)
			if _, err := p.Publish(m.clear(), 0); err != nil {
				t.Fatal(err)
			}
			h.waitSynced(p, m)
			if got := h.index.Held("r1"); len(got) != 0 {
				t.Errorf("after AllBlocksCleared the index holds %v", got)
			}
			if st := h.sub.Stats(); st.Applied[TypeAllBlocksCleared] != 1 || h.sink.cleared == 0 {
				t.Errorf("AllBlocksCleared not applied: %+v", st)
			}
		})
	}
}

func TestDroppedRangeReplayed(t *testing.T) {
	for _, topicFrame := range []bool{false, true} {
		t.Run(fmt.Sprintf("topic_frame=%v", topicFrame), func(t *testing.T) {
			h := newHarness(t)
			m := newEngineModel(2)
			// Seqs [gapFrom, gapFrom+20) go to the replay buffer only. gapFrom
			// is set once live delivery is proven, so that the subscriber's
			// catch-up replay at connect (ZeroMQ's slow joiner) cannot have
			// covered the range before it was seen missing.
			var gapFrom atomic.Int64
			gapFrom.Store(math.MaxInt64)
			p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback,
				Topic: "kv", ReplayTopicFrame: topicFrame,
				SkipLive: func(seq uint64) bool { g := gapFrom.Load(); return int64(seq) >= g && int64(seq) < g+20 }})
			defer stop()
			h.startSubscriber(p, "kv")
			h.waitFor("connected", func() bool { return h.sub.Stats().Connected })
			publishSteps(t, p, m, 20)
			h.waitSynced(p, m)
			// Prove live delivery: one more batch arrives without a replay.
			deadline := time.Now().Add(20 * time.Second)
			for {
				before := h.sub.Stats().Replays
				publishSteps(t, p, m, 1)
				h.waitSynced(p, m)
				if h.sub.Stats().Replays == before {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("no batch arrived live within 20s")
				}
			}
			replaysBefore := h.sub.Stats().Replays
			gapFrom.Store(int64(p.NextSeq()))
			publishSteps(t, p, m, 40)
			h.waitSynced(p, m)
			st := h.sub.Stats()
			if st.Replays <= replaysBefore {
				t.Errorf("replays = %d (%d before the gap), want at least one for the gap", st.Replays, replaysBefore)
			}
			if st.LostBatches != 0 {
				t.Errorf("lost %d batches, want all replayed", st.LostBatches)
			}
			if st.Gaps == 0 && st.Dropped["unknown_parent"] == 0 {
				t.Errorf("no gap seen although seqs 20..39 were never sent live: %+v", st)
			}
		})
	}
}

func TestPublisherRestart(t *testing.T) {
	h := newHarness(t)
	m := newEngineModel(3)
	p1, stop1 := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback, Encoding: EncodingMap})
	h.startSubscriber(p1, "")
	publishSteps(t, p1, m, 100)
	h.waitSynced(p1, m)

	// The engine process dies: sockets go away, the cache with them.
	stop1()
	h.waitFor("disconnect", func() bool { return h.sub.Stats().Redials > 0 })
	m2 := newEngineModel(4)
	p2, stop2 := h.startPublisher(PublisherConfig{Endpoint: p1.Endpoint(), ReplayEndpoint: p1.ReplayEndpoint(),
		Encoding: EncodingArray, ReplayTopicFrame: true})
	defer stop2()
	publishSteps(t, p2, m2, 30) // fewer than before: seq goes back
	h.waitFor("restart", func() bool { return h.sub.Stats().Restarts > 0 })
	h.waitSynced(p2, m2)
	if h.sink.cleared == 0 {
		t.Error("restart did not clear the replica in the sink")
	}
	publishSteps(t, p2, m2, 100)
	h.waitSynced(p2, m2)
}

func TestUnknownParentResyncs(t *testing.T) {
	// The subscriber starts when the replay buffer no longer reaches back to
	// the parents of later blocks: it resyncs once, then drops orphans.
	h := newHarness(t)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback, BufferSteps: 2})
	defer stop()
	tok := toks(0, 4)
	mustPublish := func(evs ...Event) {
		if _, err := p.Publish(evs, 0); err != nil {
			t.Fatal(err)
		}
	}
	mustPublish(BlockStored{BlockHashes: []uint64{1}, TokenIDs: tok, BlockSize: 4})
	mustPublish(BlockStored{BlockHashes: []uint64{2}, TokenIDs: tok, BlockSize: 4})
	mustPublish(BlockStored{BlockHashes: []uint64{3}, TokenIDs: tok, BlockSize: 4})
	h.startSubscriber(p, "")
	h.waitFor("seq 2", func() bool { return h.sub.Stats().LastSeq == 2 })
	mustPublish(BlockStored{BlockHashes: []uint64{10}, ParentHash: 1, HasParent: true, TokenIDs: tok, BlockSize: 4})
	h.waitFor("orphan handled", func() bool {
		st := h.sub.Stats()
		return st.LastSeq == 3 && st.Dropped["unknown_parent"] > 0
	})
	if st := h.sub.Stats(); st.Restarts != 0 {
		t.Errorf("an orphan is not a restart: %+v", st)
	}
	if _, ok := h.index.Lookup("r1", "", 3); !ok {
		t.Error("the resync lost block 3, which the buffer still held")
	}
}

func TestUndecodableBatchSkipped(t *testing.T) {
	h := newHarness(t)
	p, stop := h.startPublisher(PublisherConfig{Endpoint: loopback, ReplayEndpoint: loopback})
	defer stop()
	h.startSubscriber(p, "")
	h.waitFor("connected", func() bool { return h.sub.Stats().Connected })
	if _, err := p.PublishPayload([]byte{0xc1}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Publish([]Event{BlockStored{BlockHashes: []uint64{1}, TokenIDs: toks(0, 4), BlockSize: 4}}, 0); err != nil {
		t.Fatal(err)
	}
	h.waitFor("seq 1", func() bool { return h.sub.Stats().LastSeq == 1 })
	if st := h.sub.Stats(); st.Dropped["decode_error"] != 1 {
		t.Errorf("dropped = %v, want one decode_error", st.Dropped)
	}
}

func TestSubscriberConfigValidate(t *testing.T) {
	ix := NewIndex()
	good := SubscriberConfig{Replica: "r", Endpoint: "tcp://h:1", Index: ix}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]SubscriberConfig{
		"no replica":   {Endpoint: "tcp://h:1", Index: ix},
		"no endpoint":  {Replica: "r", Index: ix},
		"bad endpoint": {Replica: "r", Endpoint: "h:1", Index: ix},
		"bad replay":   {Replica: "r", Endpoint: "tcp://h:1", ReplayEndpoint: "h:2", Index: ix},
		"no index":     {Replica: "r", Endpoint: "tcp://h:1"},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: Validate accepted %+v", name, c)
		}
	}
}
