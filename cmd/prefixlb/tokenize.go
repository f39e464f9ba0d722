package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"

	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// tokenizeOptions are the flags of `prefixlb tokenize`.
type tokenizeOptions struct {
	tokenizer string
	chat      bool
	render    bool
}

func init() {
	var o tokenizeOptions
	cmd := &cobra.Command{
		Use:   "tokenize",
		Short: "Print the token ids of text (or a chat) read from stdin",
		Long: `tokenize reads text from stdin and prints its token ids as a JSON array,
exactly as the engine's Hugging Face tokenizer encodes it without added
special tokens (special tokens written in the text are recognised).

With --chat, stdin is a chat: an OpenAI chat-completions body
({"messages":[...], "tools":[...], "add_generation_prompt":true,
"chat_template_kwargs":{...}}) or a bare list of messages. It is rendered with
the model's chat template (add_generation_prompt defaults to true) and then
encoded; --render prints the rendered text instead of ids.

--tokenizer is a tokenizer.json (gzip-compressed or not) or a model directory
holding tokenizer.json and tokenizer_config.json; without it the Qwen3
tokenizer bundled in the binary is used.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runTokenize(o, cmd.InOrStdin(), cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.tokenizer, "tokenizer", "", "tokenizer.json or model directory (default: the bundled Qwen3 tokenizer)")
	f.BoolVar(&o.chat, "chat", false, "stdin is a chat JSON to render with the chat template")
	f.BoolVar(&o.render, "render", false, "with --chat, print the rendered prompt instead of token ids")
	rootCmd.AddCommand(cmd)
}

// chatInput is what `tokenize --chat` accepts on stdin.
type chatInput struct {
	Messages            []tokenize.Message         `json:"messages"`
	Tools               []json.RawMessage          `json:"tools"`
	AddGenerationPrompt *bool                      `json:"add_generation_prompt"`
	ChatTemplateKwargs  map[string]json.RawMessage `json:"chat_template_kwargs"`
}

func runTokenize(o tokenizeOptions, in io.Reader, out io.Writer) error {
	if o.render && !o.chat {
		return fmt.Errorf("tokenize: --render needs --chat")
	}
	tok, err := loadTokenizer(o.tokenizer)
	if err != nil {
		return err
	}
	data, err := io.ReadAll(in)
	if err != nil {
		return fmt.Errorf("tokenize: read stdin: %w", err)
	}
	text := string(data)
	if o.chat {
		var ci chatInput
		trimmed := bytes.TrimSpace(data)
		if len(trimmed) > 0 && trimmed[0] == '[' {
			err = json.Unmarshal(trimmed, &ci.Messages)
		} else {
			err = json.Unmarshal(trimmed, &ci)
		}
		if err != nil {
			return fmt.Errorf("tokenize: parse chat JSON: %w", err)
		}
		opts := tokenize.ChatOptions{AddGenerationPrompt: true, Tools: ci.Tools, Kwargs: ci.ChatTemplateKwargs}
		if ci.AddGenerationPrompt != nil {
			opts.AddGenerationPrompt = *ci.AddGenerationPrompt
		}
		if text, err = tok.ApplyChatTemplate(ci.Messages, opts); err != nil {
			return err
		}
		if o.render {
			_, err = io.WriteString(out, text)
			return err
		}
	}
	ids := tok.Encode(text)
	buf := make([]byte, 0, 8*len(ids)+2)
	buf = append(buf, '[')
	for i, id := range ids {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = strconv.AppendUint(buf, uint64(id), 10)
	}
	buf = append(buf, "]\n"...)
	_, err = out.Write(buf)
	return err
}

// loadTokenizer loads path, or the bundled Qwen3 tokenizer when path is "".
func loadTokenizer(path string) (*tokenize.Tokenizer, error) {
	if path == "" {
		return qwen3.Load()
	}
	return tokenize.Load(path)
}
