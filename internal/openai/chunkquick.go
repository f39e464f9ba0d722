package openai

// This file reads the common chunks of a stream without encoding/json: a
// completion or chat chunk whose choices carry only text, content,
// reasoning or tool calls, and the usage chunk, with error and timings
// absent or null. Such chunks are all of a stream from vLLM or SGLang, and
// json.Unmarshal of each one was the front door's largest source of
// allocations.
//
// quickChunk scans the chunk once with the request parser's jsonScan
// (chatparse.go), which accepts and rejects exactly as encoding/json does,
// and matches keys as encoding/json matches fields (keyIs). Whatever it is
// not sure of — a syntax error, a type encoding/json would refuse, a
// duplicate key, a number it would not read into an int, an error, timings
// or message that is not null — makes it give up (ok false), and the
// caller decodes the chunk with encoding/json as before. FuzzQuickChunk
// holds the two together.

// quickChunk reads data, one chunk's JSON, as json.Unmarshal into
// chunkInfo would: whether it carried output (chunkInfo.output) and its
// usage (nil: none, or null). ok is false when it cannot tell for sure
// (fall back to encoding/json), and whenever json.Unmarshal would fail or
// would set an error or timings.
func quickChunk(data []byte) (output bool, usage *Usage, ok bool) {
	s := jsonScan{b: data}
	s.ws()
	if s.peek() != '{' {
		return false, nil, false
	}
	empty, ok := s.open('}')
	if !ok {
		return false, nil, false
	}
	var choices, usageSeen bool
	for !empty {
		k, ok := s.key()
		if !ok {
			return false, nil, false
		}
		switch {
		case keyIs(k, "choices"):
			if choices {
				return false, nil, false // a second list decodes into the first's elements
			}
			choices = true
			out, ok := s.quickChoices()
			if !ok {
				return false, nil, false
			}
			output = output || out
		case keyIs(k, "usage"):
			if usageSeen {
				return false, nil, false
			}
			usageSeen = true
			switch s.peek() {
			case 'n':
				if !s.literal() {
					return false, nil, false
				}
			case '{':
				usage = new(Usage)
				if !s.quickUsage(usage) {
					return false, nil, false
				}
			default:
				return false, nil, false
			}
		case keyIs(k, "error"), keyIs(k, "timings"):
			if s.peek() != 'n' || !s.literal() {
				return false, nil, false
			}
		default:
			if !s.skip() {
				return false, nil, false
			}
		}
		more, ok := s.next('}')
		if !ok {
			return false, nil, false
		}
		empty = !more
	}
	s.ws()
	if s.i != len(s.b) {
		return false, nil, false
	}
	return output, usage, true
}

// quickUsage reads a usage object into u.
func (s *jsonScan) quickUsage(u *Usage) bool {
	empty, ok := s.open('}')
	if !ok {
		return false
	}
	var seen [3]bool // prompt_tokens, completion_tokens, prompt_tokens_details
	for !empty {
		k, ok := s.key()
		if !ok {
			return false
		}
		f := -1
		switch {
		case keyIs(k, "prompt_tokens"):
			f = 0
		case keyIs(k, "completion_tokens"):
			f = 1
		case keyIs(k, "prompt_tokens_details"):
			f = 2
		}
		switch {
		case f < 0:
			if !s.skip() {
				return false
			}
		case seen[f]:
			return false
		case f == 0:
			seen[f] = true
			if _, ok := s.quickInt(&u.PromptTokens); !ok {
				return false
			}
		case f == 1:
			seen[f] = true
			if _, ok := s.quickInt(&u.CompletionTokens); !ok {
				return false
			}
		default:
			seen[f] = true
			switch s.peek() {
			case 'n':
				if !s.literal() {
					return false
				}
			case '{':
				u.PromptTokensDetails = &struct {
					CachedTokens *int `json:"cached_tokens"`
				}{}
				if !s.quickDetails(&u.PromptTokensDetails.CachedTokens) {
					return false
				}
			default:
				return false
			}
		}
		more, ok := s.next('}')
		if !ok {
			return false
		}
		empty = !more
	}
	return true
}

// quickDetails reads a prompt_tokens_details object: its cached_tokens
// into *cached (a new int; nil for null).
func (s *jsonScan) quickDetails(cached **int) bool {
	empty, ok := s.open('}')
	if !ok {
		return false
	}
	seen := false
	for !empty {
		k, ok := s.key()
		if !ok {
			return false
		}
		if keyIs(k, "cached_tokens") {
			if seen {
				return false
			}
			seen = true
			var v int
			set, ok := s.quickInt(&v)
			if !ok {
				return false
			}
			if set {
				*cached = &v
			}
		} else if !s.skip() {
			return false
		}
		more, ok := s.next('}')
		if !ok {
			return false
		}
		empty = !more
	}
	return true
}

// quickInt reads an int field: an integer of up to 18 digits sets it (set
// true); null leaves it, as encoding/json does. A fraction, an exponent, a
// longer integer or any other value gives up.
func (s *jsonScan) quickInt(dst *int) (set, ok bool) {
	switch c := s.peek(); {
	case c == 'n':
		return false, s.literal()
	case c != '-' && !isDigit(c):
		return false, false
	}
	start := s.i
	if !s.number() {
		return false, false
	}
	num := s.b[start:s.i]
	neg := num[0] == '-'
	if neg {
		num = num[1:]
	}
	if len(num) > 18 {
		return false, false
	}
	v := 0
	for _, c := range num {
		if !isDigit(c) {
			return false, false // a fraction or an exponent
		}
		v = v*10 + int(c-'0')
	}
	if neg {
		v = -v
	}
	*dst = v
	return true, true
}

// quickChoices reads a chunk's choices: null, or a list of choice objects
// (or nulls).
func (s *jsonScan) quickChoices() (output, ok bool) {
	switch s.peek() {
	case 'n':
		return false, s.literal()
	case '[':
	default:
		return false, false
	}
	empty, ok := s.open(']')
	if !ok {
		return false, false
	}
	for !empty {
		switch s.peek() {
		case 'n':
			if !s.literal() {
				return false, false
			}
		case '{':
			out, ok := s.quickChoice()
			if !ok {
				return false, false
			}
			output = output || out
		default:
			return false, false
		}
		more, ok := s.next(']')
		if !ok {
			return false, false
		}
		empty = !more
	}
	return output, true
}

// quickChoice reads one choice object: its text and delta; a message gives
// up (a whole response has one, not a stream's chunk).
func (s *jsonScan) quickChoice() (output, ok bool) {
	empty, ok := s.open('}')
	if !ok {
		return false, false
	}
	var text, delta bool
	for !empty {
		k, ok := s.key()
		if !ok {
			return false, false
		}
		switch {
		case keyIs(k, "text"):
			if text {
				return false, false
			}
			text = true
			out, ok := s.quickString()
			if !ok {
				return false, false
			}
			output = output || out
		case keyIs(k, "delta"):
			if delta {
				return false, false
			}
			delta = true
			switch s.peek() {
			case 'n':
				if !s.literal() {
					return false, false
				}
			case '{':
				out, ok := s.quickDelta()
				if !ok {
					return false, false
				}
				output = output || out
			default:
				return false, false
			}
		case keyIs(k, "message"):
			return false, false
		default:
			if !s.skip() {
				return false, false
			}
		}
		more, ok := s.next('}')
		if !ok {
			return false, false
		}
		empty = !more
	}
	return output, true
}

// quickDelta reads a chat chunk's delta object.
func (s *jsonScan) quickDelta() (output, ok bool) {
	empty, ok := s.open('}')
	if !ok {
		return false, false
	}
	var seen [4]bool // content, reasoning_content, reasoning, tool_calls
	for !empty {
		k, ok := s.key()
		if !ok {
			return false, false
		}
		f := -1
		switch {
		case keyIs(k, "content"):
			f = 0
		case keyIs(k, "reasoning_content"):
			f = 1
		case keyIs(k, "reasoning"):
			f = 2
		case keyIs(k, "tool_calls"):
			f = 3
		}
		switch {
		case f < 0:
			if !s.skip() {
				return false, false
			}
		case seen[f]:
			return false, false
		case f == 3:
			seen[f] = true
			// A json.RawMessage: any value but null is output.
			null := s.peek() == 'n'
			if !s.skip() {
				return false, false
			}
			output = output || !null
		default:
			seen[f] = true
			out, ok := s.quickString()
			if !ok {
				return false, false
			}
			output = output || out
		}
		more, ok := s.next('}')
		if !ok {
			return false, false
		}
		empty = !more
	}
	return output, true
}

// quickString reads a *string field: a string (non-empty: output) or null.
func (s *jsonScan) quickString() (nonEmpty, ok bool) {
	switch s.peek() {
	case '"':
		raw, _, ok := s.scanString()
		// Any byte between the quotes unquotes to at least one byte.
		return len(raw) > 0, ok
	case 'n':
		return false, s.literal()
	}
	return false, false
}
