package workload

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Trace formats accepted by ReadTrace.
const (
	// FormatMooncake is the Mooncake FAST'25 trace (Qin et al., "Mooncake:
	// Trading More Storage for Less Computation", FAST 2025;
	// github.com/kvcache-ai/Mooncake FAST25-release/traces): JSON lines
	// {"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [..]},
	// each hash id one 512-token block; two requests share a prefix exactly as
	// far as their leading hash ids agree. Each id is expanded into token ids
	// with BlockToken, the last block cut to match input_length.
	FormatMooncake = "mooncake"
	// FormatAzure is the Azure LLM inference trace 2023 (Patel et al.,
	// "Splitwise", ISCA 2024; github.com/Azure/AzurePublicDataset): CSV
	// TIMESTAMP,ContextTokens,GeneratedTokens with wall-clock timestamps such
	// as 2023-11-16 18:17:03.9799600. It has arrivals and lengths only: prompts
	// are unrelated random tokens unless TraceOptions adds a shared prefix.
	FormatAzure = "azure"
	// FormatJSONL is prefixlb's own trace format, documented in docs/traces.md:
	// one JSON object per line with "timestamp_ms", optional "session" and
	// "group", "output_tokens", and exactly one of "tokens" (ids), "text"
	// (turned into ids by WordTokens) or "blocks" (block ids expanded like
	// Mooncake's, with optional "input_length"). Unknown fields are errors.
	FormatJSONL = "jsonl"
)

// TraceFormats returns the formats ReadTrace accepts.
func TraceFormats() []string { return []string{FormatAzure, FormatJSONL, FormatMooncake} }

// ErrMalformed matches (errors.Is) every *LineError.
var ErrMalformed = errors.New("workload: malformed trace line")

// ErrUnknownFormat is returned (wrapped) for a trace format not in TraceFormats.
var ErrUnknownFormat = errors.New("workload: unknown trace format")

// LineError is a malformed trace line: its 1-based line number and what is
// wrong with it.
type LineError struct {
	Line int
	Err  error
}

// Error formats the error as "workload: trace line 17: ...".
func (e *LineError) Error() string { return fmt.Sprintf("workload: trace line %d: %v", e.Line, e.Err) }

// Unwrap returns the cause.
func (e *LineError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrMalformed) true for every LineError.
func (e *LineError) Is(target error) bool { return target == ErrMalformed }

// TraceOptions controls ReadTrace. The zero value is usable: every zero field
// takes the default stated on it.
type TraceOptions struct {
	// SkipMalformed skips malformed lines and returns them as LineErrors;
	// otherwise the first malformed line ends the read with its error.
	SkipMalformed bool
	// BlockTokens is the tokens per block id in mooncake hash_ids and jsonl
	// "blocks". Default 512 (Mooncake's block).
	BlockTokens int
	// MaxPromptTokens makes longer prompts malformed, bounding memory on bad
	// input. Default 1<<20.
	MaxPromptTokens int
	// Seed draws the synthetic prompt tokens of an azure trace.
	Seed int64
	// SharedPrefix (azure only) starts each prompt with up to this many tokens
	// of a shared system prompt (all of the prompt if it is shorter): a simple
	// sharing model for a trace that has none. Default 0: no sharing.
	SharedPrefix int
	// SharedGroups (azure only) is the number of distinct system prompts, one
	// picked uniformly per request. Default 1.
	SharedGroups int

	// timesOnly (azure) skips building prompts: for reading arrival
	// timestamps only.
	timesOnly bool
}

func (o *TraceOptions) defaults() {
	if o.BlockTokens <= 0 {
		o.BlockTokens = 512
	}
	if o.MaxPromptTokens <= 0 {
		o.MaxPromptTokens = 1 << 20
	}
	if o.SharedGroups <= 0 {
		o.SharedGroups = 1
	}
}

// ReadTrace reads a trace in the given format (see TraceFormats). Arrivals are
// relative to the earliest request; requests are returned sorted by arrival
// (stably, so a session's lines keep their file order), with IDs 0..n-1.
// Blank lines are ignored. A malformed line is a *LineError naming its line:
// with opts.SkipMalformed it is skipped and returned in the slice, otherwise
// it is returned as the error. Requests whose leading blocks agree share the
// backing arrays of their tokens: treat Tokens as read-only.
func ReadTrace(r io.Reader, format string, opts TraceOptions) ([]Request, []LineError, error) {
	opts.defaults()
	// parse returns a request, or one without Tokens for a line that is not a
	// request (a CSV header), or an error for a malformed line.
	var parse func(line []byte) (Request, error)
	exp := newBlockExpander(opts.BlockTokens)
	switch format {
	case FormatMooncake:
		parse = func(line []byte) (Request, error) { return parseMooncake(line, exp, &opts) }
	case FormatJSONL:
		parse = func(line []byte) (Request, error) { return parseJSONL(line, exp, &opts) }
	case FormatAzure:
		az := &azureReader{opts: &opts, ts: &tokenSource{newRand(opts.Seed, streamTokens)}, sel: newRand(opts.Seed, streamSelect)}
		parse = az.parse
	default:
		return nil, nil, fmt.Errorf("%w %q (known: %s)", ErrUnknownFormat, format, strings.Join(TraceFormats(), ", "))
	}
	br := bufio.NewReaderSize(r, 1<<16)
	var (
		reqs []Request
		bad  []LineError
	)
	for lineNo := 1; ; lineNo++ {
		line, err := br.ReadBytes('\n')
		if err != nil && err != io.EOF {
			return nil, bad, fmt.Errorf("workload: read trace at line %d: %w", lineNo, err)
		}
		if t := bytes.TrimSpace(line); len(t) > 0 {
			req, perr := parse(t)
			if perr != nil {
				le := LineError{Line: lineNo, Err: perr}
				bad = append(bad, le)
				if !opts.SkipMalformed {
					return nil, bad, &le
				}
			} else if req.Tokens != nil {
				reqs = append(reqs, req)
			}
		}
		if err == io.EOF {
			break
		}
	}
	finishTrace(reqs)
	return reqs, bad, nil
}

// finishTrace makes arrivals relative to the earliest, sorts stably by arrival
// and numbers the requests.
func finishTrace(reqs []Request) {
	if len(reqs) == 0 {
		return
	}
	first := reqs[0].Arrival
	for _, r := range reqs {
		first = min(first, r.Arrival)
	}
	for i := range reqs {
		reqs[i].Arrival -= first
	}
	slices.SortStableFunc(reqs, func(a, b Request) int {
		switch {
		case a.Arrival < b.Arrival:
			return -1
		case a.Arrival > b.Arrival:
			return 1
		}
		return 0
	})
	for i := range reqs {
		reqs[i].ID = i
	}
}

// msDuration converts a non-negative finite millisecond timestamp.
func msDuration(ms float64, field string) (time.Duration, error) {
	if math.IsNaN(ms) || ms < 0 || ms > float64(math.MaxInt64/int64(time.Millisecond)) {
		return 0, fmt.Errorf("%s %v must be a non-negative number of milliseconds", field, ms)
	}
	return time.Duration(ms * float64(time.Millisecond)), nil
}

// blockExpander turns block-id lists into token ids, sharing backing arrays
// between requests whose leading ids agree: a trie over block ids remembers,
// for every prefix, the newest request's tokens through that block. Not safe
// for concurrent use.
type blockExpander struct {
	size  int
	ar    *arena
	trie  map[trieEdge]int32
	nodes []trieNode
}

type trieEdge struct {
	parent int32
	id     uint64
}

type trieNode struct {
	tokens []uint32 // a prompt whose first end tokens are this prefix
	end    int
}

func newBlockExpander(size int) *blockExpander {
	return &blockExpander{size: size, ar: newArena(), trie: make(map[trieEdge]int32)}
}

// expand returns the n tokens of blocks ids (n within the last block).
func (e *blockExpander) expand(ids []uint64, n int) []uint32 {
	var best []uint32
	cur := int32(-1)
	for i, id := range ids {
		nd, ok := e.trie[trieEdge{cur, id}]
		if !ok {
			break
		}
		node := &e.nodes[nd]
		best = node.tokens[:min(node.end, n)]
		if node.end < (i+1)*e.size || node.end >= n {
			break
		}
		cur = nd
	}
	t := e.ar.extend(best, n-len(best), n+n/4)
	for p := len(best); p < n; p++ {
		t[p] = BlockToken(ids[p/e.size], p%e.size, 0)
	}
	cur = -1
	for i, id := range ids {
		end := min((i+1)*e.size, n)
		edge := trieEdge{cur, id}
		nd, ok := e.trie[edge]
		if !ok {
			nd = int32(len(e.nodes))
			e.nodes = append(e.nodes, trieNode{})
			e.trie[edge] = nd
		}
		if node := &e.nodes[nd]; end >= node.end {
			node.tokens, node.end = t, end
		}
		cur = nd
	}
	return t
}

// checkBlocks validates a prompt of n tokens over nb blocks.
func checkBlocks(n, nb, size, maxTokens int) error {
	switch {
	case n < 1:
		return fmt.Errorf("input length %d must be >= 1", n)
	case n > maxTokens:
		return fmt.Errorf("input length %d exceeds the limit of %d tokens", n, maxTokens)
	case nb == 0:
		return errors.New("no block ids")
	case n > nb*size || n <= (nb-1)*size:
		return fmt.Errorf("input length %d does not fit %d blocks of %d tokens", n, nb, size)
	}
	return nil
}

type mooncakeLine struct {
	Timestamp    *float64 `json:"timestamp"`
	InputLength  *int     `json:"input_length"`
	OutputLength *int     `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
}

func parseMooncake(line []byte, exp *blockExpander, o *TraceOptions) (Request, error) {
	var m mooncakeLine
	if err := decodeStrict(line, &m, false); err != nil {
		return Request{}, err
	}
	switch {
	case m.Timestamp == nil:
		return Request{}, errors.New(`missing "timestamp"`)
	case m.InputLength == nil:
		return Request{}, errors.New(`missing "input_length"`)
	case m.OutputLength == nil:
		return Request{}, errors.New(`missing "output_length"`)
	case *m.OutputLength < 0:
		return Request{}, fmt.Errorf("output length %d must be >= 0", *m.OutputLength)
	}
	at, err := msDuration(*m.Timestamp, "timestamp")
	if err != nil {
		return Request{}, err
	}
	if err := checkBlocks(*m.InputLength, len(m.HashIDs), exp.size, o.MaxPromptTokens); err != nil {
		return Request{}, err
	}
	return Request{Arrival: at, Tokens: exp.expand(m.HashIDs, *m.InputLength), OutputTokens: *m.OutputLength}, nil
}

// decodeStrict decodes exactly one JSON value from line into v, optionally
// rejecting unknown fields.
func decodeStrict(line []byte, v any, disallowUnknown bool) error {
	dec := json.NewDecoder(bytes.NewReader(line))
	if disallowUnknown {
		dec.DisallowUnknownFields()
	}
	if err := dec.Decode(v); err != nil {
		return err
	}
	if _, err := dec.Token(); err != io.EOF {
		return errors.New("trailing data after the JSON object")
	}
	return nil
}

type jsonlLine struct {
	TimestampMS  *float64  `json:"timestamp_ms"`
	Session      string    `json:"session"`
	Group        string    `json:"group"`
	OutputTokens *int      `json:"output_tokens"`
	Tokens       *[]uint32 `json:"tokens"`
	Text         *string   `json:"text"`
	Blocks       *[]uint64 `json:"blocks"`
	InputLength  *int      `json:"input_length"`
}

func parseJSONL(line []byte, exp *blockExpander, o *TraceOptions) (Request, error) {
	var m jsonlLine
	if err := decodeStrict(line, &m, true); err != nil {
		return Request{}, err
	}
	if m.TimestampMS == nil {
		return Request{}, errors.New(`missing "timestamp_ms"`)
	}
	at, err := msDuration(*m.TimestampMS, "timestamp_ms")
	if err != nil {
		return Request{}, err
	}
	if m.OutputTokens == nil {
		return Request{}, errors.New(`missing "output_tokens"`)
	}
	if *m.OutputTokens < 0 {
		return Request{}, fmt.Errorf("output_tokens %d must be >= 0", *m.OutputTokens)
	}
	given := 0
	for _, ok := range []bool{m.Tokens != nil, m.Text != nil, m.Blocks != nil} {
		if ok {
			given++
		}
	}
	if given != 1 {
		return Request{}, errors.New(`want exactly one of "tokens", "text", "blocks"`)
	}
	if m.InputLength != nil && m.Blocks == nil {
		return Request{}, errors.New(`"input_length" is only allowed with "blocks"`)
	}
	req := Request{Arrival: at, OutputTokens: *m.OutputTokens, Session: m.Session, Group: m.Group}
	switch {
	case m.Tokens != nil:
		req.Tokens = *m.Tokens
	case m.Text != nil:
		req.Tokens = WordTokens(*m.Text)
	default:
		ids := *m.Blocks
		n := len(ids) * exp.size
		if m.InputLength != nil {
			n = *m.InputLength
		}
		if err := checkBlocks(n, len(ids), exp.size, o.MaxPromptTokens); err != nil {
			return Request{}, err
		}
		req.Tokens = exp.expand(ids, n)
	}
	if len(req.Tokens) == 0 {
		return Request{}, errors.New("empty prompt")
	}
	if len(req.Tokens) > o.MaxPromptTokens {
		return Request{}, fmt.Errorf("prompt of %d tokens exceeds the limit of %d", len(req.Tokens), o.MaxPromptTokens)
	}
	return req, nil
}

// azureTimeLayout parses the Azure trace's timestamps; Go accepts the 7
// fractional digits after the seconds without them in the layout.
const azureTimeLayout = "2006-01-02 15:04:05"

type azureReader struct {
	opts   *TraceOptions
	ts     *tokenSource
	sel    *rand.Rand
	lines  int
	system [][]uint32
}

func (a *azureReader) parse(line []byte) (Request, error) {
	a.lines++
	f := strings.Split(string(line), ",")
	if a.lines == 1 && len(f) > 0 && strings.EqualFold(strings.TrimSpace(f[0]), "TIMESTAMP") {
		return Request{}, nil // the header: no tokens, so not a request
	}
	if len(f) != 3 {
		return Request{}, fmt.Errorf("want 3 comma-separated fields TIMESTAMP,ContextTokens,GeneratedTokens, got %d", len(f))
	}
	t, err := time.Parse(azureTimeLayout, strings.TrimSpace(f[0]))
	if err != nil {
		return Request{}, fmt.Errorf("bad TIMESTAMP %q: want like 2023-11-16 18:17:03.9799600", f[0])
	}
	// Arrivals are nanoseconds since 1970 (UnixNano is undefined outside
	// 1678..2262), and non-negative so that their differences fit too.
	if t.Before(time.Unix(0, 0)) || t.After(time.Unix(0, math.MaxInt64)) {
		return Request{}, fmt.Errorf("TIMESTAMP %q is out of range: want a time from 1970 to 2262", strings.TrimSpace(f[0]))
	}
	n, err := strconv.Atoi(strings.TrimSpace(f[1]))
	if err != nil || n < 1 {
		return Request{}, fmt.Errorf("bad ContextTokens %q: want an integer >= 1", f[1])
	}
	if n > a.opts.MaxPromptTokens {
		return Request{}, fmt.Errorf("ContextTokens %d exceeds the limit of %d", n, a.opts.MaxPromptTokens)
	}
	out, err := strconv.Atoi(strings.TrimSpace(f[2]))
	if err != nil || out < 0 {
		return Request{}, fmt.Errorf("bad GeneratedTokens %q: want an integer >= 0", f[2])
	}
	req := Request{Arrival: time.Duration(t.UnixNano()), OutputTokens: out}
	shared := min(a.opts.SharedPrefix, n)
	if a.opts.timesOnly {
		req.Tokens = []uint32{}
	} else if shared > 0 {
		if a.system == nil {
			a.system = make([][]uint32, a.opts.SharedGroups)
		}
		g := a.sel.IntN(a.opts.SharedGroups)
		if a.system[g] == nil {
			a.system[g] = a.ts.tokens(a.opts.SharedPrefix)
		}
		req.Group = "system-" + strconv.Itoa(g)
		req.Tokens = concat(a.ts, a.system[g][:shared], n-shared)
	} else {
		req.Tokens = a.ts.tokens(n)
	}
	return req, nil
}
