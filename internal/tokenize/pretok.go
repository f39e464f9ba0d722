package tokenize

import (
	"unicode"
	"unicode/utf8"
)

// The pre-tokenizer regexes of the supported families. Go's regexp has no
// lookahead, so each is implemented by a hand-written scanner (splitLlama3,
// splitGPT2) that reproduces the leftmost-first, greedy-with-backtracking
// semantics of the Oniguruma regex the Hugging Face tokenizers library runs.
const (
	// patternQwen2 is the Split regex of Qwen2, Qwen2.5 and Qwen3.
	patternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternLlama3 is the Split regex of Llama 3.x (cl100k-style: digits in runs of 1–3).
	patternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patternGPT2 is the regex of the ByteLevel pre-tokenizer with use_regex=true.
	patternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// preTokenizer splits normalised text into pre-tokens ("words"); BPE never
// merges across the pieces it returns. split calls emit(start, end) for each
// piece of s in order; the pieces tile s.
type preTokenizer interface {
	split(s string, emit func(start, end int))
}

// Character classes of the ASCII range, precomputed so the scanners touch the
// unicode tables only for non-ASCII text.
const (
	clsLetter = 1 << iota
	clsNumber
	clsSpace
	clsNewline // \r or \n (also clsSpace)
)

var asciiClass = func() (t [utf8.RuneSelf]uint8) {
	for c := 0; c < utf8.RuneSelf; c++ {
		r := rune(c)
		switch {
		case unicode.IsLetter(r):
			t[c] = clsLetter
		case unicode.IsNumber(r):
			t[c] = clsNumber
		case r == '\r' || r == '\n':
			t[c] = clsSpace | clsNewline
		case unicode.IsSpace(r):
			t[c] = clsSpace
		}
	}
	return t
}()

// classAt returns the class bits and the width of the rune at s[i].
// \s is Unicode White_Space, which is what unicode.IsSpace implements;
// \p{L} and \p{N} are the general categories L and N of Unicode 16.0, the
// version Hugging Face tokenizers classifies with: Go's tables (15.0) plus
// letters16 and numbers16.
func classAt(s string, i int) (uint8, int) {
	c := s[i]
	if c < utf8.RuneSelf {
		return asciiClass[c], 1
	}
	r, w := utf8.DecodeRuneInString(s[i:])
	switch {
	case unicode.IsLetter(r):
		return clsLetter, w
	case unicode.IsNumber(r):
		return clsNumber, w
	case unicode.IsSpace(r):
		return clsSpace, w
	case unicode.Is(letters16, r): // Unicode 16 letters Go's 15.0 tables lack (unicode16.go)
		return clsLetter, w
	case unicode.Is(numbers16, r):
		return clsNumber, w
	}
	return 0, w
}

// contraction reports the length of a contraction ('s 't 're 've 'm 'll 'd)
// at s[i], which holds an apostrophe, or 0. With fold the match is
// case-insensitive as (?i:...) is under Unicode simple case folding, where
// 's' also matches U+017F (long s).
func contraction(s string, i int, fold bool) int {
	rest := s[i+1:]
	if len(rest) == 0 {
		return 0
	}
	lower := func(b byte) byte {
		if fold && 'A' <= b && b <= 'Z' {
			return b + 'a' - 'A'
		}
		return b
	}
	switch lower(rest[0]) {
	case 's', 't', 'm', 'd':
		return 2
	case 'r', 'v':
		if len(rest) > 1 && lower(rest[1]) == 'e' {
			return 3
		}
	case 'l':
		if len(rest) > 1 && lower(rest[1]) == 'l' {
			return 3
		}
	}
	if fold && len(rest) >= 2 && rest[0] == 0xC5 && rest[1] == 0xBF { // ſ
		return 3
	}
	return 0
}

// splitLlama3 is the scanner for patternQwen2 (maxDigits 1) and
// patternLlama3 (maxDigits 3).
type splitLlama3 struct{ maxDigits int }

func (p splitLlama3) split(s string, emit func(start, end int)) {
	n := len(s)
	i := 0
	for i < n {
		start := i
		i = p.next(s, i)
		emit(start, i)
	}
}

// next returns the end of the match that starts at i.
func (p splitLlama3) next(s string, i int) int {
	n := len(s)
	c := s[i]
	// (?i:'s|'t|'re|'ve|'m|'ll|'d)
	if c == '\'' {
		if k := contraction(s, i, true); k > 0 {
			return i + k
		}
	}
	cls, w := classAt(s, i)
	// [^\r\n\p{L}\p{N}]?\p{L}+
	j := -1
	if cls&clsLetter != 0 {
		j = i
	} else if cls&(clsNumber|clsNewline) == 0 && i+w < n {
		if c2, _ := classAt(s, i+w); c2&clsLetter != 0 {
			j = i + w
		}
	}
	if j >= 0 {
		for j < n {
			c2, w2 := classAt(s, j)
			if c2&clsLetter == 0 {
				break
			}
			j += w2
		}
		return j
	}
	// \p{N} or \p{N}{1,3}
	if cls&clsNumber != 0 {
		j = i + w
		for d := 1; d < p.maxDigits && j < n; d++ {
			c2, w2 := classAt(s, j)
			if c2&clsNumber == 0 {
				break
			}
			j += w2
		}
		return j
	}
	// ` ?[^\s\p{L}\p{N}]+[\r\n]*`
	j = i
	if c == ' ' && i+1 < n {
		if c2, _ := classAt(s, i+1); c2 == 0 {
			j = i + 1
		}
	}
	if c2, _ := classAt(s, j); c2 == 0 {
		for j < n {
			c3, w3 := classAt(s, j)
			if c3 != 0 {
				break
			}
			j += w3
		}
		for j < n && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}
	// Whitespace: \s*[\r\n]+ | \s+(?!\S) | \s+
	end, lastNL, prev := i, -1, i
	for end < n {
		c3, w3 := classAt(s, end)
		if c3&clsSpace == 0 {
			break
		}
		if c3&clsNewline != 0 {
			lastNL = end
		}
		prev = end
		end += w3
	}
	if lastNL >= 0 {
		return lastNL + 1
	}
	if end == n || prev == i {
		return end
	}
	return prev
}

// splitGPT2 is the scanner for patternGPT2.
type splitGPT2 struct{}

func (splitGPT2) split(s string, emit func(start, end int)) {
	n := len(s)
	i := 0
	for i < n {
		start := i
		i = splitGPT2{}.next(s, i)
		emit(start, i)
	}
}

func (splitGPT2) next(s string, i int) int {
	n := len(s)
	c := s[i]
	if c == '\'' {
		if k := contraction(s, i, false); k > 0 {
			return i + k
		}
	}
	// ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: the optional space is
	// taken when the run after it is non-empty.
	j := i
	cls, _ := classAt(s, i)
	if c == ' ' && i+1 < n {
		if c2, _ := classAt(s, i+1); c2&clsSpace == 0 {
			j, cls = i+1, c2
		}
	}
	if cls&clsSpace == 0 {
		want := cls & (clsLetter | clsNumber)
		for j < n {
			c3, w3 := classAt(s, j)
			if c3&clsSpace != 0 || c3&(clsLetter|clsNumber) != want {
				break
			}
			j += w3
		}
		return j
	}
	// \s+(?!\S) | \s+
	end, prev := i, i
	for end < n {
		c3, w3 := classAt(s, end)
		if c3&clsSpace == 0 {
			break
		}
		prev = end
		end += w3
	}
	if end == n || prev == i {
		return end
	}
	return prev
}
