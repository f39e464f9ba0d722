package kvevents

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"sync"

	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// ErrMalformed is wrapped by every decode error: the payload is not a batch in
// any format this package knows.
var ErrMalformed = errors.New("kvevents: malformed event batch")

// maxDepth bounds the nesting the decoder follows when it skips a value it does
// not use (extra_keys, unknown fields, unknown events), so hostile input cannot
// exhaust the stack.
const maxDepth = 32

// DecodeBatch decodes one msgpack payload as vLLM publishes it
// (vllm/distributed/kv_events.py, EventBatch and KVCacheEvent):
//
//   - the batch is an array [ts, events, data_parallel_rank?] (msgspec
//     array_like, vLLM up to ~0.23) or a map {ts, events, data_parallel_rank};
//   - each event is an array [type, field...] in field order, or a map with
//     "type" and the fields by name (vLLM ~0.26 on); trailing fields may be
//     missing and unknown trailing fields or keys are ignored;
//   - hashes are uint64, negative int64 or 32-byte bin/str, folded by FoldHash.
//
// Events of an unknown type are skipped and counted in Batch.Unknown. Any
// other deviation is an error wrapping ErrMalformed; DecodeBatch never panics.
// The returned batch shares no memory with payload.
func DecodeBatch(payload []byte) (Batch, error) {
	dec := decoderPool.Get().(*decoder)
	defer decoderPool.Put(dec)
	var b Batch
	err := dec.batch(payload, &b)
	dec.reset(nil)
	if err != nil {
		return Batch{}, fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	return b, nil
}

// FoldHash maps a vLLM block hash given as bytes to the uint64 vLLM itself
// publishes by default: the last (low) 8 bytes read big-endian. A hash shorter
// than 8 bytes is read big-endian whole. Integer hashes need no folding: a
// negative int64 is the same 64 bits as the uint64 and is reinterpreted.
func FoldHash(b []byte) uint64 {
	if len(b) >= 8 {
		return binary.BigEndian.Uint64(b[len(b)-8:])
	}
	var v uint64
	for _, c := range b {
		v = v<<8 | uint64(c)
	}
	return v
}

var decoderPool = sync.Pool{New: func() any {
	d := &decoder{}
	d.d = msgpack.NewDecoder(&d.br)
	return d
}}

// decoder reads one payload. It drives vmihailenco/msgpack's low-level Decoder
// over a bytes.Reader (which the Decoder uses directly, without buffering), and
// reads integers, strings and byte strings straight from the payload at the
// reader's offset: the hot loops (token ids, hashes) then cost no interface
// call and no allocation per element.
type decoder struct {
	buf []byte
	br  bytes.Reader
	d   *msgpack.Decoder
}

func (r *decoder) reset(buf []byte) {
	r.buf = buf
	r.br.Reset(buf)
}

// pos is the offset of the next unread byte.
func (r *decoder) pos() int { return len(r.buf) - r.br.Len() }

func (r *decoder) advance(n int) {
	_, _ = r.br.Seek(int64(n), io.SeekCurrent)
}

func (r *decoder) peek() (byte, error) {
	p := r.pos()
	if p >= len(r.buf) {
		return 0, io.ErrUnexpectedEOF
	}
	return r.buf[p], nil
}

// isNil consumes a nil and reports true if the next value is nil.
func (r *decoder) isNil() (bool, error) {
	c, err := r.peek()
	if err != nil {
		return false, err
	}
	if c == msgpcode.Nil {
		r.advance(1)
		return true, nil
	}
	return false, nil
}

// arrayLen reads an array header; -1 for nil. A length that cannot fit in the
// rest of the payload (each element takes at least one byte) is an error, so
// a hostile header cannot make the decoder allocate.
func (r *decoder) arrayLen() (int, error) {
	n, err := r.d.DecodeArrayLen()
	if err != nil {
		return 0, err
	}
	if n > r.br.Len() {
		return 0, fmt.Errorf("array of %d elements in %d bytes", n, r.br.Len())
	}
	return n, nil
}

func (r *decoder) mapLen() (int, error) {
	n, err := r.d.DecodeMapLen()
	if err != nil {
		return 0, err
	}
	if n > r.br.Len()/2 {
		return 0, fmt.Errorf("map of %d entries in %d bytes", n, r.br.Len())
	}
	return n, nil
}

// bytes reads a str or bin value and returns it aliasing the payload.
func (r *decoder) bytes() ([]byte, error) {
	n, err := r.d.DecodeBytesLen()
	if err != nil {
		return nil, err
	}
	if n < 0 {
		return nil, nil
	}
	if n > r.br.Len() {
		return nil, fmt.Errorf("string of %d bytes in %d", n, r.br.Len())
	}
	p := r.pos()
	r.advance(n)
	return r.buf[p : p+n : p+n], nil
}

// int reads any msgpack integer as its 64 bits (a negative int64 reinterpreted
// as uint64) and whether it was negative.
func (r *decoder) int() (v uint64, neg bool, err error) {
	p := r.pos()
	b := r.buf[p:]
	if len(b) == 0 {
		return 0, false, io.ErrUnexpectedEOF
	}
	c := b[0]
	var n int
	switch {
	case c <= msgpcode.PosFixedNumHigh:
		v, n = uint64(c), 1
	case c >= msgpcode.NegFixedNumLow:
		v, n, neg = uint64(int64(int8(c))), 1, true
	case c == msgpcode.Uint8 && len(b) >= 2:
		v, n = uint64(b[1]), 2
	case c == msgpcode.Uint16 && len(b) >= 3:
		v, n = uint64(binary.BigEndian.Uint16(b[1:])), 3
	case c == msgpcode.Uint32 && len(b) >= 5:
		v, n = uint64(binary.BigEndian.Uint32(b[1:])), 5
	case c == msgpcode.Uint64 && len(b) >= 9:
		v, n = binary.BigEndian.Uint64(b[1:]), 9
	case c == msgpcode.Int8 && len(b) >= 2:
		x := int64(int8(b[1]))
		v, n, neg = uint64(x), 2, x < 0
	case c == msgpcode.Int16 && len(b) >= 3:
		x := int64(int16(binary.BigEndian.Uint16(b[1:])))
		v, n, neg = uint64(x), 3, x < 0
	case c == msgpcode.Int32 && len(b) >= 5:
		x := int64(int32(binary.BigEndian.Uint32(b[1:])))
		v, n, neg = uint64(x), 5, x < 0
	case c == msgpcode.Int64 && len(b) >= 9:
		x := int64(binary.BigEndian.Uint64(b[1:]))
		v, n, neg = uint64(x), 9, x < 0
	default:
		return 0, false, fmt.Errorf("want an integer, got code %#x", c)
	}
	r.advance(n)
	return v, neg, nil
}

// smallInt reads an integer that must fit an int64 and be ≥ 0 when nonneg.
func (r *decoder) int64(what string) (int64, error) {
	v, neg, err := r.int()
	if err != nil {
		return 0, fmt.Errorf("%s: %w", what, err)
	}
	if !neg && v > math.MaxInt64 {
		return 0, fmt.Errorf("%s: %d overflows int64", what, v)
	}
	return int64(v), nil
}

func (r *decoder) optInt64(what string) (*int64, error) {
	if isNil, err := r.isNil(); err != nil || isNil {
		return nil, err
	}
	v, err := r.int64(what)
	if err != nil {
		return nil, err
	}
	return &v, nil
}

func (r *decoder) optString(what string) (*string, error) {
	if isNil, err := r.isNil(); err != nil || isNil {
		return nil, err
	}
	b, err := r.bytes()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	s := string(b)
	return &s, nil
}

// medium reads the medium field; the two names vLLM uses are interned.
func (r *decoder) medium() (string, error) {
	if isNil, err := r.isNil(); err != nil || isNil {
		return "", err
	}
	b, err := r.bytes()
	if err != nil {
		return "", fmt.Errorf("medium: %w", err)
	}
	switch string(b) {
	case MediumGPU:
		return MediumGPU, nil
	case MediumCPU:
		return MediumCPU, nil
	}
	return string(b), nil
}

// hash reads one block hash: an integer (uint64 or int64, same 64 bits) or a
// bin/str digest folded by FoldHash.
func (r *decoder) hash() (uint64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	if msgpcode.IsString(c) || msgpcode.IsBin(c) {
		b, err := r.bytes()
		if err != nil {
			return 0, err
		}
		return FoldHash(b), nil
	}
	v, _, err := r.int()
	return v, err
}

func (r *decoder) hashes() ([]uint64, error) {
	n, err := r.arrayLen()
	if err != nil || n <= 0 {
		return nil, err // empty and nil both decode to nil
	}
	hs := make([]uint64, n)
	for i := range hs {
		if hs[i], err = r.hash(); err != nil {
			return nil, fmt.Errorf("block hash %d: %w", i, err)
		}
	}
	return hs, nil
}

func (r *decoder) tokens() ([]uint32, error) {
	n, err := r.arrayLen()
	if err != nil || n <= 0 {
		return nil, err
	}
	ts := make([]uint32, n)
	// Token ids are non-negative and below 2^32, so vLLM (msgspec) writes them
	// as positive fixint, uint8, uint16 or uint32: read those from a local
	// cursor, and anything else through int, which also reports errors.
	b := r.buf
	p := r.pos()
	i := 0
	for ; i < n && p < len(b); i++ {
		c := b[p]
		if c <= msgpcode.PosFixedNumHigh {
			ts[i] = uint32(c)
			p++
		} else if c == msgpcode.Uint16 && p+3 <= len(b) {
			ts[i] = uint32(binary.BigEndian.Uint16(b[p+1:]))
			p += 3
		} else if c == msgpcode.Uint32 && p+5 <= len(b) {
			ts[i] = binary.BigEndian.Uint32(b[p+1:])
			p += 5
		} else if c == msgpcode.Uint8 && p+2 <= len(b) {
			ts[i] = uint32(b[p+1])
			p += 2
		} else {
			break
		}
	}
	r.advance(p - r.pos())
	for ; i < n; i++ {
		v, neg, err := r.int()
		if err != nil {
			return nil, fmt.Errorf("token %d: %w", i, err)
		}
		if neg || v > math.MaxUint32 {
			return nil, fmt.Errorf("token %d: %d out of range", i, int64(v))
		}
		ts[i] = uint32(v)
	}
	return ts, nil
}

// skip skips one value of any kind, following at most maxDepth-depth levels of
// nesting.
func (r *decoder) skip(depth int) error {
	if depth > maxDepth {
		return errors.New("value nested too deeply")
	}
	c, err := r.peek()
	if err != nil {
		return err
	}
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := r.arrayLen()
		if err != nil {
			return err
		}
		for range n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := r.mapLen()
		if err != nil {
			return err
		}
		for range 2 * n {
			if err := r.skip(depth + 1); err != nil {
				return err
			}
		}
		return nil
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		_, err := r.bytes() // bounds-checked, aliases the payload
		return err
	case msgpcode.IsExt(c):
		// msgpack.Decoder.Skip would read the declared length into its
		// scratch buffer, growing it by up to 1 MiB per call before finding
		// the payload short, and the pooled decoder would keep it.
		_, n, err := r.d.DecodeExtHeader()
		if err != nil {
			return err
		}
		if n > r.br.Len() {
			return fmt.Errorf("ext of %d bytes in %d", n, r.br.Len())
		}
		r.advance(n)
		return nil
	}
	return r.d.Skip() // nil, a bool or a number: a few bytes, no recursion
}

// raw skips one value and returns a copy of its encoding.
func (r *decoder) raw() ([]byte, error) {
	start := r.pos()
	if err := r.skip(1); err != nil {
		return nil, err
	}
	return bytes.Clone(r.buf[start:r.pos()]), nil
}

func (r *decoder) batch(payload []byte, b *Batch) error {
	r.reset(payload)
	c, err := r.peek()
	if err != nil {
		return fmt.Errorf("batch: %w", err)
	}
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := r.arrayLen()
		if err != nil {
			return fmt.Errorf("batch: %w", err)
		}
		if n < 2 {
			return fmt.Errorf("batch: array of %d fields, want ≥ 2", n)
		}
		for i := range n {
			if err := r.batchField(i, b); err != nil {
				return err
			}
		}
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := r.mapLen()
		if err != nil {
			return fmt.Errorf("batch: %w", err)
		}
		for range n {
			k, err := r.bytes()
			if err != nil {
				return fmt.Errorf("batch key: %w", err)
			}
			f := -1
			switch string(k) {
			case "ts":
				f = 0
			case "events":
				f = 1
			case "data_parallel_rank":
				f = 2
			}
			if err := r.batchField(f, b); err != nil {
				return err
			}
		}
	default:
		return fmt.Errorf("batch: want an array or a map, got code %#x", c)
	}
	if r.br.Len() != 0 {
		return fmt.Errorf("batch: %d trailing bytes", r.br.Len())
	}
	return nil
}

func (r *decoder) batchField(f int, b *Batch) error {
	var err error
	switch f {
	case 0:
		if b.TS, err = r.d.DecodeFloat64(); err != nil {
			return fmt.Errorf("batch ts: %w", err)
		}
	case 1:
		return r.events(b)
	case 2:
		if b.DataParallelRank, err = r.optInt64("data_parallel_rank"); err != nil {
			return err
		}
	default:
		return r.skip(1)
	}
	return nil
}

func (r *decoder) events(b *Batch) error {
	n, err := r.arrayLen()
	if err != nil {
		return fmt.Errorf("events: %w", err)
	}
	if n > 0 {
		b.Events = make([]Event, 0, n)
	}
	for i := range n {
		ev, err := r.event()
		if err != nil {
			return fmt.Errorf("event %d: %w", i, err)
		}
		if ev == nil {
			b.Unknown++
			continue
		}
		b.Events = append(b.Events, ev)
	}
	if len(b.Events) == 0 {
		b.Events = nil // however the batch was encoded: no known events is nil
	}
	return nil
}

// Field positions of BlockStored in vLLM's array encoding (after the tag).
const (
	fHashes = iota
	fParent
	fTokens
	fBlockSize
	fLoRAID
	fMedium
	fLoRAName
	fExtraKeys
	fGroupIdx
	fSpecKind
	fSlidingWindow
	fUnknown
)

// removedFields maps BlockRemoved's array positions onto the same field ids.
var removedFields = [...]int{fHashes, fMedium, fGroupIdx}

func fieldByName(k []byte) int {
	switch string(k) {
	case "block_hashes":
		return fHashes
	case "parent_block_hash":
		return fParent
	case "token_ids":
		return fTokens
	case "block_size":
		return fBlockSize
	case "lora_id":
		return fLoRAID
	case "medium":
		return fMedium
	case "lora_name":
		return fLoRAName
	case "extra_keys":
		return fExtraKeys
	case "group_idx":
		return fGroupIdx
	case "kv_cache_spec_kind":
		return fSpecKind
	case "kv_cache_spec_sliding_window":
		return fSlidingWindow
	}
	return fUnknown
}

// event decodes one event; nil, nil for an event of unknown type (skipped).
func (r *decoder) event() (Event, error) {
	c, err := r.peek()
	if err != nil {
		return nil, err
	}
	var s BlockStored
	switch {
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32:
		n, err := r.arrayLen()
		if err != nil {
			return nil, err
		}
		if n < 1 {
			return nil, errors.New("empty event array")
		}
		tag, err := r.bytes()
		if err != nil {
			return nil, fmt.Errorf("event type: %w", err)
		}
		typ := string(tag) // no allocation: compared, not kept
		for i := 0; i < n-1; i++ {
			f := fUnknown
			switch typ {
			case TypeBlockStored:
				f = i
			case TypeBlockRemoved:
				if i < len(removedFields) {
					f = removedFields[i]
				}
			}
			if err := r.field(f, &s); err != nil {
				return nil, err
			}
		}
		return makeEvent(typ, &s), nil
	case msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		n, err := r.mapLen()
		if err != nil {
			return nil, err
		}
		// Find "type" first, wherever it is: an unknown event's fields may
		// have any types, so they must not be decoded as known fields.
		start := r.pos()
		if n > 0 {
			// vLLM's tagged encoding puts "type" first: then one pass.
			k, err := r.bytes()
			if err != nil {
				return nil, fmt.Errorf("event key: %w", err)
			}
			if string(k) == "type" {
				typ, err := r.bytes()
				if err != nil {
					return nil, fmt.Errorf("event type: %w", err)
				}
				known := knownType(string(typ))
				for range n - 1 {
					k, err := r.bytes()
					if err != nil {
						return nil, fmt.Errorf("event key: %w", err)
					}
					f := fUnknown
					if known && string(k) != "type" {
						f = fieldByName(k)
					}
					if err := r.field(f, &s); err != nil {
						return nil, err
					}
				}
				if !known {
					return nil, nil // skipped whole; the caller counts it
				}
				return makeEvent(string(typ), &s), nil
			}
			r.advance(start - r.pos())
		}
		var typ []byte
		hasType := false
		for range n {
			k, err := r.bytes()
			if err != nil {
				return nil, fmt.Errorf("event key: %w", err)
			}
			if string(k) == "type" {
				if typ, err = r.bytes(); err != nil {
					return nil, fmt.Errorf("event type: %w", err)
				}
				hasType = true
				continue
			}
			if err := r.skip(0); err != nil {
				return nil, err
			}
		}
		if !hasType {
			return nil, errors.New(`event map without "type"`)
		}
		if !knownType(string(typ)) {
			return nil, nil // skipped whole; the caller counts it
		}
		end := r.pos()
		r.advance(start - end)
		for range n {
			k, err := r.bytes()
			if err != nil {
				return nil, fmt.Errorf("event key: %w", err)
			}
			f := fUnknown
			if string(k) != "type" {
				f = fieldByName(k)
			}
			if err := r.field(f, &s); err != nil {
				return nil, err
			}
		}
		return makeEvent(string(typ), &s), nil
	}
	return nil, fmt.Errorf("event: want an array or a map, got code %#x", c)
}

func knownType(typ string) bool {
	switch typ {
	case TypeBlockStored, TypeBlockRemoved, TypeAllBlocksCleared:
		return true
	}
	return false
}

// makeEvent builds the event of type typ from the fields decoded into s; nil
// for an unknown type.
func makeEvent(typ string, s *BlockStored) Event {
	switch typ {
	case TypeBlockStored:
		return *s
	case TypeBlockRemoved:
		return BlockRemoved{BlockHashes: s.BlockHashes, Medium: s.Medium, GroupIdx: s.GroupIdx}
	case TypeAllBlocksCleared:
		return AllBlocksCleared{}
	}
	return nil
}

func (r *decoder) field(f int, s *BlockStored) error {
	var err error
	switch f {
	case fHashes:
		if s.BlockHashes, err = r.hashes(); err != nil {
			return fmt.Errorf("block_hashes: %w", err)
		}
	case fParent:
		isNil, err := r.isNil()
		if err != nil {
			return fmt.Errorf("parent_block_hash: %w", err)
		}
		if !isNil {
			if s.ParentHash, err = r.hash(); err != nil {
				return fmt.Errorf("parent_block_hash: %w", err)
			}
			s.HasParent = true
		}
	case fTokens:
		if s.TokenIDs, err = r.tokens(); err != nil {
			return fmt.Errorf("token_ids: %w", err)
		}
	case fBlockSize:
		v, err := r.optInt64("block_size")
		if err != nil {
			return err
		}
		if v != nil {
			if *v < 0 || *v > math.MaxInt32 {
				return fmt.Errorf("block_size %d out of range", *v)
			}
			s.BlockSize = int(*v)
		}
	case fLoRAID:
		s.LoRAID, err = r.optInt64("lora_id")
	case fMedium:
		s.Medium, err = r.medium()
	case fLoRAName:
		s.LoRAName, err = r.optString("lora_name")
	case fExtraKeys:
		if isNil, e := r.isNil(); e != nil || isNil {
			return e
		}
		if s.ExtraKeys, err = r.raw(); err != nil {
			return fmt.Errorf("extra_keys: %w", err)
		}
	case fGroupIdx:
		s.GroupIdx, err = r.optInt64("group_idx")
	case fSpecKind:
		s.KVCacheSpecKind, err = r.optString("kv_cache_spec_kind")
	case fSlidingWindow:
		s.KVCacheSpecSlidingWindow, err = r.optInt64("kv_cache_spec_sliding_window")
	default:
		err = r.skip(1)
	}
	return err
}

// Salt returns the cache salt the blocks of s were hashed under, as vLLM
// puts it in extra_keys (vllm/distributed/kv_events.py, BlockStored:
// extra_keys is a list with one entry per block, None or a tuple;
// vllm-project/vllm at 0181ea3173e53eea8cf04a86891488e3dc89bb34). A
// block's tuple is lora_extra_keys + mm_extra_keys + cache_salt_keys +
// prompt_embeds_keys (vllm/v1/core/kv_cache_utils.py,
// generate_block_hash_extra_keys, at
// 001cabc1be16a59a70d720ed61a13b678c060a18): the adapter's name (a str,
// when the request has one: s.LoRAName), then per multimodal item an
// (identifier, offset) tuple, then the salt (a str, in the prompt's first
// block only: start_token_idx == 0), then prompt-embedding hashes
// (bytes). So the salt is the first block's last str element, once a
// leading lora_name and trailing bytes are set aside. Releases whose
// multimodal keys were bare identifier strs make an identifier look like a
// salt: such a chain is keyed apart and never predicted for anyone, a
// miss rather than a false hit.
//
// It returns "", true when the first block has no salt (no extra_keys,
// None, or no str in its place), and ok false when extra_keys is not in
// vLLM's shape (not a list of None or tuples): the caller must then keep
// the blocks apart from every request's keys. Only a chain's first event
// (no parent) carries the salt; the later ones chain after it.
func (s *BlockStored) Salt() (salt string, ok bool) {
	if len(s.ExtraKeys) == 0 {
		return "", true
	}
	r := decoderPool.Get().(*decoder)
	defer func() {
		r.reset(nil)
		decoderPool.Put(r)
	}()
	r.reset(s.ExtraKeys)
	if isNil, err := r.isNil(); err != nil || isNil {
		return "", err == nil
	}
	n, err := r.arrayLen()
	if err != nil {
		return "", false
	}
	if n == 0 {
		return "", true
	}
	if isNil, err := r.isNil(); err != nil || isNil {
		return "", err == nil
	}
	m, err := r.arrayLen()
	if err != nil {
		return "", false
	}
	// The tuple's elements, as kinds: str elements kept.
	const (
		kindStr = iota
		kindBin
		kindOther
	)
	type elem struct {
		kind int
		s    []byte
	}
	var buf [8]elem
	elems := buf[:0]
	for range m {
		c, err := r.peek()
		if err != nil {
			return "", false
		}
		switch {
		case msgpcode.IsString(c):
			b, err := r.bytes()
			if err != nil {
				return "", false
			}
			elems = append(elems, elem{kindStr, b})
		case msgpcode.IsBin(c):
			if err := r.skip(2); err != nil {
				return "", false
			}
			elems = append(elems, elem{kind: kindBin})
		default:
			if err := r.skip(2); err != nil {
				return "", false
			}
			elems = append(elems, elem{kind: kindOther})
		}
	}
	if s.LoRAName != nil && len(elems) > 0 && elems[0].kind == kindStr && string(elems[0].s) == *s.LoRAName {
		elems = elems[1:]
	}
	for len(elems) > 0 && elems[len(elems)-1].kind == kindBin {
		elems = elems[:len(elems)-1]
	}
	if len(elems) == 0 || elems[len(elems)-1].kind != kindStr {
		return "", true
	}
	return string(elems[len(elems)-1].s), true
}
