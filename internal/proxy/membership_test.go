package proxy

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/discovery"
	"github.com/prefixlb/prefixlb/internal/promtest"
)

// servedBy sends n unary completions and counts the replicas that answered
// them (x-prefixlb-replica).
func servedBy(t *testing.T, url string, n int) map[string]int {
	t.Helper()
	out := map[string]int{}
	for i := range n {
		resp := post(t, url, "/v1/completions", `{"model":"m","prompt":"membership `+strings.Repeat("x", i)+`","max_tokens":2}`)
		readAll(t, resp)
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d", i, resp.StatusCode)
		}
		out[resp.Header.Get(HeaderReplica)]++
	}
	return out
}

// TestServeDynamicMembership: replicas join serve's pool through discovery
// (here its static source, the path a Kubernetes watcher takes too), leave
// it and change readiness while it serves; each change shows in routing,
// /health, /debug/replicas and /metrics, and a replica that joins again
// reuses its router slot under its own name.
func TestServeDynamicMembership(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	cfg := testConfig(a)
	cfg.Policy = "round-robin"
	p, srv := startProxy(t, cfg)
	runLoops(t, p)

	if got := servedBy(t, srv.URL, 4); got["a"] != 4 {
		t.Fatalf("before b joins: %v", got)
	}

	// b joins through discovery.
	bAddr := strings.TrimPrefix(b.srv.URL, "http://")
	src, err := discovery.NewStatic(bAddr, discovery.Ports{Metrics: -1}, p.pool)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = src.Run(ctx) }()
	select {
	case <-src.Synced():
	case <-time.After(5 * time.Second):
		t.Fatal("discovery did not sync")
	}
	if got := servedBy(t, srv.URL, 4); got["a"] != 2 || got[bAddr] != 2 {
		t.Fatalf("after b joined, round-robin: %v", got)
	}
	var health struct {
		Up       int `json:"replicas_up"`
		Replicas int `json:"replicas"`
	}
	if err := json.Unmarshal(readAll(t, mustGet(t, srv.URL+"/health")), &health); err != nil || health.Up != 2 || health.Replicas != 2 {
		t.Fatalf("/health %+v (%v)", health, err)
	}
	m := promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
	if v, ok := promtest.Series(m, "prefixlb_replica_up", "replica", bAddr); !ok || v != 1 {
		t.Errorf("prefixlb_replica_up{replica=%s} = %v, %v", bAddr, v, ok)
	}

	// Not ready: out of routing, still a member.
	p.pool.SetReady(bAddr, false)
	if got := servedBy(t, srv.URL, 3); got["a"] != 3 {
		t.Fatalf("b not ready: %v", got)
	}
	if v, _ := promtest.Series(promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics"), "prefixlb_replica_up", "replica", bAddr); v != 0 {
		t.Errorf("b not ready: prefixlb_replica_up = %v", v)
	}
	p.pool.SetReady(bAddr, true)
	if got := servedBy(t, srv.URL, 4); got[bAddr] != 2 {
		t.Fatalf("b ready again: %v", got)
	}

	// Removed: gone from routing, the debug view and the metrics.
	p.pool.Remove(bAddr)
	if got := servedBy(t, srv.URL, 3); got["a"] != 3 {
		t.Fatalf("b removed: %v", got)
	}
	reps := p.Replicas()
	if len(reps) != 1 || reps[0].Name != "a" {
		t.Errorf("/debug/replicas after removal: %+v", reps)
	}
	m = promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
	for _, name := range []string{"prefixlb_replica_up", "prefixlb_inflight", "prefixlb_decisions_total", "prefixlb_requests_total"} {
		if _, ok := promtest.Series(m, name, "replica", bAddr); ok {
			t.Errorf("%s still has a series for the removed replica", name)
		}
	}

	// Back under another name: the free slot is reused, and the decisions
	// name the new replica.
	p.pool.Add(cluster.Replica{Name: "b2", URL: b.srv.URL, Ready: true})
	p.mu.Lock()
	id := p.pool.ByName("b2").ID
	p.mu.Unlock()
	if id != 1 {
		t.Errorf("b2 took router slot %d, want the free slot 1", id)
	}
	if got := servedBy(t, srv.URL, 4); got["b2"] != 2 {
		t.Fatalf("b2 joined: %v", got)
	}
	resp := post(t, srv.URL, "/debug/route", `{"model":"m","prompt":"which one","max_tokens":2}`)
	if body := string(readAll(t, resp)); strings.Contains(body, bAddr) {
		t.Errorf("/debug/route still names the removed replica: %s", body)
	}
}

// TestServeDynamicHealth: serve's health checks run on a replica that
// joined while it runs, and eject it when it fails them.
func TestServeDynamicHealth(t *testing.T) {
	a, b := newFakeReplica(t, "a"), newFakeReplica(t, "b")
	cfg := testConfig(a)
	cfg.HealthInterval = 20 * time.Millisecond
	cfg.EjectAfter, cfg.ReadmitAfter = 1, 1
	p, srv := startProxy(t, cfg)
	states := make(chan string, 16)
	p.hookState = func(name string, up bool) {
		if up {
			states <- name + " up"
		} else {
			states <- name + " down"
		}
	}
	runLoops(t, p)
	p.pool.Add(cluster.Replica{Name: "b", URL: b.srv.URL, Ready: true})
	want := func(s string) {
		t.Helper()
		select {
		case got := <-states:
			if got != s {
				t.Fatalf("state %q, want %q", got, s)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("no %q", s)
		}
	}
	want("b up") // joined
	b.healthy.Store(false)
	want("b down")
	if got := servedBy(t, srv.URL, 3); got["a"] != 3 {
		t.Errorf("b ejected: %v", got)
	}
	b.healthy.Store(true)
	want("b up")
}

// TestConfigDiscovery: the YAML discovery block, and a bad target.
func TestConfigDiscovery(t *testing.T) {
	c, err := ParseConfig([]byte("discovery:\n  target: service:ml/vllm\n  http_port: 8000\n  kv_events_port: 5557\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if c.Discovery != "service:ml/vllm" || c.DiscoveryPorts.HTTP != 8000 || c.DiscoveryPorts.KVEvents != 5557 {
		t.Errorf("parsed %q %+v", c.Discovery, c.DiscoveryPorts)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("discovery without backends: %v", err)
	}
	c.Discovery = "deployment:ml/vllm"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "discovery.target") {
		t.Errorf("bad target: %v", err)
	}
	if _, err := ParseConfig([]byte("discovery:\n  target: service:ml/vllm\n  port: 8000\n"), DefaultConfig()); err == nil {
		t.Error("an unknown discovery field was accepted")
	}
}
