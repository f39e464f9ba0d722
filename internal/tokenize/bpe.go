package tokenize

import (
	"hash/maphash"
	"strings"
	"sync/atomic"
)

// byteToRune is GPT-2's bytes_to_unicode table: every byte maps to a
// printable rune, so byte-level BPE vocabularies are stored as text. The
// printable bytes '!'..'~', '¡'..'¬' and '®'..'ÿ' map to themselves, the
// other 68 to U+0100 onwards in byte order.
var byteToRune = func() (t [256]rune) {
	n := rune(0)
	for b := 0; b < 256; b++ {
		if ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b && b <= 0xFF) {
			t[b] = rune(b)
		} else {
			t[b] = 256 + n
			n++
		}
	}
	return t
}()

// runeToByte inverts byteToRune; -1 marks runes that encode no byte.
var runeToByte = func() map[rune]byte {
	m := make(map[rune]byte, 256)
	for b, r := range byteToRune {
		m[r] = byte(b)
	}
	return m
}()

// mergeKey packs a pair of token ids into a merges-table key.
func mergeKey(a, b uint32) uint64 { return uint64(a)<<32 | uint64(b) }

// A merge is the result of merging a pair: its rank (lower merges first)
// in the high 32 bits and the merged token's id in the low 32 bits.
type merge uint64

func (m merge) rank() uint32 { return uint32(m >> 32) }
func (m merge) id() uint32   { return uint32(m) }

// wordCache is a bounded, direct-mapped cache from a pre-token's bytes to its
// BPE ids. Slots are replaced, never grown, so memory is bounded by
// cacheSlots entries of at most maxCachedWord bytes each. Entries are
// immutable and published through atomic pointers, so the cache is safe for
// concurrent use without locks; a lost race only costs a recomputation.
type wordCache struct {
	seed  maphash.Seed
	slots []atomic.Pointer[cacheEntry]
}

// cacheEntry holds a word (a copy, so the cache never pins request text)
// and its ids; up to len(inline) ids are stored inline, so inserting most
// words costs two allocations.
type cacheEntry struct {
	word   string
	ids    []uint32
	inline [6]uint32
}

const (
	cacheSlots    = 1 << 18
	maxCachedWord = 128
)

func newWordCache() *wordCache {
	return &wordCache{seed: maphash.MakeSeed(), slots: make([]atomic.Pointer[cacheEntry], cacheSlots)}
}

func (c *wordCache) slot(word string) *atomic.Pointer[cacheEntry] {
	return &c.slots[maphash.String(c.seed, word)&(cacheSlots-1)]
}

// bpe appends the ids of one pre-token (raw bytes) to out.
func (t *Tokenizer) bpe(word string, out []uint32) []uint32 {
	if len(word) == 1 {
		return append(out, t.byteID[word[0]])
	}
	if t.ignoreMerges {
		if id, ok := t.vocab[word]; ok {
			return append(out, id)
		}
	}
	var sl *atomic.Pointer[cacheEntry]
	if len(word) <= maxCachedWord {
		sl = t.cache.slot(word)
		if e := sl.Load(); e != nil && e.word == word {
			return append(out, e.ids...)
		}
	}
	start := len(out)
	if len(word) <= 64 {
		out = t.bpeShort(word, out)
	} else {
		out = t.bpeLong(word, out)
	}
	if sl != nil {
		e := &cacheEntry{word: strings.Clone(word)}
		if n := len(out) - start; n <= len(e.inline) {
			e.ids = e.inline[:n:n]
		} else {
			e.ids = make([]uint32, n)
		}
		copy(e.ids, out[start:])
		sl.Store(e)
	}
	return out
}

const noMerge = ^uint64(0)

// bpeShort merges a word of at most 64 bytes by repeatedly merging the
// leftmost pair of lowest rank, with all state on the stack.
func (t *Tokenizer) bpeShort(word string, out []uint32) []uint32 {
	var symBuf [64]uint32
	var rankBuf [64]uint64 // rank<<32|newID of pair (k, k+1), or noMerge
	n := len(word)
	syms := symBuf[:n]
	for i := 0; i < n; i++ {
		syms[i] = t.byteID[word[i]]
	}
	ranks := rankBuf[:n-1]
	for k := range ranks {
		ranks[k] = t.pairMerge(syms[k], syms[k+1])
	}
	for len(syms) > 1 {
		bi, best := -1, noMerge
		for k, r := range ranks {
			if r < best {
				bi, best = k, r
			}
		}
		if bi < 0 {
			break
		}
		syms[bi] = merge(best).id()
		copy(syms[bi+1:], syms[bi+2:])
		syms = syms[:len(syms)-1]
		copy(ranks[bi:], ranks[bi+1:])
		ranks = ranks[:len(ranks)-1]
		if bi > 0 {
			ranks[bi-1] = t.pairMerge(syms[bi-1], syms[bi])
		}
		if bi < len(ranks) {
			ranks[bi] = t.pairMerge(syms[bi], syms[bi+1])
		}
	}
	return append(out, syms...)
}

// pairMerge returns the merge of (a, b) as rank<<32|id, or noMerge.
func (t *Tokenizer) pairMerge(a, b uint32) uint64 {
	return t.merges.get(mergeKey(a, b))
}

// mergeTable is an open-addressing hash table from mergeKey to
// rank<<32|id, read-only after construction. It is about twice as fast as a
// Go map for this hot lookup. Keys are never emptyKey, because token ids are
// below 2^32-1.
type mergeTable struct {
	slots []mergeSlot
	shift uint
}

type mergeSlot struct{ key, val uint64 }

const emptyKey = ^uint64(0)

func newMergeTable(n int) *mergeTable {
	bits := uint(1)
	for 1<<bits < 3*n { // load factor at most 1/3: short probes
		bits++
	}
	m := &mergeTable{slots: make([]mergeSlot, 1<<bits), shift: 64 - bits}
	for i := range m.slots {
		m.slots[i].key = emptyKey
	}
	return m
}

func (m *mergeTable) home(k uint64) uint64 { return (k * 0x9E3779B97F4A7C15) >> m.shift }

// put inserts k unless it is present; it reports whether it inserted.
func (m *mergeTable) put(k, v uint64) bool {
	mask := uint64(len(m.slots) - 1)
	for i := m.home(k); ; i = (i + 1) & mask {
		switch m.slots[i].key {
		case k:
			return false
		case emptyKey:
			m.slots[i] = mergeSlot{k, v}
			return true
		}
	}
}

func (m *mergeTable) get(k uint64) uint64 {
	mask := uint64(len(m.slots) - 1)
	for i := m.home(k); ; i = (i + 1) & mask {
		s := &m.slots[i]
		if s.key == k {
			return s.val
		}
		if s.key == emptyKey {
			return noMerge
		}
	}
}

// bpeLong merges a long word (runs of spaces, long identifiers) in
// O(n log n) with a min-heap of candidate merges keyed by (rank, position),
// the algorithm of the Hugging Face tokenizers library: the leftmost pair of
// lowest rank merges first, as in bpeShort.
func (t *Tokenizer) bpeLong(word string, out []uint32) []uint32 {
	n := len(word)
	ids := make([]uint32, n)
	prev := make([]int32, n)
	next := make([]int32, n)
	for i := 0; i < n; i++ {
		ids[i] = t.byteID[word[i]]
		prev[i] = int32(i - 1)
		next[i] = int32(i + 1)
	}
	next[n-1] = -1
	h := make(mergeHeap, 0, n)
	for i := 0; i+1 < n; i++ {
		if m := t.pairMerge(ids[i], ids[i+1]); m != noMerge {
			h.push(m>>32<<32 | uint64(i))
		}
	}
	for len(h) > 0 {
		e := h.pop()
		pos := int32(uint32(e))
		rank := uint32(e >> 32)
		if ids[pos] == ^uint32(0) { // merged away
			continue
		}
		nx := next[pos]
		if nx < 0 {
			continue
		}
		m := t.pairMerge(ids[pos], ids[nx])
		if m == noMerge || uint32(m>>32) != rank {
			continue // stale: the pair changed since it was pushed
		}
		ids[pos] = merge(m).id()
		ids[nx] = ^uint32(0)
		nn := next[nx]
		next[pos] = nn
		if nn >= 0 {
			prev[nn] = pos
			if m2 := t.pairMerge(ids[pos], ids[nn]); m2 != noMerge {
				h.push(m2>>32<<32 | uint64(pos))
			}
		}
		if p := prev[pos]; p >= 0 {
			if m2 := t.pairMerge(ids[p], ids[pos]); m2 != noMerge {
				h.push(m2>>32<<32 | uint64(p))
			}
		}
	}
	for i := int32(0); i >= 0; i = next[i] {
		out = append(out, ids[i])
	}
	return out
}

// mergeHeap is a binary min-heap of rank<<32|position.
type mergeHeap []uint64

func (h *mergeHeap) push(v uint64) {
	*h = append(*h, v)
	s := *h
	i := len(s) - 1
	for i > 0 {
		p := (i - 1) / 2
		if s[p] <= s[i] {
			break
		}
		s[p], s[i] = s[i], s[p]
		i = p
	}
}

func (h *mergeHeap) pop() uint64 {
	s := *h
	top := s[0]
	last := len(s) - 1
	s[0] = s[last]
	s = s[:last]
	i := 0
	for {
		l := 2*i + 1
		if l >= len(s) {
			break
		}
		m := l
		if r := l + 1; r < len(s) && s[r] < s[l] {
			m = r
		}
		if s[i] <= s[m] {
			break
		}
		s[i], s[m] = s[m], s[i]
		i = m
	}
	*h = s
	return top
}
