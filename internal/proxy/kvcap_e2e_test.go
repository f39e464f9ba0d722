package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/tenancy"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// TestKVCapacityFromEngines runs two modelled replicas of different cache
// sizes (engine --kv-capacity) behind serve: each one's capacity is read
// from its own /metrics (vllm:cache_config_info, as vLLM writes it),
// reaches /debug/replicas and the Prometheus gauge with its source, bounds
// the router's mirror of that replica, and prices E2's eviction term per
// replica: a hot prefix on the small replica makes a new request's M
// positive there, while the large replica has room.
func TestKVCapacityFromEngines(t *testing.T) {
	const bt = 16
	caps := []int{64 * bt, 80 * bt} // 1024 and 1280 tokens
	i := 0
	backends := startEngines(t, 2, func(c *engine.Config) {
		c.Replica.KVCapacity = caps[i]
		i++
	})
	cfg := DefaultConfig()
	cfg.Backends = backends
	cfg.Policy = "e2"
	cfg.Explain = tenancy.ExplainAlways
	cfg.HealthInterval = time.Hour
	cfg.ScrapeInterval = 0 // scraped by hand below
	cfg.Calibrate = false
	cfg.Logger = slog.New(slog.DiscardHandler)
	p, srv := startProxy(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	debug := func() []ReplicaStatus {
		t.Helper()
		resp, err := srv.Client().Get(srv.URL + "/debug/replicas")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct{ Replicas []ReplicaStatus }
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
			t.Fatal(err)
		}
		return out.Replicas
	}
	for _, r := range debug() {
		if r.KVCapacitySource != "profile" {
			t.Errorf("%s before any scrape: source %q, want profile", r.Name, r.KVCapacitySource)
		}
	}
	p.mu.Lock()
	members := append([]*backend(nil), p.backendsLocked()...)
	p.mu.Unlock()
	for _, b := range members {
		p.pool.Scrape(ctx, b.Member)
	}
	for i, r := range debug() {
		if r.KVCapacityTokens != caps[i] || r.KVCapacitySource != upstream.SourceVLLMMetrics {
			t.Errorf("%s: kv_capacity_tokens %d from %q, want %d from %s", r.Name, r.KVCapacityTokens, r.KVCapacitySource, caps[i], upstream.SourceVLLMMetrics)
		}
		if r.Cache.CapacityTokens != caps[i] {
			t.Errorf("%s: mirror capacity %d, want %d", r.Name, r.Cache.CapacityTokens, caps[i])
		}
	}
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for i, b := range backends {
		want := fmt.Sprintf("prefixlb_replica_kv_capacity_tokens{replica=%q,source=%q} %d", b.Name, upstream.SourceVLLMMetrics, caps[i])
		if !strings.Contains(string(page), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}

	// A 57-block prefix asked three times is hot where it landed; a new
	// 16-block prompt then misses everywhere. On the 64-block replica it
	// would push the prefix out (57 + 16 > 64): M > 0; the 80-block one
	// has room (57 + 16 ≤ 80): M = 0.
	var home string
	for k := range 3 {
		r := e2eSend(ctx, srv.Client(), srv.URL, e2ePrompt(0, k, 900, 0, 2))
		if r.err != nil {
			t.Fatal(r.err)
		}
		if k > 0 && r.replica != home {
			t.Fatalf("request %d of the prefix went to %s, not %s (%s)", k, r.replica, home, r.route)
		}
		home = r.replica
	}
	// The client has the last [DONE] a moment before the router books the
	// request's end (its blocks then count as cached, not in flight):
	// wait for that, as a later client would find it.
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		busy := 0
		for _, r := range debug() {
			busy += r.InFlight
		}
		if busy == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("requests still in flight 5 s after their answers ended")
		}
	}
	r := e2eSend(ctx, srv.Client(), srv.URL, e2ePrompt(7, 99, 256, 0, 2))
	if r.err != nil {
		t.Fatal(r.err)
	}
	m := evictionTerms(t, r.route)
	t.Logf("prefix on %s; new prompt: %s", home, r.route)
	switch home {
	case backends[0].Name:
		if m[0] <= 0 || m[1] != 0 {
			t.Errorf("prefix on the small replica: M = %v, want M(r0) > 0 and M(r1) = 0 (%s)", m, r.route)
		}
	case backends[1].Name:
		if m[0] != 0 || m[1] != 0 {
			t.Errorf("prefix on the large replica: M = %v, want 0 on both (%s)", m, r.route)
		}
	}
}

var evictionTerm = regexp.MustCompile(`r(\d+)=[^(]*\(L=[^,]*,M=([^,]*),`)

// evictionTerms reads each candidate's M from an x-prefixlb-route header.
func evictionTerms(t *testing.T, route string) map[int]float64 {
	t.Helper()
	out := map[int]float64{}
	for _, sm := range evictionTerm.FindAllStringSubmatch(route, -1) {
		r, _ := strconv.Atoi(sm[1])
		m, err := strconv.ParseFloat(sm[2], 64)
		if err != nil {
			t.Fatalf("route %q: %v", route, err)
		}
		out[r] = m
	}
	if len(out) == 0 {
		t.Fatalf("route %q names no candidates", route)
	}
	return out
}
