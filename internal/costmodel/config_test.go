package costmodel

import (
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func readTestdata(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The roofline examples give the same GPU and batching fields as the
// built-ins' configs (the probes below check the times).
func TestRooflineExamplesConfig(t *testing.T) {
	for _, name := range []string{Qwen3_32BH100x2, Llama31_8BA100} {
		got, err := ParseConfig([]byte(readTestdata(t, name+".yaml")))
		if err != nil {
			t.Fatal(err)
		}
		want, err := BuiltinConfig(name)
		if err != nil {
			t.Fatal(err)
		}
		if *got.GPU != *want.GPU || *got.Model != *want.Model || *got.Assume != *want.Assume || got.Batching != nil || want.Batching != nil {
			t.Errorf("%s: testdata %+v %+v %+v %v, built-in %+v %+v %+v %v", name,
				*got.GPU, *got.Model, *got.Assume, got.Batching, *want.GPU, *want.Model, *want.Assume, want.Batching)
		}
	}
}

// The example files in testdata describe the built-in profiles exactly.
func TestLoadExamplesMatchBuiltins(t *testing.T) {
	probes := []Batch{
		{Prefill: []Chunk{{New: 1000, Seq: 3000}}},
		{Prefill: []Chunk{{New: 6000, Seq: 6000}}},
		{DecodeSeqs: 32, DecodeContext: 32 * 2048},
		{Prefill: []Chunk{{New: 512, Seq: 9000}}, DecodeSeqs: 7, DecodeContext: 7000},
	}
	for _, name := range []string{Qwen3_32BH100x2, Llama3_70BH100x2, Mistral7BA6000, LlamaCppTinyCPU, Llama31_8BA100} {
		got, err := Load(filepath.Join("testdata", name+".yaml"))
		if err != nil {
			t.Fatalf("Load(%s): %v", name, err)
		}
		want := mustLookup(t, name)
		if got.Name() != want.Name() || got.KVCapacity() != want.KVCapacity() {
			t.Errorf("%s: loaded %q with KV %d, built-in %q with KV %d", name, got.Name(), got.KVCapacity(), want.Name(), want.KVCapacity())
		}
		if g, w := BatchingOf(got), BatchingOf(want); g != w {
			t.Errorf("%s: loaded batching %+v, built-in %+v", name, g, w)
		}
		for _, b := range probes {
			if g, w := got.Iteration(b), want.Iteration(b); !within(g, w, 1e-4) {
				t.Errorf("%s: loaded Iteration(%+v) = %v, built-in %v", name, b, g, w)
			}
		}
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.yaml"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Load(missing) error = %v, want os.ErrNotExist", err)
	}
}

const goodLinear = `
name: my-fit
kind: linear
prefill_ms: {c0: 10, new: 0.1, seq: 0.001, new_seq: 1e-7}
decode_ms: {c0: 10, per_seq: 0.05, per_context_token: 1e-4}
kv_capacity_tokens: 100000
`

func TestParseGood(t *testing.T) {
	p, err := Parse([]byte(goodLinear))
	if err != nil {
		t.Fatal(err)
	}
	// 10 + 0.1·100 + 0.001·1000 + 1e-7·100·1000 = 21.01 ms.
	if got, want := p.Prefill(100, 1000), 21010000; int(got) != want {
		t.Errorf("Prefill(100, 1000) = %v, want %dns", got, want)
	}
	if p.Name() != "my-fit" || p.KVCapacity() != 100000 {
		t.Errorf("got %q / %d", p.Name(), p.KVCapacity())
	}
}

// Every bad input fails with an error naming the problem.
func TestParseBad(t *testing.T) {
	roofline := func(edit func(string) string) string {
		b, err := os.ReadFile(filepath.Join("testdata", "qwen3-32b-h100x2.yaml"))
		if err != nil {
			t.Fatal(err)
		}
		return edit(string(b))
	}
	replace := func(old, new string) func(string) string {
		return func(s string) string {
			if !strings.Contains(s, old) {
				t.Fatalf("example has no %q", old)
			}
			return strings.Replace(s, old, new, 1)
		}
	}
	tests := []struct {
		name    string
		yaml    string
		want    []string // substrings of the error
		invalid bool     // wraps ErrInvalidProfile
	}{
		{"invalid yaml", "name: [unclosed\n", []string{"parse profile"}, false},
		{"not a map", "- 1\n- 2\n", []string{"parse profile"}, false},
		{"empty", "", []string{"name", "missing"}, true},
		{"unknown field", goodLinear + "colour: blue\n", []string{`unknown field "colour"`}, false},
		{"unknown nested field", strings.Replace(goodLinear, "c0: 10, new:", "c0: 10, nwe: 1, new:", 1), []string{`unknown field "nwe"`}, false},
		{"duplicate field", goodLinear + "name: again\n", []string{"name", "already set"}, false},
		{"wrong type", strings.Replace(goodLinear, "100000", "lots", 1), []string{"kv_capacity_tokens"}, false},
		{"missing name", strings.Replace(goodLinear, "name: my-fit", "", 1), []string{"name: missing"}, true},
		{"missing kind", strings.Replace(goodLinear, "kind: linear", "", 1), []string{"kind: missing", "roofline"}, true},
		{"unknown kind", strings.Replace(goodLinear, "kind: linear", "kind: cubic", 1), []string{`unknown kind "cubic"`, "linear, preble-mistral, roofline"}, true},
		{"negative", strings.Replace(goodLinear, "new: 0.1", "new: -0.1", 1), []string{"prefill_ms.new", "must be >= 0, got -0.1"}, true},
		{"NaN", strings.Replace(goodLinear, "per_seq: 0.05", "per_seq: .nan", 1), []string{"decode_ms.per_seq", "NaN", "not a finite number"}, false},
		{"Inf", strings.Replace(goodLinear, "c0: 10, new", "c0: .inf, new", 1), []string{"prefill_ms.c0", "+Inf"}, false},
		{"zero capacity", strings.Replace(goodLinear, "100000", "0", 1), []string{"kv_capacity_tokens", "must be > 0, got 0"}, true},
		{"negative capacity", strings.Replace(goodLinear, "100000", "-5", 1), []string{"kv_capacity_tokens", "got -5"}, true},
		{"missing decode", strings.Replace(goodLinear, "decode_ms: {c0: 10, per_seq: 0.05, per_context_token: 1e-4}", "", 1), []string{"decode_ms: missing"}, true},
		{"all-zero fit", strings.Replace(goodLinear, "{c0: 10, new: 0.1, seq: 0.001, new_seq: 1e-7}", "{c0: 0, new: 0, seq: 0, new_seq: 0}", 1), []string{"prefill_ms: all coefficients are 0"}, true},
		{"field of another kind", goodLinear + "gpu: {count: 1}\n", []string{"gpu: only used by kind roofline, not linear"}, true},
		{"mistral without capacity", "name: m\nkind: preble-mistral\n", []string{"kv_capacity_tokens", "must be > 0"}, true},
		{"roofline with capacity", roofline(func(s string) string { return s + "kv_capacity_tokens: 5\n" }), []string{"kv_capacity_tokens: not used by kind roofline"}, true},
		{"roofline missing gpu", roofline(func(s string) string { return s[:strings.Index(s, "gpu:")] + s[strings.Index(s, "assume:"):] }), []string{"gpu: missing"}, true},
		{"roofline zero layers", roofline(replace("layers: 64", "layers: 0")), []string{"model.layers", "must be > 0, got 0"}, true},
		{"roofline negative peak", roofline(replace("peak_flops: 989.4e12", "peak_flops: -1")), []string{"gpu.peak_flops", "got -1"}, true},
		{"roofline NaN bandwidth", roofline(replace("hbm_bytes_per_s: 3.35e12", "hbm_bytes_per_s: .nan")), []string{"gpu.hbm_bytes_per_s", "not a finite number"}, false},
		{"roofline mfu above 1", roofline(replace("mfu: 0.55", "mfu: 1.5")), []string{"assume.mfu", "at most 1, got 1.5"}, true},
		{"roofline kv heads above heads", roofline(replace("kv_heads: 8", "kv_heads: 128")), []string{"model.kv_heads", "exceeds model.heads"}, true},
		{"roofline weights do not fit", roofline(replace("memory_fraction: 0.85036", "memory_fraction: 0.3")), []string{"assume.memory_fraction", "no room for KV cache"}, true},
		{"batching zero tokens", goodLinear + "batching: {max_num_batched_tokens: 0, max_num_seqs: 8}\n", []string{"batching.max_num_batched_tokens: must be > 0, got 0"}, true},
		{"batching empty", goodLinear + "batching: {}\n", []string{"batching.max_num_batched_tokens: must be > 0, got 0"}, true},
		{"batching missing seqs", goodLinear + "batching: {max_num_batched_tokens: 512}\n", []string{"batching.max_num_seqs: must be > 0, got 0"}, true},
		{"batching tokens below seqs", goodLinear + "batching: {max_num_batched_tokens: 64, max_num_seqs: 256}\n", []string{"batching.max_num_batched_tokens: must be >= batching.max_num_seqs (256)", "got 64"}, true},
		{"batching unknown field", goodLinear + "batching: {max_num_batched_tokens: 512, max_num_seqs: 8, chunked: true}\n", []string{`unknown field "chunked"`}, false},
		{"batching wrong type", goodLinear + "batching: {max_num_batched_tokens: 1.5, max_num_seqs: 8}\n", []string{"max_num_batched_tokens"}, false},
		{"batching on a roofline checked too", roofline(func(s string) string { return s + "batching: {max_num_batched_tokens: 8, max_num_seqs: 9}\n" }), []string{"batching.max_num_batched_tokens: must be >= batching.max_num_seqs (9), as vLLM requires, got 8"}, true},
		{"gpu name on a linear", goodLinear + "gpu: {name: x}\n", []string{"gpu: only used by kind roofline, not linear"}, true},
		{"roofline negative block", roofline(replace("kv_block_tokens: 16", "kv_block_tokens: -16")), []string{"assume.kv_block_tokens", "got -16"}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse([]byte(tt.yaml))
			if err == nil {
				t.Fatalf("Parse = %v, want an error", p.Name())
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			if got := errors.Is(err, ErrInvalidProfile); got != tt.invalid {
				t.Errorf("errors.Is(%q, ErrInvalidProfile) = %v, want %v", err, got, tt.invalid)
			}
		})
	}
}

func TestValidateBuiltins(t *testing.T) {
	for _, n := range Names() {
		c, err := BuiltinConfig(n)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", n, err)
		}
	}
	if _, err := BuiltinConfig("nope"); !errors.Is(err, ErrUnknownProfile) {
		t.Errorf("BuiltinConfig(nope) error = %v", err)
	}
}

// Validate rejects non-finite numbers set from Go too (YAML cannot carry
// them through JSON, so this is the only way they reach Validate).
func TestValidateNonFinite(t *testing.T) {
	c, _ := BuiltinConfig(Qwen3_32BH100x2)
	c.GPU.MemoryBytes = math.Inf(1)
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "gpu.memory_bytes: is infinite") {
		t.Errorf("Validate(Inf memory) = %v", err)
	}
	c, _ = BuiltinConfig(Qwen3_32BH100x2)
	c.Assume.OverheadMS = math.NaN()
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "assume.overhead_ms: is NaN") {
		t.Errorf("Validate(NaN overhead) = %v", err)
	}
	c, _ = BuiltinConfig(Qwen3_32BH100x2)
	c.Name = " padded"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "name: has leading or trailing space") {
		t.Errorf("Validate(padded name) = %v", err)
	}
}
