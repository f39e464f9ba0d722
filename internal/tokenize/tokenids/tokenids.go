// Package tokenids is `prefixlb tokenize`: the token ids of text, or of a
// chat rendered with the model's chat template, exactly as the engine's
// Hugging Face tokenizer encodes them without added special tokens.
package tokenids

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"

	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// Config is what to encode: the flags of `prefixlb tokenize`.
type Config struct {
	// Tokenizer is a tokenizer.json or a model directory ("": the bundled
	// Qwen3 tokenizer).
	Tokenizer string
	// Chat reads a chat (ChatInput, or a bare list of messages) and
	// renders it with the chat template before encoding.
	Chat bool
	// Render, with Chat, writes the rendered prompt instead of ids.
	Render bool
}

// ChatInput is what Run accepts as a chat: an OpenAI chat-completions body
// (add_generation_prompt defaults to true).
type ChatInput struct {
	Messages            []tokenize.Message         `json:"messages"`
	Tools               []json.RawMessage          `json:"tools"`
	AddGenerationPrompt *bool                      `json:"add_generation_prompt"`
	ChatTemplateKwargs  map[string]json.RawMessage `json:"chat_template_kwargs"`
}

// Run reads text (or with c.Chat a chat) from in and writes its token ids
// to out as a JSON array on one line (with c.Render, the rendered chat).
func Run(c Config, in io.Reader, out io.Writer) error {
	if c.Render && !c.Chat {
		return fmt.Errorf("tokenize: --render needs --chat")
	}
	tok, err := Load(c.Tokenizer)
	if err != nil {
		return err
	}
	data, err := io.ReadAll(in)
	if err != nil {
		return fmt.Errorf("tokenize: read stdin: %w", err)
	}
	return Write(out, tok, c, data)
}

// Write writes the token ids of data, text or with c.Chat a chat, encoded
// by tok to out as a JSON array on one line (with c.Render, the rendered
// chat).
func Write(out io.Writer, tok *tokenize.Tokenizer, c Config, data []byte) error {
	text := string(data)
	if c.Chat {
		var err error
		if text, err = RenderChat(tok, data); err != nil {
			return err
		}
		if c.Render {
			_, err = io.WriteString(out, text)
			return err
		}
	}
	ids := tok.Encode(text)
	_, err := out.Write(AppendJSON(make([]byte, 0, 8*len(ids)+2), ids))
	return err
}

// RenderChat renders a chat, a ChatInput or a bare JSON list of messages,
// with tok's chat template.
func RenderChat(tok *tokenize.Tokenizer, data []byte) (string, error) {
	var ci ChatInput
	var err error
	trimmed := bytes.TrimSpace(data)
	if len(trimmed) > 0 && trimmed[0] == '[' {
		err = json.Unmarshal(trimmed, &ci.Messages)
	} else {
		err = json.Unmarshal(trimmed, &ci)
	}
	if err != nil {
		return "", fmt.Errorf("tokenize: parse chat JSON: %w", err)
	}
	opts := tokenize.ChatOptions{AddGenerationPrompt: true, Tools: ci.Tools, Kwargs: ci.ChatTemplateKwargs}
	if ci.AddGenerationPrompt != nil {
		opts.AddGenerationPrompt = *ci.AddGenerationPrompt
	}
	return tok.ApplyChatTemplate(ci.Messages, opts)
}

// AppendJSON appends ids to buf as a JSON array and a newline.
func AppendJSON(buf []byte, ids []uint32) []byte {
	buf = append(buf, '[')
	for i, id := range ids {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = strconv.AppendUint(buf, uint64(id), 10)
	}
	return append(buf, "]\n"...)
}

// Load loads path, or the bundled Qwen3 tokenizer when path is "".
func Load(path string) (*tokenize.Tokenizer, error) {
	if path == "" {
		return qwen3.Load()
	}
	return tokenize.Load(path)
}
