package loadgen

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream/upstreamtest"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// llamaServer answers completions and chats with llama-server's captured
// responses, streamed (text/event-stream, as llama-server sends it) or not
// as the body asks, with its models list.
func llamaServer(t *testing.T) *httptest.Server {
	t.Helper()
	answers := map[string]string{
		"/v1/completions false":      upstreamtest.LlamaCpp(t, "completion.json"),
		"/v1/completions true":       upstreamtest.LlamaCpp(t, "completion-stream.txt"),
		"/v1/chat/completions false": upstreamtest.LlamaCpp(t, "chat.json"),
		"/v1/chat/completions true":  upstreamtest.LlamaCpp(t, "chat-stream.txt"),
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Server", "llama.cpp")
		if r.URL.Path == "/v1/models" {
			io.WriteString(w, `{"object":"list","data":[{"id":"/tmp/tiny.gguf","object":"model","owned_by":"llamacpp"}]}`)
			return
		}
		var b struct {
			Stream bool `json:"stream"`
		}
		_ = json.NewDecoder(r.Body).Decode(&b)
		answer, ok := answers[r.URL.Path+" "+map[bool]string{true: "true", false: "false"}[b.Stream]]
		if !ok {
			http.NotFound(w, r)
			return
		}
		if b.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
		} else {
			w.Header().Set("Content-Type", "application/json; charset=utf-8")
		}
		io.WriteString(w, answer)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestLlamaCppHitRatio: against llama.cpp, whose usage has no
// prompt_tokens_details, the hit ratio comes from its timings: cached =
// usage.prompt_tokens − timings.prompt_n.
func TestLlamaCppHitRatio(t *testing.T) {
	srv := llamaServer(t)
	tests := []struct {
		name                string
		mode                Mode
		wantPrompt, wantHit int
		wantPromptMs        float64
	}{
		{"completions stream", ModeCompletions, 602, 601, 6.524},
		{"chat stream", ModeChat, 10, 9, 6.448},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Target, cfg.Mode = srv.URL, tt.mode
			reqs := []workload.Request{{ID: 0, Tokens: tokens(8, 1), OutputTokens: 3}, {ID: 1, Arrival: time.Millisecond, Tokens: tokens(8, 1), OutputTokens: 3}}
			out, err := Run(context.Background(), cfg, reqs)
			if err != nil {
				t.Fatal(err)
			}
			checkNoLeak(t)
			if out.Model != "/tmp/tiny.gguf" {
				t.Errorf("model %q", out.Model)
			}
			for i, r := range out.Records {
				if r.Error != "" || r.PromptTokens != tt.wantPrompt || r.CachedTokens != tt.wantHit {
					t.Errorf("record %d: %+v, want %d prompt tokens, %d cached", i, r, tt.wantPrompt, tt.wantHit)
				}
				if tm := out.Timings[i]; tm == nil || tm.PromptN != 1 || tm.PromptMs != tt.wantPromptMs {
					t.Errorf("record %d timings %+v, want prompt_n 1, prompt_ms %v", i, tm, tt.wantPromptMs)
				}
			}
			if want := float64(tt.wantHit) / float64(tt.wantPrompt); out.Result.PrefixHitRatio != want {
				t.Errorf("hit ratio %v, want %v", out.Result.PrefixHitRatio, want)
			}
		})
	}
}

func TestReadLlamaCppResponses(t *testing.T) {
	tests := []struct {
		name                   string
		body                   string
		json                   bool
		wantPrompt, wantCached int
		wantOutput             int
		wantTimings            bool
	}{
		{"completion", upstreamtest.LlamaCpp(t, "completion.json"), true, 601, 600, 3, true},
		{"chat", upstreamtest.LlamaCpp(t, "chat.json"), true, 10, 9, 2, true},
		{"completion stream", upstreamtest.LlamaCpp(t, "completion-stream.txt"), false, 602, 601, 3, true},
		{"chat stream", upstreamtest.LlamaCpp(t, "chat-stream.txt"), false, 10, 9, 2, true},
		{"details win", `{"choices":[{"text":"a"}],"usage":{"prompt_tokens":10,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":4}},"timings":{"prompt_n":1}}`, true, 10, 4, 1, true},
		{"timings of another shape", `{"choices":[{"text":"a"}],"usage":{"prompt_tokens":10,"completion_tokens":1},"timings":"n/a"}`, true, 10, 0, 1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var o outcome
			if tt.json {
				o.readJSON(strings.NewReader(tt.body), time.Now())
			} else {
				o.readStream(strings.NewReader(tt.body), time.Now(), 0)
			}
			if o.err != nil || o.promptTokens != tt.wantPrompt || o.cachedTokens != tt.wantCached || o.outputTokens != tt.wantOutput ||
				(o.timings != nil) != tt.wantTimings {
				t.Errorf("outcome %+v (timings %+v), want prompt %d cached %d output %d", o, o.timings, tt.wantPrompt, tt.wantCached, tt.wantOutput)
			}
		})
	}
}
