package proxy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/engine/enginetest"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// e2eResult is what the end-to-end test learns from one streamed response.
type e2eResult struct {
	group   int
	replica string
	route   string
	chunks  int // events with text
	usage   *openai.Usage
	err     error
}

// startEngines runs n modelled replicas (internal/engine) on loopback, 100
// times faster than real time, until the test ends; configure, if given,
// adjusts each engine's config.
func startEngines(t *testing.T, n int, configure ...func(*engine.Config)) []Backend {
	t.Helper()
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	var out []Backend
	for i := range n {
		ec := engine.DefaultConfig()
		ec.Replica.Profile = prof
		ec.TimeScale = 100
		for _, f := range configure {
			f(&ec)
		}
		out = append(out, Backend{Name: fmt.Sprintf("engine-%d", i), URL: enginetest.Start(t, ec)})
	}
	return out
}

// e2ePrompt is a completions body whose prompt is the token ids of group
// g's shared prefix (prefix tokens) followed by suffix tokens unique to k.
func e2ePrompt(g, k, prefix, suffix, maxTokens int) string {
	var b strings.Builder
	b.WriteString(`{"model":"prefixlb-sim","prompt":[`)
	for i := range prefix + suffix {
		if i > 0 {
			b.WriteByte(',')
		}
		id := 1000*(g+1) + i // the group's prefix
		if i >= prefix {
			id = 100000 + 1000*k + i // this request's own suffix
		}
		b.WriteString(strconv.Itoa(id))
	}
	fmt.Fprintf(&b, `],"max_tokens":%d,"stream":true,"stream_options":{"include_usage":true}}`, maxTokens)
	return b.String()
}

// e2eSend posts body to the proxy and reads the stream to its end.
func e2eSend(ctx context.Context, client *http.Client, url, body string) e2eResult {
	var res e2eResult
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
	if err != nil {
		res.err = err
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		res.err = err
		return res
	}
	defer resp.Body.Close()
	res.replica = resp.Header.Get(HeaderReplica)
	res.route = resp.Header.Get(HeaderRoute)
	if resp.StatusCode != http.StatusOK {
		var msg bytes.Buffer
		_, _ = msg.ReadFrom(resp.Body)
		res.err = fmt.Errorf("status %d: %s", resp.StatusCode, msg.String())
		return res
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	done := false
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			done = true
			break
		}
		var c chunkInfo
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			res.err = fmt.Errorf("event %q: %v", data, err)
			return res
		}
		if len(c.Error) > 0 && string(c.Error) != "null" {
			res.err = fmt.Errorf("error event: %s", c.Error)
			return res
		}
		if c.Usage != nil {
			res.usage = c.Usage
		}
		for _, ch := range c.Choices {
			if ch.Text != nil && *ch.Text != "" {
				res.chunks++
			}
		}
	}
	if !done {
		res.err = fmt.Errorf("stream ended before [DONE]: %v", sc.Err())
	}
	return res
}

// matchedOf reads "matched=N" from an x-prefixlb-route header.
func matchedOf(route string) int {
	for _, f := range strings.Split(route, "; ") {
		if v, ok := strings.CutPrefix(f, "matched="); ok {
			n, _ := strconv.Atoi(v)
			return n
		}
	}
	return -1
}

// TestEndToEndPrefixReuse runs three real modelled replicas (package engine)
// behind the proxy with policy e2 and checks, over real HTTP and SSE, that
// every request completes, that requests sharing a long prefix are sent
// where it is cached and the replica reports the reuse
// (usage.prompt_tokens_details.cached_tokens), and that the routing headers
// name real replicas.
func TestEndToEndPrefixReuse(t *testing.T) {
	const (
		groups    = 4   // distinct shared prefixes
		perGroup  = 8   // requests per prefix, the first included
		prefix    = 512 // shared tokens: 32 blocks of 16
		suffix    = 40  // tokens unique to each request
		maxTokens = 6
	)
	backends := startEngines(t, 3)
	cfg := DefaultConfig()
	cfg.Backends = backends
	cfg.Policy = "e2"
	cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
	cfg.HealthInterval = time.Hour      // the engines are up; no checks needed
	cfg.ScrapeInterval = 0
	// The engines' speed is their profile's (TimeScale 100 of it): priced
	// as configured, not as a loaded test machine's scheduling makes it look
	// to calibration (which has its own end-to-end tests).
	cfg.Calibrate = false
	cfg.Logger = slog.New(slog.DiscardHandler)
	_, srv := startProxy(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	client := srv.Client()

	names := map[string]bool{}
	for _, b := range backends {
		names[b.Name] = true
	}
	check := func(r e2eResult, what string) {
		t.Helper()
		switch {
		case r.err != nil:
			t.Fatalf("%s: %v", what, r.err)
		case !names[r.replica]:
			t.Errorf("%s: %s = %q, not a backend", what, HeaderReplica, r.replica)
		case !strings.HasPrefix(r.route, "branch="):
			t.Errorf("%s: %s = %q, want an explanation", what, HeaderRoute, r.route)
		case r.chunks != maxTokens:
			t.Errorf("%s: %d text chunks, want %d", what, r.chunks, maxTokens)
		case r.usage == nil || r.usage.PromptTokens != prefix+suffix || r.usage.CompletionTokens != maxTokens:
			t.Errorf("%s: usage %+v, want %d prompt and %d completion tokens", what, r.usage, prefix+suffix, maxTokens)
		}
	}

	// Wave 1: the first request of each group, each alone, so that its
	// prefix is computed and cached before anything else asks for it.
	home := map[int]string{}
	for g := range groups {
		r := e2eSend(ctx, client, srv.URL, e2ePrompt(g, g, prefix, suffix, maxTokens))
		check(r, fmt.Sprintf("group %d first request", g))
		home[g] = r.replica
	}

	// Wave 2: the other requests, all at once.
	var wg sync.WaitGroup
	results := make([]e2eResult, groups*(perGroup-1))
	for i := range results {
		g, k := i%groups, groups+i
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = e2eSend(ctx, client, srv.URL, e2ePrompt(g, k, prefix, suffix, maxTokens))
			results[i].group = g
		}()
	}
	wg.Wait()

	hits, homed := 0, 0
	for i, r := range results {
		what := fmt.Sprintf("group %d follow-up %d (on %s, %s)", r.group, i, r.replica, r.route)
		check(r, what)
		if t.Failed() {
			return
		}
		cached := r.usage.Cached(nil)
		if cached > 0 {
			hits++
		}
		if r.replica == home[r.group] {
			homed++
			// The prefix was computed there before this request was sent:
			// the replica must report (at least) the prefix's full blocks.
			if cached < prefix {
				t.Errorf("%s: sent to the prefix's replica but cached_tokens = %d, want ≥ %d", what, cached, prefix)
			}
		}
		// A replica the router sent a concurrent request of the group to
		// (E2 replicating a hot prefix) may not have computed the prefix
		// yet: no claim about the router's prediction here.
	}
	// E2 may replicate a hot prefix to another replica (a miss there while
	// the first copy is computed), but most follow-ups must reuse a cached
	// prefix. (Round-robin would send two in three of them elsewhere.)
	if hits < 2*len(results)/3 {
		t.Errorf("%d of %d follow-ups hit the cache (%d went to their prefix's first replica): want at least two in three", hits, len(results), homed)
	}
	t.Logf("%d of %d follow-ups reported cached tokens; %d went to their prefix's first replica", hits, len(results), homed)

	// Wave 3: one more request per group, each alone. Every copy of every
	// prefix is computed by now, so the router's prediction (matched
	// tokens on the replica it chose) must be what the replica reports.
	for g := range groups {
		r := e2eSend(ctx, client, srv.URL, e2ePrompt(g, 1000+g, prefix, suffix, maxTokens))
		what := fmt.Sprintf("group %d last request (on %s, %s)", g, r.replica, r.route)
		check(r, what)
		if t.Failed() {
			return
		}
		m, cached := matchedOf(r.route), r.usage.Cached(nil)
		if m < prefix || cached < prefix {
			t.Errorf("%s: router predicted %d cached tokens, replica reported %d, want both ≥ %d", what, m, cached, prefix)
		}
	}
}
