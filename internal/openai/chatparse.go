package openai

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
	"unsafe"
)

// This file is a JSON scanner made for request bodies: one pass over the
// bytes validates the whole body and decodes the few fields the router
// reads, so a 240 KB chat body costs one read of its bytes (and one copy
// of each message's content) instead of encoding/json's four.
//
// It reproduces encoding/json (v1) exactly, because FuzzParseRequestFastPath
// and FuzzParseRequestJSON compare the two: the same inputs are rejected,
// with the same message at the same offset (checkValid's first syntax
// error wins over any type error; the first type error in document order
// wins over the rest); strings unquote alike (surrogate pairs joined, lone
// surrogates and bytes that are not UTF-8 become U+FFFD); keys match fields
// as encoding/json matches them (exactly, else under its case folding, in
// which 'ſ' is 's' and the Kelvin sign 'k'); the last of duplicate keys
// wins, and a second "messages" list decodes into the elements of the first
// as encoding/json's reuse of a slice's backing array does.

// maxJSONDepth is encoding/json's nesting limit (scanner.go,
// maxNestingDepth): the 10001st open object or array is a syntax error.
const maxJSONDepth = 10000

// Bounds on what one request body may make the parse hold. A body is
// bounded in bytes at the edge (serve's max_body_bytes, epp's 16 MiB);
// these bound what the parse builds per byte of it, so that the router's
// memory for one request stays a small multiple of its body whatever its
// shape (BenchmarkParseAlloc). A body over one is a client error (400),
// checked after the body has been read as encoding/json would read it:
// a syntax or type error still wins.
const (
	// MaxMessages bounds a chat body's "messages" list. vLLM sets none
	// (vllm/entrypoints/openai/chat_completion/protocol.py at 002032ee:
	// messages: list[ChatCompletionMessageParam]); 10,000 is far above a
	// real conversation or agent trace and bounds the per-message structs
	// (a message costs the parse about 170 bytes besides its text).
	MaxMessages = 10000
	// MaxContentParts bounds the content parts of all of a chat body's
	// messages together (so a message's too): each costs the parse about
	// 20 bytes besides its text, and a part can be 3 bytes of body
	// ("{},"). Parts are counted as the scan meets them: a body whose
	// duplicate "messages" keys or "content" keys together hold more is
	// refused too.
	MaxContentParts = 100000
	// MaxNesting bounds how deep the body's objects and lists nest, and
	// how deep the JSON in a tool call's "arguments" string nests (the chat
	// template decodes it, recursively). serde_json refuses the 129th
	// level by default (serde-rs/json src/de.rs at 00016a66,
	// remaining_depth: 128), so routers built on it (SGLang's) already
	// refuse deeper bodies; encoding/json allows 10,000.
	MaxNesting = 128
)

// jsonSyntaxError is a syntax error worded and placed as encoding/json's
// SyntaxError: off counts the bytes read up to and including the bad one.
type jsonSyntaxError struct {
	msg string
	off int
}

// jsonScan reads one JSON text. Its methods stop at the first syntax error,
// recorded in err, and return false from then on.
type jsonScan struct {
	b        []byte
	i        int // the next byte to read
	depth    int // open objects and arrays
	maxDepth int // the most depth has been
	err      *jsonSyntaxError
	stops    []int // scanString's result, reused
	// noStops makes scanString leave stops empty: its caller needs only
	// to know the string's form (formOf).
	noStops bool
	// badUTF8 reports that the last string scanned holds a byte that is
	// not UTF-8.
	badUTF8 bool
}

// strForm says what unquoting a JSON string's bytes takes.
type strForm uint8

// The forms of a string.
const (
	formPlain   strForm = iota // nothing: its bytes are the string
	formEscaped                // escapes, in UTF-8
	formBadUTF8                // bytes that are not UTF-8 (and maybe escapes)
)

// formOf is the form of the string scanString last read (plain is its
// result).
func (s *jsonScan) formOf(plain bool) strForm {
	switch {
	case plain:
		return formPlain
	case s.badUTF8:
		return formBadUTF8
	}
	return formEscaped
}

// fail records a syntax error at b[i] in context (encoding/json's words).
// At the end of the input encoding/json's scanner steps one space: where a
// space is itself wrong (spaceBad: inside a number, a literal or an escape)
// it reports that space, elsewhere the unexpected end. It returns false.
func (s *jsonScan) fail(i int, context string, spaceBad bool) bool {
	if s.err != nil {
		return false
	}
	switch {
	case i < len(s.b):
		s.err = &jsonSyntaxError{"invalid character " + quoteChar(s.b[i]) + " " + context, i + 1}
	case spaceBad:
		s.err = &jsonSyntaxError{"invalid character ' ' " + context, len(s.b)}
	default:
		s.err = &jsonSyntaxError{"unexpected end of JSON input", len(s.b)}
	}
	return false
}

// quoteChar quotes a byte as encoding/json's error messages do.
func quoteChar(c byte) string {
	switch c {
	case '\'':
		return `'\''`
	case '"':
		return `'"'`
	}
	q := strconv.Quote(string(rune(c)))
	return "'" + q[1:len(q)-1] + "'"
}

// ws skips JSON whitespace.
func (s *jsonScan) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// peek returns the byte at the read position, 0 at the end.
func (s *jsonScan) peek() byte {
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

// kindName names the JSON type of a value by its first byte, as
// encoding/json's UnmarshalTypeError.Value does.
func kindName(c byte) string {
	switch c {
	case '{':
		return "object"
	case '[':
		return "array"
	case '"':
		return "string"
	case 't', 'f':
		return "bool"
	case 'n':
		return "null"
	}
	return "number"
}

// open enters the object or array at the read position and skips the
// whitespace after its bracket; empty reports that it closed at once
// (close is '}' or ']').
func (s *jsonScan) open(close byte) (empty, ok bool) {
	s.depth++
	if s.depth > maxJSONDepth {
		return false, s.fail(s.i, "exceeded max depth", false)
	}
	s.maxDepth = max(s.maxDepth, s.depth)
	s.i++
	s.ws()
	if s.i < len(s.b) && s.b[s.i] == close {
		s.i++
		s.depth--
		return true, true
	}
	return false, true
}

// key reads an object key and the colon after it, and leaves the read
// position on the member's value. The key is unquoted; it aliases the body
// when it needs no unquoting.
func (s *jsonScan) key() ([]byte, bool) {
	if s.i >= len(s.b) || s.b[s.i] != '"' {
		return nil, s.fail(s.i, "looking for beginning of object key string", false)
	}
	raw, plain, ok := s.scanString()
	if !ok {
		return nil, false
	}
	if !plain {
		raw = []byte(unquote(raw, s.stops))
	}
	s.ws()
	if s.i >= len(s.b) || s.b[s.i] != ':' {
		return nil, s.fail(s.i, "after object key", false)
	}
	s.i++
	s.ws()
	return raw, true
}

// next reads what follows a member or an element: more reports a comma
// (the read position is then on the next key or element), else the object
// or array closed (close is '}' or ']').
func (s *jsonScan) next(close byte) (more, ok bool) {
	s.ws()
	if s.i < len(s.b) {
		switch s.b[s.i] {
		case ',':
			s.i++
			s.ws()
			return true, true
		case close:
			s.i++
			s.depth--
			return false, true
		}
	}
	if close == '}' {
		return false, s.fail(s.i, "after object key:value pair", false)
	}
	return false, s.fail(s.i, "after array element", false)
}

// literal reads true, false or null.
func (s *jsonScan) literal() bool {
	var lit string
	switch s.b[s.i] {
	case 't':
		lit = "true"
	case 'f':
		lit = "false"
	default:
		lit = "null"
	}
	for k := 1; k < len(lit); k++ {
		if j := s.i + k; j >= len(s.b) || s.b[j] != lit[k] {
			return s.fail(j, "in literal "+lit+" (expecting '"+lit[k:k+1]+"')", true)
		}
	}
	s.i += len(lit)
	return true
}

func isDigit(c byte) bool { return '0' <= c && c <= '9' }

// number reads a number (the read position is on '-' or a digit).
func (s *jsonScan) number() bool {
	b, i := s.b, s.i
	if b[i] == '-' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return s.fail(i, "in numeric literal", true)
		}
	}
	if b[i] == '0' {
		i++
	} else {
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	if i < len(b) && b[i] == '.' {
		i++
		if i >= len(b) || !isDigit(b[i]) {
			return s.fail(i, "after decimal point in numeric literal", true)
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i >= len(b) || !isDigit(b[i]) {
			return s.fail(i, "in exponent of numeric literal", true)
		}
		for i < len(b) && isDigit(b[i]) {
			i++
		}
	}
	s.i = i
	return true
}

// SWAR constants: a byte repeated in each of a word's 8 lanes.
const (
	lanes01 = 0x0101010101010101
	lanes80 = 0x8080808080808080
)

// ctlOrHigh is non-zero when one of the 8 bytes in x is a control byte
// (< 0x20) or not ASCII: subtracting 0x20 from a lane sets its high bit
// only if the lane is below 0x20 (or a lane below it already is, whose
// borrow it took), and a non-ASCII lane has it set already.
func ctlOrHigh(x uint64) uint64 { return ((x - lanes01*0x20) | x) & lanes80 }

// scanString reads the string at the read position ('"') as
// encoding/json's scanner does, and returns the bytes between its quotes
// and whether they are the string as they stand (no escapes, and UTF-8).
// When they are not, s.stops lists where unquote has work: the offsets
// (in raw) of each escape and of each byte that is not UTF-8 (unless
// s.noStops).
//
// It finds the next '"' and '\\' with bytes.IndexByte (vector code) and
// checks the text between them for control bytes and UTF-8 32 bytes at a
// time.
func (s *jsonScan) scanString() (raw []byte, plain, ok bool) {
	b := s.b
	start := s.i + 1
	i := start
	s.stops = s.stops[:0]
	plain = true
	s.badUTF8 = false
	quote, esc := -1, -1 // the next '"' and '\\' at or after i (len(b): none)
	for {
		if quote < i {
			quote = len(b)
			if k := bytes.IndexByte(b[i:], '"'); k >= 0 {
				quote = i + k
			}
		}
		if esc < i {
			esc = quote
			if k := bytes.IndexByte(b[i:quote], '\\'); k >= 0 {
				esc = i + k
			}
		}
		end := min(quote, esc)
		for i < end {
			for i+32 <= end && ctlOrHigh(binary.LittleEndian.Uint64(b[i:]))|ctlOrHigh(binary.LittleEndian.Uint64(b[i+8:]))|
				ctlOrHigh(binary.LittleEndian.Uint64(b[i+16:]))|ctlOrHigh(binary.LittleEndian.Uint64(b[i+24:])) == 0 {
				i += 32
			}
			for i+8 <= end && ctlOrHigh(binary.LittleEndian.Uint64(b[i:])) == 0 {
				i += 8
			}
			if i >= end {
				break
			}
			switch c := b[i]; {
			case c < 0x20:
				return nil, false, s.fail(i, "in string literal", false)
			case c < utf8.RuneSelf:
				i++
			default:
				r, n := utf8.DecodeRune(b[i:end])
				if r == utf8.RuneError && n == 1 {
					plain, s.badUTF8 = false, true
					if !s.noStops {
						s.stops = append(s.stops, i-start)
					}
				}
				i += n
			}
		}
		i = end
		if i >= len(b) {
			return nil, false, s.fail(i, "in string literal", false)
		}
		if b[i] == '"' {
			s.i = i + 1
			return b[start:i], plain, true
		}
		plain = false // an escape
		if !s.noStops {
			s.stops = append(s.stops, i-start)
		}
		i++
		if i >= len(b) {
			return nil, false, s.fail(i, "in string escape code", true)
		}
		switch b[i] {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			i++
		case 'u':
			i++
			for range 4 {
				if i >= len(b) || !isHex(b[i]) {
					return nil, false, s.fail(i, `in \u hexadecimal character escape`, true)
				}
				i++
			}
		default:
			return nil, false, s.fail(i, "in string escape code", true)
		}
	}
}

func isHex(c byte) bool {
	return ('0' <= c && c <= '9') || ('a' <= c && c <= 'f') || ('A' <= c && c <= 'F')
}

// str reads the string at the read position and returns it unquoted.
func (s *jsonScan) str() (string, bool) {
	raw, plain, ok := s.scanString()
	if !ok {
		return "", false
	}
	if plain {
		if w := wellKnown(raw); w != "" {
			return w, true
		}
		return string(raw), true
	}
	return unquote(raw, s.stops), true
}

// wellKnown returns the string b spells when it is one that most bodies
// hold many times (a message's role), without allocating it ("" if not).
func wellKnown(b []byte) string {
	switch string(b) { // compared without a copy
	case "user":
		return "user"
	case "assistant":
		return "assistant"
	case "system":
		return "system"
	case "tool":
		return "tool"
	case "developer":
		return "developer"
	}
	return ""
}

// unquote unquotes raw, the bytes of a valid JSON string between its
// quotes, as encoding/json's unquoteBytes does: escapes decoded, a \u
// surrogate pair joined, a lone surrogate and every byte that is not UTF-8
// replaced by U+FFFD. stops are the offsets scanString found of the
// escapes and of the bytes that are not UTF-8: the bytes between them are
// copied as they are.
func unquote(raw []byte, stops []int) string {
	var out strings.Builder
	out.Grow(unquotedCap(raw, stops))
	unquoteTo(&out, raw, stops)
	return out.String()
}

// unquotedCap bounds the length of raw unquoted: a byte that is not UTF-8
// becomes 3, and nothing else grows.
func unquotedCap(raw []byte, stops []int) int { return len(raw) + 2*len(stops) }

// unquoteTo writes raw unquoted (see unquote) to out.
func unquoteTo(out *strings.Builder, raw []byte, stops []int) {
	run := 0 // start of the bytes not yet copied
	for _, p := range stops {
		if p < run {
			continue // the second half of a surrogate pair, done
		}
		out.Write(raw[run:p])
		if raw[p] != '\\' {
			out.WriteRune(unicode.ReplacementChar)
			run = p + 1
			continue
		}
		e := raw[p+1]
		if e != 'u' {
			out.WriteByte(unescapeByte(e))
			run = p + 2
			continue
		}
		r := hex4(raw[p+2:])
		run = p + 6
		if utf16.IsSurrogate(r) {
			if r2 := getu4(raw[run:]); r2 >= 0 {
				if d := utf16.DecodeRune(r, r2); d != unicode.ReplacementChar {
					out.WriteRune(d)
					run += 6
					continue
				}
			}
			r = unicode.ReplacementChar
		}
		out.WriteRune(r)
	}
	out.Write(raw[run:])
}

// unescapeByte is the byte a one-letter escape stands for.
func unescapeByte(e byte) byte {
	switch e {
	case 'b':
		return '\b'
	case 'f':
		return '\f'
	case 'n':
		return '\n'
	case 'r':
		return '\r'
	case 't':
		return '\t'
	}
	return e // '"', '\\', '/'
}

// hex4 decodes 4 hex digits (already checked by scanString).
func hex4(h []byte) rune {
	var r rune
	for _, c := range h[:4] {
		switch {
		case c <= '9':
			c -= '0'
		case c >= 'a':
			c -= 'a' - 10
		default:
			c -= 'A' - 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// getu4 decodes a \uXXXX escape at the start of s, or returns -1.
func getu4(s []byte) rune {
	if len(s) < 6 || s[0] != '\\' || s[1] != 'u' {
		return -1
	}
	for _, c := range s[2:6] {
		if !isHex(c) {
			return -1
		}
	}
	return hex4(s[2:])
}

// skip reads the value at the read position, whatever it is, checking
// all of it.
func (s *jsonScan) skip() bool {
	// The open containers below the value: '{' or '['.
	var stackBuf [32]byte
	stack := stackBuf[:0]
	for {
		// A value starts here.
		if s.i >= len(s.b) {
			return s.fail(s.i, "looking for beginning of value", false)
		}
		switch c := s.b[s.i]; c {
		case '{', '[':
			closer := byte('}')
			if c == '[' {
				closer = ']'
			}
			empty, ok := s.open(closer)
			if !ok {
				return false
			}
			if !empty {
				stack = append(stack, c)
				if c == '{' {
					if _, ok := s.key(); !ok {
						return false
					}
				}
				continue
			}
		case '"':
			if _, _, ok := s.scanString(); !ok {
				return false
			}
		case 't', 'f', 'n':
			if !s.literal() {
				return false
			}
		default:
			if c != '-' && !isDigit(c) {
				return s.fail(s.i, "looking for beginning of value", false)
			}
			if !s.number() {
				return false
			}
		}
		// A value ended: close the containers it ends, up to the next one.
		for {
			if len(stack) == 0 {
				return true
			}
			top := stack[len(stack)-1]
			closer := byte('}')
			if top == '[' {
				closer = ']'
			}
			more, ok := s.next(closer)
			if !ok {
				return false
			}
			if more {
				if top == '{' {
					if _, ok := s.key(); !ok {
						return false
					}
				}
				break
			}
			stack = stack[:len(stack)-1]
		}
	}
}

// span reads the value at the read position and returns its bytes, as a
// json.RawMessage holds it.
func (s *jsonScan) span() ([]byte, bool) {
	start := s.i
	if !s.skip() {
		return nil, false
	}
	return s.b[start:s.i:s.i], true
}

// keyIs reports whether key names the field name (lower-case ASCII) as
// encoding/json matches keys: exactly, else equal under its folding (ASCII
// letters by case; other runes by their smallest fold, so that 'ſ' is 's'
// and the Kelvin sign is 'k').
func keyIs(key []byte, name string) bool {
	if len(key) == len(name) {
		i := 0
		for ; i < len(key); i++ {
			c := key[i]
			if c >= utf8.RuneSelf {
				break
			}
			if 'A' <= c && c <= 'Z' {
				c += 'a' - 'A'
			}
			if c != name[i] {
				return false
			}
		}
		if i == len(key) {
			return true
		}
	}
	j := 0
	for i := 0; i < len(key); {
		if j >= len(name) {
			return false
		}
		want := rune(name[j])
		if 'a' <= want && want <= 'z' {
			want -= 'a' - 'A'
		}
		var got rune
		if c := key[i]; c < utf8.RuneSelf {
			got = rune(c)
			if 'a' <= got && got <= 'z' {
				got -= 'a' - 'A'
			}
			i++
		} else {
			r, n := utf8.DecodeRune(key[i:])
			got = foldRune(r)
			i += n
		}
		if got != want {
			return false
		}
		j++
	}
	return j == len(name)
}

// foldRune is the smallest rune of r's case-folding orbit (encoding/json's
// foldRune).
func foldRune(r rune) rune {
	for {
		r2 := unicode.SimpleFold(r)
		if r2 <= r {
			return r2
		}
		r = r2
	}
}

// optString is a *string field: set is false for absent or null.
type optString struct {
	s   string
	set bool
}

// ptr returns the field as a pointer, as encoding/json leaves it.
func (o optString) ptr() *string {
	if !o.set {
		return nil
	}
	s := o.s
	return &s
}

// typeErrors keeps the first type error of a decoding, worded as
// describeJSONError words encoding/json's UnmarshalTypeError.
type typeErrors struct {
	first string
}

// add records that the value at field (a dotted path, "" for the whole
// body) is of kind got where the field wants a value of kind want.
func (t *typeErrors) add(field, want, got string) {
	if t.first != "" {
		return
	}
	if field == "" {
		t.first = "request body must be a JSON object, got " + got
		return
	}
	t.first = "field " + field + ": expected " + want + ", got " + got
}

// stringInto reads a string field: a string sets it; null leaves a string
// as it is (encoding/json ignores null for a non-pointer) and unsets a
// pointer; anything else is a type error.
func (s *jsonScan) stringInto(dst *string, set *bool, te *typeErrors, field string) bool {
	switch c := s.peek(); c {
	case '"':
		v, ok := s.str()
		if ok {
			*dst = v
			if set != nil {
				*set = true
			}
		}
		return ok
	case 'n':
		if set != nil {
			*set = false
		}
		return s.literal()
	default:
		if te != nil && c != 0 {
			te.add(field, "a string", kindName(c))
		}
		return s.skip()
	}
}

// optBool is a *bool field.
type optBool struct {
	v, set bool
}

// boolInto reads a *bool field.
func (s *jsonScan) boolInto(dst *optBool, te *typeErrors, field string) bool {
	switch c := s.peek(); c {
	case 't', 'f':
		*dst = optBool{v: c == 't', set: true}
		return s.literal()
	case 'n':
		dst.set = false
		return s.literal()
	default:
		if c != 0 {
			te.add(field, "a boolean", kindName(c))
		}
		return s.skip()
	}
}

// optInt is a *int64 field.
type optInt struct {
	v   int64
	set bool
}

// intInto reads a *int64 field: a number that is not an int64 is a type
// error naming the number, as encoding/json's is.
func (s *jsonScan) intInto(dst *optInt, te *typeErrors, field string) bool {
	switch c := s.peek(); {
	case c == '-' || isDigit(c):
		start := s.i
		if !s.number() {
			return false
		}
		lit := s.b[start:s.i]
		n, err := strconv.ParseInt(string(lit), 10, 64)
		if err != nil {
			te.add(field, "a number", "number "+string(lit))
			return true
		}
		*dst = optInt{v: n, set: true}
		return true
	case c == 'n':
		dst.set = false
		return s.literal()
	default:
		if c != 0 {
			te.add(field, "a number", kindName(c))
		}
		return s.skip()
	}
}

// reqBody is what the router reads of a request body, field by field as
// encoding/json would decode it into a struct of *string, *bool, *int64,
// json.RawMessage and []message fields. A raw field (a []byte) is nil when
// absent and holds "null" for null; it aliases the body.
type reqBody struct {
	model, user                         optString
	stream                              optBool
	maxTokens, maxCompletionTokens, n   optInt
	prompt, input, tools, addGen, kwarg []byte
	// promptIDs is the prompt read as token ids, when it is (nil if not).
	promptIDs [][]uint32
	// msgs backs the messages: a second "messages" list decodes into the
	// first one's elements, as encoding/json reuses a slice. hasMsgs is
	// whether the last "messages" was a list (not absent or null), nMsgs
	// how many elements it had: the messages are msgs' first nMsgs. The
	// elements past MaxMessages are read, for their errors, but not kept.
	msgs    blockList[chatMsg]
	hasMsgs bool
	nMsgs   int
	// parts holds the content parts of every message, each message's a
	// run of it. partsOver is set when more than MaxContentParts were
	// met: those past it were read but not kept.
	parts     blockList[chatPart]
	partsOver bool
}

// blockLen is how many elements a block of a blockList holds.
const blockLen = 256

// blockList is a list kept in blocks of blockLen elements, only the
// first grown by append: a long list is never copied as it grows, where
// append's 1.25× steps would allocate about five times the final list on
// the way (BenchmarkParseAlloc/many-small).
type blockList[T any] struct {
	blocks [][]T
	n      int // elements held
}

// at returns element i (i < n).
func (l *blockList[T]) at(i int) *T { return &l.blocks[i/blockLen][i%blockLen] }

// add appends a zero element and returns it.
func (l *blockList[T]) add() *T {
	b := l.n / blockLen
	if b == len(l.blocks) {
		c := 4 // the first block starts small: most bodies are small
		if b > 0 {
			c = blockLen
		}
		l.blocks = append(l.blocks, make([]T, 0, c))
	}
	var zero T
	l.blocks[b] = append(l.blocks[b], zero)
	l.n++
	return &l.blocks[b][len(l.blocks[b])-1]
}

// chatMsg is one element of "messages": 64 bytes besides what it
// aliases, the rarer fields behind a pointer.
type chatMsg struct {
	role    string
	content chatContent
	more    *chatMore // nil while none of its fields was met
}

// chatMore holds a message's rarer fields.
type chatMore struct {
	name, toolCallID string
	reasoning        optString
	toolCalls        []byte // raw, nil when absent
}

// extra returns m's rarer fields, allocating them on first use.
func (m *chatMsg) extra() *chatMore {
	if m.more == nil {
		m.more = &chatMore{}
	}
	return m.more
}

// The kinds of a message's content.
const (
	contentAbsent = iota
	contentNull
	contentString
	contentParts
	contentOther // a number, a boolean or an object
)

// chatContent is a message's "content". A string is left quoted, for
// renderChat to unquote into the rendering, which the message's content
// then shares; a list's parts are decoded as the scan meets them, into
// reqBody.parts.
type chatContent struct {
	kind uint8
	form strForm // a string's
	// n is how many parts a list has, first the index of the first in
	// reqBody.parts (where it was kept).
	n, first uint32
	// raw is a string's bytes between its quotes, or a list's JSON (which
	// its parts' offsets are into).
	raw []byte
}

// The part types renderChat tells apart.
const (
	partUntyped   = iota // no "type", or ""
	partText             // "text"
	partInputText        // "input_text"
	partOther            // any other type
)

// chatPart is one element of a content list, decoded as encoding/json
// decodes it into {Type string; Text *string} on its own: 20 bytes, its
// JSON and its text as offsets into its content's raw.
type chatPart struct {
	off, end   uint32 // the part's JSON
	toff, tend uint32 // its "text" string's bytes between the quotes
	typ        uint8
	textSet    bool    // "text" is a string
	textForm   strForm // ... of this form
	// bad reports that decoding the part on its own fails (partError
	// says why).
	bad bool
}

// decodeBody reads a request body. It returns the syntax error or the
// first type error, worded for the client, as encoding/json would, then
// a body nested deeper than MaxNesting.
func decodeBody(body []byte) (*reqBody, string) {
	if uint64(len(body)) > math.MaxUint32 { // chatPart's offsets
		return nil, "request body over 4 GiB"
	}
	s := &jsonScan{b: body}
	f := &reqBody{}
	var te typeErrors
	s.ws()
	switch c := s.peek(); c {
	case '{':
		f.object(s, &te)
	case 'n':
		s.literal() // null decodes into nothing
	default:
		if c != 0 && (c == '[' || c == '"' || c == 't' || c == 'f' || c == '-' || isDigit(c)) {
			te.add("", "", kindName(c))
		}
		s.skip()
	}
	if s.err == nil {
		s.ws()
		if s.i < len(body) {
			s.fail(s.i, "after top-level value", false)
		}
	}
	if s.err != nil {
		return nil, "malformed JSON at byte " + strconv.Itoa(s.err.off) + ": " + s.err.msg
	}
	if te.first != "" {
		return nil, te.first
	}
	if s.maxDepth > MaxNesting {
		return nil, nestingError(s.maxDepth)
	}
	return f, ""
}

// nestingError words a body nested depth levels deep.
func nestingError(depth int) string {
	return "request body nests " + strconv.Itoa(depth) + " levels deep, more than the " + strconv.Itoa(MaxNesting) + " allowed"
}

// object reads the body's top-level object.
func (f *reqBody) object(s *jsonScan, te *typeErrors) {
	empty, ok := s.open('}')
	for ok && !empty {
		var key []byte
		if key, ok = s.key(); !ok {
			return
		}
		switch {
		case keyIs(key, "model"):
			ok = s.stringInto(&f.model.s, &f.model.set, te, "model")
		case keyIs(key, "stream"):
			ok = s.boolInto(&f.stream, te, "stream")
		case keyIs(key, "max_tokens"):
			ok = s.intInto(&f.maxTokens, te, "max_tokens")
		case keyIs(key, "max_completion_tokens"):
			ok = s.intInto(&f.maxCompletionTokens, te, "max_completion_tokens")
		case keyIs(key, "n"):
			ok = s.intInto(&f.n, te, "n")
		case keyIs(key, "user"):
			ok = s.stringInto(&f.user.s, &f.user.set, te, "user")
		case keyIs(key, "prompt"):
			ok = f.promptValue(s)
		case keyIs(key, "messages"):
			ok = f.messagesValue(s, te)
		case keyIs(key, "tools"):
			f.tools, ok = s.span()
		case keyIs(key, "add_generation_prompt"):
			f.addGen, ok = s.span()
		case keyIs(key, "chat_template_kwargs"):
			f.kwarg, ok = s.span()
		case keyIs(key, "input"):
			f.input, ok = s.span()
		default: // stream_options and everything else
			ok = s.skip()
		}
		if !ok {
			return
		}
		var more bool
		if more, ok = s.next('}'); !more {
			return
		}
	}
}

// promptValue reads "prompt", a list of token ids directly when it is one
// (the common shape of long prompts from benchmarks and agents).
func (f *reqBody) promptValue(s *jsonScan) bool {
	f.promptIDs = nil
	start := s.i
	if s.peek() == '[' && s.depth+2 <= maxJSONDepth {
		if ids, next, ok := scanTokenIDs(s.b, s.i); ok {
			// The lists it read count in the body's depth.
			depth := s.depth + 1
			if j := skipSpace(s.b, start+1); j < len(s.b) && s.b[j] == '[' {
				depth++
			}
			s.maxDepth = max(s.maxDepth, depth)
			s.i = next
			f.prompt, f.promptIDs = s.b[start:next:next], ids
			return true
		}
	}
	var ok bool
	f.prompt, ok = s.span()
	return ok
}

// messagesValue reads "messages".
func (f *reqBody) messagesValue(s *jsonScan, te *typeErrors) bool {
	switch c := s.peek(); c {
	case '[':
	case 'n':
		f.msgs, f.parts, f.hasMsgs, f.nMsgs = blockList[chatMsg]{}, blockList[chatPart]{}, false, 0
		return s.literal()
	default:
		if c != 0 {
			te.add("messages", "a list", kindName(c))
		}
		return s.skip()
	}
	empty, ok := s.open(']')
	if !ok {
		return false
	}
	if empty {
		// encoding/json makes a new empty slice: the old elements are gone.
		f.msgs, f.parts, f.hasMsgs, f.nMsgs = blockList[chatMsg]{}, blockList[chatPart]{}, true, 0
		return true
	}
	n := 0
	var spare chatMsg // the elements past MaxMessages, read but not kept
	for {
		var m *chatMsg
		switch {
		case n < f.msgs.n:
			m = f.msgs.at(n)
		case n < MaxMessages:
			m = f.msgs.add()
		default:
			spare = chatMsg{}
			m = &spare
		}
		switch c := s.peek(); c {
		case '{':
			ok = f.message(s, m, te, m != &spare)
		case 'n':
			ok = s.literal() // null leaves the element as it is
		default:
			if c != 0 {
				te.add("messages", "an object", kindName(c))
			}
			ok = s.skip()
		}
		if !ok {
			return false
		}
		n++
		more, ok := s.next(']')
		if !ok {
			return false
		}
		if !more {
			break
		}
	}
	f.hasMsgs, f.nMsgs = true, n
	return true
}

// message reads one message object into m; keep is false for one past
// MaxMessages, whose parts are counted but not kept.
func (f *reqBody) message(s *jsonScan, m *chatMsg, te *typeErrors, keep bool) bool {
	empty, ok := s.open('}')
	for ok && !empty {
		var key []byte
		if key, ok = s.key(); !ok {
			return false
		}
		switch {
		case keyIs(key, "role"):
			ok = s.stringInto(&m.role, nil, te, "messages.role")
		case keyIs(key, "content"):
			ok = f.content(s, &m.content, keep)
		case keyIs(key, "name"):
			ok = s.stringInto(&m.extra().name, nil, te, "messages.name")
		case keyIs(key, "tool_calls"):
			m.extra().toolCalls, ok = s.span()
		case keyIs(key, "tool_call_id"):
			ok = s.stringInto(&m.extra().toolCallID, nil, te, "messages.tool_call_id")
		case keyIs(key, "reasoning_content"):
			mo := m.extra()
			ok = s.stringInto(&mo.reasoning.s, &mo.reasoning.set, te, "messages.reasoning_content")
		default:
			ok = s.skip()
		}
		if !ok {
			return false
		}
		var more bool
		if more, ok = s.next('}'); !more {
			return ok
		}
	}
	return ok
}

// content reads a message's "content": a string (checked, to be unquoted
// by renderChat) or a list of parts, decoded now into f.parts (when keep,
// and while they number at most MaxContentParts), so that the body is
// read once; anything else is kept as a kind, for renderChat to reject.
func (f *reqBody) content(s *jsonScan, c *chatContent, keep bool) bool {
	switch s.peek() {
	case '"':
		s.noStops = true // renderChat finds them again (unquoteScan)
		raw, plain, ok := s.scanString()
		s.noStops = false
		*c = chatContent{kind: contentString, raw: raw, form: s.formOf(plain)}
		return ok
	case 'n':
		*c = chatContent{kind: contentNull}
		return s.literal()
	case '[':
	default:
		*c = chatContent{kind: contentOther}
		return s.skip()
	}
	start := s.i
	*c = chatContent{kind: contentParts, first: uint32(f.parts.n)}
	empty, ok := s.open(']')
	for ok && !empty {
		var p chatPart
		at := s.i
		switch k := s.peek(); k {
		case '{':
			var msg string
			msg, ok = s.part(&p, start)
			p.bad = msg != ""
		case 'n':
			ok = s.literal()
		default:
			p.bad = k != 0
			ok = s.skip()
		}
		if !ok {
			return false
		}
		p.off, p.end = uint32(at-start), uint32(s.i-start)
		c.n++
		if keep && !f.partsOver {
			if f.parts.n < MaxContentParts {
				*f.parts.add() = p
			} else {
				f.partsOver = true
			}
		}
		var more bool
		if more, ok = s.next(']'); !more {
			break
		}
	}
	c.raw = s.b[start:s.i:s.i]
	return ok
}

// part reads one content part object; base is where its content list
// starts (the part's offsets are from there). It returns the part's first
// type error, as encoding/json decoding the part on its own words it ("":
// none).
func (s *jsonScan) part(p *chatPart, base int) (string, bool) {
	var te typeErrors
	empty, ok := s.open('}')
	for ok && !empty {
		var key []byte
		if key, ok = s.key(); !ok {
			return "", false
		}
		switch {
		case keyIs(key, "type"):
			ok = s.partType(p, &te)
		case keyIs(key, "text"):
			ok = s.partText(p, base, &te)
		default:
			ok = s.skip()
		}
		if !ok {
			return "", false
		}
		var more bool
		if more, ok = s.next('}'); !more {
			break
		}
	}
	return te.first, ok
}

// partType reads a part's "type" as a string field (stringInto) and keeps
// which of the types renderChat tells apart it is.
func (s *jsonScan) partType(p *chatPart, te *typeErrors) bool {
	if s.peek() != '"' {
		var ignored string
		return s.stringInto(&ignored, nil, te, "type") // null, or a type error
	}
	raw, plain, ok := s.scanString()
	if !ok {
		return false
	}
	t := string(raw) // no copy: only compared
	if !plain {
		t = unquote(raw, s.stops)
	}
	switch t {
	case "":
		p.typ = partUntyped
	case "text":
		p.typ = partText
	case "input_text":
		p.typ = partInputText
	default:
		p.typ = partOther
	}
	return true
}

// partText reads a part's "text" as a *string field (stringInto): a
// string sets it, null unsets it.
func (s *jsonScan) partText(p *chatPart, base int, te *typeErrors) bool {
	switch c := s.peek(); c {
	case '"':
		s.noStops = true
		raw, plain, ok := s.scanString()
		s.noStops = false
		if ok {
			p.toff = uint32(s.i - 1 - len(raw) - base)
			p.tend = p.toff + uint32(len(raw))
			p.textSet, p.textForm = true, s.formOf(plain)
		}
		return ok
	case 'n':
		p.textSet = false
		return s.literal()
	default:
		if c != 0 {
			te.add("text", "a string", kindName(c))
		}
		return s.skip()
	}
}

// partError is the error of decoding a part (its JSON) on its own.
func partError(raw []byte) string {
	if raw[0] != '{' {
		return "request body must be a JSON object, got " + kindName(raw[0])
	}
	s := jsonScan{b: raw}
	var p chatPart
	msg, _ := s.part(&p, 0)
	return msg
}

// chatLimits checks a chat body's messages against MaxMessages and
// MaxContentParts.
func (f *reqBody) chatLimits() error {
	if f.nMsgs > MaxMessages {
		return fmt.Errorf("%w: messages holds %d messages, more than the %d allowed", ErrBadRequest, f.nMsgs, MaxMessages)
	}
	parts := 0
	for i := range f.nMsgs {
		parts += int(f.msgs.at(i).content.n)
	}
	if parts > MaxContentParts {
		return fmt.Errorf("%w: messages hold %d content parts, more than the %d allowed", ErrBadRequest, parts, MaxContentParts)
	}
	if f.partsOver { // duplicate keys held them
		return fmt.Errorf("%w: messages lists hold more than the %d content parts allowed", ErrBadRequest, MaxContentParts)
	}
	return nil
}

// writeString writes a JSON string's bytes between its quotes (raw, from
// a valid string of that form) unquoted to out.
func writeString(out *strings.Builder, raw []byte, form strForm) {
	if form == formPlain {
		out.Write(raw)
		return
	}
	unquoteScan(out, raw, form == formBadUTF8)
}

// unquoteScan is unquoteTo without the stops: it finds the escapes again,
// and the bytes that are not UTF-8 when badUTF8 says there are some (so
// that a message need not keep 8 bytes per escape from the scan to the
// rendering).
func unquoteScan(out *strings.Builder, raw []byte, badUTF8 bool) {
	for len(raw) > 0 {
		k := bytes.IndexByte(raw, '\\')
		if k < 0 {
			k = len(raw)
		}
		if badUTF8 {
			writeUTF8(out, raw[:k])
		} else {
			out.Write(raw[:k])
		}
		if k == len(raw) {
			return
		}
		e := raw[k+1]
		if e != 'u' {
			out.WriteByte(unescapeByte(e))
			raw = raw[k+2:]
			continue
		}
		r := hex4(raw[k+2:])
		raw = raw[k+6:]
		if utf16.IsSurrogate(r) {
			if r2 := getu4(raw); r2 >= 0 {
				if d := utf16.DecodeRune(r, r2); d != unicode.ReplacementChar {
					out.WriteRune(d)
					raw = raw[6:]
					continue
				}
			}
			r = unicode.ReplacementChar
		}
		out.WriteRune(r)
	}
}

// writeUTF8 writes b to out with each byte that is not UTF-8 replaced by
// U+FFFD, as encoding/json unquotes.
func writeUTF8(out *strings.Builder, b []byte) {
	for len(b) > 0 {
		if utf8.Valid(b) {
			out.Write(b)
			return
		}
		i := 0
		for i < len(b) {
			if b[i] < utf8.RuneSelf {
				i++
				continue
			}
			r, n := utf8.DecodeRune(b[i:])
			if r == utf8.RuneError && n == 1 {
				break
			}
			i += n
		}
		out.Write(b[:i])
		if i < len(b) {
			out.WriteRune(unicode.ReplacementChar)
			i++
		}
		b = b[i:]
	}
}

// nestsDeeper reports whether the JSON text s (valid or not) opens more
// than limit objects or lists at once before its first value ends or a
// syntax error stops a JSON decoder: how deep a recursive decoder of it
// (the chat template's, of a tool call's arguments) goes.
func nestsDeeper(s string, limit int) bool {
	sc := jsonScan{b: unsafe.Slice(unsafe.StringData(s), len(s))} // only read
	sc.ws()
	sc.skip()
	return sc.maxDepth > limit
}
