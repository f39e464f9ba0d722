package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"

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
// through a tokenize.PrefixCache, so a long shared prefix is tokenized once.
//
// Set to fall back (SetFallback, done by the Proxy when a replica's
// /tokenize disagrees), it keys text and chats as ChunkKeyer does. A chat
// the template cannot render (no template, or the template rejects it) is
// keyed as ChunkKeyer does too. A TokenizerKeyer is safe for concurrent use.
type TokenizerKeyer struct {
	cache       *tokenize.PrefixCache
	blockTokens int
	fallback    atomic.Bool
}

var _ Keyer = (*TokenizerKeyer)(nil)

// NewTokenizerKeyer returns a keyer over tok with keys of blockTokens
// tokens and a PrefixCache of the default size.
func NewTokenizerKeyer(tok *tokenize.Tokenizer, blockTokens int) *TokenizerKeyer {
	return &TokenizerKeyer{cache: tokenize.NewPrefixCache(tok, 0), blockTokens: blockTokens}
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
// tokens count every prompt.
func (k *TokenizerKeyer) Keys(r *Request) ([]blocks.Key, int, error) {
	chunk := ChunkKeyer{BlockTokens: k.blockTokens}
	if k.fallback.Load() {
		return chunk.Keys(r)
	}
	var keys []blocks.Key
	total := 0
	switch {
	case r.Chat != nil:
		ids, err := k.EncodeChat(r.Chat)
		if err != nil {
			return chunk.Keys(r)
		}
		keys = blocks.Keys(nil, ids, k.blockTokens)
		total = len(ids)
	default:
		for i, text := range r.Texts {
			ids := k.cache.Encode(text)
			if i == 0 {
				keys = blocks.Keys(nil, ids, k.blockTokens)
			}
			total += len(ids)
		}
	}
	for i, ids := range r.TokenIDs {
		if i == 0 && len(keys) == 0 {
			keys = blocks.Keys(nil, ids, k.blockTokens)
		}
		total += len(ids)
	}
	return keys, max(total, len(keys)*k.blockTokens, 1), nil
}

// EncodeChat renders c with the chat template and encodes it.
func (k *TokenizerKeyer) EncodeChat(c *ChatPrompt) ([]uint32, error) {
	return k.cache.EncodeChat(c.Messages, tokenize.ChatOptions{
		AddGenerationPrompt: c.AddGenerationPrompt, Tools: c.Tools, Kwargs: c.Kwargs})
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
