// Package keying turns a parsed OpenAI request into the router's block
// keys: by text chunks (ChunkKeyer) or, token-exact, by the model's own
// tokenizer and chat template (TokenizerKeyer, with a memo of recent
// prompts' keys). It loads tokenizers and checks them against a replica's
// /tokenize (TokenizerCheck), so that keys match the blocks the engines
// hash. serve and epp share it.
package keying
