package engine

import (
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/kvevents"
)

// TestCacheSalt: the engine honours cache_salt as vLLM does: a salted
// prompt hits only its own salt's blocks, its blocks are keyed from the
// salted chain, and their BlockStored carries the salt in the first
// block's extra_keys (and the adapter's name on every block) so that a
// router keys them as it keys the request; an empty salt is refused with
// vLLM's message.
func TestCacheSalt(t *testing.T) {
	rec := &kvRecorder{}
	_, srv := start(t, func(c *Config) {
		c.KVPublisher = rec
		c.LoRAModules = []string{"sql-lora"}
	})
	url := srv.URL + "/v1/completions"
	prompt := words("salted", 64) // 4 blocks of 16, the last recomputed
	tests := []struct {
		name, model, salt string
		want              int
	}{
		{"a cold", "", "a", 0},
		{"b cold", "", "b", 0},
		{"unsalted cold", "", "", 0},
		{"a again", "", "a", 48},
		{"adapter with a", "sql-lora", "a", 0},
		{"adapter with a again", "sql-lora", "a", 48},
	}
	for _, tt := range tests {
		body := map[string]any{"prompt": prompt, "max_tokens": 2}
		if tt.salt != "" {
			body["cache_salt"] = tt.salt
		}
		if tt.model != "" {
			body["model"] = tt.model
		}
		r := complete(t, url, body)
		if got := r.Usage.PromptTokensDetails.CachedTokens; got != tt.want {
			t.Errorf("%s: cached_tokens %d, want %d", tt.name, got, tt.want)
		}
	}
	ids := WordTokenizer{}.Encode(prompt)
	want := map[string]bool{}
	for _, c := range [][2]string{{"", "a"}, {"", "b"}, {"", ""}, {"sql-lora", "a"}} {
		want[c[0]+"|"+c[1]] = true
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	ix := kvevents.NewIndex()
	if _, err := ix.Apply("e", rec.events, nil); err != nil {
		t.Fatal(err)
	}
	for _, ev := range rec.events {
		bs, ok := ev.(kvevents.BlockStored)
		if !ok || bs.HasParent {
			continue
		}
		salt, ok := bs.Salt()
		adapter := ""
		if bs.LoRAName != nil {
			adapter = *bs.LoRAName
		}
		chain := blocks.SeededKeys(nil, blocks.ChainSeed(adapter, salt), ids, 16)
		if !ok || !slices.Equal(keysOf(bs.BlockHashes), chain[:len(bs.BlockHashes)]) {
			t.Errorf("BlockStored (adapter %q, salt %q, %v): hashes are not the salted chain", adapter, salt, ok)
		}
		if (salt == "" && adapter == "") != (bs.ExtraKeys == nil) {
			t.Errorf("BlockStored (adapter %q, salt %q): extra_keys present %v", adapter, salt, bs.ExtraKeys != nil)
		}
		delete(want, adapter+"|"+salt)
	}
	if len(want) != 0 {
		t.Errorf("no BlockStored for %v", want)
	}
	// The router's view of the stream holds each salt's chain apart.
	for _, c := range [][2]string{{"", "a"}, {"", "b"}, {"", ""}, {"sql-lora", "a"}} {
		k := blocks.SeededKeys(nil, blocks.ChainSeed(c[0], c[1]), ids, 16)[0]
		if !slices.Contains(ix.Keys("e", ""), k) {
			t.Errorf("the index lacks the first key of adapter %q salt %q", c[0], c[1])
		}
	}
	status, out := post(t, url, `{"prompt":"x","cache_salt":""}`)
	if status != http.StatusBadRequest || !strings.Contains(string(out), "Parameter 'cache_salt' must be a non-empty string if provided.") {
		t.Errorf("empty cache_salt: %d %s; want vLLM's 400", status, out)
	}
}

func keysOf(hs []uint64) []blocks.Key {
	out := make([]blocks.Key, len(hs))
	for i, h := range hs {
		out[i] = blocks.Key(h)
	}
	return out
}
