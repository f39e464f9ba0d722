package epp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/promtest"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/tokenize"
)

func testTokenizer(t *testing.T) *tokenize.Tokenizer {
	t.Helper()
	tok, err := qwen3.Shared()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// How a fake replica's /tokenize answers.
const (
	answerMatch    int32 = iota // the ids of the same tokenizer, as vLLM's
	answerMismatch              // another model's: the last id differs
	answer404                   // no /tokenize
	answerSilent                // no answer until the client gives up
)

// tokenizeReplica is a fake vLLM replica on loopback whose /tokenize
// answers as *mode says, tokenizing with tok; it returns its "ip:port".
func tokenizeReplica(t *testing.T, tok *tokenize.Tokenizer, mode *atomic.Int32) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /tokenize", func(w http.ResponseWriter, r *http.Request) {
		var body struct {
			Prompt              *string            `json:"prompt"`
			Messages            []tokenize.Message `json:"messages"`
			AddGenerationPrompt bool               `json:"add_generation_prompt"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var ids []uint32
		switch mode.Load() {
		case answer404:
			http.NotFound(w, r)
			return
		case answerSilent:
			<-r.Context().Done()
			return
		}
		if body.Prompt != nil {
			ids = tok.Encode(*body.Prompt)
		} else {
			var err error
			if ids, err = tok.EncodeChat(body.Messages, tokenize.ChatOptions{AddGenerationPrompt: body.AddGenerationPrompt}); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
		}
		if mode.Load() == answerMismatch {
			ids[len(ids)-1]++
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids, "count": len(ids)})
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://")
}

// tokenizerEvent is one replica's last tokenizer check.
type tokenizerEvent struct {
	state    keying.TokenizerState
	noAnswer bool
	checks   int // checks so far
}

// tokenizerEvents records the picker's tokenizer checks (Picker.onTokenizer)
// for a test to wait on.
type tokenizerEvents struct {
	mu      sync.Mutex // guards last
	last    map[string]tokenizerEvent
	changed chan struct{} // signalled after each check
}

func watchTokenizer(p *Picker) *tokenizerEvents {
	ev := &tokenizerEvents{last: map[string]tokenizerEvent{}, changed: make(chan struct{}, 1)}
	p.mu.Lock()
	p.pool.Hooks.Tokenizer = func(name string, state keying.TokenizerState, err error) {
		ev.mu.Lock()
		e := ev.last[name]
		ev.last[name] = tokenizerEvent{state: state, noAnswer: errors.Is(err, upstream.ErrNoAnswer), checks: e.checks + 1}
		ev.mu.Unlock()
		select {
		case ev.changed <- struct{}{}:
		default:
		}
	}
	p.mu.Unlock()
	return ev
}

// wait waits until replica name's last check satisfies ok.
func (ev *tokenizerEvents) wait(t *testing.T, name, what string, ok func(tokenizerEvent) bool) {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		ev.mu.Lock()
		e, seen := ev.last[name]
		ev.mu.Unlock()
		if seen && ok(e) {
			return
		}
		select {
		case <-ev.changed:
		case <-timeout:
			t.Fatalf("replica %s: last check %+v (seen %v), want %s", name, e, seen, what)
		}
	}
}

// waitState waits until replica name's last answered check found want.
func (ev *tokenizerEvents) waitState(t *testing.T, name string, want keying.TokenizerState) {
	t.Helper()
	ev.wait(t, name, want.String(), func(e tokenizerEvent) bool { return !e.noAnswer && e.state == want })
}

// TestTokenizerCheck runs a picker keying with the Qwen3 tokenizer over
// fake replicas on loopback whose /tokenize tokenizes as it does, differs,
// answers 404 or does not answer, and reads the results from the real
// /metrics page: the mismatch turns text-chunk keys on for every replica;
// a fixed replica that is ready again, and a replica that leaves, turn
// them off; a replica that did not answer is retried until it does.
func TestTokenizerCheck(t *testing.T) {
	tok := testTokenizer(t)
	keyer := keying.NewTokenizerKeyer(tok, 16)
	p, err := NewPicker(Config{Keyer: keyer, Policy: "e2", ScrapeInterval: 20 * time.Millisecond,
		ScrapeTimeout: 250 * time.Millisecond, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	modes := map[string]*atomic.Int32{}
	add := func(name string, mode int32, ready bool) {
		modes[name] = new(atomic.Int32)
		modes[name].Store(mode)
		p.Add(Replica{Name: name, Address: tokenizeReplica(t, tok, modes[name]), Ready: ready})
	}
	add("same", answerMatch, true)
	add("differs", answerMismatch, true)
	add("no-tokenize", answer404, true)
	add("silent", answerSilent, true)
	add("cold", answerMatch, false) // not ready: not checked until it is
	ev := watchTokenizer(p)
	web := httptest.NewServer(p.MetricsHandler())
	t.Cleanup(web.Close)
	url := web.URL + "/metrics"

	type want struct {
		replica string // "": prefixlb_tokenizer_fallback
		v       float64
	}
	check := func(stage string, ws ...want) {
		t.Helper()
		fams := promtest.Scrape(t, nil, url)
		for _, w := range ws {
			name, labels := "prefixlb_tokenizer_match", []string{"replica", w.replica}
			if w.replica == "" {
				name, labels = "prefixlb_tokenizer_fallback", nil
			}
			if got, ok := promtest.Sum(fams, name, labels...); !ok || got != w.v {
				t.Errorf("%s: %s%v = %v (present %v), want %v", stage, name, labels, got, ok, w.v)
			}
		}
	}
	chat := proxyRequest(t, openai.KindChat, `{"model":"m","messages":[{"role":"system","content":"`+
		strings.Repeat("Be brief. ", 40)+`"},{"role":"user","content":"hi"}]}`)
	chunkKeys, _, _ := keying.ChunkKeyer{BlockTokens: 16}.Keys(chat)
	ids, err := keyer.EncodeChat(chat.Chat)
	if err != nil {
		t.Fatal(err)
	}
	tokenKeys := blocks.Keys(nil, ids, 16)
	keysAre := func(stage string, want []blocks.Key, what string) {
		t.Helper()
		if got, _, _ := p.cfg.Keyer.Keys(chat); !slices.Equal(got, want) {
			t.Errorf("%s: the picker's keys are not %s (fallback %v)", stage, what, keyer.Fallback())
		}
	}

	check("before Run", want{"same", -1}, want{"differs", -1}, want{"cold", -1}, want{"", 0})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})

	ev.waitState(t, "same", keying.TokenizerMatch)
	ev.waitState(t, "differs", keying.TokenizerMismatch)
	ev.waitState(t, "no-tokenize", keying.TokenizerUnknown)
	ev.wait(t, "silent", "two checks without an answer", func(e tokenizerEvent) bool { return e.noAnswer && e.checks >= 2 })
	check("checked", want{"same", 1}, want{"differs", 0}, want{"no-tokenize", -1}, want{"silent", -1}, want{"cold", -1}, want{"", 1})
	keysAre("one replica differs", chunkKeys, "text chunks")

	// The replica is fixed and, after a restart, ready again: checked
	// again, it matches, and token keys are back. The cold one is checked
	// once ready.
	modes["differs"].Store(answerMatch)
	p.SetReady("differs", false)
	p.SetReady("differs", true)
	p.SetReady("cold", true)
	ev.waitState(t, "differs", keying.TokenizerMatch)
	ev.waitState(t, "cold", keying.TokenizerMatch)
	check("fixed", want{"differs", 1}, want{"cold", 1}, want{"", 0})
	keysAre("every replica matches", tokenKeys, "token keys")

	// The silent replica answers at last, at its next retry.
	modes["silent"].Store(answerMatch)
	ev.waitState(t, "silent", keying.TokenizerMatch)
	check("silent answers", want{"silent", 1})

	// A mismatching replica joins, then leaves: its series leave with it,
	// and so does the fallback.
	add("late", answerMismatch, true)
	ev.waitState(t, "late", keying.TokenizerMismatch)
	check("late joined", want{"late", 0}, want{"", 1})
	keysAre("late joined", chunkKeys, "text chunks")
	p.Remove("late")
	check("late left", want{"", 0})
	if v, ok := promtest.Sum(promtest.Scrape(t, nil, url), "prefixlb_tokenizer_match", "replica", "late"); ok {
		t.Errorf("prefixlb_tokenizer_match{replica=late} = %v after it left, want no series", v)
	}
	keysAre("late left", tokenKeys, "token keys")

	// Picking works throughout; a picker keying by text chunks checks
	// nothing and exports no tokenizer series.
	if _, err := p.Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: completionBody("hello", false)}); err != nil {
		t.Fatal(err)
	}
	plain := newTestPicker(t, Config{Tokenizer: keying.TokenizerNone}, 1)
	pw := httptest.NewServer(plain.MetricsHandler())
	defer pw.Close()
	fams := promtest.Scrape(t, nil, pw.URL+"/metrics")
	for _, name := range []string{"prefixlb_tokenizer_match", "prefixlb_tokenizer_fallback"} {
		if _, ok := fams[name]; ok {
			t.Errorf("a text-chunk picker exports %s", name)
		}
	}
}

// proxyRequest parses body as the picker does.
func proxyRequest(t *testing.T, k openai.Kind, body string) *openai.Request {
	t.Helper()
	r, err := openai.ParseRequest(k, []byte(body))
	if err != nil {
		t.Fatal(fmt.Errorf("parse %s: %w", body, err))
	}
	return r
}
