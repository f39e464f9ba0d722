// Package tokenize turns prompt text into the token ids an inference engine
// will see, so the router's prefix keys match the engine's KV-cache blocks.
//
// It loads a Hugging Face tokenizer.json offline (byte-level BPE as used by
// the GPT-2, Llama-3.x and Qwen2/2.5/3 families, with added and special
// tokens and the Unicode normalizers those families use), renders the
// model's Jinja chat template from tokenizer_config.json, and reuses the
// tokens of previously seen leading text through a bounded PrefixCache, so
// routing cost does not grow with the length of a shared prefix.
//
// A Tokenizer is immutable after Load apart from an internal, bounded,
// lock-free word cache, and is safe for concurrent use.
package tokenize

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// ErrUnsupported is wrapped by the error Load returns for a tokenizer.json
// that uses a model, normalizer, pre-tokenizer or option this package does
// not implement; the message names it.
var ErrUnsupported = errors.New("unsupported tokenizer")

// Tokenizer is a byte-level BPE tokenizer loaded from a Hugging Face
// tokenizer.json, with the chat template of its tokenizer_config.json when
// one was found. Its methods are safe for concurrent use.
type Tokenizer struct {
	vocab        map[string]uint32 // raw token bytes → id (model vocabulary)
	merges       *mergeTable       // mergeKey(left, right) → rank<<32 | merged id
	byteID       [256]uint32       // id of each single-byte token
	ignoreMerges bool              // BPE "ignore_merges": a whole word in the vocabulary is one token
	normalize    func(string) string
	compatNorm   bool // an NFKC/NFKD normaliser, which can turn a non-space into a space
	pre          preTokenizer
	added        addedTokens
	decode       [][]byte // id → bytes; nil for unknown ids
	cache        *wordCache

	chat       *chatTemplate // nil when no template was found
	specialMap map[string]string
}

// Load reads a tokenizer. path is a tokenizer.json file (gzip-compressed or
// not, whatever its name) or a model directory holding tokenizer.json or
// tokenizer.json.gz and, optionally, tokenizer_config.json and
// chat_template.jinja, from which the chat template is taken. Nothing is
// fetched from the network.
func Load(path string) (*Tokenizer, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("tokenize: load: %w", err)
	}
	var tokFile, cfgFile, tmplFile string
	if st.IsDir() {
		for _, name := range []string{"tokenizer.json", "tokenizer.json.gz"} {
			if _, err := os.Stat(filepath.Join(path, name)); err == nil {
				tokFile = filepath.Join(path, name)
				break
			}
		}
		if tokFile == "" {
			return nil, fmt.Errorf("tokenize: load %s: no tokenizer.json in the directory", path)
		}
		cfgFile = filepath.Join(path, "tokenizer_config.json")
		tmplFile = filepath.Join(path, "chat_template.jinja")
	} else {
		tokFile = path
		dir := filepath.Dir(path)
		cfgFile = filepath.Join(dir, "tokenizer_config.json")
		tmplFile = filepath.Join(dir, "chat_template.jinja")
	}
	tokData, err := readMaybeGzip(tokFile)
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", tokFile, err)
	}
	var cfgData, tmplData []byte
	if b, err := readMaybeGzip(cfgFile); err == nil {
		cfgData = b
	}
	if b, err := os.ReadFile(tmplFile); err == nil {
		tmplData = b
	}
	t, err := New(tokData, cfgData)
	if err != nil {
		return nil, fmt.Errorf("tokenize: load %s: %w", tokFile, err)
	}
	if tmplData != nil {
		if t.chat, err = compileChatTemplate(string(tmplData)); err != nil {
			return nil, fmt.Errorf("tokenize: load %s: %w", tmplFile, err)
		}
	}
	return t, nil
}

func readMaybeGzip(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return maybeGunzip(b)
}

func maybeGunzip(b []byte) ([]byte, error) {
	if len(b) >= 2 && b[0] == 0x1f && b[1] == 0x8b {
		zr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil, err
		}
		defer zr.Close()
		return io.ReadAll(zr)
	}
	return b, nil
}

// hfTokenizer is the subset of tokenizer.json this package reads.
type hfTokenizer struct {
	AddedTokens  []hfAddedToken  `json:"added_tokens"`
	Normalizer   json.RawMessage `json:"normalizer"`
	PreTokenizer json.RawMessage `json:"pre_tokenizer"`
	Decoder      json.RawMessage `json:"decoder"`
	Model        json.RawMessage `json:"model"`
}

type hfModel struct {
	Type                    string            `json:"type"`
	Vocab                   map[string]uint32 `json:"vocab"`
	Merges                  json.RawMessage   `json:"merges"`
	Dropout                 *float64          `json:"dropout"`
	ByteFallback            bool              `json:"byte_fallback"`
	IgnoreMerges            bool              `json:"ignore_merges"`
	ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
}

type hfAddedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

type hfComponent struct {
	Type          string            `json:"type"`
	Normalizers   []json.RawMessage `json:"normalizers"`
	Pretokenizers []json.RawMessage `json:"pretokenizers"`
	Pattern       struct {
		Regex  *string `json:"Regex"`
		String *string `json:"String"`
	} `json:"pattern"`
	Behavior       string `json:"behavior"`
	Invert         bool   `json:"invert"`
	AddPrefixSpace bool   `json:"add_prefix_space"`
	UseRegex       *bool  `json:"use_regex"`
}

// New builds a Tokenizer from the contents of a tokenizer.json and,
// optionally (nil), a tokenizer_config.json that supplies the chat template
// and the special-token variables (bos_token, eos_token, ...) it uses.
func New(tokenizerJSON, tokenizerConfigJSON []byte) (*Tokenizer, error) {
	var hf hfTokenizer
	if err := json.Unmarshal(tokenizerJSON, &hf); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: %w", err)
	}
	var mt struct {
		Type string `json:"type"`
	}
	if err := json.Unmarshal(hf.Model, &mt); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json model: %w", err)
	}
	if mt.Type != "BPE" && mt.Type != "" {
		return nil, fmt.Errorf("%w: model type %q (only byte-level BPE is implemented)", ErrUnsupported, mt.Type)
	}
	m := new(hfModel)
	if err := json.Unmarshal(hf.Model, m); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json model: %w", err)
	}
	if m.Type != "BPE" && !(m.Type == "" && m.Vocab != nil && m.Merges != nil) {
		return nil, fmt.Errorf("%w: model type %q (only byte-level BPE is implemented)", ErrUnsupported, m.Type)
	}
	if m.Dropout != nil && *m.Dropout != 0 {
		return nil, fmt.Errorf("%w: BPE dropout %v", ErrUnsupported, *m.Dropout)
	}
	if m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "" {
		return nil, fmt.Errorf("%w: BPE continuing_subword_prefix %q", ErrUnsupported, *m.ContinuingSubwordPrefix)
	}
	if m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "" {
		return nil, fmt.Errorf("%w: BPE end_of_word_suffix %q", ErrUnsupported, *m.EndOfWordSuffix)
	}
	t := &Tokenizer{ignoreMerges: m.IgnoreMerges, cache: newWordCache()}
	var err error
	if t.normalize, err = parseNormalizer(hf.Normalizer); err != nil {
		return nil, err
	}
	t.compatNorm = bytes.Contains(hf.Normalizer, []byte(`"NFK`))
	byteLevel := false
	if t.pre, byteLevel, err = parsePreTokenizer(hf.PreTokenizer); err != nil {
		return nil, err
	}
	if !byteLevel {
		var dec hfComponent
		_ = json.Unmarshal(hf.Decoder, &dec)
		return nil, fmt.Errorf("%w: pre-tokenizer without ByteLevel (decoder %q): only byte-level BPE (GPT-2, Llama-3, Qwen2/3) is implemented; SentencePiece-style BPE is not", ErrUnsupported, dec.Type)
	}

	// Vocabulary: byte-level strings → raw bytes.
	t.vocab = make(map[string]uint32, len(m.Vocab))
	maxID := uint32(0)
	for s, id := range m.Vocab {
		raw, ok := unByteLevel(s)
		if !ok {
			return nil, fmt.Errorf("%w: vocabulary entry %q is not byte-level encoded", ErrUnsupported, s)
		}
		t.vocab[raw] = id
		maxID = max(maxID, id)
	}
	for b := 0; b < 256; b++ {
		id, ok := t.vocab[string([]byte{byte(b)})]
		if !ok {
			return nil, fmt.Errorf("%w: vocabulary lacks the single byte 0x%02x (not a byte-level BPE)", ErrUnsupported, b)
		}
		t.byteID[b] = id
	}

	// Merges: ["a b", ...] or [["a", "b"], ...].
	pairs, err := parseMerges(m.Merges)
	if err != nil {
		return nil, err
	}
	t.merges = newMergeTable(len(pairs))
	for rank, p := range pairs {
		a, okA := unByteLevel(p[0])
		b, okB := unByteLevel(p[1])
		ia, ok1 := t.vocab[a]
		ib, ok2 := t.vocab[b]
		ic, ok3 := t.vocab[a+b]
		if !okA || !okB || !ok1 || !ok2 || !ok3 {
			return nil, fmt.Errorf("parse tokenizer.json: merge %d %q: token not in vocabulary", rank, p)
		}
		t.merges.put(mergeKey(ia, ib), uint64(rank)<<32|uint64(ic))
	}

	// Added tokens.
	for _, a := range hf.AddedTokens {
		maxID = max(maxID, a.ID)
	}
	t.decode = make([][]byte, maxID+1)
	for raw, id := range t.vocab {
		t.decode[id] = []byte(raw)
	}
	toks := make([]addedToken, 0, len(hf.AddedTokens))
	for _, a := range hf.AddedTokens {
		if a.Content == "" {
			continue
		}
		t.decode[a.ID] = []byte(a.Content)
		toks = append(toks, addedToken{content: a.Content, id: a.ID, special: a.Special,
			lstrip: a.LStrip, rstrip: a.RStrip, singleWord: a.SingleWord})
	}
	t.added = newAddedTokens(toks)

	if tokenizerConfigJSON != nil {
		if err := t.loadConfig(tokenizerConfigJSON); err != nil {
			return nil, err
		}
	}
	return t, nil
}

func unByteLevel(s string) (string, bool) {
	buf := make([]byte, 0, len(s))
	for _, r := range s {
		b, ok := runeToByte[r]
		if !ok {
			return "", false
		}
		buf = append(buf, b)
	}
	return string(buf), true
}

func parseMerges(raw json.RawMessage) ([][2]string, error) {
	var asStrings []string
	if err := json.Unmarshal(raw, &asStrings); err == nil {
		out := make([][2]string, len(asStrings))
		for i, s := range asStrings {
			a, b, ok := strings.Cut(s, " ")
			if !ok {
				return nil, fmt.Errorf("parse tokenizer.json: merge %d %q has no space", i, s)
			}
			out[i] = [2]string{a, b}
		}
		return out, nil
	}
	var asPairs [][2]string
	if err := json.Unmarshal(raw, &asPairs); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json: merges are neither strings nor pairs: %w", err)
	}
	return asPairs, nil
}

func parseNormalizer(raw json.RawMessage) (func(string) string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("parse tokenizer.json normalizer: %w", err)
	}
	switch c.Type {
	case "NFC":
		return norm.NFC.String, nil
	case "NFD":
		return norm.NFD.String, nil
	case "NFKC":
		return norm.NFKC.String, nil
	case "NFKD":
		return norm.NFKD.String, nil
	case "Sequence":
		var fs []func(string) string
		for _, sub := range c.Normalizers {
			f, err := parseNormalizer(sub)
			if err != nil {
				return nil, err
			}
			if f != nil {
				fs = append(fs, f)
			}
		}
		switch len(fs) {
		case 0:
			return nil, nil
		case 1:
			return fs[0], nil
		}
		return func(s string) string {
			for _, f := range fs {
				s = f(s)
			}
			return s
		}, nil
	}
	return nil, fmt.Errorf("%w: normalizer %q (implemented: NFC, NFD, NFKC, NFKD, Sequence of them)", ErrUnsupported, c.Type)
}

// parsePreTokenizer recognises the pre-tokenizers of the supported families
// and reports whether a ByteLevel step is present.
func parsePreTokenizer(raw json.RawMessage) (preTokenizer, bool, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, false, nil
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, false, fmt.Errorf("parse tokenizer.json pre_tokenizer: %w", err)
	}
	switch c.Type {
	case "Sequence":
		var pre preTokenizer
		byteLevel := false
		for _, sub := range c.Pretokenizers {
			p, bl, err := parsePreTokenizer(sub)
			if err != nil {
				return nil, false, err
			}
			if p != nil {
				if pre != nil {
					return nil, false, fmt.Errorf("%w: more than one splitting pre-tokenizer in a Sequence", ErrUnsupported)
				}
				pre = p
			}
			byteLevel = byteLevel || bl
		}
		return pre, byteLevel, nil
	case "Split":
		if c.Pattern.Regex == nil || c.Invert || c.Behavior != "Isolated" {
			return nil, false, fmt.Errorf("%w: Split pre-tokenizer other than an Isolated, non-inverted regex", ErrUnsupported)
		}
		switch *c.Pattern.Regex {
		case patternQwen2:
			return splitLlama3{maxDigits: 1}, false, nil
		case patternLlama3:
			return splitLlama3{maxDigits: 3}, false, nil
		case patternGPT2:
			return splitGPT2{}, false, nil
		}
		return nil, false, fmt.Errorf("%w: Split pre-tokenizer regex %q (implemented: the Qwen2/3, Llama-3 and GPT-2 patterns)", ErrUnsupported, *c.Pattern.Regex)
	case "ByteLevel":
		if c.AddPrefixSpace {
			return nil, false, fmt.Errorf("%w: ByteLevel pre-tokenizer with add_prefix_space=true", ErrUnsupported)
		}
		if c.UseRegex == nil || *c.UseRegex {
			return splitGPT2{}, true, nil
		}
		return nil, true, nil
	}
	return nil, false, fmt.Errorf("%w: pre-tokenizer %q (implemented: ByteLevel, Split with a known regex, Sequence of them)", ErrUnsupported, c.Type)
}

// VocabSize returns one more than the largest token id, added tokens included.
func (t *Tokenizer) VocabSize() int { return len(t.decode) }

// TokenID returns the id of a token given by its text (an added token such
// as "<|im_end|>" or a vocabulary entry's raw bytes).
func (t *Tokenizer) TokenID(token string) (uint32, bool) {
	if id, ok := t.added.byContent[token]; ok {
		return id, true
	}
	id, ok := t.vocab[token]
	return id, ok
}

// Encode returns the token ids of text as the Hugging Face tokenizer does
// with add_special_tokens=False: no BOS or other template tokens are added,
// but added and special tokens that appear in text (such as "<|im_start|>")
// are recognised and become their own ids.
func (t *Tokenizer) Encode(text string) []uint32 {
	return t.AppendEncode(make([]uint32, 0, len(text)/3+4), text)
}

// AppendEncode appends the token ids of text, as Encode returns them, to dst.
func (t *Tokenizer) AppendEncode(dst []uint32, text string) []uint32 {
	t.added.split(text, func(seg string, id uint32, isAdded bool) {
		if isAdded {
			dst = append(dst, id)
			return
		}
		dst = t.encodeOrdinary(dst, seg)
	})
	return dst
}

// encodeOrdinary encodes text that holds no added token.
func (t *Tokenizer) encodeOrdinary(dst []uint32, text string) []uint32 {
	if t.normalize != nil && !isASCII(text) {
		text = t.normalize(text)
	}
	if t.pre == nil {
		return t.bpe(text, dst)
	}
	t.pre.split(text, func(start, end int) {
		dst = t.bpe(text[start:end], dst)
	})
	return dst
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

// Decode returns the text of ids: the bytes of each token concatenated, with
// added tokens as their content. Unknown ids are skipped. The result is
// exactly the bytes the ids stand for, so it is not valid UTF-8 when the ids
// end (or start) inside a multi-byte character.
func (t *Tokenizer) Decode(ids []uint32) string {
	n := 0
	for _, id := range ids {
		if int(id) < len(t.decode) {
			n += len(t.decode[id])
		}
	}
	b := make([]byte, 0, n)
	for _, id := range ids {
		if int(id) < len(t.decode) {
			b = append(b, t.decode[id]...)
		}
	}
	return string(b)
}

// addedToken is one entry of tokenizer.json's added_tokens.
type addedToken struct {
	content    string
	id         uint32
	special    bool
	lstrip     bool
	rstrip     bool
	singleWord bool
}

// addedTokens finds added tokens in text before normalisation and
// pre-tokenisation, leftmost-longest as the Hugging Face library does. All
// tokens are matched on the raw text; a non-special token with
// normalized=true is matched on the normalised text there, which differs
// only for tokens that normalisation would change.
type addedTokens struct {
	first     [256][]addedToken // by first byte, longest first
	byContent map[string]uint32
	onlyFirst int // the one first byte of all tokens (as in "<|...|>"), or -1
}

func newAddedTokens(toks []addedToken) addedTokens {
	var a addedTokens
	a.byContent = make(map[string]uint32, len(toks))
	for _, tk := range toks {
		a.byContent[tk.content] = tk.id
		a.first[tk.content[0]] = append(a.first[tk.content[0]], tk)
	}
	a.onlyFirst = -1
	for _, tk := range toks {
		if a.onlyFirst == -1 {
			a.onlyFirst = int(tk.content[0])
		} else if a.onlyFirst != int(tk.content[0]) {
			a.onlyFirst = -2
		}
	}
	for i := range a.first {
		l := a.first[i]
		sort.SliceStable(l, func(x, y int) bool { return len(l[x].content) > len(l[y].content) })
	}
	return a
}

// split calls f for each maximal ordinary segment of s and each added token,
// in order.
func (a *addedTokens) split(s string, f func(seg string, id uint32, isAdded bool)) {
	last := 0
	if a.onlyFirst == -1 && len(a.byContent) == 0 {
		if len(s) > 0 {
			f(s, 0, false)
		}
		return
	}
	for i := 0; i < len(s); i++ {
		if a.onlyFirst >= 0 { // skip to the next candidate with IndexByte
			k := strings.IndexByte(s[i:], byte(a.onlyFirst))
			if k < 0 {
				break
			}
			i += k
		}
		cands := a.first[s[i]]
		if cands == nil {
			continue
		}
		for _, tk := range cands {
			if !strings.HasPrefix(s[i:], tk.content) {
				continue
			}
			start, end := i, i+len(tk.content)
			if tk.singleWord && (isWordBefore(s, start) || isWordAfter(s, end)) {
				continue
			}
			if tk.lstrip {
				for start > last {
					r, w := utf8.DecodeLastRuneInString(s[last:start])
					if !unicode.IsSpace(r) {
						break
					}
					start -= w
				}
			}
			if tk.rstrip {
				for end < len(s) {
					r, w := utf8.DecodeRuneInString(s[end:])
					if !unicode.IsSpace(r) {
						break
					}
					end += w
				}
			}
			if start > last {
				f(s[last:start], 0, false)
			}
			f(s[start:end], tk.id, true)
			last = end
			i = end - 1
			break
		}
	}
	if last < len(s) {
		f(s[last:], 0, false)
	}
}

func isWordRune(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) }

func isWordBefore(s string, i int) bool {
	if i == 0 {
		return false
	}
	r, _ := utf8.DecodeLastRuneInString(s[:i])
	return isWordRune(r)
}

func isWordAfter(s string, i int) bool {
	if i >= len(s) {
		return false
	}
	r, _ := utf8.DecodeRuneInString(s[i:])
	return isWordRune(r)
}

// NewGzip is New for a tokenizer.json that may be gzip-compressed.
func NewGzip(tokenizerJSON, tokenizerConfigJSON []byte) (*Tokenizer, error) {
	b, err := maybeGunzip(tokenizerJSON)
	if err != nil {
		return nil, fmt.Errorf("tokenize: decompress tokenizer.json: %w", err)
	}
	t, err := New(b, tokenizerConfigJSON)
	if err != nil {
		return nil, fmt.Errorf("tokenize: %w", err)
	}
	return t, nil
}
