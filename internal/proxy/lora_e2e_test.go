package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestLoRAOverEngine: a prefixlb engine serving LoRA adapter "sql" publishes
// the adapter's blocks with lora_name; serve, told "sql" is an adapter,
// keys its requests from the adapter's seed, so the KV events land on the
// adapter's keys — never on the base model's for the same tokens — and the
// router predicts the adapter's cached prompt where the engine reuses it.
func TestLoRAOverEngine(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	ec := engine.DefaultConfig()
	ec.Replica.Profile = prof
	ec.Replica.MaxLoras = 2
	ec.TimeScale = 50
	ec.LoRAModules = []string{"sql"}
	ec.LoRAAdapterBytes = 84 << 20
	ec.Logger = slog.New(slog.DiscardHandler)
	pub := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0",
		Topic: "kv@lora@prefixlb-sim"})
	ec.KVPublisher = pub
	e, err := engine.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	<-pub.Ready()
	esrv := httptest.NewServer(e.Handler())
	t.Cleanup(esrv.Close)

	cfg := testConfig()
	cfg.Backends = []Backend{{Name: "e0", URL: esrv.URL, KVEvents: pub.Endpoint(), KVReplay: pub.ReplayEndpoint()}}
	cfg.LoRAAdapters = []string{"sql"}
	cfg.LoRAAdapterBytes = ec.LoRAAdapterBytes // serve --lora-adapter-bytes, as the engine's
	cfg.SpeculativeTTL = -1                    // only the engine's events say what is cached
	cfg.ScrapeInterval = 20 * time.Millisecond // vllm:lora_requests_info
	p, srv := startProxy(t, cfg)
	runLoops(t, p)

	ids := make([]string, 256)
	for i := range ids {
		ids[i] = fmt.Sprint(1000 + i)
	}
	body := func(model string) string {
		return fmt.Sprintf(`{"model":%q,"prompt":[%s],"max_tokens":2}`, model, strings.Join(ids, ","))
	}
	matched := func(model string) int {
		var ex RouteExplanation
		if err := json.Unmarshal(readAll(t, post(t, srv.URL, "/debug/route", body(model))), &ex); err != nil {
			t.Fatal(err)
		}
		return ex.MatchedTokens
	}
	waitMatched := func(model string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for matched(model) == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: the engine's KV events never reached the router's keys for it", model)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}

	readAll(t, post(t, srv.URL, "/v1/completions", body("prefixlb-sim")))
	waitMatched("prefixlb-sim")
	if n := matched("sql"); n != 0 {
		t.Errorf("the adapter's request matches %d tokens of the base model's blocks", n)
	}
	readAll(t, post(t, srv.URL, "/v1/completions", body("sql")))
	waitMatched("sql")
	// The engine reuses the adapter's cached prompt; the router predicted it.
	resp := post(t, srv.URL, "/v1/completions", body("sql"))
	var out struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(readAll(t, resp), &out); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %v", resp.StatusCode, err)
	}
	if out.Usage.Details.Cached == 0 {
		t.Error("the engine did not reuse the adapter's cached prompt")
	}
	// The engine's vllm:lora_requests_info (max_lora 2, sql not running
	// now) reaches the router, and serve passes the request's adapter to
	// the policy: e2 prices sql's load, not the base model's.
	adapterLoad := func(model string) float64 {
		var ex RouteExplanation
		if err := json.Unmarshal(readAll(t, post(t, srv.URL, "/debug/route", body(model))), &ex); err != nil || len(ex.Candidates) != 1 || ex.Candidates[0].Terms == nil {
			t.Fatalf("%s: explanation %+v (%v)", model, ex, err)
		}
		return ex.Candidates[0].Terms[policy.E2AdapterLoad]
	}
	for deadline := time.Now().Add(10 * time.Second); adapterLoad("sql") == 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("e2 never priced the adapter's load: the adapter or the engine's slots did not reach the policy")
		}
	}
	// Priced at the adapter's size (--lora-adapter-bytes), not the fixed
	// cost alone.
	if got, want := adapterLoad("sql"), costmodel.AdapterLoadOf(prof).Time(ec.LoRAAdapterBytes).Seconds(); math.Abs(got-want) > 1e-9 ||
		want <= costmodel.AdapterLoadOf(prof).Time(0).Seconds() {
		t.Errorf("adapter_load %v, want %v (%d bytes)", got, want, ec.LoRAAdapterBytes)
	}
	if l := adapterLoad("prefixlb-sim"); l != 0 {
		t.Errorf("the base model's request: adapter_load %v, want 0", l)
	}
	var models struct{ Data []struct{ ID, Parent string } }
	if err := json.Unmarshal(readAll(t, mustGet(t, esrv.URL+"/v1/models")), &models); err != nil ||
		len(models.Data) != 2 || models.Data[1].ID != "sql" || models.Data[1].Parent != "prefixlb-sim" {
		t.Errorf("engine /v1/models %+v (%v)", models, err)
	}
}
