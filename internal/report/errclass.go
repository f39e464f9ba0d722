package report

import (
	"cmp"
	"slices"
	"strings"
)

// maxClassLen bounds an error class's length in bytes: messages beyond it
// that differ only in their tail fall in one class.
const maxClassLen = 160

// ErrorClass returns the class of a failure's message: the message with
// every number replaced by "N", cut at maxClassLen bytes, keeping a
// leading "http NNN" status as it is. So the 307 failures "http 400: the
// request needs 1258 KV blocks of 16 tokens (20090 prompt + 20 output
// tokens); the replica holds 1250" and their siblings with other counts
// are one class, "http 400: the request needs N KV blocks of N tokens (N
// prompt + N output tokens); the replica holds N", while a 400 and a 503
// never share one.
func ErrorClass(msg string) string {
	var b strings.Builder
	rest := msg
	if status, tail, ok := strings.Cut(msg, " "); ok && status == "http" && len(tail) >= 3 &&
		isDigits(tail[:3]) && (len(tail) == 3 || !isDigit(tail[3])) {
		b.WriteString("http " + tail[:3])
		rest = tail[3:]
	}
	for i := 0; i < len(rest) && b.Len() < maxClassLen; i++ {
		c := rest[i]
		if !isDigit(c) {
			b.WriteByte(c)
			continue
		}
		// A number: digits with at most one decimal point or separator
		// between digits ("1258", "0.25", "1,250").
		for i+1 < len(rest) && (isDigit(rest[i+1]) ||
			((rest[i+1] == '.' || rest[i+1] == ',') && i+2 < len(rest) && isDigit(rest[i+2]))) {
			i++
		}
		b.WriteByte('N')
	}
	class := b.String()
	if len(class) > maxClassLen {
		class = class[:maxClassLen]
	}
	return class
}

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func isDigits(s string) bool {
	for i := 0; i < len(s); i++ {
		if !isDigit(s[i]) {
			return false
		}
	}
	return true
}

// ErrorClasses groups the failed records by ErrorClass; nil when none
// failed.
func ErrorClasses(recs []RequestRecord) map[string]ErrorClassCount {
	var out map[string]ErrorClassCount
	for _, r := range recs {
		if !r.Failed() {
			continue
		}
		if out == nil {
			out = map[string]ErrorClassCount{}
		}
		k := ErrorClass(r.Error)
		c, ok := out[k]
		if !ok {
			c.Example = r.Error
		}
		c.Count++
		out[k] = c
	}
	return out
}

// ErrorClassEntry is one class of SortedErrorClasses.
type ErrorClassEntry struct {
	Class string
	ErrorClassCount
}

// SortedErrorClasses returns classes most frequent first, ties by class.
func SortedErrorClasses(classes map[string]ErrorClassCount) []ErrorClassEntry {
	out := make([]ErrorClassEntry, 0, len(classes))
	for k, v := range classes {
		out = append(out, ErrorClassEntry{k, v})
	}
	slices.SortFunc(out, func(a, b ErrorClassEntry) int {
		return cmp.Or(cmp.Compare(b.Count, a.Count), cmp.Compare(a.Class, b.Class))
	})
	return out
}
