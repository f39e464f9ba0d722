// Package openai is the OpenAI-compatible API as prefixlb's front doors see
// it: request bodies (completions, chat, token ids) read in one pass
// (ParseRequest), Server-Sent Event streams cut without changing a byte
// (Framer) and read on the side (Stream, ReadChunk, llama.cpp's Timings),
// and OpenAI-style error bodies. serve, epp and the load generator share it;
// it knows nothing of routing.
package openai
