package workload

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func readFile(t *testing.T, name, format string, opts TraceOptions) []Request {
	t.Helper()
	fh, err := openTrace(name)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	reqs, bad, err := ReadTrace(fh, format, opts)
	if err != nil || len(bad) > 0 {
		t.Fatalf("ReadTrace(%s): %v, %d bad lines", name, err, len(bad))
	}
	checkTrace(t, reqs, opts)
	return reqs
}

// checkTrace checks the invariants every successful read keeps.
func checkTrace(t *testing.T, reqs []Request, opts TraceOptions) {
	t.Helper()
	opts.defaults()
	for i, r := range reqs {
		if r.ID != i || len(r.Tokens) == 0 || len(r.Tokens) > opts.MaxPromptTokens || r.OutputTokens < 0 || r.Arrival < 0 {
			t.Fatalf("request %d: ID %d, %d tokens, %d out, at %v", i, r.ID, len(r.Tokens), r.OutputTokens, r.Arrival)
		}
		if i > 0 && r.Arrival < reqs[i-1].Arrival {
			t.Fatalf("request %d arrives before request %d", i, i-1)
		}
	}
	if len(reqs) > 0 && reqs[0].Arrival != 0 {
		t.Fatalf("first arrival %v, want 0", reqs[0].Arrival)
	}
}

func TestReadMooncake(t *testing.T) {
	reqs := readFile(t, "testdata/mooncake_head50.jsonl", FormatMooncake, TraceOptions{})
	if len(reqs) != 50 {
		t.Fatalf("%d requests, want 50", len(reqs))
	}
	// Line 1: timestamp 0, 40160 tokens over hash ids 0..78, output 6.
	if r := reqs[0]; len(r.Tokens) != 40160 || r.OutputTokens != 6 || r.Tokens[512] != BlockToken(1, 0, 0) {
		t.Fatalf("request 0: %d tokens, %d out", len(r.Tokens), r.OutputTokens)
	}
	// Shared prefixes follow the hash ids exactly.
	fh, _ := os.Open("testdata/mooncake_head50.jsonl")
	defer fh.Close()
	var lines []mooncakeLine
	sc := bufio.NewScanner(fh)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var m mooncakeLine
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, m)
	}
	for i := 0; i < len(lines); i++ {
		for j := i + 1; j < len(lines); j++ {
			a, b := lines[i], lines[j]
			k := 0
			for k < min(len(a.HashIDs), len(b.HashIDs)) && a.HashIDs[k] == b.HashIDs[k] {
				k++
			}
			// Equal timestamps keep file order, so line i is request i here
			// when timestamps are sorted (they are in this trace).
			got := lcp(reqs[i].Tokens, reqs[j].Tokens)
			lo, hi := min(k*512, *a.InputLength, *b.InputLength), min((k+1)*512, *a.InputLength, *b.InputLength)
			if k < min(len(a.HashIDs), len(b.HashIDs)) {
				hi = min(k*512+1, hi) // different next id: at most a chance token
			}
			if got < lo || got > hi {
				t.Fatalf("lines %d,%d share %d hash ids but %d tokens", i+1, j+1, k, got)
			}
		}
	}
}

// TestMooncakeBlockHitRatio: Analyze on the whole Mooncake synthetic trace at
// 512-token blocks agrees with an independent count over the hash ids, and
// both give the trace's published 0.640.
func TestMooncakeBlockHitRatio(t *testing.T) {
	const name = "testdata/mooncake_synthetic_trace.jsonl.gz"
	reqs := readFile(t, name, FormatMooncake, TraceOptions{})
	if len(reqs) != 3993 {
		t.Fatalf("%d requests, want 3993", len(reqs))
	}
	st := analyze(t, reqs, 512)

	// Independent count: a block is a hit when the run of hash ids through it
	// is a leading run some earlier request had.
	fh, err := os.Open(name)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	zr, err := gzip.NewReader(fh)
	if err != nil {
		t.Fatal(err)
	}
	seen := make(map[string]bool)
	hits, total := 0, 0
	sc := bufio.NewScanner(zr)
	sc.Buffer(nil, 1<<22)
	for sc.Scan() {
		var m struct {
			HashIDs []int `json:"hash_ids"`
		}
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatal(err)
		}
		var key strings.Builder
		prefixHit := true
		for _, id := range m.HashIDs {
			fmt.Fprintf(&key, "%d,", id)
			k := key.String()
			if prefixHit && seen[k] {
				hits++
			} else {
				prefixHit = false
			}
			seen[k] = true
			total++
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	want := float64(hits) / float64(total)
	if st.Blocks != total || st.BlockHitRatio != want {
		t.Fatalf("Analyze: %d blocks, hit ratio %v; independent count: %d blocks, %v", st.Blocks, st.BlockHitRatio, total, want)
	}
	if got := fmt.Sprintf("%.3f", st.BlockHitRatio); got != "0.640" || st.UniqueBlocks != 43924 {
		t.Fatalf("block hit ratio %s, %d unique blocks; want 0.640 and 43924 (Mooncake FAST'25)", got, st.UniqueBlocks)
	}
	t.Logf("mooncake: hit ratio %.4f, shared-token ratio mean %.4f weighted %.4f", st.BlockHitRatio, st.SharedTokenRatio, st.SharedTokenRatioWeighted)
}

func TestReadAzure(t *testing.T) {
	reqs := readFile(t, "testdata/azure_code_head100.csv", FormatAzure, TraceOptions{Seed: 3})
	if len(reqs) != 100 {
		t.Fatalf("%d requests, want 100", len(reqs))
	}
	// 18:17:03.9799600,4808,10 then 18:17:04.0319600,3180,8.
	if r := reqs[0]; len(r.Tokens) != 4808 || r.OutputTokens != 10 || r.Arrival != 0 {
		t.Fatalf("row 1: %d tokens, %d out, at %v", len(r.Tokens), r.OutputTokens, r.Arrival)
	}
	if r := reqs[1]; len(r.Tokens) != 3180 || r.OutputTokens != 8 || r.Arrival != 52*time.Millisecond {
		t.Fatalf("row 2: %d tokens, %d out, at %v", len(r.Tokens), r.OutputTokens, r.Arrival)
	}
	if st := analyze(t, reqs, 16); st.SharedTokenRatio != 0 {
		t.Fatalf("no sharing model, shared-token ratio %v", st.SharedTokenRatio)
	}
	// With a shared system prompt of 1000 tokens in 2 groups.
	reqs = readFile(t, "testdata/azure_code_head100.csv", FormatAzure, TraceOptions{Seed: 3, SharedPrefix: 1000, SharedGroups: 2})
	groups := make(map[string][]uint32)
	for _, r := range reqs {
		if g, ok := groups[r.Group]; ok {
			if l := lcp(g, r.Tokens); l < min(1000, len(r.Tokens), len(g)) {
				t.Fatalf("%s: share %d tokens", r.Group, l)
			}
		} else {
			groups[r.Group] = r.Tokens
		}
	}
	if len(groups) != 2 {
		t.Fatalf("%d groups, want 2", len(groups))
	}
}

func TestReadJSONL(t *testing.T) {
	reqs := readFile(t, "testdata/small.jsonl", FormatJSONL, TraceOptions{})
	if len(reqs) != 5 {
		t.Fatalf("%d requests, want 5", len(reqs))
	}
	// Sorted by arrival: s1@0, tokens@100, s1@250.5, blocks@300, blocks@400.
	if reqs[1].Arrival != 100*time.Millisecond || !slices.Equal(reqs[1].Tokens, []uint32{101, 102, 103, 104}) {
		t.Fatalf("request 1: %v at %v", reqs[1].Tokens, reqs[1].Arrival)
	}
	a, b := reqs[0], reqs[2]
	if a.Session != "s1" || b.Session != "s1" || b.Arrival != 250500*time.Microsecond {
		t.Fatalf("session requests: %q %q at %v", a.Session, b.Session, b.Arrival)
	}
	if want := WordTokens("You are a helpful assistant. What is the capital of France?"); !slices.Equal(a.Tokens, want) || lcp(a.Tokens, b.Tokens) != len(want) {
		t.Fatalf("text prompts: %v vs %v", a.Tokens, b.Tokens)
	}
	c, d := reqs[3], reqs[4]
	if len(c.Tokens) != 700 || len(d.Tokens) != 1536 || lcp(c.Tokens, d.Tokens) != 700 || c.Group != "doc-7" {
		t.Fatalf("block prompts: %d and %d tokens sharing %d", len(c.Tokens), len(d.Tokens), lcp(c.Tokens, d.Tokens))
	}
}

func TestWordTokens(t *testing.T) {
	a := WordTokens("  hello   world\tagain\n")
	b := WordTokens("hello world")
	if len(a) != 3 || !slices.Equal(a[:2], b) || a[0] == a[1] {
		t.Fatalf("WordTokens: %v, %v", a, b)
	}
}

// TestMalformed: a malformed line is reported with its line number; skipped
// and collected with SkipMalformed, fatal without.
func TestMalformed(t *testing.T) {
	tests := []struct {
		format, trace, want string
	}{
		{FormatMooncake, `{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}
{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}

{"timestamp": 7, "input_length": 900, "output_length": 1, "hash_ids": [2]}
{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": [3]}
`, "input length 900 does not fit 1 blocks of 512 tokens"},
		{FormatAzure, `TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,48,10
2023-11-16 18:17:04.0319600,31,8
2023-11-16 18:17:05,abc,8
2023-11-16 18:17:06,12,8
`, `bad ContextTokens "abc"`},
		{FormatJSONL, `{"timestamp_ms": 0, "output_tokens": 1, "tokens": [200, 201]}
{"timestamp_ms": 1, "output_tokens": 1, "text": "hi there"}

{"timestamp_ms": 2, "output_tokens": 1, "prompt": "typo"}
{"timestamp_ms": 3, "output_tokens": 1, "blocks": [4]}
`, `unknown field "prompt"`},
	}
	for _, tt := range tests {
		_, bad, err := ReadTrace(strings.NewReader(tt.trace), tt.format, TraceOptions{})
		var le *LineError
		if !errors.As(err, &le) || le.Line != 4 || !errors.Is(err, ErrMalformed) || len(bad) != 1 {
			t.Fatalf("%s fatal: err %v", tt.format, err)
		}
		if msg := err.Error(); !strings.HasPrefix(msg, "workload: trace line 4: ") || !strings.Contains(msg, tt.want) {
			t.Errorf("%s: error %q, want line 4 and %q", tt.format, msg, tt.want)
		}
		reqs, bad, err := ReadTrace(strings.NewReader(tt.trace), tt.format, TraceOptions{SkipMalformed: true})
		if err != nil || len(reqs) != 3 || len(bad) != 1 || bad[0].Line != 4 {
			t.Fatalf("%s skip: %d requests, bad %v, err %v", tt.format, len(reqs), bad, err)
		}
	}
	if _, _, err := ReadTrace(strings.NewReader(""), "csv", TraceOptions{}); !errors.Is(err, ErrUnknownFormat) {
		t.Errorf("unknown format: %v", err)
	}
}

func TestJSONLRules(t *testing.T) {
	bad := map[string]string{
		`{"timestamp_ms": 0, "output_tokens": 1}`:                                     "exactly one of",
		`{"timestamp_ms": 0, "output_tokens": 1, "text": "a", "tokens": [200]}`:       "exactly one of",
		`{"timestamp_ms": 0, "output_tokens": 1, "tokens": []}`:                       "empty prompt",
		`{"timestamp_ms": -1, "output_tokens": 1, "tokens": [200]}`:                   "timestamp_ms",
		`{"output_tokens": 1, "tokens": [200]}`:                                       "missing \"timestamp_ms\"",
		`{"timestamp_ms": 0, "tokens": [200]}`:                                        "missing \"output_tokens\"",
		`{"timestamp_ms": 0, "output_tokens": 1, "tokens": [-3]}`:                     "json",
		`{"timestamp_ms": 0, "output_tokens": 1, "tokens": [200], "input_length": 1}`: "only allowed with",
		`{"timestamp_ms": 0, "output_tokens": 1, "tokens": [200]} {}`:                 "trailing data",
		`{"timestamp_ms": 0, "output_tokens": 1, "blocks": [1], "input_length": 600}`: "does not fit",
	}
	for line, want := range bad {
		_, _, err := ReadTrace(strings.NewReader(line), FormatJSONL, TraceOptions{})
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "trace line 1") {
			t.Errorf("%s: error %v, want %q", line, err, want)
		}
	}
}

func TestFlagsLoad(t *testing.T) {
	f := DefaultFlags()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	f.AddFlags(fs)
	err := fs.Parse([]string{"--workload", "shared-prefix", "--requests", "200", "--groups", "3", "--system-prompt-tokens", "64",
		"--question-tokens", "16", "--arrival", "ramp", "--ramp", "5:10s,50:10s"})
	if err != nil {
		t.Fatal(err)
	}
	reqs, _, err := f.Load()
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 200 || len(reqs[0].Tokens) != 80 || reqs[len(reqs)-1].Arrival == 0 {
		t.Fatalf("%d requests of %d tokens, last at %v", len(reqs), len(reqs[0].Tokens), reqs[len(reqs)-1].Arrival)
	}

	f = DefaultFlags()
	fs = pflag.NewFlagSet("test", pflag.ContinueOnError)
	f.AddFlags(fs)
	if err := fs.Parse([]string{"--requests", "150", "--arrival", "azure", "--arrival-trace", "testdata/azure_code_head100.csv", "--time-scale", "2"}); err != nil {
		t.Fatal(err)
	}
	reqs, _, err = f.Load()
	if err != nil {
		t.Fatal(err)
	}
	if reqs[1].Arrival != 26*time.Millisecond {
		t.Fatalf("azure arrivals at half time: second at %v, want 26ms", reqs[1].Arrival)
	}

	f = DefaultFlags()
	f.Trace = "testdata/mooncake_head50.jsonl"
	reqs, _, err = f.Load()
	if err != nil || len(reqs) != 50 {
		t.Fatalf("trace via flags: %d requests, %v", len(reqs), err)
	}
	for _, c := range []struct{ name, head, want string }{
		{"x.csv.gz", "", FormatAzure},
		{"x.txt", "TIMESTAMP,ContextTokens", FormatAzure},
		{"x.jsonl", `{"timestamp": 0, "hash_ids": [1]}`, FormatMooncake},
		{"x.jsonl", `{"timestamp_ms": 0}`, FormatJSONL},
	} {
		if got := DetectTraceFormat(c.name, []byte(c.head)); got != c.want {
			t.Errorf("DetectTraceFormat(%s, %q) = %s, want %s", c.name, c.head, got, c.want)
		}
	}
}

func fuzzReader(f *testing.F, format string) {
	f.Fuzz(func(t *testing.T, data []byte) {
		opts := TraceOptions{SkipMalformed: true, MaxPromptTokens: 1 << 16, SharedPrefix: 8, SharedGroups: 2, BlockTokens: 16}
		reqs, bad, err := ReadTrace(strings.NewReader(string(data)), format, opts)
		if err != nil {
			t.Fatalf("SkipMalformed read failed: %v", err)
		}
		for _, le := range bad {
			if le.Line < 1 || !strings.HasPrefix(le.Error(), "workload: trace line ") {
				t.Fatalf("bad line error %v", &le)
			}
		}
		checkTrace(t, reqs, opts)
		opts.SkipMalformed = false
		strict, _, err := ReadTrace(strings.NewReader(string(data)), format, opts)
		if (err == nil) != (len(bad) == 0) || (err == nil && len(strict) != len(reqs)) {
			t.Fatalf("strict read: %v with %d bad lines", err, len(bad))
		}
	})
}

func FuzzReadTraceMooncake(f *testing.F) { fuzzReader(f, FormatMooncake) }
func FuzzReadTraceAzure(f *testing.F)    { fuzzReader(f, FormatAzure) }
func FuzzReadTraceJSONL(f *testing.F)    { fuzzReader(f, FormatJSONL) }
