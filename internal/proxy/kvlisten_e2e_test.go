package proxy

import (
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/kvevents"
)

// TestKVEventsListenEndToEnd: serve binds --kv-events-listen, two real
// engines' publishers dial it (as llm-d deploys vLLM) with the topic
// kv@<host:port>@<model>, and the router takes each replica's cache from
// its events: /debug/replicas and /debug/cache say so, and after a load
// the router's view agrees with every engine's cache.
func TestKVEventsListenEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("real sockets and engines")
	}
	// The engines' HTTP fronts first: their host:port is their topic.
	engines := make([]*kvEngine, 2)
	cfg := DefaultConfig()
	for i := range engines {
		k := &kvEngine{t: t, name: []string{"a", "b"}[i]}
		k.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			h := k.handler.Load()
			if h == nil {
				http.Error(w, "engine not started", http.StatusServiceUnavailable)
				return
			}
			(*h).ServeHTTP(w, r)
		}))
		t.Cleanup(k.srv.Close)
		engines[i] = k
		cfg.Backends = append(cfg.Backends, Backend{Name: k.name, URL: k.srv.URL})
	}
	cfg.KVEventsListen = "tcp://127.0.0.1:0"
	cfg.Logger = slog.New(slog.DiscardHandler)
	cfg.HealthInterval = 200 * time.Millisecond
	cfg.SpeculativeTTL = 300 * time.Millisecond
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	srv := httptest.NewServer(p.Handler())
	t.Cleanup(func() {
		cancel()
		<-done
		srv.Close()
		p.Close()
	})
	l := p.pool.Listener()
	select {
	case <-l.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("listener never bound")
	}
	listenEP := l.Endpoint()
	for _, v := range p.CacheView().Replicas {
		if v.KVEvents || v.Endpoint != "listen:"+listenEP {
			t.Errorf("%s before any batch: kv_events %v endpoint %q; want mirrored, listen:%s", v.Replica, v.KVEvents, v.Endpoint, listenEP)
		}
	}

	// The engines, publishing to the listener.
	for _, k := range engines {
		u, _ := url.Parse(k.srv.URL)
		startDialingEngine(t, k, listenEP, "kv@"+u.Host+"@prefixlb-sim")
	}
	// ZeroMQ's slow joiner: batches published before a PUB has our
	// subscription are lost. Empty the engines' caches (each reset is an
	// AllBlocksCleared batch) until each replica's events arrive.
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	deadline := time.After(20 * time.Second)
	for on := 0; on < len(engines); {
		on = 0
		for i, v := range p.CacheView().Replicas {
			if v.KVEvents {
				on++
				continue
			}
			resp, err := http.Post(engines[i].srv.URL+"/reset_prefix_cache", "", nil)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("replicas never switched to events: %+v", p.CacheView().Replicas)
		}
	}

	samples := kvLoad(t, srv.URL, 40, 0)
	waitAgree(t, p, engines, samples, 20*time.Second)

	req, _ := http.NewRequest(http.MethodGet, srv.URL+"/debug/replicas", nil)
	req.Header.Set("Authorization", "Bearer "+p.cfg.AdminToken)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var dr struct {
		Replicas []ReplicaStatus `json:"replicas"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&dr); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/debug/replicas: status %d, %v", resp.StatusCode, err)
	}
	for _, r := range dr.Replicas {
		if !r.Cache.Events || r.KVEvents != "listen:"+listenEP {
			t.Errorf("/debug/replicas %s: events %v kv_events %q; want true, listen:%s", r.Name, r.Cache.Events, r.KVEvents, listenEP)
		}
	}
	for _, v := range p.CacheView().Replicas {
		if v.Stream == nil || v.Stream.State != kvevents.StateListening || v.Stream.Batches == 0 || v.Router.Stored == 0 {
			t.Errorf("/debug/cache %s: stream %+v router %+v; want listening, batches and stored events", v.Replica, v.Stream, v.Router)
		}
	}
	if st := l.Stats(); st.Replicas != 2 || st.Dropped["unknown_topic"] != 0 {
		t.Errorf("listener stats %+v: want 2 replicas, nothing unknown", st)
	}
}

// startDialingEngine runs k's engine with a publisher that dials endpoint
// (no replay socket: the router cannot reach one it was not told of).
func startDialingEngine(t *testing.T, k *kvEngine, endpoint, topic string) {
	t.Helper()
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	ec := engine.DefaultConfig()
	ec.Replica.Profile = prof
	ec.Replica.KVCapacity = kvEngineCapacity
	ec.TimeScale = 50
	ec.Logger = slog.New(slog.DiscardHandler)
	pub := kvevents.NewPublisher(kvevents.PublisherConfig{Endpoint: endpoint, Dial: true, Topic: topic})
	ec.KVPublisher = pub
	e, err := engine.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	k.eng, k.cancel, k.done = e, cancel, make(chan error, 1)
	go func() { k.done <- e.Run(ctx) }()
	t.Cleanup(k.stop)
	select {
	case <-pub.Ready():
	case err := <-k.done:
		t.Fatalf("%s: Run: %v", k.name, err)
	}
	if !strings.HasPrefix(pub.Endpoint(), "tcp://") {
		t.Fatalf("%s: publisher endpoint %q", k.name, pub.Endpoint())
	}
	h := e.Handler()
	k.handler.Store(&h)
}
