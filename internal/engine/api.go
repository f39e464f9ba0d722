package engine

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// requestError is an error in a request: the client's fault, answered with
// 400. Every error of a decoder is one, or wraps one.
type requestError struct{ msg string }

func (e *requestError) Error() string { return e.msg }

func badRequest(format string, args ...any) error {
	return &requestError{fmt.Sprintf(format, args...)}
}

// isBadRequest reports whether err is the client's fault.
func isBadRequest(err error) bool {
	var re *requestError
	return errors.As(err, &re)
}

// genRequest is a decoded completion or chat-completion request.
type genRequest struct {
	model string
	// Completions: the prompt as text, or as token ids when isIDs.
	text  string
	ids   []uint32
	isIDs bool
	// Chat: the messages, and as a chat template takes them (tmpl).
	messages []ChatMessage
	chat     bool
	tmpl     chatInput

	maxTokens       int // 0: the engine's default
	stream          bool
	includeUsage    bool // stream_options.include_usage
	continuousUsage bool // stream_options.continuous_usage_stats

	kv kvTransfer // kv_transfer_params: a P/D leg (pd.go)

	// salt is the body's cache_salt ("" none): the request's blocks are
	// hashed and cached apart from other salts' (replica.Request.Salt),
	// and published with it in extra_keys, as vLLM does.
	salt string
}

// streamOptions is OpenAI's stream_options, with vLLM's extension.
type streamOptions struct {
	IncludeUsage         *bool `json:"include_usage"`
	ContinuousUsageStats *bool `json:"continuous_usage_stats"`
}

// samplingFields are the request fields both endpoints share. Only these are
// type-checked; unknown fields are ignored, as vLLM ignores them.
type samplingFields struct {
	Model         *string        `json:"model"`
	MaxTokens     *int           `json:"max_tokens"`
	MinTokens     *int           `json:"min_tokens"`
	N             *int           `json:"n"`
	Stream        *bool          `json:"stream"`
	StreamOptions *streamOptions `json:"stream_options"`
	IgnoreEOS     *bool          `json:"ignore_eos"`
	Temperature   *float64       `json:"temperature"`
	TopP          *float64       `json:"top_p"`
	Seed          *int64         `json:"seed"`
	User          *string        `json:"user"`
	// KVTransferParams is vLLM's kv_transfer_params (pd.go), decoded by
	// decodeKVTransfer.
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

// rawCompletion is the body of POST /v1/completions.
type rawCompletion struct {
	samplingFields
	Prompt json.RawMessage `json:"prompt"`
}

// rawChat is the body of POST /v1/chat/completions.
type rawChat struct {
	samplingFields
	chatTemplateFields
	Messages            []rawMessage `json:"messages"`
	MaxCompletionTokens *int         `json:"max_completion_tokens"`
}

// chatTemplateFields are vLLM's chat-body fields that reach the chat
// template (used with Config.ChatEncoder).
type chatTemplateFields struct {
	Tools               []json.RawMessage          `json:"tools"`
	AddGenerationPrompt *bool                      `json:"add_generation_prompt"`
	ChatTemplateKwargs  map[string]json.RawMessage `json:"chat_template_kwargs"`
}

// chatInput is a chat as a chat template takes it.
type chatInput struct {
	messages []tokenize.Message
	opts     tokenize.ChatOptions
}

// rawMessage is one chat message; content is a string, a list of parts, or
// null. The other fields reach only a chat template.
type rawMessage struct {
	Role             *string             `json:"role"`
	Content          json.RawMessage     `json:"content"`
	Name             string              `json:"name"`
	ToolCalls        []tokenize.ToolCall `json:"tool_calls"`
	ToolCallID       string              `json:"tool_call_id"`
	ReasoningContent *string             `json:"reasoning_content"`
}

// contentPart is one part of a message's content list.
type contentPart struct {
	Type *string `json:"type"`
	Text *string `json:"text"`
}

// unmarshal decodes a JSON document into v, with errors a client can read.
func unmarshal(data []byte, v any) error {
	err := json.Unmarshal(data, v)
	if err == nil {
		return nil
	}
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		if te.Field == "" {
			return badRequest("request body must be a JSON object, got %s", te.Value)
		}
		field := strings.TrimPrefix(te.Field, "samplingFields.")
		return badRequest("field %q: expected %s, got %s", field, jsonKind(te.Type.Kind().String()), te.Value)
	}
	var se *json.SyntaxError
	if errors.As(err, &se) {
		return badRequest("malformed JSON at byte %d: %v", se.Offset, err)
	}
	return badRequest("malformed JSON: %v", err)
}

// jsonKind names a Go kind the way a JSON user would.
func jsonKind(kind string) string {
	switch kind {
	case "int", "int64", "uint32", "float64":
		return "a number"
	case "bool":
		return "a boolean"
	case "string":
		return "a string"
	case "slice":
		return "a list"
	case "struct", "map":
		return "an object"
	}
	return kind
}

// decodeSampling checks the shared fields and copies them into g.
func decodeSampling(f *samplingFields, maxTokens *int, g *genRequest) error {
	if f.Model != nil {
		g.model = *f.Model
	}
	if f.N != nil && *f.N != 1 {
		return badRequest("n must be 1 (one choice per request), got %d", *f.N)
	}
	if maxTokens != nil {
		if *maxTokens < 1 {
			return badRequest("max_tokens must be at least 1, got %d", *maxTokens)
		}
		g.maxTokens = *maxTokens
	}
	if f.MinTokens != nil {
		switch {
		case *f.MinTokens < 0:
			return badRequest("min_tokens must be at least 0, got %d", *f.MinTokens)
		case maxTokens != nil && *f.MinTokens > *maxTokens:
			return badRequest("min_tokens (%d) must be at most max_tokens (%d)", *f.MinTokens, *maxTokens)
		}
	}
	if f.Temperature != nil && (*f.Temperature < 0 || math.IsNaN(*f.Temperature)) {
		return badRequest("temperature must be non-negative, got %v", *f.Temperature)
	}
	if f.Stream != nil {
		g.stream = *f.Stream
	}
	if o := f.StreamOptions; o != nil {
		g.includeUsage = o.IncludeUsage != nil && *o.IncludeUsage
		g.continuousUsage = o.ContinuousUsageStats != nil && *o.ContinuousUsageStats
	}
	kv, err := decodeKVTransfer(f.KVTransferParams)
	if err != nil {
		return err
	}
	g.kv = kv
	return nil
}

// decodeSalt reads the body's cache_salt into g as vLLM reads it (exact
// key, null as none; openai.CacheSalt, the router's reader) and refuses
// one that is not a non-empty string with vLLM's message
// (vllm/entrypoints/openai/protocol.py, check_cache_salt_support;
// vllm-project/vllm at 0052bed36509c7a5a2d8e48265334e40cf2f5a0e).
func decodeSalt(body []byte, g *genRequest) error {
	salt, err := openai.CacheSalt(body)
	if err != nil {
		return badRequest("Parameter 'cache_salt' must be a non-empty string if provided.")
	}
	g.salt = salt
	return nil
}

// decodeCompletion decodes and checks the body of POST /v1/completions. The
// prompt is a string, a list of one string, a list of token ids or a list of
// one token-id list; several prompts in one request are refused.
func decodeCompletion(body []byte) (genRequest, error) {
	var raw rawCompletion
	if err := unmarshal(body, &raw); err != nil {
		return genRequest{}, err
	}
	var g genRequest
	if err := decodeSampling(&raw.samplingFields, raw.MaxTokens, &g); err != nil {
		return genRequest{}, err
	}
	if err := decodeSalt(body, &g); err != nil {
		return genRequest{}, err
	}
	if err := decodePrompt(raw.Prompt, &g); err != nil {
		return genRequest{}, err
	}
	return g, nil
}

// decodePrompt decodes a completion prompt into g.
func decodePrompt(raw json.RawMessage, g *genRequest) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return badRequest("prompt is required")
	}
	const wrongType = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
	switch raw[0] {
	case '"':
		if err := json.Unmarshal(raw, &g.text); err != nil {
			return badRequest("prompt: %v", err)
		}
		return nil
	case '[':
	default:
		return badRequest(wrongType)
	}
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return badRequest("prompt: %v", err)
	}
	if len(items) == 0 {
		return badRequest("prompt must not be empty")
	}
	first := bytes.TrimSpace(items[0])
	if len(first) == 0 {
		return badRequest(wrongType)
	}
	switch first[0] {
	case '"':
		if len(items) > 1 {
			return badRequest("batched prompts not supported: send one prompt per request (got %d)", len(items))
		}
		if err := json.Unmarshal(first, &g.text); err != nil {
			return badRequest("prompt: %v", err)
		}
		return nil
	case '[':
		if len(items) > 1 {
			return badRequest("batched prompts not supported: send one prompt per request (got %d)", len(items))
		}
		return decodeIDs(first, g)
	default:
		return decodeIDs(raw, g)
	}
}

// decodeIDs decodes a list of token ids into g.
func decodeIDs(raw json.RawMessage, g *genRequest) error {
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return badRequest("prompt: token ids must be integers: %v", err)
	}
	if len(ids) == 0 {
		return badRequest("prompt must not be empty")
	}
	g.ids = make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxUint32 {
			return badRequest("prompt: token id %d at %d is out of range", id, i)
		}
		g.ids[i] = uint32(id)
	}
	g.isIDs = true
	return nil
}

// decodeChat decodes and checks the body of POST /v1/chat/completions.
// max_completion_tokens wins over max_tokens, as in vLLM.
func decodeChat(body []byte) (genRequest, error) {
	var raw rawChat
	if err := unmarshal(body, &raw); err != nil {
		return genRequest{}, err
	}
	g := genRequest{chat: true}
	maxTokens := raw.MaxTokens
	if raw.MaxCompletionTokens != nil {
		maxTokens = raw.MaxCompletionTokens
	}
	if err := decodeSampling(&raw.samplingFields, maxTokens, &g); err != nil {
		return genRequest{}, err
	}
	if err := decodeSalt(body, &g); err != nil {
		return genRequest{}, err
	}
	msgs, err := decodeMessages(raw.Messages)
	if err != nil {
		return genRequest{}, err
	}
	g.messages = msgs
	g.tmpl = templateInput(raw.Messages, msgs, &raw.chatTemplateFields)
	return g, nil
}

// templateInput is a chat as a chat template takes it: msgs (checked by
// decodeMessages) with their other fields from raw, and f's options
// (add_generation_prompt defaults to true, as in vLLM).
func templateInput(raw []rawMessage, msgs []ChatMessage, f *chatTemplateFields) chatInput {
	in := chatInput{messages: make([]tokenize.Message, len(msgs))}
	for i, m := range msgs {
		r := &raw[i]
		in.messages[i] = tokenize.Message{Role: m.Role, Content: m.Content, Name: r.Name,
			ToolCalls: r.ToolCalls, ToolCallID: r.ToolCallID, ReasoningContent: r.ReasoningContent}
	}
	in.opts = tokenize.ChatOptions{AddGenerationPrompt: true, Tools: f.Tools, Kwargs: f.ChatTemplateKwargs}
	if f.AddGenerationPrompt != nil {
		in.opts.AddGenerationPrompt = *f.AddGenerationPrompt
	}
	return in
}

// decodeMessages checks chat messages and joins their content parts.
func decodeMessages(raw []rawMessage) ([]ChatMessage, error) {
	if len(raw) == 0 {
		return nil, badRequest("messages must be a non-empty list")
	}
	msgs := make([]ChatMessage, len(raw))
	for i, m := range raw {
		if m.Role == nil || *m.Role == "" {
			return nil, badRequest("messages[%d]: role is required", i)
		}
		msgs[i].Role = *m.Role
		content, err := decodeContent(m.Content)
		if err != nil {
			return nil, fmt.Errorf("messages[%d]: %w", i, err)
		}
		msgs[i].Content = content
	}
	return msgs, nil
}

// decodeContent decodes a message's content: a string, null (""), or a list
// of {"type":"text","text":...} parts, joined with newlines.
func decodeContent(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", badRequest("content: %v", err)
		}
		return s, nil
	case '[':
		var parts []contentPart
		if err := json.Unmarshal(raw, &parts); err != nil {
			return "", badRequest("content must be a string or a list of text parts: %v", err)
		}
		var b bytes.Buffer
		for j, p := range parts {
			if p.Type == nil || (*p.Type != "text" && *p.Type != "input_text") {
				t := "missing"
				if p.Type != nil {
					t = fmt.Sprintf("%q", *p.Type)
				}
				return "", badRequest("content[%d]: part type %s is not supported (only \"text\")", j, t)
			}
			if p.Text == nil {
				return "", badRequest("content[%d]: text is required", j)
			}
			if j > 0 {
				b.WriteByte('\n')
			}
			b.WriteString(*p.Text)
		}
		return b.String(), nil
	}
	return "", badRequest("content must be a string or a list of text parts")
}

// rawTokenize is the body of POST /tokenize: a prompt or chat messages.
type rawTokenize struct {
	chatTemplateFields
	Model    *string         `json:"model"`
	Prompt   json.RawMessage `json:"prompt"`
	Messages []rawMessage    `json:"messages"`
}

// decodeTokenize decodes the body of POST /tokenize. Exactly one of the
// prompt (a string) and the messages is returned.
func decodeTokenize(body []byte) (genRequest, error) {
	var raw rawTokenize
	if err := unmarshal(body, &raw); err != nil {
		return genRequest{}, err
	}
	var g genRequest
	if raw.Model != nil {
		g.model = *raw.Model
	}
	hasPrompt := len(bytes.TrimSpace(raw.Prompt)) > 0 && string(bytes.TrimSpace(raw.Prompt)) != "null"
	switch {
	case hasPrompt && raw.Messages != nil:
		return genRequest{}, badRequest("give either prompt or messages, not both")
	case hasPrompt:
		if err := json.Unmarshal(raw.Prompt, &g.text); err != nil {
			return genRequest{}, badRequest("field \"prompt\": expected a string")
		}
	case raw.Messages != nil:
		msgs, err := decodeMessages(raw.Messages)
		if err != nil {
			return genRequest{}, err
		}
		g.messages, g.chat = msgs, true
		g.tmpl = templateInput(raw.Messages, msgs, &raw.chatTemplateFields)
	default:
		return genRequest{}, badRequest("prompt or messages is required")
	}
	return g, nil
}
