package openai

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// The reference decoder: ParseRequest as it was written with encoding/json
// (Unmarshal into a struct of RawMessage fields, then each message and
// content part again), kept for the differential tests of decodeBody.

// refRequest is the part of a completions or chat body the proxy reads; the
// field types reject wrong JSON types with an error naming the field.
type refRequest struct {
	Model               *string          `json:"model"`
	Stream              *bool            `json:"stream"`
	MaxTokens           *int64           `json:"max_tokens"`
	MaxCompletionTokens *int64           `json:"max_completion_tokens"`
	N                   *int64           `json:"n"`
	User                *string          `json:"user"`
	Prompt              json.RawMessage  `json:"prompt"`
	Messages            []refMessage     `json:"messages"`
	Tools               json.RawMessage  `json:"tools"`
	StreamOptions       *json.RawMessage `json:"stream_options"`
	AddGenerationPrompt json.RawMessage  `json:"add_generation_prompt"`
	ChatTemplateKwargs  json.RawMessage  `json:"chat_template_kwargs"`
	Input               json.RawMessage  `json:"input"`
}

// refMessage is one chat message.
type refMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	Name       string          `json:"name"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
	ToolCallID string          `json:"tool_call_id"`
	// ReasoningContent is passed to the chat template when present.
	ReasoningContent *string `json:"reasoning_content"`
}

// refPart is one part of a chat message's content list.
type refPart struct {
	Type string  `json:"type"`
	Text *string `json:"text"`
}

// refParseRequest is readRequest as it was written with encoding/json:
// the reference the single-pass decoder is checked against.
func refParseRequest(k Kind, body []byte) (*Request, error) {
	req := &Request{Kind: k}
	var raw refRequest
	var ids [][]uint32
	if err := json.Unmarshal(body, &raw); err != nil {
		return nil, fmt.Errorf("%w: %s", ErrBadRequest, refDescribe(err))
	}
	if d := refDepth(body); d > MaxNesting {
		return nil, fmt.Errorf("%w: request body nests %d levels deep, more than the %d allowed", ErrBadRequest, d, MaxNesting)
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
		if len(raw.Messages) > MaxMessages {
			return nil, fmt.Errorf("%w: messages holds %d messages, more than the %d allowed", ErrBadRequest, len(raw.Messages), MaxMessages)
		}
		parts := 0
		for _, m := range raw.Messages {
			var list []json.RawMessage
			if c := bytes.TrimSpace(m.Content); len(c) > 0 && c[0] == '[' && json.Unmarshal(c, &list) == nil {
				parts += len(list)
			}
		}
		if parts > MaxContentParts {
			return nil, fmt.Errorf("%w: messages hold %d content parts, more than the %d allowed", ErrBadRequest, parts, MaxContentParts)
		}
		text, msgs, err := refRenderChat(raw.Messages, raw.Tools)
		if err != nil {
			return nil, err
		}
		req.Texts = []string{text}
		req.Chat = refChatPrompt(msgs, &raw)
	case k == KindCompletion || (k == KindOther && raw.Prompt != nil):
		if len(raw.Prompt) == 0 || bytes.Equal(raw.Prompt, []byte("null")) {
			if k == KindOther {
				break
			}
			return nil, fmt.Errorf("%w: you must provide a prompt", ErrBadRequest)
		}
		if ids != nil {
			req.TokenIDs = ids
		} else if err := refParsePrompt(req, raw.Prompt, "prompt"); err != nil {
			return nil, err
		}
		prompts = max(len(req.Texts), len(req.TokenIDs))
	case raw.Input != nil && !bytes.Equal(raw.Input, []byte("null")):
		// Embeddings and similar: "input" takes the shapes of "prompt".
		if err := refParsePrompt(req, raw.Input, "input"); err != nil {
			return nil, err
		}
		prompts = max(len(req.Texts), len(req.TokenIDs))
	}
	total := float64(maxTok) * float64(n) * float64(prompts)
	req.MaxTokens = int(min(total, math.MaxInt32))
	return req, nil
}

// refParsePrompt reads a prompt in any of its four shapes: a string, a list of
// strings, a list of token ids, or a list of token-id lists.
func refParsePrompt(req *Request, raw json.RawMessage, field string) error {
	raw = bytes.TrimSpace(raw)
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return fmt.Errorf("%w: %s: %s", ErrBadRequest, field, refDescribe(err))
		}
		req.Texts = []string{s}
		return nil
	case '[':
	default:
		return fmt.Errorf("%w: %s must be a string, a list of strings, a list of token ids or a list of token-id lists", ErrBadRequest, field)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return fmt.Errorf("%w: %s: %s", ErrBadRequest, field, refDescribe(err))
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
			ids, err := refTokenIDs(it)
			if err != nil {
				return fmt.Errorf("%w: %s[%d]: %v", ErrBadRequest, field, i, err)
			}
			if len(ids) == 0 {
				return fmt.Errorf("%w: %s[%d] must not be empty", ErrBadRequest, field, i)
			}
			req.TokenIDs = append(req.TokenIDs, ids)
		}
	default:
		ids, err := refTokenIDs(raw)
		if err != nil {
			return fmt.Errorf("%w: %s: %v", ErrBadRequest, field, err)
		}
		req.TokenIDs = [][]uint32{ids}
	}
	return nil
}

// tokenIDs decodes a JSON list of token ids (integers in [0, 2³²)).
func refTokenIDs(raw json.RawMessage) ([]uint32, error) {
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

// refRenderChat renders messages (and tools, which chat templates put first)
// into one canonical string: "role\x00content\x00" per message, content
// parts concatenated. It is what ChunkKeyer keys (without a tokenizer, or
// when the tokenizer disagrees with the replicas): two conversations share
// a prefix of the rendering exactly when they share leading messages. It
// also returns the messages as a chat template takes them.
func refRenderChat(msgs []refMessage, tools json.RawMessage) (string, []tokenize.Message, error) {
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
				return "", nil, fmt.Errorf("%w: messages[%d].content: %s", ErrBadRequest, i, refDescribe(err))
			}
			b.WriteString(s)
			tm.Content = s
		case c[0] == '[':
			var parts []json.RawMessage
			if err := json.Unmarshal(c, &parts); err != nil {
				return "", nil, fmt.Errorf("%w: messages[%d].content: %s", ErrBadRequest, i, refDescribe(err))
			}
			var texts []string
			for j, praw := range parts {
				var p refPart
				if err := json.Unmarshal(praw, &p); err != nil {
					return "", nil, fmt.Errorf("%w: messages[%d].content[%d]: %s", ErrBadRequest, i, j, refDescribe(err))
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
			for j, call := range tm.ToolCalls {
				if refDepth([]byte(call.Function.Arguments)) > MaxNesting {
					return "", nil, fmt.Errorf("%w: messages[%d].tool_calls[%d].function.arguments nests more than the %d levels allowed", ErrBadRequest, i, j, MaxNesting)
				}
			}
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
func refChatPrompt(msgs []tokenize.Message, raw *refRequest) *ChatPrompt {
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

// refDepth is how deep the objects and lists of data (JSON, valid or
// not) nest at most, read with encoding/json's tokenizer until its first
// value ends or it fails.
func refDepth(data []byte) int {
	dec := json.NewDecoder(bytes.NewReader(data))
	depth, most := 0, 0
	for {
		tok, err := dec.Token()
		if err != nil {
			return most
		}
		switch tok {
		case json.Delim('['), json.Delim('{'):
			depth++
			most = max(most, depth)
		case json.Delim(']'), json.Delim('}'):
			depth--
		}
		if depth == 0 {
			return most
		}
	}
}

// refDescribe turns a decoding error into a message for the client.
func refDescribe(err error) string {
	var te *json.UnmarshalTypeError
	var se *json.SyntaxError
	switch {
	case errors.As(err, &te):
		if te.Field == "" {
			return fmt.Sprintf("request body must be a JSON object, got %s", te.Value)
		}
		return fmt.Sprintf("field %s: expected %s, got %s", te.Field, refTypeName(te.Type.Kind().String()), te.Value)
	case errors.As(err, &se):
		return fmt.Sprintf("malformed JSON at byte %d: %v", se.Offset, se)
	}
	return "malformed JSON: " + err.Error()
}

// refTypeName names a Go kind the way a JSON user would.
func refTypeName(kind string) string {
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
