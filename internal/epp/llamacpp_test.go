package epp

import (
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"
	"github.com/prefixlb/prefixlb/internal/upstream/upstreamtest"

	"github.com/prefixlb/prefixlb/internal/tokenize"
)

// engineFake is a model server answering GETs as llama-server does (from
// the captured fixtures, with its Server header) or, switched, as vLLM
// does. It counts GET /props.
type engineFake struct {
	srv   *httptest.Server
	vllm  atomic.Bool
	props atomic.Int64
}

func newEngineFake(t *testing.T) *engineFake {
	t.Helper()
	f := &engineFake{}
	llama := map[string]string{
		"/metrics": upstreamtest.LlamaCpp(t, "metrics.txt"), "/props": upstreamtest.LlamaCpp(t, "props.json"), "/v1/models": upstreamtest.LlamaCpp(t, "models.json"),
	}
	vllm := map[string]string{
		"/metrics":   "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 4\n",
		"/v1/models": `{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}`,
	}
	f.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		answers := llama
		if f.vllm.Load() {
			answers = vllm
		} else {
			w.Header().Set("Server", "llama.cpp")
		}
		if r.URL.Path == "/props" {
			f.props.Add(1)
		}
		body, ok := answers[r.URL.Path]
		if !ok {
			w.WriteHeader(http.StatusNotFound)
			io.WriteString(w, `{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}`)
			return
		}
		io.WriteString(w, body)
	}))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *engineFake) replica(name string) Replica {
	return Replica{Name: name, Address: strings.TrimPrefix(f.srv.URL, "http://"), MetricsURL: f.srv.URL + "/metrics", Ready: true}
}

// runPicker runs p until the test ends; detections go to the channel.
func runPicker(t *testing.T, p *Picker) chan upstream.Detection {
	t.Helper()
	ch := make(chan upstream.Detection, 16)
	p.pool.Hooks.Detected = func(_ string, d upstream.Detection) { ch <- d }
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		_ = p.Run(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	return ch
}

func waitDetection(t *testing.T, ch chan upstream.Detection) upstream.Detection {
	t.Helper()
	select {
	case d := <-ch:
		return d
	case <-time.After(10 * time.Second):
		t.Fatal("no detection")
	}
	return upstream.Detection{}
}

func getBody(t *testing.T, h http.Handler, path string) string {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET %s: %d", path, rec.Code)
	}
	return rec.Body.String()
}

// TestPickerLlamaCpp: a llama.cpp replica is detected, its slots and load
// reach the router, and the cached tokens of its responses (from timings)
// are checked against the router's prediction.
func TestPickerLlamaCpp(t *testing.T) {
	f := newEngineFake(t)
	p, err := NewPicker(Config{Logger: slog.New(slog.DiscardHandler), ScrapeInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	p.Add(f.replica("l0"))
	detected := runPicker(t, p)
	if d := waitDetection(t, detected); d.Kind != upstream.LlamaCpp || d.Slots != 2 || d.Via != "metrics" {
		t.Fatalf("detected %+v", d)
	}
	p.mu.Lock()
	l0 := p.pool.ByName("l0")
	p.mu.Unlock()
	p.pool.Scrape(context.Background(), l0)

	tests := []struct {
		name, fixture string
		sse           bool
		wantOut       int
		wantCached    int
	}{
		{"stream", "completion-stream.txt", true, 3, 601},
		{"unary", "completion.json", false, 3, 600},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			pick, err := p.Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: []byte(`{"model":"m","prompt":"hello world hello world","max_tokens":3}`)})
			if err != nil {
				t.Fatal(err)
			}
			w := openai.Watcher{SSE: tt.sse, Max: 1 << 20}
			w.Feed([]byte(upstreamtest.LlamaCpp(t, tt.fixture)))
			out, cached := w.Result()
			if out != tt.wantOut || cached != tt.wantCached {
				t.Fatalf("watcher: %d out, %d cached; want %d, %d", out, cached, tt.wantOut, tt.wantCached)
			}
			p.Finished(pick.ID, out, cached, true)
			p.mu.Lock()
			v, _ := p.rt.CacheView(0)
			p.mu.Unlock()
			if want := pick.Decision.MatchedTokens - tt.wantCached; v.Checked != i+1 || v.LastErrorTokens != want || v.Slots != 2 {
				t.Errorf("cache view %+v, want %d checked, last error %d", v, i+1, want)
			}
		})
	}

	metrics := getBody(t, p.MetricsHandler(), "/metrics")
	for _, want := range []string{
		`prefixlb_replica_info{kind="llamacpp",replica="l0"} 1`,
		`prefixlb_cache_prediction_error_tokens{replica="l0"} `,
		`prefixlb_cache_capacity_tokens{replica="l0"} `,
		`prefixlb_cache_corrections_total{replica="l0"} `,
		`prefixlb_cached_tokens_reported_total 1201`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	var dbg struct {
		Replicas []ReplicaView `json:"replicas"`
	}
	if err := json.Unmarshal([]byte(getBody(t, p.DebugHandler(), "/debug/replicas")), &dbg); err != nil {
		t.Fatal(err)
	}
	if len(dbg.Replicas) != 1 {
		t.Fatalf("debug replicas %+v", dbg)
	}
	if r := dbg.Replicas[0]; r.Kind != upstream.LlamaCpp || r.Slots != 2 || r.Cache.Checked != 2 || r.KVTokens != 615 ||
		r.Running != 0 || r.Waiting != 0 || r.KVUsage <= 0 {
		t.Errorf("debug replica %+v", r)
	}
}

// TestPickerReDetects: a replica that is ready again after being unready is
// detected again: here vLLM has replaced llama.cpp behind its address.
func TestPickerReDetects(t *testing.T) {
	f := newEngineFake(t)
	p, err := NewPicker(Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	p.Add(f.replica("r0"))
	detected := runPicker(t, p)
	if d := waitDetection(t, detected); d.Kind != upstream.LlamaCpp || d.Slots != 2 {
		t.Fatalf("detected %+v", d)
	}
	p.SetReady("r0", false)
	f.vllm.Store(true)
	p.SetReady("r0", true)
	if d := waitDetection(t, detected); d.Kind != upstream.VLLM {
		t.Fatalf("re-detected %+v", d)
	}
	p.mu.Lock()
	v, _ := p.rt.CacheView(0)
	kind := p.pool.ByName("r0").Kind()
	p.mu.Unlock()
	if v.Slots != 0 || kind != upstream.VLLM {
		t.Errorf("after re-detection: kind %s, router slots %d", kind, v.Slots)
	}
}

func TestPickerConfiguredKind(t *testing.T) {
	t.Run("vllm: nothing detected", func(t *testing.T) {
		f := newEngineFake(t)
		p, err := NewPicker(Config{Logger: slog.New(slog.DiscardHandler), BackendKind: upstream.VLLM})
		if err != nil {
			t.Fatal(err)
		}
		p.Add(f.replica("r0"))
		if got := p.ReplicaViews()[0].Kind; got != upstream.VLLM {
			t.Errorf("kind %s", got)
		}
		if m := getBody(t, p.MetricsHandler(), "/metrics"); !strings.Contains(m, `prefixlb_replica_info{kind="vllm",replica="r0"} 1`) {
			t.Error("no replica_info for r0")
		}
		p.mu.Lock()
		due := p.pool.StateOf(p.pool.ByName("r0")).KindDue
		p.mu.Unlock()
		if due || f.props.Load() != 0 {
			t.Errorf("a configured vLLM replica is due a detection (props read %d times)", f.props.Load())
		}
	})
	t.Run("llamacpp: slots read", func(t *testing.T) {
		f := newEngineFake(t)
		p, err := NewPicker(Config{Logger: slog.New(slog.DiscardHandler), BackendKind: upstream.LlamaCpp})
		if err != nil {
			t.Fatal(err)
		}
		p.Add(f.replica("r0"))
		if got := p.ReplicaViews()[0].Kind; got != upstream.LlamaCpp {
			t.Errorf("kind before its slots are read %s", got)
		}
		// The captured /props (upstreamtest): n_ctx 8192 a slot × 2 slots.
		want := upstream.Detection{Kind: upstream.LlamaCpp, Slots: 2, Via: "configured",
			Capacity: upstream.Capacity{Tokens: 16384, Source: upstream.SourceLlamaCppProps}}
		if d := waitDetection(t, runPicker(t, p)); d != want {
			t.Errorf("detection %+v", d)
		}
		// The picker prices and shows that capacity, as serve does.
		if v := p.ReplicaViews()[0]; v.KVCapacityTokens != 16384 || v.KVCapacitySource != upstream.SourceLlamaCppProps {
			t.Errorf("replica view: kv capacity %d from %q", v.KVCapacityTokens, v.KVCapacitySource)
		}
	})
	t.Run("invalid", func(t *testing.T) {
		_, err := NewPicker(Config{BackendKind: "llama"})
		if err == nil || err.Error() != `epp: backend kind: unknown backend kind "llama" (want auto, vllm, sglang or llamacpp)` {
			t.Errorf("NewPicker: %v", err)
		}
	})
}

// TestWatcherTimings reads cached tokens from llama.cpp's timings as the
// response path sees them: on the usage chunk, or (timings_per_token) on
// earlier chunks; prompt_tokens_details wins where present.
func TestWatcherTimings(t *testing.T) {
	tests := []struct {
		name       string
		sse        bool
		body       string
		wantCached int
	}{
		{"chat stream", true, "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n" +
			"data: {\"choices\":[{\"delta\":{}}],\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":10},\"timings\":{\"prompt_n\":1}}\n\ndata: [DONE]\n\n", 9},
		{"timings per token", true, "data: {\"choices\":[{\"text\":\"a\"}],\"timings\":{\"prompt_n\":4}}\n\n" +
			"data: {\"choices\":[],\"usage\":{\"completion_tokens\":1,\"prompt_tokens\":10}}\n\ndata: [DONE]\n\n", 6},
		{"vLLM", true, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1,\"prompt_tokens_details\":{\"cached_tokens\":8}}}\n\n", 8},
		{"no report", true, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":1}}\n\n", -1},
		{"chat unary", false, `{"choices":[{"message":{"content":"x"}}],"usage":{"completion_tokens":2,"prompt_tokens":10},"timings":{"prompt_n":1}}`, 9},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := openai.Watcher{SSE: tt.sse, Max: 1 << 20}
			for i := 0; i < len(tt.body); i += 7 { // split across feeds
				w.Feed([]byte(tt.body[i:min(i+7, len(tt.body))]))
			}
			if _, cached := w.Result(); cached != tt.wantCached {
				t.Errorf("cached %d, want %d", cached, tt.wantCached)
			}
		})
	}
}

// TestTokenizerCheckLlamaCpp: once a replica is detected as llama.cpp its
// tokenizer is checked through llama-server's /tokenize ({"content":...})
// and /apply-template, not vLLM's request (which llama.cpp answers with no
// ids).
func TestTokenizerCheckLlamaCpp(t *testing.T) {
	tok := testTokenizer(t)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /props", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, upstreamtest.LlamaCpp(t, "props.json"))
	})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Content *string `json:"content"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		ids := []uint32{}
		if body.Content != nil {
			ids = tok.Encode(*body.Content)
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids})
	})
	mux.HandleFunc("POST /apply-template", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Messages []tokenize.Message `json:"messages"`
		}
		_ = json.NewDecoder(r.Body).Decode(&body)
		s, _ := tok.ApplyChatTemplate(body.Messages, tokenize.ChatOptions{AddGenerationPrompt: true})
		_ = json.NewEncoder(w).Encode(map[string]any{"prompt": s})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	p, err := NewPicker(Config{Keyer: keying.NewTokenizerKeyer(tok, 16), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	p.Add(Replica{Name: "l0", Address: strings.TrimPrefix(srv.URL, "http://"), Ready: true})
	ev := watchTokenizer(p)
	if d := waitDetection(t, runPicker(t, p)); d.Kind != upstream.LlamaCpp || d.Via != "props" {
		t.Fatalf("detected %+v", d)
	}
	ev.waitState(t, "l0", keying.TokenizerMatch)
}
