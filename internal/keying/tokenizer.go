package keying

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// Tokenizer specs (Config.Tokenizer, --tokenizer) with a meaning of their
// own; any other spec is a tokenizer.json or a model directory.
const (
	// TokenizerQwen3 is the Qwen3 tokenizer bundled in the binary.
	TokenizerQwen3 = "qwen3"
	// TokenizerAuto, the default, keys by the bundled Qwen3 tokenizer's
	// ids once a replica's /tokenize confirms them (and none disagrees),
	// and by text chunks until then (NewAutoTokenizerKeyer).
	TokenizerAuto = "auto"
	// TokenizerNone keys text and chats by text chunks (ChunkKeyer).
	TokenizerNone = "none"
)

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
	// cache is nil until the tokenizer is loaded (an auto keyer loads it
	// in the background on Load; ready is closed then, loadErr set if it
	// failed).
	cache       atomic.Pointer[tokenize.PrefixCache]
	ready       chan struct{}
	loadOnce    sync.Once
	loadErr     error
	blockTokens int
	fallback    atomic.Bool
	memo        *keyMemo
	// spec names the tokenizer (TokenizerQwen3, a path); auto says it was
	// chosen by TokenizerAuto, not configured.
	spec string
	auto bool
}

var _ Keyer = (*TokenizerKeyer)(nil)

// NewTokenizerKeyer returns a keyer over tok with keys of blockTokens
// tokens, a PrefixCache of the default size and a key memo of at most
// memoMaxKeys keys.
func NewTokenizerKeyer(tok *tokenize.Tokenizer, blockTokens int) *TokenizerKeyer {
	k := &TokenizerKeyer{blockTokens: blockTokens, memo: newKeyMemo(blockTokens), ready: make(chan struct{})}
	k.cache.Store(tokenize.NewPrefixCache(tok, 0))
	close(k.ready)
	return k
}

// NewAutoTokenizerKeyer is the keyer of TokenizerAuto: a TokenizerKeyer
// over the bundled Qwen3 tokenizer that starts in fallback (text chunks)
// and keys by token ids only while some replica's /tokenize has confirmed
// the tokenizer and none has shown other ids (the Pool's checks decide:
// cluster.Pool), once the tokenizer is loaded (Load). Qwen3's vocabulary is the one the replicas prefixlb is
// run against most often have (Qwen2.5/Qwen3 models, the llama.cpp test
// engine); any other model's replicas disagree on the probe and keep text
// chunks, as with no tokenizer at all.
func NewAutoTokenizerKeyer(blockTokens int) *TokenizerKeyer {
	k := &TokenizerKeyer{blockTokens: blockTokens, memo: newKeyMemo(blockTokens), ready: make(chan struct{}),
		spec: TokenizerQwen3, auto: true}
	k.fallback.Store(true)
	return k
}

// Load starts loading an auto keyer's tokenizer in the background, once
// (Ready is closed when it is done); the Pool calls it when a replica's
// /tokenize first confirms it. Loading takes a second or two of CPU and
// about 23 MiB of heap, which a router in front of another model's
// replicas never spends. Text stays keyed by chunks until it is loaded.
// For a keyer made by NewTokenizerKeyer it does nothing.
func (k *TokenizerKeyer) Load() {
	if !k.auto {
		return
	}
	k.loadOnce.Do(func() {
		go func() {
			defer close(k.ready)
			tok, err := qwen3.Shared()
			if err != nil {
				k.loadErr = err
				return
			}
			k.cache.Store(tokenize.NewPrefixCache(tok, 0))
		}()
	})
}

// Check is the tokenizer check of the keyer's tokenizer: for an auto
// keyer, one against the Qwen3 probe ids known without loading it
// (qwen3probe.go); otherwise NewTokenizerCheck of its tokenizer.
func (k *TokenizerKeyer) Check() *TokenizerCheck {
	if k.auto {
		return newQwen3ProbeCheck()
	}
	return NewTokenizerCheck(k.Tokenizer())
}

// Ready is closed once the keyer's tokenizer is loaded, or failed to load
// (LoadErr).
func (k *TokenizerKeyer) Ready() <-chan struct{} { return k.ready }

// LoadErr is why the tokenizer failed to load (nil: loaded, or not yet:
// see Ready).
func (k *TokenizerKeyer) LoadErr() error {
	select {
	case <-k.ready:
		return k.loadErr
	default:
		return nil
	}
}

// SetSpec records the name of the keyer's tokenizer (the spec it was loaded
// from), for logs and the debug endpoints.
func (k *TokenizerKeyer) SetSpec(spec string) { k.spec = spec }

// Spec is the keyer's tokenizer as configured ("" unnamed).
func (k *TokenizerKeyer) Spec() string { return k.spec }

// Auto reports whether the keyer was chosen by TokenizerAuto: token keys
// then need a replica's confirmation, not only the absence of a mismatch.
func (k *TokenizerKeyer) Auto() bool { return k.auto }

// Tokenizer returns the keyer's tokenizer.
// It is nil until the tokenizer is loaded (Ready).
func (k *TokenizerKeyer) Tokenizer() *tokenize.Tokenizer {
	if c := k.cache.Load(); c != nil {
		return c.Tokenizer()
	}
	return nil
}

// Cache returns the keyer's prefix cache (nil until the tokenizer is
// loaded).
func (k *TokenizerKeyer) Cache() *tokenize.PrefixCache { return k.cache.Load() }

// BlockTokens is the tokens per key.
func (k *TokenizerKeyer) BlockTokens() int { return k.blockTokens }

// SetFallback switches text and chat keying to ChunkKeyer's (on) or back to
// token ids (off).
func (k *TokenizerKeyer) SetFallback(on bool) { k.fallback.Store(on) }

// Fallback reports whether the keyer keys text as ChunkKeyer does.
func (k *TokenizerKeyer) Fallback() bool { return k.fallback.Load() }

// Keys implements Keyer. A batch is keyed by its first prompt; its prompt
// tokens count every prompt. A chat's ids go to a pooled buffer, and its
// block keys through the keyer's memo of recent prompts (keyMemo). Keys
// start from the request's adapter and salt (blocks.ChainSeed), as
// ChunkKeyer's do.
func (k *TokenizerKeyer) Keys(r *openai.Request) ([]blocks.Key, int, error) {
	chunk := ChunkKeyer{BlockTokens: k.blockTokens}
	cache := k.cache.Load()
	if k.fallback.Load() || cache == nil {
		return chunk.Keys(r)
	}
	var keys []blocks.Key
	total := 0
	seed := blocks.ChainSeed(r.Adapter, r.CacheSalt)
	r.TokensEstimated = false
	switch {
	case r.Chat != nil:
		buf := idsPool.Get().(*[]uint32)
		ids, err := cache.AppendEncodeChat((*buf)[:0], r.Chat.Messages, chatOptions(r.Chat))
		if err != nil {
			idsPool.Put(buf)
			return chunk.Keys(r)
		}
		keys = k.memo.keys(seed, ids)
		total = len(ids)
		if cap(ids) <= maxPooledIDs {
			*buf = ids[:0]
			idsPool.Put(buf)
		}
	default:
		for i, text := range r.Texts {
			ids := cache.Encode(text)
			if i == 0 {
				keys = k.memo.keys(seed, ids)
			}
			total += len(ids)
		}
	}
	for i, ids := range r.TokenIDs {
		if i == 0 && len(keys) == 0 {
			keys = k.memo.keys(seed, ids)
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

// keys returns blocks.SeededKeys(nil, seed, ids, blockTokens), reusing
// the keys of a recent prompt that shares a prefix with ids under the same
// seed (the fingerprints start from it).
func (m *keyMemo) keys(seed blocks.Seed, ids []uint32) []blocks.Key {
	bs := m.blockTokens
	n := len(ids) / bs
	checks := n / memoStride
	if checks == 0 {
		return blocks.SeededKeys(nil, seed, ids, bs)
	}
	prints := make([]uint64, checks)
	prev := uint64(seed) // BaseSeed: 0x9E3779B97F4A7C15, as ever
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
	out = blocks.SeededKeys(out, seed, ids[len(out)*bs:], bs)
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
func (k *TokenizerKeyer) EncodeChat(c *openai.ChatPrompt) ([]uint32, error) {
	cache := k.cache.Load()
	if cache == nil {
		return nil, errors.New("keying: the tokenizer is not loaded yet")
	}
	return cache.EncodeChat(c.Messages, chatOptions(c))
}

// chatOptions are the template options of c.
func chatOptions(c *openai.ChatPrompt) tokenize.ChatOptions {
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

// TokenizerState is what a tokenizer check found for one replica, as the
// value of the gauge prefixlb_tokenizer_match.
type TokenizerState int

// Tokenizer check results.
const (
	// TokenizerUnknown: not checked yet, or the replica cannot tokenize
	// (its /tokenize answered an HTTP error status, or an answer that is
	// not vLLM's).
	TokenizerUnknown TokenizerState = -1
	// TokenizerMismatch: the replica's ids differ from the local
	// tokenizer's, so token keys would never match its KV blocks.
	TokenizerMismatch TokenizerState = 0
	// TokenizerMatch: the replica's ids are the local tokenizer's on the
	// probe prompt and chat.
	TokenizerMatch TokenizerState = 1
)

// String returns "unknown", "mismatch" or "match".
func (s TokenizerState) String() string {
	switch s {
	case TokenizerMatch:
		return "match"
	case TokenizerMismatch:
		return "mismatch"
	case TokenizerUnknown:
		return "unknown"
	}
	return fmt.Sprintf("TokenizerState(%d)", int(s))
}

// Log reports a check's result for replica on log: a match as info, a
// mismatch (keys fall back to text chunks) or a failed /tokenize (token
// keys are kept) as a warning with err.
func (s TokenizerState) Log(log *slog.Logger, replica string, err error) {
	switch s {
	case TokenizerMatch:
		log.Info("tokenizer matches the replica's", "replica", replica)
	case TokenizerMismatch:
		log.Warn("tokenizer differs from the replica's /tokenize: keying text and chats by text chunks for every replica",
			"replica", replica, "err", err)
	default:
		log.Warn("cannot verify the tokenizer: the replica's /tokenize failed", "replica", replica, "err", err)
	}
}

// TokenizerCheck compares a local tokenizer with a replica's: it posts a
// probe prompt and a probe chat to the replica's /tokenize and compares the
// ids with the local ones. The probes exercise what tokenizers disagree on
// (digits, runs of spaces, newlines, code, non-ASCII, the chat template's
// special tokens). It speaks vLLM's /tokenize (Compare), or the one of the
// replica's engine (CompareKind: llama.cpp's). A TokenizerCheck is safe for
// concurrent use.
type TokenizerCheck struct {
	// Timeout bounds each request of a Compare (0: only ctx bounds them).
	Timeout time.Duration

	// want are the local tokenizer's ids of the probe prompt and chat
	// (wantChat nil when the tokenizer has no chat template).
	want, wantChat []uint32
}

// NewTokenizerCheck encodes the probe prompt and chat with tok, once.
func NewTokenizerCheck(tok *tokenize.Tokenizer) *TokenizerCheck {
	c := &TokenizerCheck{want: tok.Encode(probePrompt)}
	if ids, err := tok.EncodeChat(probeMessages, tokenize.ChatOptions{AddGenerationPrompt: true}); err == nil {
		c.wantChat = ids
	}
	return c
}

// Compare posts the probe prompt and, if the local tokenizer has a chat
// template, the probe chat to baseURL's vLLM /tokenize (baseURL is the
// replica's OpenAI server, "http://10.0.0.1:8000") with client (nil:
// http.DefaultClient), and compares the ids. It returns TokenizerMatch
// with a nil error; TokenizerMismatch with an error saying where the ids
// part; TokenizerUnknown with an error for an HTTP error status or an
// answer it cannot read (an empty id list included: llama.cpp's answer to
// vLLM's request), or, wrapping upstream.ErrNoAnswer, for no answer at all.
func (c *TokenizerCheck) Compare(ctx context.Context, client *http.Client, baseURL string) (TokenizerState, error) {
	return c.CompareKind(ctx, client, baseURL, upstream.VLLM)
}

// CompareKind is Compare speaking the tokenizer endpoints of a replica of
// the given kind:
//
//   - upstream.LlamaCpp: llama-server's POST /tokenize {"content": ...,
//     "add_special": true} → {"tokens": [...]} (server.cpp,
//     handle_tokenize, at commit c392e50). add_special is true because
//     that is how /v1/completions and /v1/chat/completions tokenize their
//     prompt (tokenize_input_prompts with add_special), so a model whose
//     vocabulary adds a BOS token shows as a mismatch rather than being
//     keyed one token off, as with vLLM. The chat is rendered by the
//     replica's POST /apply-template {"messages": [...]} → {"prompt":
//     "..."} (llama.cpp renders chats itself, always with the generation
//     prompt) and that text tokenized as above; a replica without
//     /apply-template (an HTTP error: an older llama.cpp) is checked on
//     the probe prompt alone. Both endpoints live at the server's root,
//     under baseURL's path (there is no /v1/tokenize).
//   - any other kind: vLLM's POST /tokenize {"prompt": ...} and
//     {"messages": [...], "add_generation_prompt": true}.
func (c *TokenizerCheck) CompareKind(ctx context.Context, client *http.Client, baseURL string, kind upstream.Kind) (TokenizerState, error) {
	if client == nil {
		client = http.DefaultClient
	}
	u, err := url.Parse(baseURL)
	if err != nil {
		return TokenizerUnknown, fmt.Errorf("keying: tokenizer check: replica URL: %w", err)
	}
	at := func(path string) string {
		v := *u
		v.Path = upstream.TrimSlash(u.Path) + path
		v.RawPath = ""
		return v.String()
	}
	endpoint := at("/tokenize")
	llama := kind == upstream.LlamaCpp
	promptBody := map[string]any{"prompt": probePrompt}
	if llama {
		promptBody = map[string]any{"content": probePrompt, "add_special": true}
	}
	got, err := c.tokenize(ctx, client, endpoint, promptBody)
	if err != nil {
		return TokenizerUnknown, err
	}
	if !slices.Equal(got, c.want) {
		return TokenizerMismatch, fmt.Errorf("probe prompt: replica %d ids, local %d ids (first difference at %d)",
			len(got), len(c.want), firstDiff(got, c.want))
	}
	if c.wantChat == nil {
		return TokenizerMatch, nil
	}
	if llama {
		rendered, err := c.applyTemplate(ctx, client, at("/apply-template"))
		if errors.Is(err, errNoTemplateEndpoint) {
			return TokenizerMatch, nil // the prompt matched; the chat cannot be checked
		}
		if err != nil {
			return TokenizerUnknown, err
		}
		got, err = c.tokenize(ctx, client, endpoint, map[string]any{"content": rendered, "add_special": true})
	} else {
		got, err = c.tokenize(ctx, client, endpoint, map[string]any{"messages": probeMessages, "add_generation_prompt": true})
	}
	if err != nil {
		return TokenizerUnknown, err
	}
	if !slices.Equal(got, c.wantChat) {
		return TokenizerMismatch, fmt.Errorf("probe chat: replica %d ids, local %d ids (first difference at %d)",
			len(got), len(c.wantChat), firstDiff(got, c.wantChat))
	}
	return TokenizerMatch, nil
}

// errNoTemplateEndpoint: the replica answered /apply-template with an HTTP
// error status (a llama.cpp without it).
var errNoTemplateEndpoint = errors.New("no /apply-template")

// post POSTs body as JSON to endpoint, bounded by c.Timeout, and returns a
// 2xx answer's body. It wraps upstream.ErrNoAnswer when no answer came, and
// errHTTPStatus for an error status.
func (c *TokenizerCheck) post(ctx context.Context, client *http.Client, endpoint string, body any) ([]byte, error) {
	if c.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.Timeout)
		defer cancel()
	}
	js, err := json.Marshal(body)
	if err != nil {
		return nil, fmt.Errorf("keying: post to %s: %w", endpoint, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, endpoint, bytes.NewReader(js))
	if err != nil {
		return nil, fmt.Errorf("keying: post to %s: %w", endpoint, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("keying: post to %s: %w: %w", endpoint, upstream.ErrNoAnswer, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, fmt.Errorf("keying: post to %s: %w: %w", endpoint, upstream.ErrNoAnswer, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return nil, fmt.Errorf("keying: post to %s: %w %d", endpoint, errHTTPStatus, resp.StatusCode)
	}
	return data, nil
}

// errHTTPStatus is wrapped by post's error for an HTTP error status.
var errHTTPStatus = errors.New("status")

// tokenize POSTs body to endpoint (a /tokenize URL) and returns the ids it
// answers (vLLM: {"tokens":[...],"count":N}; llama.cpp: {"tokens":[...]}).
// An answer without ids is an error: the probes are never empty, and
// llama.cpp answers a request in vLLM's shape with {"tokens":[]}.
func (c *TokenizerCheck) tokenize(ctx context.Context, client *http.Client, endpoint string, body any) ([]uint32, error) {
	data, err := c.post(ctx, client, endpoint, body)
	if err != nil {
		return nil, fmt.Errorf("keying: tokenize: %w", err)
	}
	var out struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(data, &out); err != nil {
		return nil, fmt.Errorf("keying: tokenize on %s: decode answer: %w", endpoint, err)
	}
	if len(out.Tokens) == 0 {
		return nil, fmt.Errorf("keying: tokenize on %s: the answer holds no ids (a llama.cpp replica answers vLLM's request so: give it kind llamacpp)", endpoint)
	}
	return out.Tokens, nil
}

// applyTemplate renders the probe chat with llama.cpp's POST
// /apply-template at endpoint ({"prompt": "..."}).
func (c *TokenizerCheck) applyTemplate(ctx context.Context, client *http.Client, endpoint string) (string, error) {
	data, err := c.post(ctx, client, endpoint, map[string]any{"messages": probeMessages})
	if errors.Is(err, errHTTPStatus) {
		return "", fmt.Errorf("%w: %w", errNoTemplateEndpoint, err)
	}
	if err != nil {
		return "", fmt.Errorf("keying: apply chat template: %w", err)
	}
	var out struct {
		Prompt *string `json:"prompt"`
	}
	if err := json.Unmarshal(data, &out); err != nil || out.Prompt == nil {
		return "", fmt.Errorf("keying: apply chat template on %s: the answer holds no prompt string", endpoint)
	}
	return *out.Prompt, nil
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
