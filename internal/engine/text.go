package engine

import (
	"encoding/binary"
	"strings"

	"github.com/cespare/xxhash/v2"

	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// Tokenizer turns text into token ids. Implementations must be deterministic
// and safe for concurrent use.
type Tokenizer interface {
	// Encode returns the token ids of text.
	Encode(text string) []uint32
}

// WordTokenizer is prefixlb's stand-in tokenizer (workload.WordTokens): one
// id per white-space-separated word. It stands in until a real tokenizer is
// configured; counts are words, not BPE tokens.
type WordTokenizer struct{}

// Encode returns workload.WordTokens(text).
func (WordTokenizer) Encode(text string) []uint32 { return workload.WordTokens(text) }

var _ Tokenizer = WordTokenizer{}

// ChatEncoder renders a chat with a model's chat template and tokenizes it.
// Implementations must be safe for concurrent use.
type ChatEncoder interface {
	// EncodeChat returns the token ids of msgs rendered with opts; an error
	// is the client's (the template rejected the conversation).
	EncodeChat(msgs []tokenize.Message, opts tokenize.ChatOptions) ([]uint32, error)
}

var (
	_ ChatEncoder = (*tokenize.Tokenizer)(nil)
	_ ChatEncoder = (*tokenize.PrefixCache)(nil)
	_ Tokenizer   = (*tokenize.PrefixCache)(nil)
)

// ChatMessage is one message of a chat request, its content parts joined.
type ChatMessage struct {
	// Role is the author: "system", "user", "assistant", "tool", ...
	Role string
	// Content is the message text.
	Content string
}

// RenderChat is the default chat template: each message becomes
// "<|role|>\ncontent\n", followed by "<|assistant|>\n" to prompt the answer
// (add_generation_prompt). It is deliberately simple: what matters to the
// prefix cache is that conversations sharing their first messages share a
// prefix of the rendered text, which any chat template preserves.
func RenderChat(msgs []ChatMessage) string {
	var b strings.Builder
	for _, m := range msgs {
		b.WriteString("<|")
		b.WriteString(m.Role)
		b.WriteString("|>\n")
		b.WriteString(m.Content)
		b.WriteString("\n")
	}
	b.WriteString("<|assistant|>\n")
	return b.String()
}

// outputWords are the words generated text is made of.
var outputWords = [...]string{
	"the", "model", "cache", "prefix", "token", "block", "replica", "router",
	"request", "batch", "prompt", "decode", "prefill", "queue", "latency", "time",
	"memory", "layer", "attention", "key", "value", "hash", "tree", "node",
	"load", "balance", "engine", "stream", "chunk", "event", "score", "cost",
	"and", "of", "to", "in", "is", "it", "that", "for",
	"on", "with", "as", "by", "at", "from", "this", "be",
	"fast", "slow", "hot", "cold", "long", "short", "shared", "new",
	"first", "last", "next", "same", "each", "every", "one", "two",
}

// promptHash identifies a prompt for text generation.
func promptHash(tokens []uint32) uint64 {
	var d xxhash.Digest
	d.Reset()
	var buf [4]byte
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(buf[:], t)
		_, _ = d.Write(buf[:])
	}
	return d.Sum64()
}

// outputToken is the text of output token k (from 1) of a prompt whose
// promptHash is h: a space and a word chosen by mixing h and k, so the same
// prompt always gets the same text and longer outputs extend shorter ones.
func outputToken(h uint64, k int) string {
	x := h ^ uint64(k)*0x9e3779b97f4a7c15
	// SplitMix64's finalizer (Steele, Lea and Flood) spreads the bits.
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	x ^= x >> 31
	return " " + outputWords[x%uint64(len(outputWords))]
}
