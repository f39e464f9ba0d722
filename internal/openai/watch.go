package openai

import (
	"bytes"
	"time"

	"github.com/prefixlb/prefixlb/internal/calibrate"
)

// Watcher reads a response body on the side, pushed to it in chunks as
// they pass (an ext_proc picker's response path, or a data plane that
// hands the body to one): SSE events for the first token and the usage,
// or a whole JSON response's usage. The zero value watches a JSON body
// of no more than Max bytes. Not safe for concurrent use.
type Watcher struct {
	// SSE says the body is a Server-Sent Events stream (its Content-Type
	// is text/event-stream); set it before the first Feed.
	SSE bool
	// Max bounds the bytes held: a JSON body's, an SSE line's.
	Max int
	// Usage is the last chunk that reported usage (nil: none yet).
	Usage *Chunk
	// Timings are the last llama.cpp timings seen (the final chunk's).
	Timings *Timings
	// Gaps samples the time between fed chunks that carried output tokens
	// (a chunk is what arrived at once): the decode step calibration
	// learns.
	Gaps calibrate.Gaps

	line    []byte // SSE: the unfinished line
	body    []byte // JSON: the body so far (up to Max)
	tokens  int
	overrun bool
}

// Feed reads b; it reports whether b carried the first output token.
func (w *Watcher) Feed(b []byte) (first bool) {
	if !w.SSE {
		if len(w.body)+len(b) <= w.Max {
			w.body = append(w.body, b...)
		} else {
			w.overrun = true
		}
		return false
	}
	w.line = append(w.line, b...)
	output := false
	for {
		i := bytes.IndexByte(w.line, '\n')
		if i < 0 {
			if len(w.line) > w.Max { // a runaway line: drop it
				w.line = w.line[:0]
			}
			if output {
				w.Gaps.Token(time.Now())
			}
			return first
		}
		ln := bytes.TrimRight(w.line[:i], "\r")
		if data, ok := bytes.CutPrefix(ln, []byte("data:")); ok {
			if w.event(bytes.TrimSpace(data)) {
				output = true
				if w.tokens == 1 {
					first = true
				}
			}
		}
		w.line = w.line[i+1:]
	}
}

// event reads one SSE data payload; it reports whether it carried output.
func (w *Watcher) event(data []byte) bool {
	if len(data) == 0 || string(data) == "[DONE]" {
		return false
	}
	c, ok := ReadChunk(data)
	if !ok {
		return false
	}
	if c.HasUsage {
		w.Usage = &c
	}
	if c.Timings != nil {
		w.Timings = c.Timings
	}
	if c.Output {
		w.tokens++
	}
	return c.Output
}

// Result returns the output tokens and the cached prompt tokens reported
// (-1 unknown): usage.prompt_tokens_details.cached_tokens (vLLM, SGLang),
// else usage.prompt_tokens − timings.prompt_n (llama.cpp, whose timings
// ride on the usage chunk, or on every chunk with timings_per_token).
func (w *Watcher) Result() (out, cached int) {
	if !w.SSE && !w.overrun && len(w.body) > 0 {
		if c, ok := ReadChunk(w.body); ok && c.HasUsage {
			w.Usage = &c
		}
	}
	out, cached = w.tokens, -1
	if w.Usage != nil {
		out, cached = w.Usage.CompletionTokens, w.Usage.CachedTokens
		if cached < 0 && w.Timings != nil {
			cached = CachedFromTimings(w.Usage.PromptTokens, w.Timings)
		}
	}
	return out, cached
}

// PromptTokens is the prompt tokens the engine counted
// (usage.prompt_tokens), 0 when it reported none; read after Result.
func (w *Watcher) PromptTokens() int {
	if w.Usage == nil {
		return 0
	}
	return w.Usage.PromptTokens
}
