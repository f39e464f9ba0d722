package dataset

import (
	"fmt"
	"strconv"
	"strings"
	"unicode/utf8"
)

// pyParser parses the subset of Python's literal syntax that
// ast.literal_eval accepts and LooGLE's qa_pairs use: str (single, double
// and triple quotes, adjacent literals joined, Python's escapes), int,
// float, True, False, None, list, tuple and dict with str keys. Lists and
// tuples become []any, dicts map[string]any, numbers float64, None nil.
// It runs no code, nests at most maxDepth deep, and errors name the byte
// offset.
type pyParser struct {
	s     string
	i     int
	depth int
}

// literal parses s as one literal followed only by white space.
func (p *pyParser) literal() (any, error) {
	v, err := p.value()
	if err != nil {
		return nil, err
	}
	p.space()
	if p.i != len(p.s) {
		return nil, p.errorf("unexpected %q after the literal", p.peekRune())
	}
	return v, nil
}

func (p *pyParser) errorf(format string, args ...any) error {
	return fmt.Errorf("python literal at byte %d: %s", p.i, fmt.Sprintf(format, args...))
}

func (p *pyParser) space() {
	for p.i < len(p.s) {
		switch p.s[p.i] {
		case ' ', '\t', '\n', '\r', '\f', '\v':
			p.i++
		case '\\': // an explicit line join
			if strings.HasPrefix(p.s[p.i:], "\\\n") {
				p.i += 2
				continue
			}
			return
		default:
			return
		}
	}
}

func (p *pyParser) peekRune() rune {
	if p.i >= len(p.s) {
		return utf8.RuneError
	}
	r, _ := utf8.DecodeRuneInString(p.s[p.i:])
	return r
}

func (p *pyParser) value() (any, error) {
	p.space()
	if p.i >= len(p.s) {
		return nil, p.errorf("unexpected end")
	}
	switch c := p.s[p.i]; {
	case c == '\'' || c == '"':
		return p.strs()
	case c == '[':
		return p.sequence('[', ']')
	case c == '(':
		return p.sequence('(', ')')
	case c == '{':
		return p.dict()
	case c == '-' || c == '+' || c == '.' || ('0' <= c && c <= '9'):
		return p.number()
	}
	for _, w := range []struct {
		word string
		v    any
	}{{"True", true}, {"False", false}, {"None", nil}} {
		if strings.HasPrefix(p.s[p.i:], w.word) && !identByte(p.s, p.i+len(w.word)) {
			p.i += len(w.word)
			return w.v, nil
		}
	}
	return nil, p.errorf("unexpected %q", p.peekRune())
}

// identByte reports whether s[i] continues an identifier.
func identByte(s string, i int) bool {
	if i >= len(s) {
		return false
	}
	c := s[i]
	return c == '_' || c >= 0x80 || ('a' <= c && c <= 'z') || ('A' <= c && c <= 'Z') || ('0' <= c && c <= '9')
}

// enter and leave bound the nesting.
func (p *pyParser) enter() error {
	p.depth++
	if p.depth > maxDepth {
		return p.errorf("nested deeper than %d", maxDepth)
	}
	return nil
}

func (p *pyParser) sequence(open, close byte) (any, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	defer func() { p.depth-- }()
	p.i++ // open
	out := []any{}
	for {
		p.space()
		if p.i < len(p.s) && p.s[p.i] == close {
			p.i++
			return out, nil
		}
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		out = append(out, v)
		p.space()
		if p.i >= len(p.s) {
			return nil, p.errorf("unclosed %q", open)
		}
		switch p.s[p.i] {
		case ',':
			p.i++
		case close:
			p.i++
			return out, nil
		default:
			return nil, p.errorf("want ',' or %q, found %q", close, p.peekRune())
		}
	}
}

func (p *pyParser) dict() (any, error) {
	if err := p.enter(); err != nil {
		return nil, err
	}
	defer func() { p.depth-- }()
	p.i++ // {
	out := map[string]any{}
	for {
		p.space()
		if p.i < len(p.s) && p.s[p.i] == '}' {
			p.i++
			return out, nil
		}
		k, err := p.value()
		if err != nil {
			return nil, err
		}
		key, ok := k.(string)
		if !ok {
			return nil, p.errorf("dict key %s: want a str", pyType(k))
		}
		p.space()
		if p.i >= len(p.s) || p.s[p.i] != ':' {
			return nil, p.errorf("want ':' after a dict key")
		}
		p.i++
		v, err := p.value()
		if err != nil {
			return nil, err
		}
		out[key] = v
		p.space()
		if p.i >= len(p.s) {
			return nil, p.errorf("unclosed '{'")
		}
		switch p.s[p.i] {
		case ',':
			p.i++
		case '}':
			p.i++
			return out, nil
		default:
			return nil, p.errorf("want ',' or '}', found %q", p.peekRune())
		}
	}
}

func (p *pyParser) number() (any, error) {
	start := p.i
	if p.s[p.i] == '-' || p.s[p.i] == '+' {
		p.i++
	}
	for p.i < len(p.s) {
		c := p.s[p.i]
		if ('0' <= c && c <= '9') || c == '.' || c == '_' || c == 'e' || c == 'E' ||
			((c == '-' || c == '+') && (p.s[p.i-1] == 'e' || p.s[p.i-1] == 'E')) {
			p.i++
			continue
		}
		break
	}
	text := strings.ReplaceAll(p.s[start:p.i], "_", "")
	f, err := strconv.ParseFloat(text, 64)
	if err != nil {
		p.i = start
		return nil, p.errorf("bad number %q", p.s[start:min(len(p.s), start+32)])
	}
	return f, nil
}

// strs parses one or more adjacent string literals, joined.
func (p *pyParser) strs() (any, error) {
	var b strings.Builder
	for {
		if err := p.str(&b); err != nil {
			return nil, err
		}
		save := p.i
		p.space()
		if p.i < len(p.s) && (p.s[p.i] == '\'' || p.s[p.i] == '"') {
			continue
		}
		p.i = save
		return b.String(), nil
	}
}

// str parses one string literal at p.i into b.
func (p *pyParser) str(b *strings.Builder) error {
	q := p.s[p.i : p.i+1]
	triple := strings.HasPrefix(p.s[p.i:], q+q+q)
	if triple {
		q = q + q + q
	}
	start := p.i
	p.i += len(q)
	for {
		if p.i >= len(p.s) {
			p.i = start
			return p.errorf("unterminated string")
		}
		if strings.HasPrefix(p.s[p.i:], q) {
			p.i += len(q)
			return nil
		}
		c := p.s[p.i]
		switch {
		case c == '\\':
			if err := p.escape(b); err != nil {
				return err
			}
		case c == '\n' && !triple:
			return p.errorf("new line in a string")
		default:
			r, n := utf8.DecodeRuneInString(p.s[p.i:])
			b.WriteRune(r)
			p.i += n
		}
	}
}

// escape decodes the escape sequence at p.i (a backslash) into b, as
// Python does; an unknown one is kept with its backslash.
func (p *pyParser) escape(b *strings.Builder) error {
	p.i++ // backslash
	if p.i >= len(p.s) {
		return p.errorf("unterminated string")
	}
	c := p.s[p.i]
	p.i++
	switch c {
	case '\n':
	case '\\', '\'', '"':
		b.WriteByte(c)
	case 'n':
		b.WriteByte('\n')
	case 'r':
		b.WriteByte('\r')
	case 't':
		b.WriteByte('\t')
	case 'a':
		b.WriteByte('\a')
	case 'b':
		b.WriteByte('\b')
	case 'f':
		b.WriteByte('\f')
	case 'v':
		b.WriteByte('\v')
	case '0', '1', '2', '3', '4', '5', '6', '7':
		v := int(c - '0')
		for k := 0; k < 2 && p.i < len(p.s) && '0' <= p.s[p.i] && p.s[p.i] <= '7'; k++ {
			v = v*8 + int(p.s[p.i]-'0')
			p.i++
		}
		b.WriteRune(rune(v))
	case 'x', 'u', 'U':
		n := map[byte]int{'x': 2, 'u': 4, 'U': 8}[c]
		if p.i+n > len(p.s) {
			return p.errorf("truncated \\%c escape", c)
		}
		v, err := strconv.ParseUint(p.s[p.i:p.i+n], 16, 32)
		if err != nil || v > utf8.MaxRune {
			return p.errorf("bad \\%c escape %q", c, p.s[p.i:p.i+n])
		}
		p.i += n
		b.WriteRune(rune(v))
	default:
		b.WriteByte('\\')
		p.i-- // the character after it is read as itself
	}
	return nil
}

// pyType names v's Python type, for errors.
func pyType(v any) string {
	switch v.(type) {
	case nil:
		return "None"
	case bool:
		return "bool"
	case float64:
		return "number"
	case string:
		return "str"
	case []any:
		return "list"
	case map[string]any:
		return "dict"
	}
	return fmt.Sprintf("%T", v)
}
