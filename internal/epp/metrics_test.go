package epp

import (
	"context"
	"errors"
	"log/slog"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/promtest"

	dto "github.com/prometheus/client_model/go"

	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/router"
)

// failingShared is a shared state that is always down.
type failingShared struct{}

var errDown = errors.New("redis down")

func (failingShared) Add(context.Context, string, router.ExternalLoad) error { return errDown }
func (failingShared) Others(context.Context) (map[string]router.ExternalLoad, error) {
	return nil, errDown
}

// TestMetricsEndpoint drives the ext_proc server through a pick, a
// response, a 503 and a 400, and reads the figures from the real /metrics
// page.
func TestMetricsEndpoint(t *testing.T) {
	p := newTestPicker(t, Config{Shared: failingShared{}}, 3)
	p.SetReady("r2", false)
	conn := startServer(t, NewServer(p, ServerConfig{}))
	web := httptest.NewServer(p.MetricsHandler())
	t.Cleanup(web.Close)
	url := web.URL + "/metrics"

	type want struct {
		name   string
		labels []string
		v      float64
	}
	check := func(stage string, fams map[string]*dto.MetricFamily, ws []want) {
		t.Helper()
		for _, w := range ws {
			got, ok := promtest.Sum(fams, w.name, w.labels...)
			if !ok || got != w.v {
				t.Errorf("%s: %s%v = %v (present %v), want %v", stage, w.name, w.labels, got, ok, w.v)
			}
		}
	}

	// Before anything: every series that must exist from the start.
	check("at start", promtest.Scrape(t, nil, url), []want{
		{"prefixlb_replica_up", []string{"replica", "r0"}, 1},
		{"prefixlb_replica_up", []string{"replica", "r2"}, 0},
		{"prefixlb_inflight", nil, 0},
		{"prefixlb_epp_immediate_responses_total", []string{"code", "503"}, 0},
		{"prefixlb_epp_immediate_responses_total", []string{"code", "429"}, 0},
		{"prefixlb_epp_errors_total", []string{"kind", "shared_read"}, 0},
		{"prefixlb_cache_predictions_total", []string{"outcome", "exact"}, 0},
		{"prefixlb_tree_blocks", nil, 0},
		{"prefixlb_epp_streams", nil, 0},
	})

	// One request, held open after the pick.
	e := newEnvoy(t, conn)
	body := completionBody(strings.Repeat("the same long system prompt ", 200), false)
	e.request("/v1/completions", body, 4096, nil)
	h, _, _ := e.decision()
	primary := map[string]string{addr(0): "r0", addr(1): "r1"}[strings.Split(h, ",")[0]]
	if primary == "" {
		t.Fatalf("destination %q: want r0 or r1 first", h)
	}
	fams := promtest.Scrape(t, nil, url)
	check("request held", fams, []want{
		{"prefixlb_epp_streams", nil, 1},
		{"prefixlb_epp_streams_total", nil, 1},
		{"prefixlb_inflight", []string{"replica", primary}, 1},
		{"prefixlb_inflight", nil, 1},
		{"prefixlb_decisions_total", []string{"policy", "e2", "replica", primary}, 1},
		{"prefixlb_epp_decision_seconds", nil, 1},
		{"prefixlb_matched_tokens_total", []string{"replica", primary}, 0},
		{"prefixlb_epp_errors_total", []string{"kind", "shared_read"}, 1},
		{"prefixlb_epp_errors_total", []string{"kind", "shared_write"}, 1},
		{"prefixlb_epp_shared_inflight", nil, 0},
	})
	if v, _ := promtest.Sum(fams, "prefixlb_prompt_tokens_total", "replica", primary); v < 1000 {
		t.Errorf("prefixlb_prompt_tokens_total{replica=%s} = %v, want the prompt's ~1400 tokens", primary, v)
	}
	if v, _ := promtest.Sum(fams, "prefixlb_tree_blocks"); v < 1 {
		t.Errorf("prefixlb_tree_blocks = %v, want the routed prompt's blocks", v)
	}

	// The replica answers: 0 cached tokens, as predicted.
	e.respond(primary, "application/json", []string{`{"choices":[{"text":"x"}],"usage":{"prompt_tokens":1400,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}`}, nil)
	check("response done", promtest.Scrape(t, nil, url), []want{
		{"prefixlb_inflight", nil, 0},
		{"prefixlb_cache_predictions_total", []string{"outcome", "exact"}, 1},
		{"prefixlb_cached_tokens_reported_total", nil, 0},
		{"prefixlb_epp_errors_total", []string{"kind", "shared_write"}, 2},
	})

	// No endpoint in the subset hint: 503. A broken body: 400.
	e = newEnvoy(t, conn)
	e.request("/v1/completions", completionBody("hi", false), 100, subsetHint(t, addr(2)))
	if got := e.immediate(); got != 503 {
		t.Fatalf("status %v, want 503", got)
	}
	e = newEnvoy(t, conn)
	e.request("/v1/completions", []byte(`{"prompt":`), 100, nil)
	if got := e.immediate(); got != 400 {
		t.Fatalf("status %v, want 400", got)
	}
	// The second prompt shares the first's prefix: the hit shows.
	e = newEnvoy(t, conn)
	e.request("/v1/completions", completionBody(strings.Repeat("the same long system prompt ", 200)+"and more", false), 4096, nil)
	e.decision()
	fams = promtest.Scrape(t, nil, url)
	check("errors", fams, []want{
		{"prefixlb_epp_immediate_responses_total", []string{"code", "503"}, 1},
		{"prefixlb_epp_immediate_responses_total", []string{"code", "400"}, 1},
		{"prefixlb_epp_immediate_responses_total", []string{"code", "429"}, 0},
		{"prefixlb_decisions_total", nil, 2},
		{"prefixlb_epp_decision_seconds", nil, 2},
		{"prefixlb_epp_errors_total", []string{"kind", "shared_read"}, 3},
	})
	matched, _ := promtest.Sum(fams, "prefixlb_matched_tokens_total")
	prompt, _ := promtest.Sum(fams, "prefixlb_prompt_tokens_total")
	if ratio := matched / prompt; ratio < 0.4 || ratio > 0.5 {
		t.Errorf("prefix hit ratio %v/%v = %.2f, want about 0.5 (the second prompt is the first plus 2 words)", matched, prompt, ratio)
	}

	// A replica that leaves takes its series with it.
	p.Remove("r0")
	p.Remove("r1")
	fams = promtest.Scrape(t, nil, url)
	for _, name := range []string{"prefixlb_decisions_total", "prefixlb_inflight", "prefixlb_prompt_tokens_total"} {
		if v, ok := promtest.Sum(fams, name, "replica", primary); ok {
			t.Errorf("%s{replica=%s} = %v after the replica was removed, want no series", name, primary, v)
		}
	}
}

// kvPublisher runs a KV-event publisher on loopback for the test.
func kvPublisher(t *testing.T) *kvevents.Publisher {
	t.Helper()
	pub := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0",
		Topic: "kv@r1@m"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- pub.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("publisher: %v", err)
		}
	})
	select {
	case <-pub.Ready():
	case err := <-done:
		t.Fatalf("publisher: %v", err)
	}
	return pub
}

// TestTokenizerKeysMatchKVEvents: with a tokenizer, a prompt's keys are
// the router keys of the blocks a vLLM replica reports in BlockStored
// (computed from the event's token ids), so the picker sends the prompt
// where its blocks are; with text-chunk keys it matches nothing.
func TestTokenizerKeysMatchKVEvents(t *testing.T) {
	const bt = 16
	newPicker := func(tokenizer string) *Picker {
		p, err := NewPicker(Config{Tokenizer: tokenizer, BlockTokens: bt, Policy: "e2", Logger: slog.New(slog.DiscardHandler)})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	withTok := newPicker("../tokenize/qwen3") // a model directory, as --tokenizer takes
	tk, ok := withTok.cfg.Keyer.(*keying.TokenizerKeyer)
	if !ok {
		t.Fatalf("keyer %T with a tokenizer, want *proxy.TokenizerKeyer", withTok.cfg.Keyer)
	}
	prompt := strings.Repeat("You are a helpful assistant. Answer in French, briefly. ", 20)
	ids := tk.Tokenizer().Encode(prompt)
	full := len(ids) / bt * bt

	// One replica (r1) publishes, as vLLM does, that it holds the prompt's
	// full blocks; engine hashes are opaque numbers.
	pub := kvPublisher(t)
	hashes := make([]uint64, full/bt)
	for i := range hashes {
		hashes[i] = 0xabc000 + uint64(i)
	}
	if _, err := pub.Publish([]kvevents.Event{kvevents.BlockStored{BlockHashes: hashes, TokenIDs: ids[:full],
		BlockSize: bt, Medium: kvevents.MediumGPU}}, 1); err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name        string
		p           *Picker
		wantMatched int
	}{
		{"tokenizer", withTok, full},
		{"text chunks", newPicker(""), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.p
			applied := make(chan struct{}, 1)
			p.pool.Hooks.KV = func() {
				select {
				case applied <- struct{}{}:
				default:
				}
			}
			p.Add(Replica{Name: "r0", Address: addr(0), Ready: true})
			p.Add(Replica{Name: "r1", Address: addr(1), Ready: true, KVEvents: pub.Endpoint(), KVReplay: pub.ReplayEndpoint(), KVTopic: "kv@r1"})
			p.Add(Replica{Name: "r2", Address: addr(2), Ready: true})
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			go func() { done <- p.Run(ctx) }()
			defer func() {
				cancel()
				<-done
			}()
			select { // the subscriber replays the batch when it connects
			case <-applied:
			case <-time.After(20 * time.Second):
				t.Fatal("the BlockStored event never reached the router")
			}
			pk, err := p.Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: completionBody(prompt, false)})
			if err != nil {
				t.Fatal(err)
			}
			if pk.Decision.MatchedTokens != tc.wantMatched {
				t.Errorf("matched %d tokens on %s, want %d", pk.Decision.MatchedTokens, pk.Replica, tc.wantMatched)
			}
			if tc.wantMatched > 0 && pk.Replica != "r1" {
				t.Errorf("picked %s, want r1 (it caches the prompt's %d tokens)", pk.Replica, full)
			}
			web := httptest.NewServer(p.MetricsHandler())
			defer web.Close()
			fams := promtest.Scrape(t, nil, web.URL+"/metrics")
			for _, w := range []struct {
				name   string
				labels []string
			}{
				{"prefixlb_kvevents_events_applied_total", []string{"replica", "r1", "type", kvevents.TypeBlockStored}},
				{"prefixlb_kvevents_router_total", []string{"replica", "r1", "outcome", "stored"}},
			} {
				if v, _ := promtest.Sum(fams, w.name, w.labels...); v != 1 {
					t.Errorf("%s%v = %v, want 1", w.name, w.labels, v)
				}
			}
		})
	}
}
