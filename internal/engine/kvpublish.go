package engine

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/replica"
)

// KVPublisher receives the engine's KV-cache event batches, as vLLM's
// ZmqEventPublisher does: *kvevents.Publisher implements it.
type KVPublisher interface {
	// Publish sends one batch, stamped ts (seconds since the Unix epoch).
	Publish(events []kvevents.Event, ts float64) (uint64, error)
}

var _ KVPublisher = (*kvevents.Publisher)(nil)

// DefaultReplayEndpoint is vLLM's convention for the replay socket: the
// events endpoint with its port plus one ("tcp://*:5557" → "tcp://*:5558").
func DefaultReplayEndpoint(endpoint string) (string, error) {
	tr, addr, ok := strings.Cut(endpoint, "://")
	if !ok {
		return "", fmt.Errorf("engine: kv events endpoint %q is not transport://host:port", endpoint)
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", fmt.Errorf("engine: kv events endpoint %q: %w", endpoint, err)
	}
	n, err := strconv.Atoi(port)
	if err != nil || n <= 0 || n >= 65535 {
		return "", fmt.Errorf("engine: kv events endpoint %q: no numeric port to derive the replay port from", endpoint)
	}
	return tr + "://" + net.JoinHostPort(host, strconv.Itoa(n+1)), nil
}

// DefaultKVTopic is the topic vLLM documents for an engine served at listen
// with model: "kv@<host:port>@<model>".
func DefaultKVTopic(listen, model string) string { return "kv@" + listen + "@" + model }

// kvTokens is one block's token ids, shared by the live requests whose
// prompts hold the block.
type kvTokens struct {
	toks []uint32
	refs int32
}

// kvAdapter turns the replica's cache events into vLLM's KV events and
// publishes them, one batch per deliver call (at most two per iteration:
// evictions at its start, stores at its end). It is owned by Run's
// goroutine.
//
// A BlockStored carries its blocks' token ids, which the replica does not
// keep: the adapter holds, for every block of every live request's prompt,
// a slice of that request's token ids, released when the request ends.
// Engine block hashes are the chain keys themselves (uint64(blocks.Key)).
type kvAdapter struct {
	pub   KVPublisher
	bs    int
	toks  map[blocks.Key]kvTokens
	batch []kvevents.Event
	e     *Engine
}

func newKVAdapter(e *Engine, pub KVPublisher) *kvAdapter {
	return &kvAdapter{pub: pub, bs: e.cfg.Replica.BlockSize, toks: make(map[blocks.Key]kvTokens), e: e}
}

// hold registers the token ids of s's prompt blocks.
func (a *kvAdapter) hold(s *stream) {
	for i, k := range s.req.Keys {
		t := a.toks[k]
		if t.refs == 0 {
			t.toks = s.tokens[i*a.bs : (i+1)*a.bs : (i+1)*a.bs]
		}
		t.refs++
		a.toks[k] = t
	}
}

// release drops s's hold on its blocks' token ids.
func (a *kvAdapter) release(s *stream) {
	for _, k := range s.req.Keys {
		t, ok := a.toks[k]
		if !ok {
			continue
		}
		if t.refs--; t.refs <= 0 {
			delete(a.toks, k)
		} else {
			a.toks[k] = t
		}
	}
}

// add converts one cache event into the pending batch.
func (a *kvAdapter) add(ev replica.Event) {
	if ev.Medium != "" {
		a.addTier(ev)
		return
	}
	switch ev.Kind {
	case replica.BlocksStored:
		bs := kvevents.BlockStored{
			BlockHashes: make([]uint64, len(ev.Keys)),
			ParentHash:  uint64(ev.Parent),
			HasParent:   ev.HasParent,
			TokenIDs:    make([]uint32, 0, len(ev.Keys)*a.bs),
			BlockSize:   a.bs,
			Medium:      kvevents.MediumGPU,
		}
		if ev.Adapter != "" {
			// vLLM's BlockStored names the adapter the blocks were
			// computed under (lora_name; lora_id, deprecated, is omitted).
			name := ev.Adapter
			bs.LoRAName = &name
		}
		for i, k := range ev.Keys {
			t, ok := a.toks[k]
			if !ok {
				// Cannot happen: a block is stored by a live request.
				a.e.cfg.Logger.Error("engine: kv events: stored block without tokens; event dropped", "key", uint64(k))
				return
			}
			bs.BlockHashes[i] = uint64(k)
			bs.TokenIDs = append(bs.TokenIDs, t.toks...)
		}
		a.batch = append(a.batch, bs)
	case replica.BlocksRemoved:
		br := kvevents.BlockRemoved{BlockHashes: make([]uint64, len(ev.Keys)), Medium: kvevents.MediumGPU}
		for i, k := range ev.Keys {
			br.BlockHashes[i] = uint64(k)
		}
		a.batch = append(a.batch, br)
	case replica.AllCleared:
		a.batch = append(a.batch, kvevents.AllBlocksCleared{})
	}
}

// addTier converts one event of the CPU offload tier into the pending
// batch as vLLM's OffloadingConnector publishes it
// (OffloadingConnectorScheduler.take_events, vllm-project/vllm @
// e57c0d427864471fe231b58b2cd9a73453322cb2): a BlockStored with the block
// hashes, no parent, no token ids, the block size and no LoRA fields, or a
// BlockRemoved, each with the tier's medium ("CPU").
func (a *kvAdapter) addTier(ev replica.Event) {
	hashes := make([]uint64, len(ev.Keys))
	for i, k := range ev.Keys {
		hashes[i] = uint64(k)
	}
	switch ev.Kind {
	case replica.BlocksStored:
		a.batch = append(a.batch, kvevents.BlockStored{BlockHashes: hashes, TokenIDs: []uint32{}, BlockSize: a.bs, Medium: ev.Medium})
	case replica.BlocksRemoved:
		a.batch = append(a.batch, kvevents.BlockRemoved{BlockHashes: hashes, Medium: ev.Medium})
	}
}

// flush publishes the pending batch, if any, stamped now.
func (a *kvAdapter) flush(now time.Time) {
	if len(a.batch) == 0 {
		return
	}
	if _, err := a.pub.Publish(a.batch, float64(now.UnixNano())/1e9); err != nil {
		a.e.cfg.Logger.Warn("engine: kv events: publish", "err", err)
	}
	clear(a.batch)
	a.batch = a.batch[:0]
}
