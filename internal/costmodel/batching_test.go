package costmodel

import (
	"errors"
	"strings"
	"testing"
	"time"
)

const gib = 1 << 30

// vLLM's rule (EngineArgs._set_default_args): ≥ 70 GiB per device and no
// "a100" in the lower-cased name gives the large defaults.
func TestVLLMBatching(t *testing.T) {
	large := Batching{MaxBatchedTokens: 8192, MaxSeqs: 1024}
	small := Batching{MaxBatchedTokens: 2048, MaxSeqs: 256}
	tests := []struct {
		name string
		gpu  GPU
		want Batching
	}{
		{"H100 80GB", GPU{Count: 1, MemoryBytes: 80 * gib, Name: "NVIDIA H100 80GB HBM3"}, large},
		{"2×H100: memory is per GPU", GPU{Count: 2, MemoryBytes: 80 * gib, Name: "NVIDIA H100 80GB HBM3"}, large},
		{"H200", GPU{Count: 1, MemoryBytes: 141e9, Name: "NVIDIA H200"}, large},
		{"MI300X", GPU{Count: 1, MemoryBytes: 192 * gib, Name: "AMD Instinct MI300X"}, large},
		{"A100 80GB by name", GPU{Count: 1, MemoryBytes: 80 * gib, Name: "NVIDIA A100-SXM4-80GB"}, small},
		{"A100 80GB PCIe", GPU{Count: 1, MemoryBytes: 80 * gib, Name: "NVIDIA A100 80GB PCIe"}, small},
		{"A100, lower case", GPU{Count: 1, MemoryBytes: 80 * gib, Name: "nvidia a100-sxm4-80gb"}, small},
		{"A100, mixed case", GPU{Count: 1, MemoryBytes: 80 * gib, Name: "Nvidia a100 (custom)"}, small},
		{"A100 40GB", GPU{Count: 1, MemoryBytes: 40 * gib, Name: "NVIDIA A100-SXM4-40GB"}, small},
		{"A6000 48GB", GPU{Count: 1, MemoryBytes: 48 * gib, Name: "NVIDIA RTX A6000"}, small},
		{"2×A6000: memory is per GPU", GPU{Count: 2, MemoryBytes: 48 * gib, Name: "NVIDIA RTX A6000"}, small},
		{"exactly 70 GiB", GPU{Count: 1, MemoryBytes: 70 * gib}, large},
		{"just under 70 GiB", GPU{Count: 1, MemoryBytes: 70*gib - 1}, small},
		{"no name, 80 GiB", GPU{Count: 1, MemoryBytes: 80 * gib}, large},
		{"memory unknown", GPU{}, small},
	}
	for _, tt := range tests {
		if got := VLLMBatching(tt.gpu); got != tt.want {
			t.Errorf("%s: VLLMBatching(%+v) = %+v, want %+v", tt.name, tt.gpu, got, tt.want)
		}
	}
	if got, want := VLLMBatching(GPU{}), DefaultBatching; got != want {
		t.Errorf("VLLMBatching(unknown GPU) = %+v, want DefaultBatching %+v", got, want)
	}
}

func TestBuiltinBatching(t *testing.T) {
	tests := []struct {
		profile string
		want    Batching
	}{
		{Mistral7BA6000, Batching{512, 256}},     // Preble's chunk_prefill_budget
		{Llama3_70BH100x2, Batching{8192, 1024}}, // given: vLLM on H100
		{Qwen3_32BH100x2, Batching{8192, 1024}},  // the rule, H100
		{Llama31_8BH100, Batching{8192, 1024}},   // the rule, H100
		{Llama31_8BA100, Batching{2048, 256}},    // the rule, A100 by name
		{LlamaCppTinyCPU, Batching{2048, 2}},     // n_batch; -np 2
	}
	if len(tests) != len(Names()) {
		t.Errorf("%d built-ins tested, %d exist (%v)", len(tests), len(Names()), Names())
	}
	for _, tt := range tests {
		p := mustLookup(t, tt.profile)
		if _, ok := p.(Batcher); !ok {
			t.Errorf("%s: %T does not implement Batcher", tt.profile, p)
		}
		if got := BatchingOf(p); got != tt.want {
			t.Errorf("%s: BatchingOf = %+v, want %+v", tt.profile, got, tt.want)
		}
	}
}

// fakeProfile implements Profile but not Batcher.
type fakeProfile struct{}

func (fakeProfile) Name() string                   { return "fake" }
func (fakeProfile) Prefill(n, s int) time.Duration { return time.Duration(max(n, 0)) }
func (fakeProfile) Iteration(b Batch) time.Duration {
	return time.Duration(max(b.DecodeSeqs, 0))
}
func (fakeProfile) KVCapacity() int { return 1 }

func TestBatchingOfNonBatcher(t *testing.T) {
	if got, want := BatchingOf(fakeProfile{}), DefaultBatching; got != want {
		t.Errorf("BatchingOf(fake) = %+v, want DefaultBatching %+v", got, want)
	}
}

// A YAML profile without batching gets its kind's default; with it, its own.
func TestParseBatching(t *testing.T) {
	qwen := readTestdata(t, "qwen3-32b-h100x2.yaml")
	noName := strings.Replace(qwen, "  name: NVIDIA H100 80GB HBM3", "", 1)
	a100 := strings.Replace(qwen, "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", 1)
	a6000 := strings.Replace(noName, "memory_bytes: 85899345920", "memory_bytes: 51539607552", 1) // 48 GiB
	a6000 = strings.Replace(a6000, "memory_fraction: 0.85036", "memory_fraction: 0.95", 1)
	const given = "batching: {max_num_batched_tokens: 4096, max_num_seqs: 128}\n"
	tests := []struct {
		name string
		yaml string
		want Batching
	}{
		{"linear without", goodLinear, DefaultBatching},
		{"linear with", goodLinear + given, Batching{4096, 128}},
		{"preble-mistral without", "name: m\nkind: preble-mistral\nkv_capacity_tokens: 10\n", DefaultBatching},
		{"preble-mistral with", "name: m\nkind: preble-mistral\nkv_capacity_tokens: 10\n" + given, Batching{4096, 128}},
		{"roofline H100 by name", qwen, Batching{8192, 1024}},
		{"roofline 80 GiB, no name", noName, Batching{8192, 1024}},
		{"roofline A100 by name", a100, Batching{2048, 256}},
		{"roofline 48 GiB", a6000, Batching{2048, 256}},
		{"roofline with", a100 + given, Batching{4096, 128}},
		{"equal budget and seqs", goodLinear + "batching: {max_num_batched_tokens: 64, max_num_seqs: 64}\n", Batching{64, 64}},
	}
	for _, tt := range tests {
		p, err := Parse([]byte(tt.yaml))
		if err != nil {
			t.Fatalf("%s: Parse: %v", tt.name, err)
		}
		if got := BatchingOf(p); got != tt.want {
			t.Errorf("%s: BatchingOf = %+v, want %+v", tt.name, got, tt.want)
		}
	}
}

func TestValidateBatching(t *testing.T) {
	tests := []struct {
		name string
		b    Batching
		want string // the error after the profile's name; "" for none
	}{
		{"valid", Batching{2048, 256}, ""},
		{"equal", Batching{256, 256}, ""},
		{"zero tokens", Batching{0, 256}, "batching.max_num_batched_tokens: must be > 0, got 0"},
		{"negative tokens", Batching{-1, 256}, "batching.max_num_batched_tokens: must be > 0, got -1"},
		{"zero seqs", Batching{2048, 0}, "batching.max_num_seqs: must be > 0, got 0"},
		{"both zero", Batching{}, "batching.max_num_batched_tokens: must be > 0, got 0"},
		{"tokens below seqs", Batching{128, 256}, "batching.max_num_batched_tokens: must be >= batching.max_num_seqs (256), as vLLM requires, got 128"},
	}
	for _, kind := range []string{Mistral7BA6000, LlamaCppTinyCPU, Qwen3_32BH100x2} {
		for _, tt := range tests {
			c, err := BuiltinConfig(kind)
			if err != nil {
				t.Fatal(err)
			}
			b := tt.b
			c.Batching = &b
			err = c.Validate()
			if tt.want == "" {
				if err != nil {
					t.Errorf("%s %s: Validate = %v, want nil", kind, tt.name, err)
				}
				continue
			}
			want := `costmodel: invalid profile "` + kind + `": ` + tt.want
			if err == nil || err.Error() != want {
				t.Errorf("%s %s: Validate = %v, want %s", kind, tt.name, err, want)
			}
			if !errors.Is(err, ErrInvalidProfile) {
				t.Errorf("%s %s: %v does not wrap ErrInvalidProfile", kind, tt.name, err)
			}
		}
	}
}
