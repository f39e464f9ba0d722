package cluster

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

func settings() Settings {
	return Settings{BlockTokens: 16, Profile: "llama3.1-8b-h100", Policy: "e2", MaxPromptTokens: 100}
}

// TestNewResolvesOnce: New names the setting at fault, and builds the
// keyer the settings ask for.
func TestNewResolvesOnce(t *testing.T) {
	for _, tt := range []struct {
		name string
		set  func(*Settings)
		want string
	}{
		{"profile", func(s *Settings) { s.Profile = "no-such-gpu" }, "profile: "},
		{"policy", func(s *Settings) { s.Policy = "no-such-policy" }, "policy: "},
		{"tokenizer", func(s *Settings) { s.Tokenizer = "/no/such/tokenizer.json" }, "tokenizer: "},
		{"block size", func(s *Settings) {
			tok, err := qwen3.Load()
			if err != nil {
				t.Fatal(err)
			}
			s.Keyer = keying.NewTokenizerKeyer(tok, 32)
		}, "keyer: tokenizer keys of 32 tokens, block_tokens is 16"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			s := settings()
			tt.set(&s)
			_, err := New(s)
			if err == nil || !strings.HasPrefix(err.Error(), tt.want) {
				t.Fatalf("error %v, want one starting %q", err, tt.want)
			}
		})
	}
	c, err := New(settings())
	if err != nil {
		t.Fatal(err)
	}
	// The default keyer is auto: the bundled Qwen3, falling back to text
	// chunks until a replica confirms it.
	if tk, ok := c.Keyer.(*keying.TokenizerKeyer); !ok || !tk.Auto() || !tk.Fallback() || tk.Spec() != keying.TokenizerQwen3 || c.Policy != "e2" {
		t.Errorf("keyer %T, policy %q: want auto (qwen3, in fallback) and e2", c.Keyer, c.Policy)
	}
	s := settings()
	s.Tokenizer = "none"
	if c, err = New(s); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.Keyer.(keying.ChunkKeyer); !ok {
		t.Errorf("tokenizer none: keyer %T", c.Keyer)
	}
}

// TestKeyAdmits: a prompt over MaxPromptTokens is refused with
// ErrPromptTooLong; one at the bound is keyed.
func TestKeyAdmits(t *testing.T) {
	c, err := New(settings())
	if err != nil {
		t.Fatal(err)
	}
	ok := &openai.Request{TokenIDs: [][]uint32{make([]uint32, 100)}}
	keys, tokens, err := c.Key(ok)
	if err != nil || tokens != 100 || len(keys) != 6 {
		t.Fatalf("100 tokens: %d keys, %d tokens, %v", len(keys), tokens, err)
	}
	long := &openai.Request{TokenIDs: [][]uint32{make([]uint32, 101)}}
	if _, _, err := c.Key(long); !errors.Is(err, ErrPromptTooLong) {
		t.Fatalf("101 tokens: %v, want ErrPromptTooLong", err)
	}
	s := settings()
	s.MaxPromptTokens = 0
	if c, err = New(s); err != nil {
		t.Fatal(err)
	}
	if err := c.Admit(1 << 30); err != nil {
		t.Errorf("no bound: %v", err)
	}
}

// TestSink applies each kind of event to a real router and counts its
// outcome, unknown replicas and offloaded blocks included.
func TestSink(t *testing.T) {
	c, err := New(settings())
	if err != nil {
		t.Fatal(err)
	}
	id := c.Router.AddReplica("r0", true)
	reg := prometheus.NewRegistry()
	kv, err := NewKV(reg)
	if err != nil {
		t.Fatal(err)
	}
	var seen []string
	s := &Sink{Core: c, KV: kv,
		ID: func(name string) int {
			if name == "r0" {
				return id
			}
			return -1
		},
		Applied: func(name, outcome string) { seen = append(seen, name+":"+outcome) },
	}
	keys := blocks.Keys(nil, make([]uint32, 64), 16)
	s.Stored("r0", 0, false, keys[:2], kvevents.MediumGPU)
	s.Stored("r0", keys[1], true, keys[2:], kvevents.MediumGPU)
	s.Stored("r0", blocks.Key(12345), true, []blocks.Key{777}, kvevents.MediumGPU) // parent never stored
	s.Stored("r0", 0, false, keys, "CPU")
	s.Stored("gone", 0, false, keys, kvevents.MediumGPU)
	s.Removed("r0", keys[3:], kvevents.MediumGPU)
	s.Removed("r0", keys, "CPU")
	s.Cleared("gone")
	if got := c.Router.Tree().CachedBlocks(id); got != 3 {
		t.Errorf("router holds %d blocks of r0, want 3", got)
	}
	s.Cleared("r0")
	if got := c.Router.Tree().CachedBlocks(id); got != 0 {
		t.Errorf("after clear: %d blocks", got)
	}
	want := []string{"r0:stored", "r0:stored", "r0:unknown_parent", "r0:tier_stored", "r0:removed", "r0:tier_removed", "r0:cleared"}
	if strings.Join(seen, " ") != strings.Join(want, " ") {
		t.Errorf("outcomes %v, want %v", seen, want)
	}
	for outcome, n := range map[string]float64{"stored": 2, "unknown_parent": 1, "tier_stored": 1, "tier_removed": 1, "removed": 1, "cleared": 1} {
		if got := testutil.ToFloat64(kv.Applied.WithLabelValues("r0", outcome)); got != n {
			t.Errorf("prefixlb_kvevents_router_total{outcome=%q} = %v, want %v", outcome, got, n)
		}
	}
	if n := testutil.CollectAndCount(kv.Applied); n != 6 {
		t.Errorf("%d series, want 6 (nothing for the unknown replica)", n)
	}
	// Tiers off: a slower tier's blocks are ignored, and counted so.
	seen = nil
	s.IgnoreTiers = true
	s.Stored("r0", 0, false, keys, "CPU")
	if c.Router.TierBlocks(id) != 0 || strings.Join(seen, " ") != "r0:cpu_ignored" {
		t.Errorf("tiers off: %d tier blocks, outcomes %v", c.Router.TierBlocks(id), seen)
	}
}

// TestExpireSpeculative: the loop unmarks a decision's speculative blocks
// once their time is up, and returns when its context ends.
func TestExpireSpeculative(t *testing.T) {
	s := settings()
	s.SpeculativeTTL = 20 * time.Millisecond
	c, err := New(s)
	if err != nil {
		t.Fatal(err)
	}
	c.Router.AddReplica("r0", true)
	req := policy.Request{ID: 1, Keys: blocks.Keys(nil, make([]uint32, 64), 16), PromptTokens: 64, OutputTokens: 1}
	if _, err := c.Router.Route(req, time.Now()); err != nil {
		t.Fatal(err)
	}
	if c.Router.Speculative() == 0 {
		t.Fatal("e2 marked nothing speculatively")
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.ExpireSpeculative(ctx, 5*time.Millisecond)
	}()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c.Mu.Lock()
		n := c.Router.Speculative()
		c.Mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d speculative blocks left after 5 s", n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the loop did not return when its context ended")
	}
}

// TestScrapeLoRA: a replica's vllm:lora_requests_info reaches the router as
// its adapter residency, running and waiting adapters.
func TestScrapeLoRA(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "# TYPE vllm:lora_requests_info gauge\n"+
			`vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters="math"} 1.8e9`+"\n")
	}))
	defer srv.Close()
	c, err := New(settings())
	if err != nil {
		t.Fatal(err)
	}
	m, err := NewMetrics("decisions")
	if err != nil {
		t.Fatal(err)
	}
	p, err := NewPool(c, m, PoolConfig{Kind: upstream.VLLM, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	p.Add(Replica{Name: "r0", URL: srv.URL, MetricsURL: srv.URL + "/metrics", Ready: true})
	p.Mu.Lock()
	mem := p.ByName("r0")
	p.Mu.Unlock()
	p.Scrape(context.Background(), mem)
	p.Mu.Lock()
	defer p.Mu.Unlock()
	rp, _ := c.Router.Replica(mem.ID)
	if rp.MaxAdapters != 4 || !slices.Equal(rp.Adapters, []string{"sql", "chat"}) {
		t.Errorf("router adapters %v of %d, want [sql chat] of 4", rp.Adapters, rp.MaxAdapters)
	}
	if !slices.Equal(rp.RunningAdapters, []string{"sql", "chat"}) || !slices.Equal(rp.WaitingAdapters, []string{"math"}) {
		t.Errorf("router running %v, waiting %v, want [sql chat] and [math]", rp.RunningAdapters, rp.WaitingAdapters)
	}
}
