package openai

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"strconv"
	"strings"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// Kind is the OpenAI endpoint a request is for.
type Kind int

// The kinds of request a front door parses.
const (
	// KindOther is any other /v1 path: forwarded, keyed if it has a prompt.
	KindOther Kind = iota
	// KindCompletion is POST /v1/completions.
	KindCompletion
	// KindChat is POST /v1/chat/completions.
	KindChat
)

// String names the kind for logs.
func (k Kind) String() string {
	switch k {
	case KindCompletion:
		return "completion"
	case KindChat:
		return "chat"
	}
	return "other"
}

// ErrBadRequest is wrapped by every request-body error: the client sent
// something prefixlb cannot route (the HTTP edge answers 400).
var ErrBadRequest = errors.New("invalid request")

// errNoModel is the error for a body without "model" (its param is "model").
var errNoModel = fmt.Errorf("%w: you must provide a model parameter", ErrBadRequest)

// Request is what a front door reads from an OpenAI request body: enough to key
// the prompt and to know what to expect back. The body itself is forwarded
// untouched.
type Request struct {
	// Kind is the endpoint.
	Kind Kind
	// Model is the body's "model".
	Model string
	// Adapter is the LoRA adapter Model names ("": the base model); the
	// parser leaves it empty, and the routing core sets it from the
	// adapters it is told of (cluster.Settings.Adapters) before keying:
	// keys then start from the adapter's seed (blocks.AdapterSeed).
	Adapter string
	// Stream is the body's "stream".
	Stream bool
	// MaxTokens is max_completion_tokens, else max_tokens (0 if absent),
	// multiplied by n and by the number of prompts in a batch.
	MaxTokens int
	// User is the body's "user" (a session key when no x-session-id header).
	User string
	// CacheSalt is the body's "cache_salt" ("" when absent or null): vLLM
	// folds it into the hash of the prompt's first block, so that salted
	// prefixes are never shared across salts (blocks.SaltedSeed). Keys
	// are seeded with it. A front door that isolates tenants replaces it
	// (and the body's) with the tenant's salt before keying.
	CacheSalt string
	// Texts are the prompts given as text (completions: one per prompt of a
	// batch; chat: the canonical rendering of the messages).
	Texts []string
	// TokenIDs are the prompts given as token ids (one list per prompt).
	TokenIDs [][]uint32
	// Chat is what a chat template needs to render the messages as the
	// engine does (nil unless the body had messages): TokenizerKeyer keys
	// it, ChunkKeyer keys Texts.
	Chat *ChatPrompt
	// TokensEstimated is set by the keyer (internal/keying) when it
	// counted the prompt's tokens from its bytes (text keyed by chunks)
	// rather than with the engine's tokenizer.
	TokensEstimated bool
}

// ChatPrompt is a chat body as vLLM hands it to the model's chat template.
type ChatPrompt struct {
	// Messages are the body's messages, content parts of type text joined
	// with "\n" as vLLM does for text-only models.
	Messages []tokenize.Message
	// Tools are the body's tools, each as the client sent it.
	Tools []json.RawMessage
	// AddGenerationPrompt is the body's add_generation_prompt (vLLM's
	// default: true).
	AddGenerationPrompt bool
	// Kwargs are the body's chat_template_kwargs.
	Kwargs map[string]json.RawMessage
}

// ParseRequest reads the body of a request of kind k. Completions need a
// model and a prompt; chat needs a model and messages; other kinds are read
// best effort: a body prefixlb cannot read (not JSON, or another API's
// shapes) yields an empty Request and no error, since it is forwarded as it
// is, unkeyed. Errors wrap ErrBadRequest.
//
// The body is read in one pass (decodeBody) that accepts, rejects and
// decodes exactly as encoding/json would decode it into the fields the
// front doors read, with encoding/json's error messages; cache_salt is
// read as vLLM reads it (CacheSalt: a second pass, only over bodies that
// may hold the key). The Request does not alias the body.
func ParseRequest(k Kind, body []byte) (*Request, error) {
	req, err := readRequest(k, body)
	if err != nil && k == KindOther {
		return &Request{Kind: KindOther}, nil
	}
	if err != nil {
		return nil, err
	}
	// The salt is read as vLLM reads it (CacheSalt), apart from the
	// fields read as encoding/json reads them.
	salt, err := CacheSalt(body)
	switch {
	case err == nil:
		req.CacheSalt = salt
	case k != KindOther:
		return nil, err
	}
	return req, nil
}

// readRequest is ParseRequest without the leniency for other kinds.
func readRequest(k Kind, body []byte) (*Request, error) {
	raw, msg := decodeBody(body)
	if msg != "" {
		return nil, fmt.Errorf("%w: %s", ErrBadRequest, msg)
	}
	req := &Request{Kind: k, Stream: raw.stream.set && raw.stream.v}
	if raw.model.set {
		req.Model = raw.model.s
	}
	if raw.user.set {
		req.User = raw.user.s
	}
	if k != KindOther && req.Model == "" {
		return nil, errNoModel
	}
	maxTok := int64(0)
	switch {
	case raw.maxCompletionTokens.set:
		maxTok = raw.maxCompletionTokens.v
	case raw.maxTokens.set:
		maxTok = raw.maxTokens.v
	}
	if maxTok < 0 {
		return nil, fmt.Errorf("%w: max_tokens must be ≥ 0, got %d", ErrBadRequest, maxTok)
	}
	n := int64(1)
	if raw.n.set {
		if raw.n.v < 1 {
			return nil, fmt.Errorf("%w: n must be ≥ 1, got %d", ErrBadRequest, raw.n.v)
		}
		n = raw.n.v
	}
	prompts := 1
	switch {
	case k == KindChat || (k == KindOther && raw.hasMsgs):
		if raw.nMsgs == 0 {
			return nil, fmt.Errorf("%w: messages must be a non-empty list", ErrBadRequest)
		}
		if err := raw.chatLimits(); err != nil {
			return nil, err
		}
		text, msgs, err := renderChat(raw)
		if err != nil {
			return nil, err
		}
		req.Texts = []string{text}
		req.Chat = chatPrompt(msgs, raw)
	case k == KindCompletion || (k == KindOther && raw.prompt != nil):
		if raw.prompt == nil || string(raw.prompt) == "null" {
			if k == KindOther {
				break
			}
			return nil, fmt.Errorf("%w: you must provide a prompt", ErrBadRequest)
		}
		if raw.promptIDs != nil {
			req.TokenIDs = raw.promptIDs
		} else if err := parsePrompt(req, raw.prompt, "prompt"); err != nil {
			return nil, err
		}
		prompts = max(len(req.Texts), len(req.TokenIDs))
	case raw.input != nil && string(raw.input) != "null":
		// Embeddings and similar: "input" takes the shapes of "prompt".
		if err := parsePrompt(req, raw.input, "input"); err != nil {
			return nil, err
		}
		prompts = max(len(req.Texts), len(req.TokenIDs))
	}
	total := float64(maxTok) * float64(n) * float64(prompts)
	req.MaxTokens = int(min(total, math.MaxInt32))
	return req, nil
}

// parsePrompt reads a prompt in any of its four shapes: a string, a list of
// strings, a list of token ids, or a list of token-id lists. raw is one
// valid JSON value, as the body holds it.
func parsePrompt(req *Request, raw []byte, field string) error {
	switch raw[0] {
	case '"':
		s := jsonScan{b: raw}
		t, _ := s.str()
		req.Texts = []string{t}
		return nil
	case '[':
	default:
		return fmt.Errorf("%w: %s must be a string, a list of strings, a list of token ids or a list of token-id lists", ErrBadRequest, field)
	}
	// Token ids, the common shape of long prompts from benchmarks and
	// agents, are read by a direct scan.
	if ids, ok := scanTokenIDLists(raw); ok {
		req.TokenIDs = ids
		return nil
	}
	items := listItems(raw)
	if len(items) == 0 {
		return fmt.Errorf("%w: %s must not be empty", ErrBadRequest, field)
	}
	switch items[0][0] {
	case '"':
		// A list of strings; null items are "" (encoding/json leaves a
		// string as it is on null).
		ss := make([]string, len(items))
		for i, it := range items {
			switch it[0] {
			case '"':
				s := jsonScan{b: it}
				ss[i], _ = s.str()
			case 'n':
			default:
				return fmt.Errorf("%w: %s: a list of strings must hold only strings", ErrBadRequest, field)
			}
		}
		req.Texts = ss
	case '[':
		for i, it := range items {
			ids, err := tokenIDs(it)
			if err != nil {
				return fmt.Errorf("%w: %s[%d]: %v", ErrBadRequest, field, i, err)
			}
			if len(ids) == 0 {
				return fmt.Errorf("%w: %s[%d] must not be empty", ErrBadRequest, field, i)
			}
			req.TokenIDs = append(req.TokenIDs, ids)
		}
	default:
		ids, err := tokenIDs(raw)
		if err != nil {
			return fmt.Errorf("%w: %s: %v", ErrBadRequest, field, err)
		}
		req.TokenIDs = [][]uint32{ids}
	}
	return nil
}

// listItems returns the items of raw, a valid JSON list, each as its JSON.
// It returns a non-nil empty list for [] (encoding/json's result for a
// []json.RawMessage) and nil when raw is not a list.
func listItems(raw []byte) [][]byte {
	s := jsonScan{b: raw}
	if s.peek() != '[' {
		return nil
	}
	items := [][]byte{}
	empty, ok := s.open(']')
	for ok && !empty {
		var it []byte
		if it, ok = s.span(); !ok {
			break
		}
		items = append(items, it)
		var more bool
		if more, ok = s.next(']'); !more {
			break
		}
	}
	return items
}

// tokenIDs decodes raw, a valid JSON value, as a list of token ids
// (integers in [0, 2³²)), as encoding/json decodes it into []int64 and
// then checks the range: null is an empty list and a null item 0.
func tokenIDs(raw []byte) ([]uint32, error) {
	errInts := errors.New("token ids must be integers")
	switch raw[0] {
	case 'n':
		return []uint32{}, nil
	case '[':
	default:
		return nil, errInts
	}
	items := listItems(raw)
	ids := make([]int64, len(items))
	bad := false
	for i, it := range items {
		switch {
		case it[0] == 'n':
		case it[0] == '-' || isDigit(it[0]):
			v, err := strconv.ParseInt(string(it), 10, 64)
			if err != nil {
				bad = true
			}
			ids[i] = v
		default:
			bad = true
		}
	}
	if bad {
		return nil, errInts
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxUint32 {
			return nil, fmt.Errorf("token id %d out of range", id)
		}
		out[i] = uint32(id)
	}
	return out, nil
}

// scanTokenIDLists reads raw, a whole JSON value, as scanTokenIDs does.
func scanTokenIDLists(raw []byte) ([][]uint32, bool) {
	ids, n, ok := scanTokenIDs(raw, 0)
	if !ok || skipSpace(raw, n) != len(raw) {
		return nil, false
	}
	return ids, true
}

// scanTokenIDs reads the value at raw[i] as a non-empty list of token ids
// or a non-empty list of non-empty token-id lists, ids being JSON integers
// in [0, 2³²), and returns the index just past it. It returns ok=false for
// anything else, which the caller then decodes with encoding/json for a
// precise error: whatever it accepts is valid JSON that encoding/json
// decodes to the same ids.
func scanTokenIDs(raw []byte, i int) (ids [][]uint32, next int, ok bool) {
	if i >= len(raw) || raw[i] != '[' {
		return nil, 0, false
	}
	j := skipSpace(raw, i+1)
	if j >= len(raw) || raw[j] != '[' {
		l, n, ok := scanIDList(raw, i, idCount(raw, i))
		if !ok || len(l) == 0 {
			return nil, 0, false
		}
		return [][]uint32{l}, n, true
	}
	for {
		l, n, ok := scanIDList(raw, j, idCount(raw, j))
		if !ok || len(l) == 0 {
			return nil, 0, false
		}
		ids = append(ids, l)
		j = skipSpace(raw, n)
		if j >= len(raw) {
			return nil, 0, false
		}
		switch raw[j] {
		case ',':
			j = skipSpace(raw, j+1)
		case ']':
			return ids, j + 1, true
		default:
			return nil, 0, false
		}
	}
}

// idCount sizes the flat list of ids at raw[i] ('[') for scanIDList: the
// commas before the next ']', plus one. Two vectorised passes over the
// list's bytes cost less than growing the slice, or guessing its size from
// the bytes left (which overshot by a fifth).
func idCount(raw []byte, i int) int {
	end := bytes.IndexByte(raw[i:], ']')
	if end < 0 {
		return 0
	}
	return bytes.Count(raw[i:i+end], []byte{','}) + 1
}

// scanIDList reads the flat list of token ids that starts at raw[i] ('[')
// into a list of capacity capHint, and returns it and the index just past
// its ']'.
func scanIDList(raw []byte, i, capHint int) (ids []uint32, next int, ok bool) {
	if i >= len(raw) || raw[i] != '[' {
		return nil, 0, false
	}
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		return []uint32{}, i + 1, true
	}
	ids = make([]uint32, 0, capHint)
	for {
		// The common id, 1 to 7 digits with 8 bytes to read, all at once;
		// any other byte by byte.
		var v uint32
		n := 0
		if i+8 <= len(raw) {
			t := binary.LittleEndian.Uint64(raw[i:]) ^ lanes30
			if n = idLen(t); n > 0 {
				v = digitsValue(t, n)
			}
		}
		if n > 0 {
			i += n
		} else {
			start := i
			var w uint64
			for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
				w = w*10 + uint64(raw[i]-'0')
				if w > math.MaxUint32 {
					return nil, 0, false
				}
				i++
			}
			if i == start || (raw[start] == '0' && i-start > 1) {
				return nil, 0, false // not a plain integer: let encoding/json say why
			}
			v = uint32(w)
		}
		ids = append(ids, v)
		if i < len(raw) && raw[i] == ',' { // the common case: no spaces
			i++
			if i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
				continue
			}
			i = skipSpace(raw, i)
			continue
		}
		i = skipSpace(raw, i)
		if i >= len(raw) {
			return nil, 0, false
		}
		switch raw[i] {
		case ',':
			i = skipSpace(raw, i+1)
		case ']':
			return ids, i + 1, true
		default:
			return nil, 0, false
		}
	}
}

// idLen is the length of the plain integer that the word t (8 bytes read
// little-endian, the first byte lowest, XOR lanes30) starts with when it
// has 1 to 7 digits and no leading zero, else 0 (the caller reads it byte
// by byte). SWAR: the lanes that are not digits are found together
// (digitRun), and digitsValue combines the digits pairwise.
func idLen(t uint64) int {
	n := digitRun(t)
	if uint(n-1) > 6 || (n > 1 && t&0xff == 0) { // n is 0 or 8, or a leading zero
		return 0
	}
	return n
}

// lanes30 is '0' in each lane: a word XOR it has a digit's value, 0 to 9,
// in the lane of each digit, and more in every other lane.
const lanes30 = 0x3030303030303030

// digitRun is the number of lanes of t (a word XOR lanes30) before the
// first that is not a digit (8: none is). A lane's high bit is set where
// it is 10 or more (the carries of such lanes reach only lanes after
// them).
func digitRun(t uint64) int {
	return bits.TrailingZeros64(((t+0x7676767676767676)|t)&lanes80) >> 3
}

// digitsValue is the number written by t's first n lanes, 1 ≤ n ≤ 7
// (simdjson's eight-digit parse, once they are shifted to the top lanes).
func digitsValue(t uint64, n int) uint32 {
	t <<= 64 - 8*uint(n)
	t = t*10 + t>>8
	return uint32(((t&0x000000ff000000ff)*(100+1000000<<32) + (t>>16&0x000000ff000000ff)*(1+10000<<32)) >> 32)
}

// skipSpace returns the index of the first byte of raw at or after i that
// is not JSON whitespace.
func skipSpace(raw []byte, i int) int {
	for i < len(raw) && (raw[i] == ' ' || raw[i] == '\n' || raw[i] == '\r' || raw[i] == '\t') {
		i++
	}
	return i
}

// renderChat renders the body's messages (and tools, which chat templates
// put first) into one canonical string: "role\x00content\x00" per message,
// content parts concatenated. It is what ChunkKeyer keys (without a
// tokenizer, or when the tokenizer disagrees with the replicas): two
// conversations share a prefix of the rendering exactly when they share
// leading messages. It also returns the messages as a chat template takes
// them: their contents are substrings of the rendering where they can be.
func renderChat(f *reqBody) (string, []tokenize.Message, error) {
	size, shared := len(f.tools)+8, 0
	for i := range f.nMsgs {
		m := f.msgs.at(i)
		size += len(m.role) + 4
		if mo := m.more; mo != nil {
			size += len(mo.name) + len(mo.toolCalls) + len(mo.toolCallID)
		}
		switch c := &m.content; c.kind {
		case contentString:
			size += len(c.raw)
			shared++
		case contentParts:
			for j := range c.n {
				p := f.parts.at(int(c.first + j))
				if p.typ == partText && p.textSet {
					size += int(p.tend - p.toff)
				} else {
					size += int(p.end - p.off)
				}
			}
			shared++
		}
	}
	var b strings.Builder
	b.Grow(size)
	if tools := f.tools; len(tools) > 0 && string(tools) != "null" {
		b.WriteString("tools\x00")
		b.Write(tools)
		b.WriteByte(0)
	}
	out := make([]tokenize.Message, f.nMsgs)
	// Where each content that is a substring of the rendering lies in it.
	type span struct{ msg, start, end uint32 }
	spans := make([]span, 0, shared)
	for i := range f.nMsgs {
		m := f.msgs.at(i)
		if m.role == "" {
			return "", nil, fmt.Errorf("%w: messages[%d].role is required", ErrBadRequest, i)
		}
		tm := &out[i]
		tm.Role = m.role
		mo := m.more
		if mo != nil {
			tm.Name, tm.ToolCallID, tm.ReasoningContent = mo.name, mo.toolCallID, mo.reasoning.ptr()
		}
		b.WriteString(m.role)
		b.WriteByte(0)
		if tm.Name != "" {
			b.WriteString(tm.Name)
			b.WriteByte(0)
		}
		switch c := &m.content; c.kind {
		case contentAbsent, contentNull:
		case contentString:
			start := b.Len()
			writeString(&b, c.raw, c.form)
			spans = append(spans, span{uint32(i), uint32(start), uint32(b.Len())})
		case contentParts:
			texts, written := 0, 0 // parts tokenize.Message keeps; of those, written unquoted
			var at span
			for j := range int(c.n) {
				p := f.parts.at(int(c.first) + j)
				if p.bad {
					return "", nil, fmt.Errorf("%w: messages[%d].content[%d]: %s", ErrBadRequest, i, j, partError(c.raw[p.off:p.end]))
				}
				if p.typ == partText && p.textSet {
					start := b.Len()
					writeString(&b, c.raw[p.toff:p.tend], p.textForm)
					at, written = span{uint32(i), uint32(start), uint32(b.Len())}, written+1
				} else {
					// Images, audio, files: key their JSON (the same image
					// URL is the same prefix).
					b.Write(c.raw[p.off:p.end])
				}
				if p.typ != partOther && p.textSet {
					texts++
				}
			}
			// What tokenize.Message keeps of a part list: its texts joined
			// with "\n", the rendering's own bytes when it is one text.
			switch {
			case texts == 1 && written == 1:
				spans = append(spans, at)
			case texts > 0:
				tm.Content = joinTexts(c, &f.parts)
			}
		default:
			return "", nil, fmt.Errorf("%w: messages[%d].content must be a string or a list of parts", ErrBadRequest, i)
		}
		b.WriteByte(0)
		if mo == nil {
			continue
		}
		if tc := mo.toolCalls; len(tc) > 0 && string(tc) != "null" {
			b.Write(tc)
			b.WriteByte(0)
			// Malformed tool calls are left out of the template's view;
			// the engine rejects such a request anyway.
			tm.ToolCalls = toolCalls(tc)
			for j := range tm.ToolCalls {
				// The template decodes the arguments, recursively.
				if nestsDeeper(tm.ToolCalls[j].Function.Arguments, MaxNesting) {
					return "", nil, fmt.Errorf("%w: messages[%d].tool_calls[%d].function.arguments nests more than the %d levels allowed", ErrBadRequest, i, j, MaxNesting)
				}
			}
		}
		if mo.toolCallID != "" {
			b.WriteString(mo.toolCallID)
			b.WriteByte(0)
		}
	}
	text := b.String()
	for _, sp := range spans {
		out[sp.msg].Content = text[sp.start:sp.end]
	}
	return text, out, nil
}

// joinTexts is the texts of c's parts (a content list's, kept in parts)
// that tokenize.Message keeps, joined with "\n".
func joinTexts(c *chatContent, parts *blockList[chatPart]) string {
	size := 0
	for j := range c.n {
		p := parts.at(int(c.first + j))
		size += int(p.tend-p.toff) + 1
	}
	var b strings.Builder
	b.Grow(size)
	first := true
	for j := range c.n {
		p := parts.at(int(c.first + j))
		if p.typ == partOther || !p.textSet {
			continue
		}
		if !first {
			b.WriteByte('\n')
		}
		first = false
		writeString(&b, c.raw[p.toff:p.tend], p.textForm)
	}
	return b.String()
}

// toolCalls decodes a message's tool_calls (raw, a valid JSON value) as
// encoding/json decodes it into []tokenize.ToolCall with its error
// ignored: what has the wrong shape is left out, the rest kept.
func toolCalls(raw []byte) []tokenize.ToolCall {
	s := jsonScan{b: raw}
	if s.peek() != '[' {
		return nil
	}
	calls := []tokenize.ToolCall{}
	empty, ok := s.open(']')
	for ok && !empty {
		var tc tokenize.ToolCall
		if s.peek() == '{' {
			ok = s.toolCall(&tc)
		} else {
			ok = s.skip()
		}
		calls = append(calls, tc)
		var more bool
		if more, ok = s.next(']'); !more {
			break
		}
	}
	return calls
}

// toolCall reads one tool call object, leniently (see toolCalls).
func (s *jsonScan) toolCall(tc *tokenize.ToolCall) bool {
	empty, ok := s.open('}')
	for ok && !empty {
		var key []byte
		if key, ok = s.key(); !ok {
			return false
		}
		switch {
		case keyIs(key, "id"):
			ok = s.stringInto(&tc.ID, nil, nil, "")
		case keyIs(key, "type"):
			ok = s.stringInto(&tc.Type, nil, nil, "")
		case keyIs(key, "function") && s.peek() == '{':
			ok = s.function(&tc.Function)
		default:
			ok = s.skip()
		}
		if !ok {
			return false
		}
		var more bool
		if more, ok = s.next('}'); !more {
			break
		}
	}
	return ok
}

// function reads a tool call's function object, leniently.
func (s *jsonScan) function(f *tokenize.FunctionCall) bool {
	empty, ok := s.open('}')
	for ok && !empty {
		var key []byte
		if key, ok = s.key(); !ok {
			return false
		}
		switch {
		case keyIs(key, "name"):
			ok = s.stringInto(&f.Name, nil, nil, "")
		case keyIs(key, "arguments"):
			ok = s.stringInto(&f.Arguments, nil, nil, "")
		default:
			ok = s.skip()
		}
		if !ok {
			return false
		}
		var more bool
		if more, ok = s.next('}'); !more {
			break
		}
	}
	return ok
}

// chatPrompt gathers what a chat template needs from a chat body. Tools or
// kwargs of the wrong shape are left out (the engine rejects such a body).
// Their JSON is copied out of the body.
func chatPrompt(msgs []tokenize.Message, raw *reqBody) *ChatPrompt {
	c := &ChatPrompt{Messages: msgs, AddGenerationPrompt: string(raw.addGen) != "false"}
	if t := raw.tools; len(t) > 0 && t[0] == '[' {
		t = bytes.Clone(t)
		items := listItems(t)
		c.Tools = make([]json.RawMessage, len(items))
		for i, it := range items {
			c.Tools[i] = it
		}
	}
	if k := raw.kwarg; len(k) > 0 && k[0] == '{' {
		k = bytes.Clone(k)
		c.Kwargs = map[string]json.RawMessage{}
		s := jsonScan{b: k}
		empty, ok := s.open('}')
		for ok && !empty {
			var key, v []byte
			if key, ok = s.key(); !ok {
				break
			}
			if v, ok = s.span(); !ok {
				break
			}
			c.Kwargs[string(key)] = v
			var more bool
			if more, ok = s.next('}'); !more {
				break
			}
		}
	}
	return c
}

// cacheSaltKey is the body member vLLM reads the salt from.
const cacheSaltKey = "cache_salt"

// errCacheSalt is vLLM's answer to a cache_salt that is not a non-empty
// string (vllm/entrypoints/openai/protocol.py, check_cache_salt_support:
// "Parameter 'cache_salt' must be a non-empty string if provided.";
// vllm-project/vllm at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e). null is
// no salt.
var errCacheSalt = fmt.Errorf("%w: Parameter 'cache_salt' must be a non-empty string if provided.", ErrBadRequest)

// CacheSalt returns the "cache_salt" member of body, a JSON object, as
// vLLM reads it: the member whose key is exactly cache_salt once unescaped
// (Python's json and pydantic match keys exactly, not encoding/json's
// case-folded way), the last one when there are several, null as no salt.
// A value that is not a non-empty string is an error wrapping
// ErrBadRequest (vLLM answers 400). A body that is not a valid JSON
// object has no salt. Bodies that cannot hold the key (most) cost one vector search.
func CacheSalt(body []byte) (string, error) {
	if !mayHoldSaltKey(body) {
		return "", nil
	}
	var salt string
	var bad bool
	valid := forMembers(body, func(key []byte, s *jsonScan) bool {
		if string(key) != cacheSaltKey {
			return s.skip()
		}
		switch s.peek() {
		case '"':
			v, ok := s.str()
			salt, bad = v, v == ""
			return ok
		case 'n':
			salt, bad = "", false
			return s.literal()
		}
		salt, bad = "", true
		return s.skip()
	}, nil)
	if !valid {
		return "", nil // not an object: no salt (the parser said why)
	}
	if bad {
		return "", errCacheSalt
	}
	return salt, nil
}

// WithCacheSalt returns body, a JSON object, with its cache_salt members
// (as CacheSalt finds them) removed and "cache_salt": salt added last: the
// salt the replica then applies whatever the client sent. The other
// members are copied byte for byte. It does not modify body.
func WithCacheSalt(body []byte, salt string) ([]byte, error) {
	quoted, err := json.Marshal(salt)
	if err != nil {
		return nil, fmt.Errorf("openai: set cache_salt: %w", err)
	}
	out := make([]byte, 0, len(body)+len(cacheSaltKey)+len(quoted)+4)
	out = append(out, '{')
	members, start := 0, 0
	ok := forMembers(body, func(key []byte, s *jsonScan) bool {
		if !s.skip() {
			return false
		}
		if string(key) != cacheSaltKey {
			if members > 0 {
				out = append(out, ',')
			}
			out = append(out, body[start:s.i]...)
			members++
		}
		return true
	}, func(s *jsonScan) { start = s.i })
	if !ok {
		return nil, fmt.Errorf("%w: set cache_salt: the body is not a JSON object", ErrBadRequest)
	}
	if members > 0 {
		out = append(out, ',')
	}
	out = append(out, '"')
	out = append(out, cacheSaltKey...)
	out = append(out, '"', ':')
	out = append(out, quoted...)
	return append(out, '}'), nil
}

// forMembers calls member for each member of the JSON object body, in
// order, with its unquoted key and s on its value; member must read the
// value and return false on a syntax error. before, when set, is called
// at each member's key. It returns false when body is not an object or
// not valid JSON.
func forMembers(body []byte, member func(key []byte, s *jsonScan) bool, before func(s *jsonScan)) bool {
	s := &jsonScan{b: body}
	s.ws()
	if s.peek() != '{' {
		return false
	}
	empty, ok := s.open('}')
	for ok && !empty {
		if before != nil {
			before(s)
		}
		var key []byte
		if key, ok = s.key(); !ok {
			return false
		}
		if !member(key, s) {
			return false
		}
		var more bool
		if more, ok = s.next('}'); !more {
			break
		}
	}
	if !ok {
		return false
	}
	s.ws()
	return s.i == len(body)
}

// mayHoldSaltKey reports whether body may have a key that unescapes to
// cache_salt: it holds the key as it stands, or a \u00XX escape of one of
// its letters (the only way to write them otherwise).
func mayHoldSaltKey(body []byte) bool {
	if bytes.Contains(body, []byte(cacheSaltKey)) {
		return true
	}
	for rest := body; ; {
		i := bytes.Index(rest, []byte(`\u00`))
		if i < 0 || i+6 > len(rest) {
			return false
		}
		if c, ok := hexByte(rest[i+4], rest[i+5]); ok && strings.IndexByte(cacheSaltKey, c) >= 0 {
			return true
		}
		rest = rest[i+4:]
	}
}

// hexByte decodes two hex digits.
func hexByte(hi, lo byte) (byte, bool) {
	h, ok1 := hexVal(hi)
	l, ok2 := hexVal(lo)
	return h<<4 | l, ok1 && ok2
}

func hexVal(c byte) (byte, bool) {
	switch {
	case '0' <= c && c <= '9':
		return c - '0', true
	case 'a' <= c && c <= 'f':
		return c - 'a' + 10, true
	case 'A' <= c && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
