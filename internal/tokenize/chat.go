package tokenize

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/ardanlabs/jinja"
)

// ErrNoChatTemplate is returned by ApplyChatTemplate when the tokenizer was
// loaded without a chat template.
var ErrNoChatTemplate = errors.New("tokenize: no chat template")

// Message is one chat message as the OpenAI chat API carries it. Content
// accepts a string, null, or a list of content parts when unmarshalled from
// JSON; text parts are joined with "\n" as vLLM does for text-only models.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
	// ReasoningContent is passed to the template only when non-nil (Qwen3's
	// template tests `message.reasoning_content is defined`).
	ReasoningContent *string    `json:"reasoning_content,omitempty"`
	Name             string     `json:"name,omitempty"`
	ToolCalls        []ToolCall `json:"tool_calls,omitempty"`
	ToolCallID       string     `json:"tool_call_id,omitempty"`
}

// ToolCall is one entry of an assistant message's tool_calls.
type ToolCall struct {
	ID       string       `json:"id,omitempty"`
	Type     string       `json:"type,omitempty"`
	Function FunctionCall `json:"function"`
}

// FunctionCall names a function and its arguments, a JSON-encoded object as
// the OpenAI API sends it. Like vLLM, the template receives the arguments
// decoded (key order kept) when they are valid JSON, else the raw string.
type FunctionCall struct {
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
}

// UnmarshalJSON accepts content as a string, null or a list of parts.
func (m *Message) UnmarshalJSON(b []byte) error {
	type plain Message
	var aux struct {
		plain
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(b, &aux); err != nil {
		return err
	}
	*m = Message(aux.plain)
	c := bytes.TrimSpace(aux.Content)
	switch {
	case len(c) == 0 || string(c) == "null":
		m.Content = ""
	case c[0] == '"':
		return json.Unmarshal(c, &m.Content)
	case c[0] == '[':
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(c, &parts); err != nil {
			return fmt.Errorf("message content: %w", err)
		}
		var texts []string
		for _, p := range parts {
			if p.Type == "text" || p.Type == "input_text" || p.Type == "" {
				texts = append(texts, p.Text)
			}
		}
		m.Content = strings.Join(texts, "\n")
	default:
		return fmt.Errorf("message content: want a string, null or a list of parts, got %.20s", c)
	}
	return nil
}

// ChatOptions are the arguments of apply_chat_template besides the messages.
type ChatOptions struct {
	// AddGenerationPrompt appends the assistant turn header.
	AddGenerationPrompt bool
	// Tools are the tool definitions, each a JSON object as the client sent
	// it ({"type":"function","function":{...}}); key order is kept, because
	// templates print them with tojson. Nil or empty means no tools.
	Tools []json.RawMessage
	// Kwargs are extra template variables (vLLM's chat_template_kwargs, such
	// as {"enable_thinking": false}), each a JSON value.
	Kwargs map[string]json.RawMessage
}

// chatTemplate is a compiled Jinja chat template.
type chatTemplate struct {
	tmpl *jinja.Template
	src  string
	// native renders the conversations it covers in place of tmpl (nil if
	// the template has no native renderer; see nativeRenderer).
	native nativeRenderer
}

func compileChatTemplate(src string) (*chatTemplate, error) {
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, fmt.Errorf("compile chat template: %w", err)
	}
	return &chatTemplate{tmpl: t, src: src, native: nativeFor(src)}, nil
}

// loadConfig reads tokenizer_config.json: the chat template (a string, or a
// list of {name, template} where "default" wins) and the special-token
// strings templates refer to.
func (t *Tokenizer) loadConfig(b []byte) error {
	var cfg map[string]json.RawMessage
	if err := json.Unmarshal(b, &cfg); err != nil {
		return fmt.Errorf("parse tokenizer_config.json: %w", err)
	}
	t.specialMap = map[string]string{}
	for _, k := range []string{"bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"} {
		raw, ok := cfg[k]
		if !ok {
			continue
		}
		var s string
		if json.Unmarshal(raw, &s) == nil {
			t.specialMap[k] = s
			continue
		}
		var obj struct {
			Content string `json:"content"`
		}
		if json.Unmarshal(raw, &obj) == nil && obj.Content != "" {
			t.specialMap[k] = obj.Content
		}
	}
	raw, ok := cfg["chat_template"]
	if !ok || string(raw) == "null" {
		return nil
	}
	var src string
	if err := json.Unmarshal(raw, &src); err != nil {
		var named []struct {
			Name     string `json:"name"`
			Template string `json:"template"`
		}
		if err := json.Unmarshal(raw, &named); err != nil || len(named) == 0 {
			return fmt.Errorf("parse tokenizer_config.json: chat_template is neither a string nor a list of named templates")
		}
		src = named[0].Template
		for _, n := range named {
			if n.Name == "default" {
				src = n.Template
			}
		}
	}
	var err error
	t.chat, err = compileChatTemplate(src)
	return err
}

// HasChatTemplate reports whether the tokenizer has a chat template.
func (t *Tokenizer) HasChatTemplate() bool { return t.chat != nil }

// ChatTemplate returns the source of the chat template, or "".
func (t *Tokenizer) ChatTemplate() string {
	if t.chat == nil {
		return ""
	}
	return t.chat.src
}

// SetChatTemplate replaces the chat template (for a model whose template is
// kept elsewhere, or vLLM's --chat-template). It must not be called while
// other goroutines use the Tokenizer.
func (t *Tokenizer) SetChatTemplate(src string) error {
	c, err := compileChatTemplate(src)
	if err != nil {
		return fmt.Errorf("tokenize: %w", err)
	}
	t.chat = c
	return nil
}

// ApplyChatTemplate renders msgs with the model's chat template the way
// Hugging Face transformers' apply_chat_template (and so vLLM) does: Jinja
// with trim_blocks and lstrip_blocks, the messages, tools (absent when
// empty), add_generation_prompt, the special-token strings of
// tokenizer_config.json and opts.Kwargs as variables. A template with a
// native renderer (the Qwen3 template) renders the conversations that
// renderer covers without Jinja, to the same text.
func (t *Tokenizer) ApplyChatTemplate(msgs []Message, opts ChatOptions) (string, error) {
	if t.chat == nil {
		return "", ErrNoChatTemplate
	}
	if b, ok := t.appendChat(nil, msgs, opts); ok {
		return bytesString(b), nil // b is new, and no one else holds it
	}
	vars := make(map[string]jinja.Value, 8+len(opts.Kwargs))
	for k, v := range t.specialMap {
		vars[k] = jinja.NewString(v)
	}
	for k, raw := range opts.Kwargs {
		v, err := jsonToValue(raw)
		if err != nil {
			return "", fmt.Errorf("tokenize: chat template kwarg %q: %w", k, err)
		}
		vars[k] = v
	}
	list := make([]jinja.Value, len(msgs))
	for i := range msgs {
		list[i] = messageValue(&msgs[i])
	}
	vars["messages"] = jinja.NewList(list)
	if len(opts.Tools) > 0 {
		tools := make([]jinja.Value, len(opts.Tools))
		for i, raw := range opts.Tools {
			v, err := jsonToValue(raw)
			if err != nil {
				return "", fmt.Errorf("tokenize: tool %d: %w", i, err)
			}
			tools[i] = v
		}
		vars["tools"] = jinja.NewList(tools)
	} else {
		vars["tools"] = jinja.None()
	}
	vars["add_generation_prompt"] = jinja.NewBool(opts.AddGenerationPrompt)
	out, err := t.chat.tmpl.RenderValues(vars)
	if err != nil {
		return "", fmt.Errorf("tokenize: render chat template: %w", err)
	}
	return out, nil
}

// EncodeChat renders msgs with ApplyChatTemplate and encodes the result.
func (t *Tokenizer) EncodeChat(msgs []Message, opts ChatOptions) ([]uint32, error) {
	s, err := t.ApplyChatTemplate(msgs, opts)
	if err != nil {
		return nil, err
	}
	return t.Encode(s), nil
}

func messageValue(m *Message) jinja.Value {
	d := jinja.NewDict()
	dict := d.AsDict()
	dict.Set("role", jinja.NewString(m.Role))
	dict.Set("content", jinja.NewString(m.Content))
	if m.ReasoningContent != nil {
		dict.Set("reasoning_content", jinja.NewString(*m.ReasoningContent))
	}
	if m.Name != "" {
		dict.Set("name", jinja.NewString(m.Name))
	}
	if m.ToolCallID != "" {
		dict.Set("tool_call_id", jinja.NewString(m.ToolCallID))
	}
	if len(m.ToolCalls) > 0 {
		calls := make([]jinja.Value, len(m.ToolCalls))
		for i, tc := range m.ToolCalls {
			c := jinja.NewDict()
			cd := c.AsDict()
			if tc.ID != "" {
				cd.Set("id", jinja.NewString(tc.ID))
			}
			typ := tc.Type
			if typ == "" {
				typ = "function"
			}
			cd.Set("type", jinja.NewString(typ))
			f := jinja.NewDict()
			fd := f.AsDict()
			fd.Set("name", jinja.NewString(tc.Function.Name))
			args := jinja.NewString(tc.Function.Arguments)
			if v, err := jsonToValue(json.RawMessage(tc.Function.Arguments)); err == nil {
				args = v
			}
			fd.Set("arguments", args)
			cd.Set("function", f)
			calls[i] = c
		}
		dict.Set("tool_calls", jinja.NewList(calls))
	}
	return d
}

// jsonToValue decodes one JSON value into a jinja.Value, keeping the key
// order of objects (templates print tools with tojson, and Python dicts keep
// insertion order) and integers distinct from floats.
func jsonToValue(raw json.RawMessage) (jinja.Value, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec)
	if err != nil {
		return jinja.Undefined(), err
	}
	if _, err := dec.Token(); err != io.EOF {
		return jinja.Undefined(), errors.New("trailing data after JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder) (jinja.Value, error) {
	tok, err := dec.Token()
	if err != nil {
		return jinja.Undefined(), err
	}
	switch x := tok.(type) {
	case json.Delim:
		switch x {
		case '{':
			d := jinja.NewDict()
			dict := d.AsDict()
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return jinja.Undefined(), err
				}
				k, _ := kt.(string)
				v, err := decodeValue(dec)
				if err != nil {
					return jinja.Undefined(), err
				}
				dict.Set(k, v)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Undefined(), err
			}
			return d, nil
		case '[':
			var items []jinja.Value
			for dec.More() {
				v, err := decodeValue(dec)
				if err != nil {
					return jinja.Undefined(), err
				}
				items = append(items, v)
			}
			if _, err := dec.Token(); err != nil {
				return jinja.Undefined(), err
			}
			if items == nil {
				items = []jinja.Value{}
			}
			return jinja.NewList(items), nil
		}
		return jinja.Undefined(), fmt.Errorf("unexpected %v", x)
	case json.Number, string, bool, nil:
		return jinja.FromGoValue(x), nil
	}
	return jinja.Undefined(), fmt.Errorf("unexpected JSON token %v", tok)
}
