// Package dataset reads real-text datasets, ShareGPT's conversations and
// LooGLE's long documents, into workload requests that carry their text,
// their chat messages and their token ids under a real tokenizer, so that
// `prefixlb bench` sends real text while `sim` and `analyze` see the same
// prompts as the same tokens, and one command's figures can be checked
// against the other's.
//
// A ShareGPT conversation becomes one request a user turn, each re-sending
// the conversation so far with the answers the file records, as a user's
// chat client does: turn k+1's prompt extends turn k's prompt and answer,
// which is the prefix sharing of real multi-turn chat. As text (bench
// --mode text) a conversation is
//
//	User: <turn 1>\n\nAssistant: <answer 1>\n\nUser: <turn 2>\n\nAssistant:
//
// each message trimmed of surrounding white space; the prompt ends at
// "Assistant:", so the answer's leading space starts a new pre-token and
// turn k's prompt encodes to a prefix of turn k+1's ids, exactly, under a
// byte-level BPE tokenizer (Qwen3, Llama 3). As a chat (--mode chat) it is
// the messages as they are.
//
// A LooGLE document becomes one request a question, the prompt Preble's
// LooGLE loader builds ("Please answer the question based on the long texts
// below. \n{document}\nQuestion: {Q}\nAnswer: "), so every question on a
// document shares the document as a prefix.
package dataset

import (
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"strings"
	"sync"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// UnansweredOutputTokens is the output of a turn whose answer the dataset
// does not record (a conversation that ends with the user's message): 128
// tokens, the output length vLLM's random dataset defaults to
// (DEFAULT_OUTPUT_LEN, vllm/benchmarks/datasets/random.py at 237145ea).
const UnansweredOutputTokens = 128

// LooGLEPrompt is Preble's LooGLE prompt (LooGLEDataset.prompt_format,
// multi_node/benchmarks/benchmark_workload_gen.py of github.com/WukLab/preble
// at 150e400d), the same for short- and long-dependency QA: %[1]s is the
// document, %[2]s the question.
const LooGLEPrompt = "Please answer the question based on the long texts below. \n%[1]s\nQuestion: %[2]s\nAnswer: "

// Text-form labels of a ShareGPT conversation (see the package comment).
const (
	userLabel      = "User: "
	assistantLabel = "\n\nAssistant:"
	turnEnd        = "\n\n"
)

// ErrEmpty is returned when a dataset yields no request.
var ErrEmpty = errors.New("dataset: no requests")

// Options says how a dataset becomes requests.
type Options struct {
	// Tokenizer encodes the text. Required.
	Tokenizer *tokenize.Tokenizer
	// Chat makes each request's Tokens those of its Messages rendered by
	// the tokenizer's chat template with the generation prompt, else
	// those of its Text.
	Chat bool
	// MaxOutputTokens caps each request's output, the recorded answer's
	// length (default workload.DefaultMaxOutputTokens).
	MaxOutputTokens int
	// OutputTokens, when > 0, is every request's output instead.
	OutputTokens int
	// Requests is the most requests to take (0: all).
	Requests int
	// Sessions is how many ShareGPT conversations are in progress at once
	// (default workload.DefaultDatasetSessions).
	Sessions int
	// Seed shuffles the conversations (ShareGPT) or the questions
	// (LooGLE), as vLLM's and Preble's loaders shuffle theirs.
	Seed int64
}

func (o Options) withDefaults() (Options, error) {
	if o.Tokenizer == nil {
		return o, errors.New("dataset: no tokenizer")
	}
	if o.Chat && !o.Tokenizer.HasChatTemplate() {
		return o, errors.New("dataset: the tokenizer has no chat template to render chats with")
	}
	if o.MaxOutputTokens <= 0 {
		o.MaxOutputTokens = workload.DefaultMaxOutputTokens
	}
	if o.Sessions <= 0 {
		o.Sessions = workload.DefaultDatasetSessions
	}
	return o, nil
}

// encoder tokenizes a dataset's prompts, reusing the ids of the long
// prefixes they share (tokenize.PrefixCache: the ids are exactly Encode's).
type encoder struct {
	o     Options
	cache *tokenize.PrefixCache
}

func newEncoder(o Options) *encoder {
	return &encoder{o: o, cache: tokenize.NewPrefixCache(o.Tokenizer, tokenize.DefaultPrefixCacheTokens)}
}

// prompt returns the ids of a request's prompt: its messages as the chat
// template renders them, or its text.
func (e *encoder) prompt(text string, msgs []workload.Message) ([]uint32, error) {
	if !e.o.Chat {
		return e.cache.Encode(text), nil
	}
	tm := make([]tokenize.Message, len(msgs))
	for i, m := range msgs {
		tm[i] = tokenize.Message{Role: m.Role, Content: m.Content}
	}
	s, err := e.o.Tokenizer.ApplyChatTemplate(tm, tokenize.ChatOptions{AddGenerationPrompt: true})
	if err != nil {
		return nil, fmt.Errorf("dataset: chat template: %w", err)
	}
	return e.cache.Encode(s), nil
}

// output returns the output of a request whose recorded answer is answer
// (answered false: none).
func (e *encoder) output(answer string, answered bool) int {
	switch {
	case e.o.OutputTokens > 0:
		return e.o.OutputTokens
	case !answered:
		return min(UnansweredOutputTokens, e.o.MaxOutputTokens)
	}
	return max(1, min(len(e.o.Tokenizer.Encode(answer)), e.o.MaxOutputTokens))
}

// ShareGPTText returns the text form of a conversation's prompt at its
// last message (a user's): every earlier message and the answers, labelled
// (see the package comment).
func ShareGPTText(msgs []workload.Message) string {
	var b strings.Builder
	for i, m := range msgs {
		if m.Role == "user" {
			b.WriteString(userLabel)
			b.WriteString(strings.TrimSpace(m.Content))
			b.WriteString(assistantLabel)
			continue
		}
		b.WriteByte(' ')
		b.WriteString(strings.TrimSpace(m.Content))
		if i < len(msgs)-1 {
			b.WriteString(turnEnd)
		}
	}
	return b.String()
}

// ShareGPTRequests turns conversations into requests: conversations in an
// order shuffled by o.Seed, o.Sessions of them in progress at once, each
// next request a turn of a random one of those, so that conversations
// overlap in time while each keeps its order. A conversation's turn k > 0
// has AwaitPrevious set. Its Session is "sharegpt-<i>" for the i-th
// conversation taken and its Group the conversation's id.
func ShareGPTRequests(convs []Conversation, o Options) ([]workload.Request, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	rng := rand.New(rand.NewPCG(uint64(o.Seed), 0x5ba7e))
	var order []int // the conversations that start with a user turn, shuffled
	total := 0
	for _, i := range rng.Perm(len(convs)) {
		if m := convs[i].Messages; len(m) > 0 && m[0].Role == "user" {
			order = append(order, i)
			total += (len(m) + 1) / 2
		}
	}
	n := total
	if o.Requests > 0 {
		n = min(n, o.Requests)
	}
	if n == 0 {
		return nil, fmt.Errorf("%w: no conversation has a user turn", ErrEmpty)
	}
	enc := newEncoder(o)
	type active struct {
		conv    int
		session string
		turn    int
	}
	var running []active
	next := 0
	out := make([]workload.Request, 0, n)
	for len(out) < n {
		for len(running) < o.Sessions && next < len(order) {
			running = append(running, active{conv: order[next], session: fmt.Sprintf("sharegpt-%d", next)})
			next++
		}
		k := rng.IntN(len(running))
		a := &running[k]
		c := &convs[a.conv]
		end := 2*a.turn + 1 // the messages of the prompt: up to this user turn
		msgs := c.Messages[:end:end]
		text := ShareGPTText(msgs)
		ids, err := enc.prompt(text, msgs)
		if err != nil {
			return nil, fmt.Errorf("%w (conversation %s)", err, c.ID)
		}
		answered := end < len(c.Messages)
		answer := ""
		if answered {
			answer = c.Messages[end].Content
		}
		out = append(out, workload.Request{
			ID: len(out), Tokens: ids, OutputTokens: enc.output(answer, answered),
			Session: a.session, Group: c.ID, Text: text, Messages: msgs, AwaitPrevious: a.turn > 0,
		})
		a.turn++
		if 2*a.turn >= len(c.Messages) {
			running[k] = running[len(running)-1]
			running = running[:len(running)-1]
		}
	}
	return out, nil
}

// LooGLEText returns the prompt of question q on document doc
// (LooGLEPrompt).
func LooGLEText(doc, q string) string { return fmt.Sprintf(LooGLEPrompt, doc, q) }

// LooGLERequests turns documents into requests, one a question, in an
// order shuffled by o.Seed (Preble shuffles its LooGLE workload), each
// with its document's title as Group and as a chat one user message
// holding the prompt. The questions are not replicated to make more
// requests (Preble does so): a file gives as many requests as it asks
// questions.
func LooGLERequests(docs []Document, o Options) ([]workload.Request, error) {
	o, err := o.withDefaults()
	if err != nil {
		return nil, err
	}
	type pick struct{ doc, q int }
	var all []pick
	for i, d := range docs {
		for j := range d.Questions {
			all = append(all, pick{i, j})
		}
	}
	if len(all) == 0 {
		return nil, fmt.Errorf("%w: no document has a question", ErrEmpty)
	}
	rng := rand.New(rand.NewPCG(uint64(o.Seed), 0x1006e))
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	if o.Requests > 0 && o.Requests < len(all) {
		all = all[:o.Requests]
	}
	enc := newEncoder(o)
	out := make([]workload.Request, 0, len(all))
	for _, p := range all {
		d := &docs[p.doc]
		qa := d.Questions[p.q]
		text := LooGLEText(d.Text, qa.Q)
		msgs := []workload.Message{{Role: "user", Content: text}}
		ids, err := enc.prompt(text, msgs)
		if err != nil {
			return nil, fmt.Errorf("%w (document %s)", err, d.Title)
		}
		out = append(out, workload.Request{
			ID: len(out), Tokens: ids, OutputTokens: enc.output(qa.A, true),
			Group: d.Title, Text: text, Messages: msgs,
		})
	}
	return out, nil
}

// tokenizers holds the tokenizers Load has loaded, by spec, so that the
// runs of one process load each once.
var tokenizers sync.Map // spec → *tokenize.Tokenizer

// Tokenizer returns the tokenizer spec names: "" or "qwen3" the bundled
// Qwen3 (shared), else a tokenizer.json or a model directory
// (keying.LoadTokenizer), loaded once per process.
func Tokenizer(spec string) (*tokenize.Tokenizer, error) {
	if spec == "" || spec == keying.TokenizerQwen3 {
		return qwen3.Shared()
	}
	if t, ok := tokenizers.Load(spec); ok {
		return t.(*tokenize.Tokenizer), nil
	}
	t, err := keying.LoadTokenizer(spec)
	if err != nil {
		return nil, fmt.Errorf("dataset: tokenizer %s: %w", spec, err)
	}
	v, _ := tokenizers.LoadOrStore(spec, t)
	return v.(*tokenize.Tokenizer), nil
}

// Load reads the dataset d names and turns it into requests under d's
// tokenizer, taking s.Requests (0: all), s.OutputTokens and s.Seed: a
// workload.DatasetLoader. A file name ending in .gz is decompressed.
func Load(d workload.DatasetSpec, s workload.Spec) ([]workload.Request, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	if d.Name == "" {
		return nil, errors.New("dataset: none named")
	}
	tok, err := Tokenizer(d.Tokenizer)
	if err != nil {
		return nil, err
	}
	o := Options{Tokenizer: tok, Chat: d.Chat, MaxOutputTokens: d.MaxOutputTokens, OutputTokens: s.OutputTokens,
		Requests: s.Requests, Sessions: d.Sessions, Seed: s.Seed}
	rc, err := open(d.File)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	switch d.Name {
	case workload.DatasetShareGPT:
		convs, _, err := ReadShareGPT(rc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d.File, err)
		}
		return ShareGPTRequests(convs, o)
	default:
		docs, err := ReadLooGLE(rc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d.File, err)
		}
		return LooGLERequests(docs, o)
	}
}

// open opens name, gunzipping a .gz file.
func open(name string) (io.ReadCloser, error) {
	fh, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("dataset: %w", err)
	}
	if !strings.HasSuffix(name, ".gz") {
		return fh, nil
	}
	zr, err := gzip.NewReader(fh)
	if err != nil {
		fh.Close()
		return nil, fmt.Errorf("dataset: %s: %w", name, err)
	}
	return struct {
		io.Reader
		io.Closer
	}{zr, fh}, nil
}

var _ workload.DatasetLoader = Load
