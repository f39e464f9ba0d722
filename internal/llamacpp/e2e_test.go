package llamacpp_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/upstream"

	"github.com/prefixlb/prefixlb/internal/llamacpp"
	"github.com/prefixlb/prefixlb/internal/proxy"
)

// startServers starts n llama-servers (-t 1 -np 2), or skips the test when
// no llama-server is available.
func startServers(t *testing.T, n int) []*llamacpp.Server {
	t.Helper()
	bin, model, skip := llamacpp.ForTest()
	if skip != "" {
		t.Skip(skip)
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	servers := make([]*llamacpp.Server, n)
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range servers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := llamacpp.Default(bin, model)
			servers[i], errs[i] = llamacpp.Start(ctx, o)
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, s := range servers {
			if s != nil {
				s.Stop()
			}
		}
	})
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	return servers
}

// ids is a prompt of n random token ids (seeded), inside the Qwen3 vocabulary.
func ids(seed uint64, n int) []int {
	r := rand.New(rand.NewPCG(seed, 7))
	out := make([]int, n)
	for i := range out {
		out[i] = 100 + r.IntN(150000-100)
	}
	return out
}

// startRouter runs `prefixlb serve` in-process in front of servers and
// waits until it has every replica up.
func startRouter(t *testing.T, policy string, servers []*llamacpp.Server) (*proxy.Proxy, string) {
	t.Helper()
	cfg := proxy.DefaultConfig()
	cfg.Policy = policy
	cfg.HealthInterval = 200 * time.Millisecond
	cfg.ScrapeInterval = 200 * time.Millisecond
	cfg.EjectAfter = 1
	for i, s := range servers {
		cfg.Backends = append(cfg.Backends, proxy.Backend{Name: fmt.Sprintf("llama-%d", i), URL: s.URL})
	}
	p, err := proxy.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{}, 2)
	go func() { _ = p.Run(ctx); done <- struct{}{} }()
	go func() { _ = p.Serve(ctx, ln); done <- struct{}{} }()
	t.Cleanup(func() { cancel(); <-done; <-done; p.Close() })
	deadline := time.Now().Add(20 * time.Second)
	for {
		up := 0
		for _, r := range p.Replicas() {
			if r.Up && r.Kind == upstream.LlamaCpp && r.Slots > 0 {
				up++
			}
		}
		if up == len(servers) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("replicas not up: %+v", p.Replicas())
		}
		time.Sleep(50 * time.Millisecond)
	}
	return p, "http://" + ln.Addr().String()
}

// answer is what a test reads of one response.
type answer struct {
	status  int
	replica string
	text    string
	usage   struct{ PromptTokens, CompletionTokens int }
	cached  int  // prompt_tokens − timings.prompt_n (-1: no timings)
	done    bool // a stream ended with [DONE]
	errored bool // a stream carried an error event
}

func post(t *testing.T, url, path string, body map[string]any) answer {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	a := answer{status: resp.StatusCode, replica: resp.Header.Get(proxy.HeaderReplica), cached: -1}
	read := func(data []byte) {
		var c struct {
			Choices []struct {
				Text    string `json:"text"`
				Message *struct {
					Content string `json:"content"`
				} `json:"message"`
				Delta *struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			Timings *struct {
				PromptN int `json:"prompt_n"`
			} `json:"timings"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(data, &c); err != nil {
			t.Errorf("%s: not JSON: %q", path, data)
			return
		}
		for _, ch := range c.Choices {
			a.text += ch.Text
			if ch.Message != nil {
				a.text += ch.Message.Content
			}
			if ch.Delta != nil {
				a.text += ch.Delta.Content
			}
		}
		if c.Usage != nil {
			a.usage.PromptTokens, a.usage.CompletionTokens = c.Usage.PromptTokens, c.Usage.CompletionTokens
			if c.Timings != nil {
				a.cached = c.Usage.PromptTokens - c.Timings.PromptN
			}
		}
		if len(c.Error) > 0 && string(c.Error) != "null" {
			a.errored = true
		}
	}
	if stream, _ := body["stream"].(bool); !stream {
		data, _ := io.ReadAll(resp.Body)
		if a.status == http.StatusOK {
			read(data)
		}
		return a
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if line == "[DONE]" {
			a.done = true
			continue
		}
		read([]byte(line))
	}
	return a
}

// TestRealEngineEndToEnd: prefixlb serve in front of three real
// llama-servers: completions and chats, streamed and unary, go through;
// the router learns each replica's cached tokens from llama.cpp's timings;
// a replica killed mid-stream ends that stream with a clean error, and the
// others keep serving.
func TestRealEngineEndToEnd(t *testing.T) {
	servers := startServers(t, 3)
	p, url := startRouter(t, "e2", servers)

	doc := ids(1, 1200)
	q := func(s uint64) []int { return append(append([]int(nil), doc...), ids(s, 20)...) }

	first := post(t, url, "/v1/completions", map[string]any{"model": "m", "prompt": q(2), "max_tokens": 4})
	if first.status != http.StatusOK || first.replica == "" || first.usage.CompletionTokens == 0 {
		t.Fatalf("unary completion: %+v", first)
	}
	// The same document with another question: e2 sends it where the
	// document is cached, and llama.cpp says it reused it.
	again := post(t, url, "/v1/completions", map[string]any{"model": "m", "prompt": q(3), "max_tokens": 4, "stream": true})
	if again.status != http.StatusOK || !again.done || again.text == "" {
		t.Fatalf("streamed completion: %+v", again)
	}
	if again.replica != first.replica {
		t.Errorf("shared document went to %s, then %s", first.replica, again.replica)
	}
	if again.cached < 1200 {
		t.Errorf("llama.cpp reports %d cached tokens on the repeat, want ≥ 1200", again.cached)
	}
	for _, stream := range []bool{false, true} {
		c := post(t, url, "/v1/chat/completions", map[string]any{"model": "m", "max_tokens": 4, "stream": stream,
			"messages": []map[string]string{{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}}})
		if c.status != http.StatusOK || c.usage.CompletionTokens == 0 || (stream && !c.done) {
			t.Errorf("chat (stream=%v): %+v", stream, c)
		}
	}
	// The router read the cached tokens llama.cpp reported and checked its
	// prediction against them.
	var checked int
	for i, r := range p.Replicas() {
		checked += r.Cache.Checked
		if r.Cache.Slots != 2 {
			t.Errorf("replica %d: router sees %d slots, want 2 (llama-server -np 2)", i, r.Cache.Slots)
		}
	}
	if checked < 4 {
		t.Errorf("router checked %d predictions against llama.cpp's reports, want ≥ 4", checked)
	}
	// Calibration (on by default) learnt each replica's prefill from
	// llama.cpp's timings of the requests it served, and its model now
	// agrees with them.
	var timed int64
	for _, r := range p.Replicas() {
		if !r.Calibrated || r.Learnt == nil {
			t.Fatalf("%s: not calibrating (calibrated %v)", r.Name, r.Calibrated)
		}
		timed += r.Learnt.PrefillTimings
		if a := r.Learnt.TimedPrefill; a.N > 0 && (a.Ratio() < 0.5 || a.Ratio() > 2) {
			t.Errorf("%s: the model predicts %.2f× what llama.cpp measured of %d prefills, want within 2×", r.Name, a.Ratio(), a.N)
		}
	}
	if timed < 4 {
		t.Errorf("calibration learnt from %d of llama.cpp's prefill timings, want ≥ 4", timed)
	}

	// A long stream; its replica is killed as soon as the stream has begun.
	got := make(chan answer, 1)
	started := make(chan string, 1)
	go func() {
		b, _ := json.Marshal(map[string]any{"model": "m", "prompt": ids(9, 300), "max_tokens": 2000, "stream": true, "ignore_eos": true})
		resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
		if err != nil {
			got <- answer{status: -1}
			return
		}
		defer resp.Body.Close()
		started <- resp.Header.Get(proxy.HeaderReplica)
		a := answer{status: resp.StatusCode}
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			line, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok {
				continue
			}
			if line == "[DONE]" {
				a.done = true
			} else if strings.Contains(line, `"error"`) {
				a.errored = true
			}
		}
		got <- a
	}()
	var victim string
	select {
	case victim = <-started:
	case <-time.After(30 * time.Second):
		t.Fatal("long stream did not start")
	}
	idx := -1
	fmt.Sscanf(victim, "llama-%d", &idx)
	if idx < 0 || idx >= len(servers) {
		t.Fatalf("stream served by %q", victim)
	}
	servers[idx].Kill()
	select {
	case a := <-got:
		if !a.errored || !a.done {
			t.Errorf("stream cut by a dead replica: %+v, want an error event then [DONE]", a)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("stream did not end after its replica died")
	}
	for i := 0; i < 4; i++ {
		a := post(t, url, "/v1/completions", map[string]any{"model": "m", "prompt": ids(uint64(20+i), 200), "max_tokens": 2})
		if a.status != http.StatusOK {
			t.Errorf("request %d after the kill: status %d", i, a.status)
		}
		if a.replica == victim {
			t.Errorf("request %d served by the dead replica %s", i, victim)
		}
	}
}
