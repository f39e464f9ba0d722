package tokenize

import (
	"hash/maphash"
	"slices"
	"strings"
	"sync"
)

// DefaultPrefixCacheTokens is a PrefixCache size that holds the prefixes of
// a busy router (about 4M tokens, roughly 40 MiB with their text).
const DefaultPrefixCacheTokens = 1 << 22

// minChunk is the smallest chunk, in bytes, that PrefixCache cuts ordinary
// text into: small enough that little is re-tokenised after a divergence,
// large enough that hashing and lookups cost far less than BPE.
const minChunk = 512

// PrefixCache encodes text like Tokenizer.Encode, reusing the ids of leading
// text it has seen recently, so a prompt whose long prefix was routed before
// is only tokenised from where it diverges.
//
// Text is cut into chunks: at every added/special token, and inside ordinary
// text at the first safe boundary after minChunk bytes. A boundary is safe
// when the pre-tokenizer always splits there and normalisation cannot
// combine across it, so the ids of a chunk do not depend on what follows it:
// after a newline that is followed by a non-space character, or between an
// ASCII letter or digit and a space that precedes an ASCII letter. Each
// chunk's key hashes its text chained with the key of the chunk before it,
// like the block keys of a prefix cache, and maps to the chunk's ids. Text
// with no safe boundary (a megabyte of base64) is one chunk.
//
// Memory is bounded: once the cached ids exceed the budget, chunks are
// evicted oldest first, but a chunk hit since it was inserted or last
// passed over is moved to the front instead (the second-chance, or CLOCK,
// approximation of least-recently-used), so that a hit costs one store
// rather than a list move. A PrefixCache is safe for concurrent use: one
// mutex guards the table and is held only for lookups and inserts, never
// while tokenising.
//
// The work Encode does on the text of chunks it has seen, however long, is
// a scan for added tokens (vectorised) and for chunk boundaries (the bytes
// from minChunk to the next safe boundary of each chunk), one hash pass,
// one comparison of each chunk with its entry's text (so the ids are
// exactly Encode's, not just equal with overwhelming probability), and
// the copy of the ids.
type PrefixCache struct {
	tok       *Tokenizer
	seed      maphash.Seed
	maxTokens int

	mu      sync.Mutex // guards entries (and their used flags), the list, tokens and the counters
	entries map[uint64]*chunkEntry
	lru     chunkEntry // sentinel: lru.next is the newest (or last spared)
	tokens  int
	stats   PrefixCacheStats
}

// PrefixCacheStats counts a PrefixCache's work since it was made.
type PrefixCacheStats struct {
	Chunks     int   // chunks held now
	Tokens     int   // ids held now
	HitTokens  int64 // ids reused from the cache
	MissTokens int64 // ids produced by tokenising
}

type chunkEntry struct {
	key  uint64
	text string
	ids  []uint32
	// used is set by a hit; eviction gives a used entry a second chance
	// (moves it to the front, clearing used) rather than moving every
	// chunk of a long prompt on every hit.
	used       bool
	prev, next *chunkEntry
}

// NewPrefixCache returns a cache over tok holding at most maxTokens ids
// (DefaultPrefixCacheTokens when maxTokens <= 0).
func NewPrefixCache(tok *Tokenizer, maxTokens int) *PrefixCache {
	if maxTokens <= 0 {
		maxTokens = DefaultPrefixCacheTokens
	}
	c := &PrefixCache{tok: tok, seed: maphash.MakeSeed(), maxTokens: maxTokens, entries: make(map[uint64]*chunkEntry)}
	c.lru.next, c.lru.prev = &c.lru, &c.lru
	return c
}

// Tokenizer returns the tokenizer the cache encodes with.
func (c *PrefixCache) Tokenizer() *Tokenizer { return c.tok }

// Stats returns the cache's counters.
func (c *PrefixCache) Stats() PrefixCacheStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.stats
	s.Chunks, s.Tokens = len(c.entries), c.tokens
	return s
}

// piece is a chunk of a prompt: ordinary text, or one added token.
type piece struct {
	text    string
	key     uint64
	added   bool
	id      uint32 // added token id
	entry   *chunkEntry
	encoded []uint32
}

// piecePool recycles Encode's list of pieces (one per chunk: ~500 for a
// 240 KB prompt).
var piecePool = sync.Pool{New: func() any { return new([]piece) }}

// Encode returns exactly the ids Tokenizer.Encode returns for text.
func (c *PrefixCache) Encode(text string) []uint32 {
	return c.encode(nil, text, true)
}

// AppendEncode appends the ids Encode returns for text to dst and returns
// the extended slice: a caller that reuses dst saves allocating the ids.
func (c *PrefixCache) AppendEncode(dst []uint32, text string) []uint32 {
	return c.encode(dst, text, false)
}

// encode is AppendEncode; exact sizes a new result to its length (Encode's
// result is kept by its caller) rather than growing dst as append does. It
// keeps no reference to text (the cache's entries hold copies), so text
// may be a view of a buffer the caller reuses.
func (c *PrefixCache) encode(dst []uint32, text string, exact bool) []uint32 {
	pp := piecePool.Get().(*[]piece)
	pieces := (*pp)[:0]
	defer func() {
		clear(pieces) // drop the references to text, entries and ids
		if cap(pieces) <= 1<<16 {
			*pp = pieces[:0]
			piecePool.Put(pp)
		}
	}()
	c.tok.added.split(text, func(seg string, id uint32, isAdded bool) {
		if isAdded {
			pieces = append(pieces, piece{added: true, id: id})
			return
		}
		for len(seg) > 0 {
			n := safeCut(seg, minChunk, c.tok.compatNorm)
			pieces = append(pieces, piece{text: seg[:n]})
			seg = seg[n:]
		}
	})
	prev := uint64(0x9E3779B97F4A7C15)
	for i := range pieces {
		p := &pieces[i]
		var h uint64
		if p.added {
			h = uint64(p.id) ^ 0xA5A5A5A5A5A5A5A5
		} else {
			h = maphash.String(c.seed, p.text)
		}
		prev = mix(prev, h)
		p.key = prev
	}

	c.mu.Lock()
	for i := range pieces {
		p := &pieces[i]
		if p.added {
			continue
		}
		if e, ok := c.entries[p.key]; ok && e.text == p.text {
			p.entry = e
			e.used = true
		}
	}
	c.mu.Unlock()

	n, hit, miss := 0, 0, 0
	for i := range pieces {
		p := &pieces[i]
		switch {
		case p.added:
			n++
		case p.entry != nil:
			n += len(p.entry.ids)
			hit += len(p.entry.ids)
		default:
			p.encoded = c.tok.encodeOrdinary(make([]uint32, 0, len(p.text)/3+4), p.text)
			n += len(p.encoded)
			miss += len(p.encoded)
		}
	}
	var out []uint32
	if exact && dst == nil {
		out = make([]uint32, 0, n)
	} else {
		out = slices.Grow(dst, n)
	}
	for i := range pieces {
		p := &pieces[i]
		switch {
		case p.added:
			out = append(out, p.id)
		case p.entry != nil:
			out = append(out, p.entry.ids...)
		default:
			out = append(out, p.encoded...)
		}
	}

	c.mu.Lock()
	c.stats.HitTokens += int64(hit)
	c.stats.MissTokens += int64(miss)
	for i := range pieces {
		p := &pieces[i]
		if p.added || p.entry != nil || len(p.encoded) > c.maxTokens {
			continue
		}
		if e, ok := c.entries[p.key]; ok { // inserted concurrently, or a hash collision
			c.unlink(e)
			delete(c.entries, e.key)
			c.tokens -= len(e.ids)
		}
		e := &chunkEntry{key: p.key, text: strings.Clone(p.text), ids: p.encoded}
		c.entries[p.key] = e
		c.pushFront(e)
		c.tokens += len(e.ids)
	}
	for c.tokens > c.maxTokens {
		e := c.lru.prev
		if e.used { // a second chance
			e.used = false
			c.moveToFront(e)
			continue
		}
		c.unlink(e)
		delete(c.entries, e.key)
		c.tokens -= len(e.ids)
	}
	c.mu.Unlock()
	return out
}

// EncodeChat renders msgs with the tokenizer's chat template and encodes the
// result through the cache.
func (c *PrefixCache) EncodeChat(msgs []Message, opts ChatOptions) ([]uint32, error) {
	return c.AppendEncodeChat(nil, msgs, opts)
}

// AppendEncodeChat appends the ids EncodeChat returns to dst. A template
// with a native renderer renders into a pooled buffer.
func (c *PrefixCache) AppendEncodeChat(dst []uint32, msgs []Message, opts ChatOptions) ([]uint32, error) {
	bp := renderPool.Get().(*[]byte)
	if b, ok := c.tok.appendChat((*bp)[:0], msgs, opts); ok {
		// encode does not keep its text: the buffer can go back after it.
		out := c.encode(dst, bytesString(b), dst == nil)
		if cap(b) <= maxPooledRender {
			*bp = b[:0]
			renderPool.Put(bp)
		}
		return out, nil
	}
	renderPool.Put(bp)
	s, err := c.tok.ApplyChatTemplate(msgs, opts)
	if err != nil {
		return dst, err
	}
	return c.encode(dst, s, dst == nil), nil
}

func (c *PrefixCache) unlink(e *chunkEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

func (c *PrefixCache) pushFront(e *chunkEntry) {
	e.prev, e.next = &c.lru, c.lru.next
	c.lru.next.prev = e
	c.lru.next = e
}

func (c *PrefixCache) moveToFront(e *chunkEntry) {
	c.unlink(e)
	c.pushFront(e)
}

// mix chains a chunk hash onto the previous key (the finaliser of
// SplitMix64 over their combination), so equal chunks after different
// prefixes get different keys.
func mix(prev, h uint64) uint64 {
	x := prev*0xBF58476D1CE4E5B9 ^ h
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	x ^= x >> 31
	return x
}

// safeCut returns the length of the first chunk of s: up to the first safe
// boundary at or after min bytes, or all of s.
func safeCut(s string, min int, asciiOnly bool) int {
	for p := min; p < len(s); p++ {
		if isSafeBoundary(s, p, asciiOnly) {
			return p
		}
	}
	return len(s)
}

// isSafeBoundary reports whether ordinary text s can be cut before s[p]
// without changing its tokens (see PrefixCache). For the Qwen2/3, Llama-3
// and GPT-2 pre-tokenizers:
//   - after "\n" and before a non-space: every pre-token holding the newline
//     ends there (newline runs, punctuation followed by [\r\n]*, whitespace
//     runs), and the next one starts there;
//   - between an ASCII letter or digit and " " followed by an ASCII letter:
//     letter and digit runs and contractions end at the space, and the space
//     starts " word".
//
// Neither newline nor space composes under Unicode normalisation. With
// asciiOnly (compatibility normalisers, which can map a character to a
// space) the character after a newline must be ASCII.
func isSafeBoundary(s string, p int, asciiOnly bool) bool {
	if p <= 0 || p >= len(s) {
		return false
	}
	b := s[p]
	if s[p-1] == '\n' {
		if b < 0x80 {
			return asciiClass[b]&clsSpace == 0
		}
		if asciiOnly {
			return false
		}
		c, _ := classAt(s, p)
		return c&clsSpace == 0
	}
	return b == ' ' && p+1 < len(s) && isASCIIAlnum(s[p-1]) && isASCIILetter(s[p+1])
}

func isASCIILetter(b byte) bool { return ('a' <= b && b <= 'z') || ('A' <= b && b <= 'Z') }

func isASCIIAlnum(b byte) bool { return isASCIILetter(b) || ('0' <= b && b <= '9') }
