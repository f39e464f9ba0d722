package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"unsafe"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// TokenizerQwen3 is the tokenizer spec (Config.Tokenizer, --tokenizer) of
// the Qwen3 tokenizer bundled in the binary.
const TokenizerQwen3 = "qwen3"

// LoadTokenizer loads the tokenizer a spec names: TokenizerQwen3 for the
// bundled one, else a tokenizer.json (gzip-compressed or not) or a model
// directory (tokenize.Load).
func LoadTokenizer(spec string) (*tokenize.Tokenizer, error) {
	if spec == TokenizerQwen3 {
		return qwen3.Load()
	}
	return tokenize.Load(spec)
}

// TokenizerKeyer keys prompts by the token ids the replicas' own tokenizer
// gives them, so that the router's keys are the replicas' KV blocks: text
// prompts are encoded (add_special_tokens=false), chats rendered with the
// model's chat template (tools, add_generation_prompt and
// chat_template_kwargs from the body) and encoded, exactly as vLLM renders
// and tokenizes them; token-id prompts are keyed as they are. Encoding goes
// through a tokenize.PrefixCache, so a long shared prefix is tokenized once,
// and block keys through a memo of recent prompts' keys (keyMemo), so it is
// hashed into keys once.
//
// Set to fall back (SetFallback, done by the Proxy when a replica's
// /tokenize disagrees), it keys text and chats as ChunkKeyer does. A chat
// the template cannot render (no template, or the template rejects it) is
// keyed as ChunkKeyer does too. A TokenizerKeyer is safe for concurrent use.
type TokenizerKeyer struct {
	cache       *tokenize.PrefixCache
	blockTokens int
	fallback    atomic.Bool
	memo        *keyMemo
}

var _ Keyer = (*TokenizerKeyer)(nil)

// NewTokenizerKeyer returns a keyer over tok with keys of blockTokens
// tokens, a PrefixCache of the default size and a key memo of at most
// memoMaxKeys keys.
func NewTokenizerKeyer(tok *tokenize.Tokenizer, blockTokens int) *TokenizerKeyer {
	return &TokenizerKeyer{cache: tokenize.NewPrefixCache(tok, 0), blockTokens: blockTokens, memo: newKeyMemo(blockTokens)}
}

// Tokenizer returns the keyer's tokenizer.
func (k *TokenizerKeyer) Tokenizer() *tokenize.Tokenizer { return k.cache.Tokenizer() }

// Cache returns the keyer's prefix cache.
func (k *TokenizerKeyer) Cache() *tokenize.PrefixCache { return k.cache }

// BlockTokens is the tokens per key.
func (k *TokenizerKeyer) BlockTokens() int { return k.blockTokens }

// SetFallback switches text and chat keying to ChunkKeyer's (on) or back to
// token ids (off).
func (k *TokenizerKeyer) SetFallback(on bool) { k.fallback.Store(on) }

// Fallback reports whether the keyer keys text as ChunkKeyer does.
func (k *TokenizerKeyer) Fallback() bool { return k.fallback.Load() }

// Keys implements Keyer. A batch is keyed by its first prompt; its prompt
// tokens count every prompt. A chat's ids go to a pooled buffer, and its
// block keys through the keyer's memo of recent prompts (keyMemo).
func (k *TokenizerKeyer) Keys(r *Request) ([]blocks.Key, int, error) {
	chunk := ChunkKeyer{BlockTokens: k.blockTokens}
	if k.fallback.Load() {
		return chunk.Keys(r)
	}
	var keys []blocks.Key
	total := 0
	switch {
	case r.Chat != nil:
		buf := idsPool.Get().(*[]uint32)
		ids, err := k.cache.AppendEncodeChat((*buf)[:0], r.Chat.Messages, chatOptions(r.Chat))
		if err != nil {
			idsPool.Put(buf)
			return chunk.Keys(r)
		}
		keys = k.memo.keys(ids)
		total = len(ids)
		if cap(ids) <= maxPooledIDs {
			*buf = ids[:0]
			idsPool.Put(buf)
		}
	default:
		for i, text := range r.Texts {
			ids := k.cache.Encode(text)
			if i == 0 {
				keys = k.memo.keys(ids)
			}
			total += len(ids)
		}
	}
	for i, ids := range r.TokenIDs {
		if i == 0 && len(keys) == 0 {
			keys = k.memo.keys(ids)
		}
		total += len(ids)
	}
	return keys, max(total, len(keys)*k.blockTokens, 1), nil
}

// keyMemo remembers the block keys of recent prompts, so that a prompt
// that shares a long prefix with one of them is hashed by blocks.Keys
// (about 60 ns a block) only from about where they part: the keys of a
// 58k-token chat whose first 57k tokens were keyed before cost one quick
// fingerprinting pass over its ids and the hashing of its last blocks.
//
// A prompt's ids are fingerprinted at every checkpoint of memoStride
// blocks: the fingerprint is a seeded maphash of the checkpoint's ids
// chained onto the previous one, so it stands for all the ids before it,
// as a block key does. The memo maps each fingerprint of a recent prompt
// to that prompt's keys, and a new prompt takes the keys up to its last
// checkpoint found there. Equal fingerprints are taken for equal ids: a
// false match (a collision of two 64-bit hashes under a random seed, about
// 2⁻⁶⁴ a lookup) would only route one request as if it shared a prefix
// it does not have. Memory is bounded: least recently used prompts are
// forgotten once the keys held exceed memoMaxKeys. A keyMemo is safe for
// concurrent use; its lock is held for map lookups and inserts only.
type keyMemo struct {
	blockTokens int
	seed        maphash.Seed

	mu      sync.Mutex // guards byPrint, lru and held
	byPrint map[uint64]*memoEntry
	lru     memoEntry // sentinel: lru.next is the most recently used
	held    int       // keys held by the entries
}

// memoEntry is one prompt's keys and checkpoint fingerprints.
type memoEntry struct {
	keys       []blocks.Key // shared with the router, which never changes them
	prints     []uint64
	prev, next *memoEntry
}

const (
	// memoStride is the blocks between checkpoints: with 16-token blocks,
	// at most 1023 tokens of a shared prefix are hashed again.
	memoStride = 64
	// memoMaxKeys bounds the keys a keyMemo holds (8 MiB).
	memoMaxKeys = 1 << 20
)

func newKeyMemo(blockTokens int) *keyMemo {
	m := &keyMemo{blockTokens: blockTokens, seed: maphash.MakeSeed(), byPrint: make(map[uint64]*memoEntry)}
	m.lru.next, m.lru.prev = &m.lru, &m.lru
	return m
}

// keys returns blocks.Keys(nil, ids, blockTokens), reusing the keys of
// a recent prompt that shares a prefix with ids.
func (m *keyMemo) keys(ids []uint32) []blocks.Key {
	bs := m.blockTokens
	n := len(ids) / bs
	checks := n / memoStride
	if checks == 0 {
		return blocks.Keys(nil, ids, bs)
	}
	prints := make([]uint64, checks)
	prev := uint64(0x9E3779B97F4A7C15)
	step := memoStride * bs
	for c := range prints {
		seg := ids[c*step : (c+1)*step]
		// The ids' bytes as they lie in memory: the fingerprints only
		// meet other fingerprints of this process.
		raw := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(seg))), 4*len(seg))
		prev = chainPrint(prev, maphash.Bytes(m.seed, raw))
		prints[c] = prev
	}
	out := make([]blocks.Key, 0, n)
	found := -1 // the last checkpoint found
	m.mu.Lock()
	for c := checks - 1; c >= 0; c-- {
		if e := m.byPrint[prints[c]]; e != nil && len(e.keys) >= (c+1)*memoStride {
			out = append(out, e.keys[:(c+1)*memoStride]...)
			m.unlink(e)
			m.pushFront(e)
			found = c
			break
		}
	}
	m.mu.Unlock()
	out = blocks.Keys(out, ids[len(out)*bs:], bs)
	if found == checks-1 {
		return out // every checkpoint is known already
	}
	e := &memoEntry{keys: out, prints: prints}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, p := range prints {
		m.byPrint[p] = e
	}
	m.pushFront(e)
	m.held += len(out)
	for m.held > memoMaxKeys {
		old := m.lru.prev
		m.unlink(old)
		m.held -= len(old.keys)
		for _, p := range old.prints {
			if m.byPrint[p] == old {
				delete(m.byPrint, p)
			}
		}
	}
	return out
}

func (m *keyMemo) unlink(e *memoEntry) {
	e.prev.next, e.next.prev = e.next, e.prev
	e.prev, e.next = nil, nil
}

func (m *keyMemo) pushFront(e *memoEntry) {
	e.prev, e.next = &m.lru, m.lru.next
	m.lru.next.prev = e
	m.lru.next = e
}

// chainPrint chains a checkpoint's hash onto the previous fingerprint
// (SplitMix64's finaliser over their combination).
func chainPrint(prev, h uint64) uint64 {
	x := prev*0xBF58476D1CE4E5B9 ^ h
	x ^= x >> 30
	x *= 0xBF58476D1CE4E5B9
	x ^= x >> 27
	x *= 0x94D049BB133111EB
	return x ^ x>>31
}

// idsPool recycles the token ids of the chats Keys encodes (a 60k-token
// chat's are 240 KB).
var idsPool = sync.Pool{New: func() any { return new([]uint32) }}

// maxPooledIDs bounds the buffers idsPool keeps (4 MiB of ids).
const maxPooledIDs = 1 << 20

// EncodeChat renders c with the chat template and encodes it.
func (k *TokenizerKeyer) EncodeChat(c *ChatPrompt) ([]uint32, error) {
	return k.cache.EncodeChat(c.Messages, chatOptions(c))
}

// chatOptions are the template options of c.
func chatOptions(c *ChatPrompt) tokenize.ChatOptions {
	return tokenize.ChatOptions{AddGenerationPrompt: c.AddGenerationPrompt, Tools: c.Tools, Kwargs: c.Kwargs}
}

// The probe's inputs: text and a chat that exercise what tokenizers
// disagree on (digits, runs of spaces, newlines, code, non-ASCII, the chat
// template's special tokens).
const probePrompt = "prefixlb tokenizer probe: The quick brown fox jumps over the lazy dog. " +
	"1234567 + 89 = 1234656\n\n\tdef f(x):\n        return x**2  # naïve café, 日本語, 🙂\n"

var probeMessages = []tokenize.Message{
	{Role: "system", Content: "You are a helpful assistant."},
	{Role: "user", Content: "prefixlb probe: what is 12+30?\nAnswer in one word."},
}

// Tokenizer match states (prefixlb_tokenizer_match).
const (
	tokUnknown  = -1 // not probed yet, or the replica cannot tokenize (no /tokenize)
	tokMismatch = 0
	tokMatch    = 1
)

// errProbeTransport marks a probe that got no HTTP answer: it is retried
// after the replica's next good health check.
var errProbeTransport = errors.New("no answer")

// tokenizerProbe is the state of the tokenizer checks: which replicas are
// due a probe, and what each last probe found.
type tokenizerProbe struct {
	keyer *TokenizerKeyer
	// want are the local tokenizer's ids of the probe prompt and chat
	// (wantChat nil when the tokenizer has no chat template).
	want, wantChat []uint32

	mu    sync.Mutex // guards due and state
	due   []bool
	state []int
}

// newTokenizerProbe prepares the probe for n replicas, all due.
func newTokenizerProbe(k *TokenizerKeyer, n int) *tokenizerProbe {
	tp := &tokenizerProbe{keyer: k, due: make([]bool, n), state: make([]int, n)}
	tp.want = k.Tokenizer().Encode(probePrompt)
	if ids, err := k.Tokenizer().EncodeChat(probeMessages, tokenize.ChatOptions{AddGenerationPrompt: true}); err == nil {
		tp.wantChat = ids
	}
	for i := range n {
		tp.due[i], tp.state[i] = true, tokUnknown
	}
	return tp
}

// markDue makes replica id due a probe (it was re-admitted).
func (tp *tokenizerProbe) markDue(id int) {
	tp.mu.Lock()
	tp.due[id] = true
	tp.mu.Unlock()
}

// isDue reports whether replica id is due a probe.
func (tp *tokenizerProbe) isDue(id int) bool {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return tp.due[id]
}

// set records replica id's state and returns whether any replica
// mismatches now.
func (tp *tokenizerProbe) set(id, state int) (anyMismatch bool) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	tp.due[id] = false
	tp.state[id] = state
	return slices.Contains(tp.state, tokMismatch)
}

// probeTokenizer compares the local tokenizer with replica b's /tokenize on
// the probe prompt and chat, if b is due a probe, and sets the keyer's
// fallback: on while any replica mismatches. A replica without /tokenize
// (an HTTP error) is "unknown" and does not stop token keying; one that
// did not answer stays due.
func (p *Proxy) probeTokenizer(ctx context.Context, b *backend) {
	tp := p.tokProbe
	if tp == nil || !tp.isDue(b.id) {
		return
	}
	state, err := p.compareTokenizer(ctx, b)
	if ctx.Err() != nil {
		return
	}
	if errors.Is(err, errProbeTransport) {
		p.log.Debug("tokenizer probe: no answer; retrying after the next health check", "replica", b.name, "err", err)
		return
	}
	anyMismatch := tp.set(b.id, state)
	p.m.tokMatch.WithLabelValues(b.name).Set(float64(state))
	switch state {
	case tokMatch:
		p.log.Info("tokenizer matches the replica's", "replica", b.name)
	case tokMismatch:
		p.log.Warn("tokenizer differs from the replica's /tokenize: keying text and chats by text chunks for every replica",
			"replica", b.name, "err", err)
	default:
		p.log.Warn("cannot verify the tokenizer: the replica's /tokenize failed; keeping token keys", "replica", b.name, "err", err)
	}
	if was := tp.keyer.Fallback(); was != anyMismatch {
		tp.keyer.SetFallback(anyMismatch)
		if !anyMismatch {
			p.log.Info("every probed replica's tokenizer matches again: keying text and chats by token ids")
		}
	}
	p.m.tokFallback.Set(boolFloat(anyMismatch))
	if p.hookProbe != nil {
		p.hookProbe(b.name, state)
	}
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// compareTokenizer posts the probe prompt and chat to b's /tokenize and
// compares the ids with the local tokenizer's. An HTTP error status makes
// the state unknown; no answer at all wraps errProbeTransport.
func (p *Proxy) compareTokenizer(ctx context.Context, b *backend) (int, error) {
	tp := p.tokProbe
	got, err := p.tokenizeOn(ctx, b, map[string]any{"prompt": probePrompt})
	if err != nil {
		return tokUnknown, err
	}
	if !slices.Equal(got, tp.want) {
		return tokMismatch, fmt.Errorf("probe prompt: replica %d ids, local %d ids (first difference at %d)",
			len(got), len(tp.want), firstDiff(got, tp.want))
	}
	if tp.wantChat == nil {
		return tokMatch, nil
	}
	got, err = p.tokenizeOn(ctx, b, map[string]any{"messages": probeMessages, "add_generation_prompt": true})
	if err != nil {
		return tokUnknown, err
	}
	if !slices.Equal(got, tp.wantChat) {
		return tokMismatch, fmt.Errorf("probe chat: replica %d ids, local %d ids (first difference at %d)",
			len(got), len(tp.wantChat), firstDiff(got, tp.wantChat))
	}
	return tokMatch, nil
}

// firstDiff is the first index where a and b differ.
func firstDiff(a, b []uint32) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// tokenizeOn POSTs body to b's /tokenize (bounded by HealthTimeout) and
// returns the ids it answers (vLLM: {"tokens":[...],"count":N}).
func (p *Proxy) tokenizeOn(ctx context.Context, b *backend, body any) ([]uint32, error) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.HealthTimeout)
	defer cancel()
	js, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("proxy: tokenize on %s: %w", b.name, err)
	}
	u := *b.url
	u.Path = trimSlash(b.url.Path) + "/tokenize"
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(js))
	if err != nil {
		return nil, fmt.Errorf("proxy: tokenize on %s: %w", b.name, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.checks.Do(req)
	if err != nil {
		return nil, fmt.Errorf("proxy: tokenize on %s: %w: %w", b.name, errProbeTransport, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("proxy: tokenize on %s: %w: %w", b.name, errProbeTransport, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, fmt.Errorf("proxy: tokenize on %s: status %d", b.name, resp.StatusCode)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("proxy: tokenize on %s: decode answer: %w", b.name, err)
	}
	return out.Tokens, nil
}
