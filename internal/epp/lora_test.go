package epp

import (
	"context"
	"math"
	"testing"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestPickAdapter: a request whose model is a LoRA adapter reaches the
// policy as that adapter's (e2 prices its load on a replica with adapter
// slots that lacks it); the base model's does not.
func TestPickAdapter(t *testing.T) {
	p := newTestPicker(t, Config{LoRAAdapters: []string{"sql"}}, 1)
	p.mu.Lock()
	err := p.rt.SetAdapters(p.pool.ByName("r0").ID, nil, 2)
	p.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		model   string
		loading bool
	}{{"sql", true}, {"m", false}} {
		body := []byte(`{"model":"` + tt.model + `","prompt":"hello there","max_tokens":8}`)
		pk, err := p.Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: body, Explain: true})
		if err != nil {
			t.Fatal(err)
		}
		p.Finished(pk.ID, 1, -1, true)
		c := pk.Decision.Candidates
		if len(c) != 1 || c[0].Terms == nil || (c[0].Terms[policy.E2AdapterLoad] > 0) != tt.loading {
			t.Errorf("model %s: candidates %+v, want adapter_load > 0: %v", tt.model, c, tt.loading)
		}
	}
}

// TestPickAdapterBytes: --lora-adapter-bytes prices a load at the adapter's
// size (bytes over the profile's host-to-device bandwidth plus its fixed
// cost), not at the fixed cost alone.
func TestPickAdapterBytes(t *testing.T) {
	for _, n := range []int64{0, 84 << 20} {
		p := newTestPicker(t, Config{LoRAAdapters: []string{"sql"}, LoRAAdapterBytes: n}, 1)
		p.mu.Lock()
		err := p.rt.SetAdapters(p.pool.ByName("r0").ID, nil, 2)
		prof := p.pool.Profile
		p.mu.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		body := []byte(`{"model":"sql","prompt":"hello there","max_tokens":8}`)
		pk, err := p.Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: body, Explain: true})
		if err != nil {
			t.Fatal(err)
		}
		p.Finished(pk.ID, 1, -1, true)
		want := costmodel.AdapterLoadOf(prof).Time(n).Seconds()
		if c := pk.Decision.Candidates; len(c) != 1 || c[0].Terms == nil || math.Abs(c[0].Terms[policy.E2AdapterLoad]-want) > 1e-12 {
			t.Errorf("%d bytes: candidates %+v, want adapter_load %v", n, c, want)
		}
	}
	if _, err := NewPicker(Config{Policy: "e2", LoRAAdapterBytes: -1}); err == nil {
		t.Error("negative adapter bytes accepted")
	}
}
