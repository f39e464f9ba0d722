package proxy

import (
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestTokenizePassThrough: POST /tokenize and /detokenize through serve
// answer what a replica answers (a client learns the replicas' tokenizer
// through the router, as from vLLM itself); a body over max_body_bytes is
// refused, and with no replica up the answer is 503.
func TestTokenizePassThrough(t *testing.T) {
	backends := startEngines(t, 2)
	cfg := DefaultConfig()
	cfg.Backends = backends
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.MaxBodyBytes = 4 << 10
	_, srv := startProxy(t, cfg)
	post := func(url, body string) (int, string, string) {
		t.Helper()
		resp, err := http.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), resp.Header.Get(HeaderReplica)
	}
	const body = `{"prompt":"the quick brown fox jumps over the lazy dog"}`
	_, want, _ := post(backends[0].URL+"/tokenize", body)
	seen := map[string]bool{}
	for range 4 {
		code, got, replica := post(srv.URL+"/tokenize", body)
		if code != http.StatusOK || got != want {
			t.Fatalf("/tokenize through serve: %d %s, want 200 %s", code, got, want)
		}
		seen[replica] = true
	}
	if len(seen) != 2 {
		t.Errorf("/tokenize went to %v, want both replicas in turn", seen)
	}
	dbody := `{"tokens":[1,2,3]}`
	// The modelled engine has no /detokenize: its answer, whatever it is,
	// is the client's.
	wantCode, wantD, _ := post(backends[0].URL+"/detokenize", dbody)
	if code, got, _ := post(srv.URL+"/detokenize", dbody); code != wantCode || got != wantD {
		t.Errorf("/detokenize through serve: %d %s, want %d %s", code, got, wantCode, wantD)
	}
	if code, _, _ := post(srv.URL+"/tokenize", `{"prompt":"`+strings.Repeat("x", 8<<10)+`"}`); code != http.StatusRequestEntityTooLarge {
		t.Errorf("an 8 KiB body over max_body_bytes 4 KiB: %d, want 413", code)
	}

	// No replica up: 503, not a hang.
	down := DefaultConfig()
	down.Backends = []Backend{{Name: "gone", URL: "http://127.0.0.1:1"}}
	down.Logger = slog.New(slog.DiscardHandler)
	down.HealthInterval = 50 * time.Millisecond
	p2, srv2 := startProxy(t, down)
	runLoops(t, p2)
	deadline := time.Now().Add(5 * time.Second)
	for {
		code, msg, _ := post(srv2.URL+"/tokenize", body)
		if code == http.StatusServiceUnavailable {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/tokenize with its only replica down: %d %s, want 503", code, msg)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
