package proxy

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"io"
)

// maxEventBytes bounds one Server-Sent Event (all its lines): a chunk of an
// OpenAI stream is a few hundred bytes, a big usage or logprobs object a few
// kilobytes.
const maxEventBytes = 8 << 20

// errEventTooLong is returned by the framer for an event over its limit.
var errEventTooLong = errors.New("sse event too long")

// sseEvent is one event of a stream: its exact bytes and its data.
type sseEvent struct {
	// Raw is the event's bytes as received, through the blank line that
	// ends it (or, at the end of input, whatever is left).
	Raw []byte
	// Data is the event's "data:" field values joined with "\n"; HasData
	// says whether it had any.
	Data    []byte
	HasData bool
}

// sseFramer cuts a Server-Sent Events stream (WHATWG HTML, "server-sent
// events") into events without changing a byte, so the proxy can forward
// each event the moment its blank line arrives and read its data on the side.
//
// Lines end in "\n" or "\r\n". A lone "\r" does not end a line (no
// OpenAI-compatible server sends one): such input only makes events longer.
// Where the input is split across reads does not change the events. Raw and
// Data are valid until the next call to Next.
//
// sseFramer is not safe for concurrent use.
type sseFramer struct {
	br   *bufio.Reader
	max  int
	raw  []byte
	data []byte
}

// newSSEFramer returns a framer reading r, accepting events up to max bytes
// (maxEventBytes if max ≤ 0).
func newSSEFramer(r io.Reader, max int) *sseFramer {
	if max <= 0 {
		max = maxEventBytes
	}
	return &sseFramer{br: bufio.NewReaderSize(r, 32<<10), max: max}
}

// Next returns the next event. At the end of input it returns io.EOF when
// the input ended between events, or the partial event and
// io.ErrUnexpectedEOF when it ended inside one. Other errors are the
// reader's or errEventTooLong (with the partial event).
func (f *sseFramer) Next() (sseEvent, error) {
	f.raw, f.data = f.raw[:0], f.data[:0]
	hasData := false
	for {
		line, err := f.readLine()
		if err != nil {
			ev := sseEvent{Raw: f.raw, Data: f.data, HasData: hasData}
			if err == io.EOF {
				if len(f.raw) == 0 {
					return sseEvent{}, io.EOF
				}
				return ev, io.ErrUnexpectedEOF
			}
			return ev, err
		}
		body := bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r"))
		if len(body) == 0 {
			return sseEvent{Raw: f.raw, Data: f.data, HasData: hasData}, nil
		}
		if body[0] == ':' {
			continue // a comment
		}
		name, value, found := bytes.Cut(body, []byte(":"))
		if found && len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
		if string(name) == "data" {
			if hasData {
				f.data = append(f.data, '\n')
			}
			f.data = append(f.data, value...)
			hasData = true
		}
	}
}

// ready reports whether the input already read holds the whole next event
// (Next will return it without reading): the stream's writer uses it to
// flush once for events that arrived together.
func (f *sseFramer) ready() bool {
	n := f.br.Buffered()
	if n == 0 {
		return false
	}
	b, _ := f.br.Peek(n)
	// An event ends at a blank line: one at the start of what is buffered
	// (the last event ended just before it), or after a line's "\n".
	return b[0] == '\n' || bytes.HasPrefix(b, []byte("\r\n")) ||
		bytes.Contains(b, []byte("\n\n")) || bytes.Contains(b, []byte("\n\r\n"))
}

// readLine appends the next line (with its "\n") to f.raw and returns it.
// At the end of input a final line without "\n" is appended and io.EOF
// returned.
func (f *sseFramer) readLine() ([]byte, error) {
	start := len(f.raw)
	for {
		chunk, err := f.br.ReadSlice('\n')
		if len(f.raw)+len(chunk) > f.max {
			f.raw = append(f.raw, chunk[:max(0, f.max-len(f.raw))]...)
			return nil, errEventTooLong
		}
		f.raw = append(f.raw, chunk...)
		switch err {
		case nil:
			return f.raw[start:], nil
		case bufio.ErrBufferFull:
			continue
		default:
			return nil, err
		}
	}
}

// chunkInfo is what the proxy reads from one event's data on the side: the
// fields of an OpenAI completion or chat chunk (or a whole non-streamed
// response) that tell it about tokens and usage.
type chunkInfo struct {
	Choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Content          *string         `json:"content"`
			ReasoningContent *string         `json:"reasoning_content"`
			Reasoning        *string         `json:"reasoning"`
			ToolCalls        json.RawMessage `json:"tool_calls"`
		} `json:"delta"`
		Message *struct {
			Content *string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage *usage          `json:"usage"`
	Error json.RawMessage `json:"error"`
}

// usage is an OpenAI usage object.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails *struct {
		CachedTokens *int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

// output reports whether a chunk carried output: text, content, reasoning
// or tool calls.
func (c *chunkInfo) output() bool {
	for _, ch := range c.Choices {
		if (ch.Text != nil && *ch.Text != "") ||
			(ch.Delta != nil && ((ch.Delta.Content != nil && *ch.Delta.Content != "") ||
				(ch.Delta.ReasoningContent != nil && *ch.Delta.ReasoningContent != "") ||
				(ch.Delta.Reasoning != nil && *ch.Delta.Reasoning != "") ||
				(len(ch.Delta.ToolCalls) > 0 && string(ch.Delta.ToolCalls) != "null"))) {
			return true
		}
	}
	return false
}

// Chunk is what ReadChunk learns from one completion or chat chunk.
type Chunk struct {
	// Output says whether the chunk carried output tokens.
	Output bool
	// HasUsage says whether it reported usage; CompletionTokens and
	// CachedTokens (-1: not reported) are then set.
	HasUsage                       bool
	CompletionTokens, CachedTokens int
}

// ReadChunk parses one completion or chat chunk — an SSE event's data, or
// a whole non-streamed response — the way the proxy reads replies on the
// side (the endpoint picker shares it). ok is false when data is not JSON.
func ReadChunk(data []byte) (c Chunk, ok bool) {
	var ci chunkInfo
	if json.Unmarshal(data, &ci) != nil {
		return Chunk{}, false
	}
	c.Output = ci.output()
	if ci.Usage != nil {
		c.HasUsage = true
		c.CompletionTokens, c.CachedTokens = ci.Usage.CompletionTokens, ci.Usage.cached()
	}
	return c, true
}

// cached returns the reported cached prompt tokens, or -1 if none.
func (u *usage) cached() int {
	if u == nil || u.PromptTokensDetails == nil || u.PromptTokensDetails.CachedTokens == nil {
		return -1
	}
	return max(*u.PromptTokensDetails.CachedTokens, 0)
}

// done reports whether data is the stream's terminator "[DONE]".
func done(data []byte) bool { return string(bytes.TrimSpace(data)) == "[DONE]" }

// streamState accumulates what the proxy learns from a stream's events.
type streamState struct {
	// tokens counts events that carried output (text, content, reasoning or
	// tool calls): one token per chunk for vLLM without speculative decoding.
	tokens int
	// usage is the last usage object seen (nil if none).
	usage *usage
	// sawDone is set by the "[DONE]" event.
	sawDone bool
	// upstreamError is set by an in-stream {"error":...} event.
	upstreamError bool
}

// observe reads one event. It returns whether the event carried output
// tokens, and an error if its data is neither "[DONE]" nor JSON (garbage).
func (s *streamState) observe(ev *sseEvent) (token bool, err error) {
	if !ev.HasData {
		return false, nil
	}
	if done(ev.Data) {
		s.sawDone = true
		return false, nil
	}
	var c chunkInfo
	if err := json.Unmarshal(ev.Data, &c); err != nil {
		return false, errGarbage
	}
	if c.Usage != nil {
		s.usage = c.Usage
	}
	if len(c.Error) > 0 && string(c.Error) != "null" {
		s.upstreamError = true
	}
	token = c.output()
	if token {
		s.tokens++
	}
	return token, nil
}
