package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// Kind is the OpenAI endpoint a request is for.
type Kind int

// The kinds of request the proxy parses.
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
// something the proxy cannot route (the HTTP edge answers 400).
var ErrBadRequest = errors.New("invalid request")

// errNoModel is the error for a body without "model" (its param is "model").
var errNoModel = fmt.Errorf("%w: you must provide a model parameter", ErrBadRequest)

// Request is what the proxy reads from an OpenAI request body: enough to key
// the prompt and to know what to expect back. The body itself is forwarded
// untouched.
type Request struct {
	// Kind is the endpoint.
	Kind Kind
	// Model is the body's "model".
	Model string
	// Stream is the body's "stream".
	Stream bool
	// MaxTokens is max_completion_tokens, else max_tokens (0 if absent),
	// multiplied by n and by the number of prompts in a batch.
	MaxTokens int
	// User is the body's "user" (a session key when no x-session-id header).
	User string
	// Texts are the prompts given as text (completions: one per prompt of a
	// batch; chat: the canonical rendering of the messages).
	Texts []string
	// TokenIDs are the prompts given as token ids (one list per prompt).
	TokenIDs [][]uint32
	// Chat is what a chat template needs to render the messages as the
	// engine does (nil unless the body had messages): TokenizerKeyer keys
	// it, ChunkKeyer keys Texts.
	Chat *ChatPrompt
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

// rawRequest is the part of a completions or chat body the proxy reads; the
// field types reject wrong JSON types with an error naming the field.
type rawRequest struct {
	Model               *string          `json:"model"`
	Stream              *bool            `json:"stream"`
	MaxTokens           *int64           `json:"max_tokens"`
	MaxCompletionTokens *int64           `json:"max_completion_tokens"`
	N                   *int64           `json:"n"`
	User                *string          `json:"user"`
	Prompt              json.RawMessage  `json:"prompt"`
	Messages            []rawMessage     `json:"messages"`
	Tools               json.RawMessage  `json:"tools"`
	StreamOptions       *json.RawMessage `json:"stream_options"`
	AddGenerationPrompt json.RawMessage  `json:"add_generation_prompt"`
	ChatTemplateKwargs  json.RawMessage  `json:"chat_template_kwargs"`
	Input               json.RawMessage  `json:"input"`
}

// rawMessage is one chat message.
type rawMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	Name       string          `json:"name"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
	ToolCallID string          `json:"tool_call_id"`
	// ReasoningContent is passed to the chat template when present.
	ReasoningContent *string `json:"reasoning_content"`
}

// rawPart is one part of a chat message's content list.
type rawPart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

// ParseRequest reads the body of a request of kind k. Completions need a
// model and a prompt; chat needs a model and messages; other kinds are read
// best effort: a body the proxy cannot read (not JSON, or another API's
// shapes) yields an empty Request and no error, since it is forwarded as it
// is, unkeyed. Errors wrap ErrBadRequest.
func ParseRequest(k Kind, body []byte) (*Request, error) {
	req, err := parseRequest(k, body, true)
	if err != nil && k == KindOther {
		return &Request{Kind: KindOther}, nil
	}
	return req, err
}

// parseRequest is ParseRequest; fast enables the direct scan of a token-id
// prompt (splitTokenPrompt), which tests turn off to check it changes
// nothing.
func parseRequest(k Kind, body []byte, fast bool) (*Request, error) {
	req := &Request{Kind: k}
	var raw rawRequest
	var ids [][]uint32 // the prompt, when splitTokenPrompt read it
	if fast && k != KindChat {
		raw, ids = splitTokenPrompt(body)
	}
	if ids == nil {
		if err := json.Unmarshal(body, &raw); err != nil {
			return nil, fmt.Errorf("%w: %s", ErrBadRequest, describeJSONError(err))
		}
	}
	if raw.Model != nil {
		req.Model = *raw.Model
	}
	if raw.Stream != nil {
		req.Stream = *raw.Stream
	}
	if raw.User != nil {
		req.User = *raw.User
	}
	if k != KindOther && req.Model == "" {
		return nil, errNoModel
	}
	maxTok := int64(0)
	switch {
	case raw.MaxCompletionTokens != nil:
		maxTok = *raw.MaxCompletionTokens
	case raw.MaxTokens != nil:
		maxTok = *raw.MaxTokens
	}
	if maxTok < 0 {
		return nil, fmt.Errorf("%w: max_tokens must be ≥ 0, got %d", ErrBadRequest, maxTok)
	}
	n := int64(1)
	if raw.N != nil {
		if *raw.N < 1 {
			return nil, fmt.Errorf("%w: n must be ≥ 1, got %d", ErrBadRequest, *raw.N)
		}
		n = *raw.N
	}
	prompts := 1
	switch {
	case k == KindChat || (k == KindOther && raw.Messages != nil):
		if len(raw.Messages) == 0 {
			return nil, fmt.Errorf("%w: messages must be a non-empty list", ErrBadRequest)
		}
		text, msgs, err := renderChat(raw.Messages, raw.Tools)
		if err != nil {
			return nil, err
		}
		req.Texts = []string{text}
		req.Chat = chatPrompt(msgs, &raw)
	case k == KindCompletion || (k == KindOther && raw.Prompt != nil):
		if len(raw.Prompt) == 0 || bytes.Equal(raw.Prompt, []byte("null")) {
			if k == KindOther {
				break
			}
			return nil, fmt.Errorf("%w: you must provide a prompt", ErrBadRequest)
		}
		if ids != nil {
			req.TokenIDs = ids
		} else if err := parsePrompt(req, raw.Prompt, "prompt"); err != nil {
			return nil, err
		}
		prompts = max(len(req.Texts), len(req.TokenIDs))
	case raw.Input != nil && !bytes.Equal(raw.Input, []byte("null")):
		// Embeddings and similar: "input" takes the shapes of "prompt".
		if err := parsePrompt(req, raw.Input, "input"); err != nil {
			return nil, err
		}
		prompts = max(len(req.Texts), len(req.TokenIDs))
	}
	total := float64(maxTok) * float64(n) * float64(prompts)
	req.MaxTokens = int(min(total, math.MaxInt32))
	return req, nil
}

// parsePrompt reads a prompt in any of its four shapes: a string, a list of
// strings, a list of token ids, or a list of token-id lists.
func parsePrompt(req *Request, raw json.RawMessage, field string) error {
	raw = bytes.TrimSpace(raw)
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return fmt.Errorf("%w: %s: %s", ErrBadRequest, field, describeJSONError(err))
		}
		req.Texts = []string{s}
		return nil
	case '[':
	default:
		return fmt.Errorf("%w: %s must be a string, a list of strings, a list of token ids or a list of token-id lists", ErrBadRequest, field)
	}
	// Token ids, the common shape of long prompts from benchmarks and
	// agents, are read by a direct scan: decoding a 4096-id list item by
	// item through encoding/json costs milliseconds per request.
	if ids, ok := scanTokenIDLists(raw); ok {
		req.TokenIDs = ids
		return nil
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return fmt.Errorf("%w: %s: %s", ErrBadRequest, field, describeJSONError(err))
	}
	if len(items) == 0 {
		return fmt.Errorf("%w: %s must not be empty", ErrBadRequest, field)
	}
	first := bytes.TrimSpace(items[0])
	switch {
	case len(first) > 0 && first[0] == '"':
		var ss []string
		if err := json.Unmarshal(raw, &ss); err != nil {
			return fmt.Errorf("%w: %s: a list of strings must hold only strings", ErrBadRequest, field)
		}
		req.Texts = ss
	case len(first) > 0 && first[0] == '[':
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

// tokenIDs decodes a JSON list of token ids (integers in [0, 2³²)).
func tokenIDs(raw json.RawMessage) ([]uint32, error) {
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, errors.New("token ids must be integers")
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

// splitTokenPrompt reads a body whose prompt is token ids without handing
// the ids to encoding/json: it finds and scans the prompt's value in one
// pass (findTokenPrompt) and decodes the rest of the body with the prompt
// replaced by 0. A 4096-token prompt then costs one pass over its bytes
// instead of four through encoding/json, and a tenth of the CPU. It
// returns nil ids when the body is not of that shape or does not decode;
// the caller then decodes the whole body, so results and errors are those
// of encoding/json alone.
func splitTokenPrompt(body []byte) (rawRequest, [][]uint32) {
	s, e, ids := findTokenPrompt(body)
	if ids == nil {
		return rawRequest{}, nil
	}
	rest := make([]byte, 0, len(body)-(e-s)+1)
	rest = append(append(append(rest, body[:s]...), '0'), body[e:]...)
	var raw rawRequest
	if json.Unmarshal(rest, &raw) != nil || !bytes.Equal(raw.Prompt, []byte("0")) {
		return rawRequest{}, nil
	}
	raw.Prompt = body[s:e]
	return raw, ids
}

// findTokenPrompt finds, in body, the value that encoding/json decodes
// into rawRequest.Prompt: that of the last top-level key equal to "prompt"
// under bytes.EqualFold (encoding/json's key matching; the last duplicate
// wins). When that value is token ids (scanTokenIDs) it returns where it
// lies and the ids; otherwise, or when body is not an object the scan can
// follow (a key with an escape, unbalanced brackets, text after the
// object), nil ids. The scan lexes strings as JSON does, so when the body
// with the value replaced is valid JSON the value found is the real one.
func findTokenPrompt(body []byte) (start, end int, ids [][]uint32) {
	i := skipSpace(body, 0)
	if i >= len(body) || body[i] != '{' {
		return 0, 0, nil
	}
	i = skipSpace(body, i+1)
	if i < len(body) && body[i] == '}' {
		return 0, 0, nil
	}
	for {
		if i >= len(body) || body[i] != '"' {
			return 0, 0, nil
		}
		ke := bytes.IndexByte(body[i+1:], '"')
		if ke < 0 {
			return 0, 0, nil
		}
		key := body[i+1 : i+1+ke]
		if bytes.IndexByte(key, '\\') >= 0 {
			return 0, 0, nil
		}
		i = skipSpace(body, i+ke+2)
		if i >= len(body) || body[i] != ':' {
			return 0, 0, nil
		}
		vs := skipSpace(body, i+1)
		var ve int
		var ok bool
		if bytes.EqualFold(key, []byte("prompt")) {
			start, ids = vs, nil
			if ids, ve, ok = scanTokenIDs(body, vs); !ok {
				ids = nil
				ve, ok = skipValue(body, vs)
			}
			end = ve
		} else {
			ve, ok = skipValue(body, vs)
		}
		if !ok {
			return 0, 0, nil
		}
		i = skipSpace(body, ve)
		if i >= len(body) {
			return 0, 0, nil
		}
		switch body[i] {
		case ',':
			i = skipSpace(body, i+1)
		case '}':
			if skipSpace(body, i+1) != len(body) {
				return 0, 0, nil
			}
			return start, end, ids
		default:
			return 0, 0, nil
		}
	}
}

// skipValue returns the index just past the JSON value that starts at
// body[i]. It checks only what it needs to find the end: strings, and
// bracket depth.
func skipValue(body []byte, i int) (int, bool) {
	if i >= len(body) {
		return 0, false
	}
	switch body[i] {
	case '"':
		return skipString(body, i)
	case '{', '[':
		depth := 0
		for i < len(body) {
			switch body[i] {
			case '"':
				e, ok := skipString(body, i)
				if !ok {
					return 0, false
				}
				i = e
				continue
			case '{', '[':
				depth++
			case '}', ']':
				depth--
				if depth == 0 {
					return i + 1, true
				}
			}
			i++
		}
		return 0, false
	}
	// A number or a literal: up to the next delimiter.
	for i < len(body) {
		switch body[i] {
		case ',', '}', ']', ' ', '\n', '\r', '\t':
			return i, true
		}
		i++
	}
	return i, true
}

// skipString returns the index just past the JSON string that starts at
// body[i] ('"').
func skipString(body []byte, i int) (int, bool) {
	for i++; i < len(body); i++ {
		switch body[i] {
		case '\\':
			i++ // the escaped byte ("\u" digits need no care)
		case '"':
			return i + 1, true
		}
	}
	return 0, false
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
		// Most ids of a tokenizer's vocabulary take 4 to 6 bytes with
		// their comma: size the list once.
		l, n, ok := scanIDList(raw, i, (len(raw)-i)/5+1)
		if !ok || len(l) == 0 {
			return nil, 0, false
		}
		return [][]uint32{l}, n, true
	}
	for {
		l, n, ok := scanIDList(raw, j, 0)
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
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > math.MaxUint32 {
				return nil, 0, false
			}
			i++
		}
		if i == start || (raw[start] == '0' && i-start > 1) {
			return nil, 0, false // not a plain integer: let encoding/json say why
		}
		ids = append(ids, uint32(v))
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

// skipSpace returns the index of the first byte of raw at or after i that
// is not JSON whitespace.
func skipSpace(raw []byte, i int) int {
	for i < len(raw) && (raw[i] == ' ' || raw[i] == '\n' || raw[i] == '\r' || raw[i] == '\t') {
		i++
	}
	return i
}

// renderChat renders messages (and tools, which chat templates put first)
// into one canonical string: "role\x00content\x00" per message, content
// parts concatenated. It is what ChunkKeyer keys (without a tokenizer, or
// when the tokenizer disagrees with the replicas): two conversations share
// a prefix of the rendering exactly when they share leading messages. It
// also returns the messages as a chat template takes them.
func renderChat(msgs []rawMessage, tools json.RawMessage) (string, []tokenize.Message, error) {
	var b strings.Builder
	if t := bytes.TrimSpace(tools); len(t) > 0 && !bytes.Equal(t, []byte("null")) {
		b.WriteString("tools\x00")
		b.Write(t)
		b.WriteByte(0)
	}
	out := make([]tokenize.Message, len(msgs))
	for i, m := range msgs {
		if m.Role == "" {
			return "", nil, fmt.Errorf("%w: messages[%d].role is required", ErrBadRequest, i)
		}
		tm := &out[i]
		tm.Role, tm.Name, tm.ToolCallID, tm.ReasoningContent = m.Role, m.Name, m.ToolCallID, m.ReasoningContent
		b.WriteString(m.Role)
		b.WriteByte(0)
		if m.Name != "" {
			b.WriteString(m.Name)
			b.WriteByte(0)
		}
		c := bytes.TrimSpace(m.Content)
		switch {
		case len(c) == 0 || bytes.Equal(c, []byte("null")):
		case c[0] == '"':
			var s string
			if err := json.Unmarshal(c, &s); err != nil {
				return "", nil, fmt.Errorf("%w: messages[%d].content: %s", ErrBadRequest, i, describeJSONError(err))
			}
			b.WriteString(s)
			tm.Content = s
		case c[0] == '[':
			var parts []json.RawMessage
			if err := json.Unmarshal(c, &parts); err != nil {
				return "", nil, fmt.Errorf("%w: messages[%d].content: %s", ErrBadRequest, i, describeJSONError(err))
			}
			var texts []string
			for j, praw := range parts {
				var p rawPart
				if err := json.Unmarshal(praw, &p); err != nil {
					return "", nil, fmt.Errorf("%w: messages[%d].content[%d]: %s", ErrBadRequest, i, j, describeJSONError(err))
				}
				if p.Type == "text" && p.Text != nil {
					b.WriteString(*p.Text)
				} else {
					// Images, audio, files: key their JSON (the same image
					// URL is the same prefix).
					b.Write(bytes.TrimSpace(praw))
				}
				// What tokenize.Message keeps of a part list.
				if (p.Type == "text" || p.Type == "input_text" || p.Type == "") && p.Text != nil {
					texts = append(texts, *p.Text)
				}
			}
			tm.Content = strings.Join(texts, "\n")
		default:
			return "", nil, fmt.Errorf("%w: messages[%d].content must be a string or a list of parts", ErrBadRequest, i)
		}
		b.WriteByte(0)
		if tc := bytes.TrimSpace(m.ToolCalls); len(tc) > 0 && !bytes.Equal(tc, []byte("null")) {
			b.Write(tc)
			b.WriteByte(0)
			// Malformed tool calls are left out of the template's view;
			// the engine rejects such a request anyway.
			_ = json.Unmarshal(tc, &tm.ToolCalls)
		}
		if m.ToolCallID != "" {
			b.WriteString(m.ToolCallID)
			b.WriteByte(0)
		}
	}
	return b.String(), out, nil
}

// chatPrompt gathers what a chat template needs from a chat body. Tools or
// kwargs of the wrong shape are left out (the engine rejects such a body).
func chatPrompt(msgs []tokenize.Message, raw *rawRequest) *ChatPrompt {
	c := &ChatPrompt{Messages: msgs, AddGenerationPrompt: true}
	if bytes.Equal(bytes.TrimSpace(raw.AddGenerationPrompt), []byte("false")) {
		c.AddGenerationPrompt = false
	}
	if t := bytes.TrimSpace(raw.Tools); len(t) > 0 && t[0] == '[' {
		_ = json.Unmarshal(t, &c.Tools)
	}
	if k := bytes.TrimSpace(raw.ChatTemplateKwargs); len(k) > 0 && k[0] == '{' {
		_ = json.Unmarshal(k, &c.Kwargs)
	}
	return c
}

// describeJSONError turns a decoding error into a message for the client.
func describeJSONError(err error) string {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		if te.Field == "" {
			return fmt.Sprintf("request body must be a JSON object, got %s", te.Value)
		}
		return fmt.Sprintf("field %s: expected %s, got %s", te.Field, jsonTypeName(te.Type.Kind().String()), te.Value)
	case errors.As(err, &se):
		return fmt.Sprintf("malformed JSON at byte %d: %v", se.Offset, se)
	}
	return "malformed JSON: " + err.Error()
}

// jsonTypeName names a Go kind the way a JSON user would.
func jsonTypeName(kind string) string {
	switch kind {
	case "bool":
		return "a boolean"
	case "string":
		return "a string"
	case "int", "int64", "int32", "uint32", "uint64", "float64":
		return "a number"
	case "slice":
		return "a list"
	case "struct", "map":
		return "an object"
	}
	return kind
}

// Keyer turns a parsed request into the router's block keys and an estimate
// of its prompt length in tokens. Text-chunk keying stands in until
// token-exact tokenization lands; a tokenizer will implement the same
// interface. Implementations must be safe for concurrent use.
type Keyer interface {
	// Keys returns the keys of the request's (first) prompt and the prompt
	// tokens of the whole request (every prompt of a batch), ≥ 1 and ≥
	// len(keys)·block size.
	Keys(r *Request) (keys []blocks.Key, promptTokens int, err error)
}

// ChunkKeyer keys text by chunks of 4·BlockTokens bytes (blocks.TextKeys)
// and token ids by blocks of BlockTokens (blocks.Keys), so that one key
// stands for BlockTokens tokens either way, as the router requires.
type ChunkKeyer struct {
	// BlockTokens is the tokens per key (the router's block size).
	BlockTokens int
}

var _ Keyer = ChunkKeyer{}

// ChunkBytes is the text chunk size: blocks.TokensPerChunk of it is
// BlockTokens (about 4 bytes per token of English text).
func (k ChunkKeyer) ChunkBytes() int { return 4 * k.BlockTokens }

// Keys implements Keyer. A batch is keyed by its first prompt (the one the
// engine schedules first); its prompt tokens count every prompt.
func (k ChunkKeyer) Keys(r *Request) ([]blocks.Key, int, error) {
	var keys []blocks.Key
	total := 0
	for i, text := range r.Texts {
		if i == 0 {
			keys = blocks.TextKeys(nil, text, k.ChunkBytes())
		}
		total += (len(text) + 3) / 4
	}
	for i, ids := range r.TokenIDs {
		if i == 0 && len(keys) == 0 {
			keys = blocks.Keys(nil, ids, k.BlockTokens)
		}
		total += len(ids)
	}
	total = max(total, len(keys)*k.BlockTokens, 1)
	return keys, total, nil
}
