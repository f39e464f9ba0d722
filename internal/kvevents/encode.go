package kvevents

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Encoding is how events and batches are laid out in msgpack.
type Encoding int

const (
	// EncodingArray is msgspec's array_like layout, vLLM up to ~0.23: a batch
	// is [ts, events, dp_rank?] and an event [type, field...].
	EncodingArray Encoding = iota
	// EncodingMap is the tagged-map layout of vLLM ~0.26 on (PR #42892): a
	// batch is {ts, events, data_parallel_rank?} and an event {"type", fields}.
	EncodingMap
)

// String names the encoding as the engine's --kv-events-encoding flag does.
func (e Encoding) String() string {
	switch e {
	case EncodingArray:
		return "array"
	case EncodingMap:
		return "map"
	}
	return fmt.Sprintf("Encoding(%d)", int(e))
}

// ParseEncoding reads "array" or "map".
func ParseEncoding(s string) (Encoding, error) {
	switch s {
	case "array":
		return EncodingArray, nil
	case "map":
		return EncodingMap, nil
	}
	return 0, fmt.Errorf("kvevents: unknown encoding %q (want array or map)", s)
}

// HashFormat is how block hashes are written.
type HashFormat int

const (
	// HashUint64 writes the uint64 (vLLM's default,
	// VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1).
	HashUint64 HashFormat = iota
	// HashInt64 writes the same 64 bits as a signed integer (old releases).
	HashInt64
	// HashBytes writes a 32-byte bin digest whose last 8 bytes are the uint64
	// big-endian (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
	HashBytes
	// HashString is HashBytes sent as a msgpack str, as some encoders do.
	HashString
)

// EncodeOptions selects the layout EncodeBatchOptions writes.
type EncodeOptions struct {
	Encoding Encoding
	Hashes   HashFormat
	// StoredFields, when > 0, writes only the first StoredFields fields of each
	// BlockStored and RemovedFields of each BlockRemoved, as older vLLM
	// releases did (BlockStored had 5 fields before medium, 6 before lora_name,
	// 7 before extra_keys ...). 0 writes what vLLM writes today: the required
	// fields, then the defaulted ones up to the last one set (msgspec
	// omit_defaults).
	StoredFields  int
	RemovedFields int
}

// EncodeBatch encodes b as vLLM's publisher would in the given encoding, with
// uint64 hashes.
func EncodeBatch(b Batch, enc Encoding) ([]byte, error) {
	return EncodeBatchOptions(b, EncodeOptions{Encoding: enc})
}

// EncodeBatchOptions encodes b with every layout choice explicit.
func EncodeBatchOptions(b Batch, o EncodeOptions) ([]byte, error) {
	var buf bytes.Buffer
	w := &writer{e: msgpack.NewEncoder(&buf), o: o}
	w.batch(b)
	if w.err != nil {
		return nil, fmt.Errorf("kvevents: encode batch: %w", w.err)
	}
	return buf.Bytes(), nil
}

// writer keeps the first error so the layout code reads straight through.
type writer struct {
	e   *msgpack.Encoder
	o   EncodeOptions
	err error
}

func (w *writer) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *writer) key(k string) {
	if w.o.Encoding == EncodingMap {
		w.do(w.e.EncodeString(k))
	}
}

func (w *writer) header(n int) {
	if w.o.Encoding == EncodingMap {
		w.do(w.e.EncodeMapLen(n))
	} else {
		w.do(w.e.EncodeArrayLen(n))
	}
}

func (w *writer) batch(b Batch) {
	n := 2
	if b.DataParallelRank != nil {
		n = 3
	}
	w.header(n)
	w.key("ts")
	w.do(w.e.EncodeFloat64(b.TS))
	w.key("events")
	w.do(w.e.EncodeArrayLen(len(b.Events)))
	for _, ev := range b.Events {
		w.event(ev)
	}
	if b.DataParallelRank != nil {
		w.key("data_parallel_rank")
		w.do(w.e.EncodeInt(*b.DataParallelRank))
	}
}

func (w *writer) event(ev Event) {
	switch ev := ev.(type) {
	case BlockStored:
		w.stored(&ev)
	case *BlockStored:
		w.stored(ev)
	case BlockRemoved:
		w.removed(&ev)
	case *BlockRemoved:
		w.removed(ev)
	case AllBlocksCleared, *AllBlocksCleared:
		w.header(1)
		w.tag(TypeAllBlocksCleared)
	default:
		w.do(fmt.Errorf("unknown event type %T", ev))
	}
}

func (w *writer) tag(t string) {
	w.key("type")
	w.do(w.e.EncodeString(t))
}

// fieldCount is how many fields to write: all required ones, then defaulted
// ones up to the last set, unless limit caps it.
func fieldCount(required int, optionalSet []bool, limit int) int {
	n := required
	for i, set := range optionalSet {
		if set {
			n = required + i + 1
		}
	}
	if limit > 0 {
		n = min(limit, required+len(optionalSet))
	}
	return n
}

func (w *writer) stored(s *BlockStored) {
	// vLLM's BlockStored: 7 required fields, then 4 with defaults.
	nf := fieldCount(7, []bool{s.ExtraKeys != nil, s.GroupIdx != nil,
		s.KVCacheSpecKind != nil, s.KVCacheSpecSlidingWindow != nil}, w.o.StoredFields)
	if w.o.Encoding == EncodingMap && w.o.StoredFields == 0 {
		// Map layout omits each defaulted field that is unset, not just
		// trailing ones.
		nf = 7
		for _, set := range []bool{s.ExtraKeys != nil, s.GroupIdx != nil,
			s.KVCacheSpecKind != nil, s.KVCacheSpecSlidingWindow != nil} {
			if set {
				nf++
			}
		}
	}
	w.header(nf + 1)
	w.tag(TypeBlockStored)
	written := 0
	field := func(i int, name string, set bool, enc func()) {
		if i >= 7 && w.o.Encoding == EncodingMap && w.o.StoredFields == 0 && !set {
			return
		}
		if written >= nf {
			return
		}
		written++
		w.key(name)
		enc()
	}
	field(0, "block_hashes", true, func() { w.hashes(s.BlockHashes) })
	field(1, "parent_block_hash", true, func() {
		if s.HasParent {
			w.hash(s.ParentHash)
		} else {
			w.do(w.e.EncodeNil())
		}
	})
	field(2, "token_ids", true, func() {
		w.do(w.e.EncodeArrayLen(len(s.TokenIDs)))
		for _, t := range s.TokenIDs {
			w.do(w.e.EncodeUint(uint64(t)))
		}
	})
	field(3, "block_size", true, func() { w.do(w.e.EncodeInt(int64(s.BlockSize))) })
	field(4, "lora_id", true, func() { w.optInt(s.LoRAID) })
	field(5, "medium", true, func() { w.optStr(s.Medium) })
	field(6, "lora_name", true, func() { w.optStrPtr(s.LoRAName) })
	field(7, "extra_keys", s.ExtraKeys != nil, func() {
		if s.ExtraKeys == nil {
			w.do(w.e.EncodeNil())
			return
		}
		w.do(w.e.Encode(msgpack.RawMessage(s.ExtraKeys)))
	})
	field(8, "group_idx", s.GroupIdx != nil, func() { w.optInt(s.GroupIdx) })
	field(9, "kv_cache_spec_kind", s.KVCacheSpecKind != nil, func() { w.optStrPtr(s.KVCacheSpecKind) })
	field(10, "kv_cache_spec_sliding_window", s.KVCacheSpecSlidingWindow != nil, func() {
		w.optInt(s.KVCacheSpecSlidingWindow)
	})
}

func (w *writer) removed(r *BlockRemoved) {
	// vLLM's BlockRemoved: 2 required fields, then group_idx with a default.
	nf := fieldCount(2, []bool{r.GroupIdx != nil}, w.o.RemovedFields)
	w.header(nf + 1)
	w.tag(TypeBlockRemoved)
	w.key("block_hashes")
	w.hashes(r.BlockHashes)
	if nf >= 2 {
		w.key("medium")
		w.optStr(r.Medium)
	}
	if nf >= 3 {
		w.key("group_idx")
		w.optInt(r.GroupIdx)
	}
}

func (w *writer) hashes(hs []uint64) {
	w.do(w.e.EncodeArrayLen(len(hs)))
	for _, h := range hs {
		w.hash(h)
	}
}

func (w *writer) hash(h uint64) {
	switch w.o.Hashes {
	case HashInt64:
		w.do(w.e.EncodeInt(int64(h)))
	case HashBytes:
		w.do(w.e.EncodeBytes(digest32(h)))
	case HashString:
		w.do(w.e.EncodeString(string(digest32(h))))
	default:
		w.do(w.e.EncodeUint(h))
	}
}

// digest32 makes a 32-byte digest that FoldHash folds back to h: 24 bytes
// derived from h (so fixtures look like SHA-256 output), then h big-endian.
func digest32(h uint64) []byte {
	var be [8]byte
	binary.BigEndian.PutUint64(be[:], h)
	sum := sha256.Sum256(be[:])
	out := make([]byte, 32)
	copy(out, sum[:24])
	copy(out[24:], be[:])
	return out
}

func (w *writer) optInt(v *int64) {
	if v == nil {
		w.do(w.e.EncodeNil())
		return
	}
	w.do(w.e.EncodeInt(*v))
}

func (w *writer) optStr(s string) {
	if s == "" {
		w.do(w.e.EncodeNil())
		return
	}
	w.do(w.e.EncodeString(s))
}

func (w *writer) optStrPtr(s *string) {
	if s == nil {
		w.do(w.e.EncodeNil())
		return
	}
	w.do(w.e.EncodeString(*s))
}

// ExtraKeys encodes the extra_keys vLLM sends with a BlockStored of
// blocks blocks computed for a request of LoRA adapter lora ("" none) and
// cache salt salt ("" none), the first of which starts the prompt when
// first: one entry per block, the tuple [lora] for each block of an
// adapter's request, with salt appended to the first block's when first
// (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys;
// vllm/v1/core/block_pool.py, cache_full_blocks, which builds the list;
// vllm-project/vllm at 001cabc1be16a59a70d720ed61a13b678c060a18), None
// for a block without any. It returns nil (extra_keys left out) when no
// block has any, as the engine sent before salts: the event is then the
// same as an unsalted request's.
func ExtraKeys(blocks int, lora, salt string, first bool) []byte {
	if lora == "" && (salt == "" || !first) {
		return nil
	}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	_ = e.EncodeArrayLen(blocks)
	for i := range blocks {
		n := 0
		if lora != "" {
			n++
		}
		if i == 0 && first && salt != "" {
			n++
		}
		if n == 0 {
			_ = e.EncodeNil()
			continue
		}
		_ = e.EncodeArrayLen(n)
		if lora != "" {
			_ = e.EncodeString(lora)
		}
		if i == 0 && first && salt != "" {
			_ = e.EncodeString(salt)
		}
	}
	return buf.Bytes()
}
