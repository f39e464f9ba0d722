package proxy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/tenancy"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// tokenizeReplica is a fake replica: /health answers 200 and /tokenize
// what answer returns (nil: 404).
func tokenizeReplica(t *testing.T, name string, answer func(body map[string]json.RawMessage) []uint32) Backend {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]json.RawMessage
		b, _ := io.ReadAll(r.Body)
		if err := json.Unmarshal(b, &body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		ids := answer(body)
		if ids == nil {
			http.NotFound(w, r)
			return
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids, "count": len(ids)})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return Backend{Name: name, URL: srv.URL}
}

// exactTokenize answers /tokenize as vLLM does with tok.
func exactTokenize(tok *tokenize.Tokenizer) func(map[string]json.RawMessage) []uint32 {
	return func(body map[string]json.RawMessage) []uint32 {
		if p, ok := body["prompt"]; ok {
			var s string
			_ = json.Unmarshal(p, &s)
			return tok.Encode(s)
		}
		var msgs []tokenize.Message
		_ = json.Unmarshal(body["messages"], &msgs)
		var agp bool
		_ = json.Unmarshal(body["add_generation_prompt"], &agp)
		ids, _ := tok.EncodeChat(msgs, tokenize.ChatOptions{AddGenerationPrompt: agp})
		return ids
	}
}

// probeAll starts p's loops and waits for one probe result per replica.
func probeAll(t *testing.T, p *Proxy, n int) map[string]int {
	t.Helper()
	got := make(chan [2]any, n)
	p.pool.Hooks.Tokenizer = func(name string, state keying.TokenizerState, err error) {
		if !errors.Is(err, upstream.ErrNoAnswer) {
			got <- [2]any{name, int(state)}
		}
	}
	runLoops(t, p)
	out := map[string]int{}
	timeout := time.After(10 * time.Second)
	for len(out) < n {
		select {
		case r := <-got:
			out[r[0].(string)] = r[1].(int)
		case <-timeout:
			t.Fatalf("probes: got %v, want %d replicas", out, n)
		}
	}
	return out
}

func TestTokenizerProbe(t *testing.T) {
	tok := testTokenizer(t)
	chat := `{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat("Be brief. ", 40) + `"},{"role":"user","content":"hi"}]}`
	tests := []struct {
		name         string
		answers      []func(map[string]json.RawMessage) []uint32
		wantStates   []int
		wantFallback bool
	}{
		{"all match", []func(map[string]json.RawMessage) []uint32{exactTokenize(tok), exactTokenize(tok)},
			[]int{1, 1}, false},
		{"one differs", []func(map[string]json.RawMessage) []uint32{exactTokenize(tok), func(b map[string]json.RawMessage) []uint32 {
			ids := exactTokenize(tok)(b)
			ids[len(ids)-1]++ // another model's last token
			return ids
		}}, []int{1, 0}, true},
		{"no /tokenize", []func(map[string]json.RawMessage) []uint32{exactTokenize(tok), func(map[string]json.RawMessage) []uint32 { return nil }},
			[]int{1, -1}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.HealthInterval = time.Hour
			cfg.ScrapeInterval = 0
			cfg.Logger = slog.New(slog.DiscardHandler)
			for i, a := range tt.answers {
				cfg.Backends = append(cfg.Backends, tokenizeReplica(t, fmt.Sprintf("r%d", i), a))
			}
			keyer := keying.NewTokenizerKeyer(tok, cfg.BlockTokens)
			cfg.Keyer = keyer
			p, srv := startProxy(t, cfg)
			states := probeAll(t, p, len(tt.answers))
			for i, want := range tt.wantStates {
				if got := states[fmt.Sprintf("r%d", i)]; got != want {
					t.Errorf("replica r%d: state %d, want %d", i, got, want)
				}
			}
			if keyer.Fallback() != tt.wantFallback {
				t.Errorf("fallback %v, want %v", keyer.Fallback(), tt.wantFallback)
			}
			metrics := string(readAll(t, mustGet(t, srv.URL+"/metrics")))
			for i, want := range tt.wantStates {
				line := fmt.Sprintf("prefixlb_tokenizer_match{replica=\"r%d\"} %d", i, want)
				if !strings.Contains(metrics, line) {
					t.Errorf("metrics lack %q:\n%s", line, grep(metrics, "prefixlb_tokenizer"))
				}
			}
			if line := fmt.Sprintf("prefixlb_tokenizer_fallback %d", map[bool]int{true: 1}[tt.wantFallback]); !strings.Contains(metrics, line) {
				t.Errorf("metrics lack %q:\n%s", line, grep(metrics, "prefixlb_tokenizer"))
			}
			// The keys the proxy uses now: token ids, or text chunks in fallback.
			r := mustParse(t, openai.KindChat, chat)
			keys, _, _ := p.pool.Keyer.Keys(r)
			want, _, _ := keying.ChunkKeyer{BlockTokens: cfg.BlockTokens}.Keys(r)
			if !tt.wantFallback {
				ids, _ := keyer.EncodeChat(r.Chat)
				want = blocks.Keys(nil, ids, cfg.BlockTokens)
			}
			if !slices.Equal(keys, want) {
				t.Errorf("keys (fallback %v) are not the expected key space", tt.wantFallback)
			}
		})
	}
}

// TestTokenizerProbeOnReadmission checks that a replica that comes back
// after an ejection is probed again, and that a fixed replica ends the
// fallback.
func TestTokenizerProbeOnReadmission(t *testing.T) {
	tok := testTokenizer(t)
	var mu sync.Mutex
	wrong := true
	b := tokenizeReplica(t, "r0", func(body map[string]json.RawMessage) []uint32 {
		mu.Lock()
		defer mu.Unlock()
		ids := exactTokenize(tok)(body)
		if wrong {
			ids = append(ids, 1)
		}
		return ids
	})
	cfg := DefaultConfig()
	cfg.Backends = []Backend{b}
	cfg.HealthInterval = time.Hour
	cfg.ScrapeInterval = 0
	cfg.ReadmitAfter = 1
	cfg.Logger = slog.New(slog.DiscardHandler)
	keyer := keying.NewTokenizerKeyer(tok, cfg.BlockTokens)
	cfg.Keyer = keyer
	p, _ := startProxy(t, cfg)
	if st := probeAll(t, p, 1)["r0"]; st != 0 || !keyer.Fallback() {
		t.Fatalf("first probe: state %d, fallback %v; want 0, true", st, keyer.Fallback())
	}
	got := make(chan int, 1)
	p.mu.Lock()
	p.pool.Hooks.Tokenizer = func(_ string, state keying.TokenizerState, _ error) { got <- int(state) }
	p.mu.Unlock()
	mu.Lock()
	wrong = false
	mu.Unlock()
	rb := p.backendAt(0)
	p.checked(rb, false, true) // ejected
	p.checked(rb, true, false) // re-admitted: due a check, which runs at once
	if st := <-got; st != 1 || keyer.Fallback() {
		t.Errorf("after re-admission: state %d, fallback %v; want 1, false", st, keyer.Fallback())
	}
}

// startTokenizerEngines runs n modelled replicas that tokenize with tok.
func startTokenizerEngines(t *testing.T, n int, tok *tokenize.Tokenizer) []Backend {
	t.Helper()
	return startEngines(t, n, func(ec *engine.Config) {
		c := tokenize.NewPrefixCache(tok, 0)
		ec.Tokenizer, ec.ChatEncoder = c, c
	})
}

// TestEndToEndTokenizerChat runs real modelled replicas that tokenize with
// the Qwen3 tokenizer and its chat template behind a proxy keying with the
// same tokenizer: the probe finds them equal, chats sharing a long system
// prompt are reported cached, and the router's predicted match is exactly
// the replica's cached_tokens.
func TestEndToEndTokenizerChat(t *testing.T) {
	tok := testTokenizer(t)
	backends := startTokenizerEngines(t, 3, tok)
	cfg := DefaultConfig()
	cfg.Backends = backends
	cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
	cfg.HealthInterval = time.Hour
	cfg.ScrapeInterval = 0
	cfg.Logger = slog.New(slog.DiscardHandler)
	keyer := keying.NewTokenizerKeyer(tok, cfg.BlockTokens)
	cfg.Keyer = keyer
	p, srv := startProxy(t, cfg)
	for name, st := range probeAll(t, p, len(backends)) {
		if st != 1 {
			t.Errorf("replica %s: tokenizer state %d, want 1 (engines tokenize with the same tokenizer)", name, st)
		}
	}
	if keyer.Fallback() {
		t.Fatal("fallback on with matching replicas")
	}
	system := strings.Repeat("You are the support assistant of a large shop. Answer politely, cite the policy, never invent prices.\n", 25)
	send := func(question string) (replica string, matched int, u openai.Usage) {
		t.Helper()
		body, _ := json.Marshal(map[string]any{"model": "m", "max_tokens": 4, "messages": []map[string]string{
			{"role": "system", "content": system}, {"role": "user", "content": question}}})
		resp := post(t, srv.URL, "/v1/chat/completions", string(body))
		b := readAll(t, resp)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		var out struct{ Usage openai.Usage }
		if err := json.Unmarshal(b, &out); err != nil {
			t.Fatal(err)
		}
		return resp.Header.Get(HeaderReplica), matchedOf(resp.Header.Get(HeaderRoute)), out.Usage
	}
	want, _ := tok.EncodeChat([]tokenize.Message{{Role: "system", Content: system}, {Role: "user", Content: "Where is my order #1234?"}},
		tokenize.ChatOptions{AddGenerationPrompt: true})
	r1, m1, u1 := send("Where is my order #1234?")
	if u1.PromptTokens != len(want) {
		t.Errorf("first chat: engine counted %d prompt tokens, the tokenizer %d", u1.PromptTokens, len(want))
	}
	if m1 != 0 {
		t.Errorf("first chat: router predicted %d cached tokens on a cold cluster", m1)
	}
	for i, q := range []string{"Can I return a gift?", "Do you ship to Zürich, Switzerland?", "What is 12+30?"} {
		r, m, u := send(q)
		c := u.Cached(nil)
		if c <= 0 {
			t.Errorf("follow-up %d on %s: cached_tokens %d, want > 0", i, r, c)
		}
		if m != c {
			t.Errorf("follow-up %d on %s: router predicted %d cached tokens, replica reported %d", i, r, m, c)
		}
		if r != r1 {
			t.Errorf("follow-up %d went to %s, not to the prefix's replica %s", i, r, r1)
		}
	}
}

// TestTokenizerCheckCompare runs the exported check against fake replicas
// on loopback: one that tokenizes as the local tokenizer, one whose chat
// template differs, one without /tokenize, one that answers garbage, one
// that closes the connection, one that is not listening, and one whose
// URL has a path prefix.
func TestTokenizerCheckCompare(t *testing.T) {
	tok := testTokenizer(t)
	c := keying.NewTokenizerCheck(tok)
	c.Timeout = 5 * time.Second
	urlOf := func(b Backend) string { return b.URL }
	hangUp := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		conn, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			conn.Close()
		}
	}))
	t.Cleanup(hangUp.Close)
	down := httptest.NewServer(http.NotFoundHandler())
	down.Close()
	garbage := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "<html>") }))
	t.Cleanup(garbage.Close)
	prefixed := http.NewServeMux()
	prefixed.Handle("POST /v1/tokenize", http.StripPrefix("/v1", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]json.RawMessage
		_ = json.NewDecoder(r.Body).Decode(&body)
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": exactTokenize(tok)(body)})
	})))
	prefixedSrv := httptest.NewServer(prefixed)
	t.Cleanup(prefixedSrv.Close)
	tests := []struct {
		name       string
		url        string
		want       keying.TokenizerState
		wantErr    bool
		wantNoAnsw bool
	}{
		{"match", urlOf(tokenizeReplica(t, "m", exactTokenize(tok))), keying.TokenizerMatch, false, false},
		{"match behind a path and a slash", prefixedSrv.URL + "/v1/", keying.TokenizerMatch, false, false},
		{"chat differs", urlOf(tokenizeReplica(t, "d", func(b map[string]json.RawMessage) []uint32 {
			ids := exactTokenize(tok)(b)
			if _, chat := b["messages"]; chat {
				ids = ids[1:] // no BOS-like first token, say
			}
			return ids
		})), keying.TokenizerMismatch, true, false},
		{"404", urlOf(tokenizeReplica(t, "n", func(map[string]json.RawMessage) []uint32 { return nil })), keying.TokenizerUnknown, true, false},
		{"not vLLM's answer", garbage.URL, keying.TokenizerUnknown, true, false},
		{"connection closed", hangUp.URL, keying.TokenizerUnknown, true, true},
		{"not listening", down.URL, keying.TokenizerUnknown, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := c.Compare(context.Background(), nil, tt.url)
			if got != tt.want || (err != nil) != tt.wantErr || errors.Is(err, upstream.ErrNoAnswer) != tt.wantNoAnsw {
				t.Errorf("Compare = %v, %v; want %v, error %v, ErrNoAnswer %v", got, err, tt.want, tt.wantErr, tt.wantNoAnsw)
			}
		})
	}
	t.Run("timeout", func(t *testing.T) {
		release := make(chan struct{})
		slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-release:
			}
		}))
		defer slow.Close()
		defer close(release)
		c := keying.NewTokenizerCheck(tok)
		c.Timeout = 50 * time.Millisecond
		if got, err := c.Compare(context.Background(), nil, slow.URL); got != keying.TokenizerUnknown || !errors.Is(err, upstream.ErrNoAnswer) {
			t.Errorf("Compare = %v, %v; want unknown and ErrNoAnswer", got, err)
		}
	})
}

// TestTokenizerAuto: at the defaults (tokenizer auto) text and chats are
// keyed by text chunks until a replica's /tokenize confirms the bundled
// Qwen3 tokenizer and none disagrees; /debug/replicas says which keying is
// in force and why.
func TestTokenizerAuto(t *testing.T) {
	q, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	other := func(b map[string]json.RawMessage) []uint32 {
		ids := exactTokenize(q)(b)
		ids[0]++ // another model's tokenizer
		return ids
	}
	none := func(map[string]json.RawMessage) []uint32 { return nil }
	tests := []struct {
		name         string
		answers      []func(map[string]json.RawMessage) []uint32
		wantMode     string
		wantWhy      string
		wantFallback bool
	}{
		{"confirmed", []func(map[string]json.RawMessage) []uint32{exactTokenize(q), exactTokenize(q)}, "token ids", "2 replica(s)' /tokenize give the ids of qwen3", false},
		{"confirmed, one cannot tell", []func(map[string]json.RawMessage) []uint32{exactTokenize(q), none}, "token ids", "1 replica(s)' /tokenize give the ids of qwen3", false},
		{"another model", []func(map[string]json.RawMessage) []uint32{exactTokenize(q), other}, "text chunks", "replica r1's /tokenize gives other ids than qwen3", true},
		{"no /tokenize", []func(map[string]json.RawMessage) []uint32{none, none}, "text chunks", "no replica has confirmed qwen3", true},
	}
	chat := `{"model":"m","messages":[{"role":"system","content":"` + strings.Repeat("Be brief. ", 40) + `"},{"role":"user","content":"hi"}]}`
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.HealthInterval = time.Hour
			cfg.ScrapeInterval = 0
			cfg.Logger = slog.New(slog.DiscardHandler)
			for i, a := range tt.answers {
				cfg.Backends = append(cfg.Backends, tokenizeReplica(t, fmt.Sprintf("r%d", i), a))
			}
			p, srv := startProxy(t, cfg)
			keyer, ok := p.pool.Keyer.(*keying.TokenizerKeyer)
			if !ok || !keyer.Auto() || !keyer.Fallback() {
				t.Fatalf("default keyer %T: want auto, in fallback before any probe", p.pool.Keyer)
			}
			probeAll(t, p, len(tt.answers))
			if keyer.Fallback() != tt.wantFallback {
				t.Errorf("fallback %v, want %v", keyer.Fallback(), tt.wantFallback)
			}
			// The tokenizer loads in the background once confirmed.
			var dbg struct {
				Keying cluster.Keying `json:"keying"`
			}
			for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if err := json.Unmarshal(readAll(t, mustGet(t, srv.URL+"/debug/replicas")), &dbg); err != nil {
					t.Fatal(err)
				}
				if dbg.Keying.Mode == tt.wantMode || time.Now().After(deadline) {
					break
				}
			}
			if dbg.Keying.Mode != tt.wantMode || !dbg.Keying.Auto || dbg.Keying.Tokenizer != "qwen3" || !strings.HasPrefix(dbg.Keying.Why, tt.wantWhy) {
				t.Errorf("/debug/replicas keying %+v, want mode %q, why %q…", dbg.Keying, tt.wantMode, tt.wantWhy)
			}
			r := mustParse(t, openai.KindChat, chat)
			keys, _, _ := p.pool.Keyer.Keys(r)
			want, _, _ := keying.ChunkKeyer{BlockTokens: cfg.BlockTokens}.Keys(r)
			if !tt.wantFallback {
				ids, _ := keyer.EncodeChat(r.Chat)
				want = blocks.Keys(nil, ids, cfg.BlockTokens)
			}
			if !slices.Equal(keys, want) {
				t.Errorf("keys (fallback %v) are not the expected key space", tt.wantFallback)
			}
		})
	}
}
