package main

import (
	"github.com/spf13/cobra"

	"github.com/prefixlb/prefixlb/internal/tokenize/tokenids"
)

// init adds `prefixlb tokenize`: its flags fill a tokenids.Config, and
// tokenids.Run encodes stdin.
func init() {
	var c tokenids.Config
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
			return tokenids.Run(c, cmd.InOrStdin(), cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.StringVar(&c.Tokenizer, "tokenizer", "", "tokenizer.json or model directory (default: the bundled Qwen3 tokenizer)")
	f.BoolVar(&c.Chat, "chat", false, "stdin is a chat JSON to render with the chat template")
	f.BoolVar(&c.Render, "render", false, "with --chat, print the rendered prompt instead of token ids")
	rootCmd.AddCommand(cmd)
}
