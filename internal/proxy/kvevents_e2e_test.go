package proxy

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

// kvEngine is one engine publishing KV events on loopback, behind an HTTP
// server whose handler survives restarts of the engine.
type kvEngine struct {
	t        *testing.T
	name     string
	srv      *httptest.Server
	handler  atomic.Pointer[http.Handler]
	eng      *engine.Engine
	pubEP    string // bound endpoints, reused on restart
	replayEP string
	cancel   context.CancelFunc
	done     chan error
	// configure, when set, changes the engine's configuration.
	configure func(*engine.Config)
}

// kvEngineCapacity is small (64 blocks of 16 tokens) so the load evicts.
const kvEngineCapacity = 1024

// start runs a fresh engine and publisher on pubEP/replayEP (":0" ports the
// first time).
func (k *kvEngine) start(pubEP, replayEP string) {
	k.t.Helper()
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		k.t.Fatal(err)
	}
	ec := engine.DefaultConfig()
	ec.Replica.Profile = prof
	ec.Replica.KVCapacity = kvEngineCapacity
	ec.TimeScale = 50
	ec.Logger = slog.New(slog.DiscardHandler)
	pub := kvevents.NewPublisher(kvevents.PublisherConfig{
		Endpoint: pubEP, ReplayEndpoint: replayEP, Topic: "kv@" + k.name + "@prefixlb-sim",
	})
	ec.KVPublisher = pub
	if k.configure != nil {
		k.configure(&ec)
	}
	e, err := engine.New(ec)
	if err != nil {
		k.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	k.eng, k.cancel, k.done = e, cancel, make(chan error, 1)
	go func() { k.done <- e.Run(ctx) }()
	select {
	case <-pub.Ready():
	case err := <-k.done:
		k.t.Fatalf("%s: Run: %v", k.name, err)
	}
	k.pubEP, k.replayEP = pub.Endpoint(), pub.ReplayEndpoint()
	h := e.Handler()
	k.handler.Store(&h)
}

// stop ends the engine's Run (and so its publisher).
func (k *kvEngine) stop() {
	k.cancel()
	if err := <-k.done; err != nil {
		k.t.Errorf("%s: Run: %v", k.name, err)
	}
}

func startKVEngines(t *testing.T, n int, configure ...func(*engine.Config)) []*kvEngine {
	t.Helper()
	var out []*kvEngine
	for i := range n {
		k := &kvEngine{t: t, name: fmt.Sprintf("engine-%d", i)}
		for _, f := range configure {
			prev := k.configure
			k.configure = func(c *engine.Config) {
				if prev != nil {
					prev(c)
				}
				f(c)
			}
		}
		k.start("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
		k.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			(*k.handler.Load()).ServeHTTP(w, r)
		}))
		t.Cleanup(func() {
			k.srv.Close()
			k.stop()
		})
		out = append(out, k)
	}
	return out
}

func (k *kvEngine) backend() Backend {
	return Backend{Name: k.name, URL: k.srv.URL, KVEvents: k.pubEP, KVReplay: k.replayEP}
}

// startKVProxy runs a proxy over engines, subscribed to their events.
func startKVProxy(t *testing.T, engines []*kvEngine) (*Proxy, *httptest.Server, context.CancelFunc) {
	t.Helper()
	cfg := DefaultConfig()
	for _, k := range engines {
		cfg.Backends = append(cfg.Backends, k.backend())
	}
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
	stop := func() {
		cancel()
		<-done
		srv.Close()
		p.Close()
	}
	var once sync.Once
	t.Cleanup(func() { once.Do(stop) })
	return p, srv, func() { once.Do(stop) }
}

// kvPrompt is group g's 64-token prefix plus 32 tokens unique to k.
func kvPrompt(g, k int) []uint32 {
	out := make([]uint32, 0, 96)
	for i := range 64 {
		out = append(out, uint32(1000*(g+1)+i))
	}
	for i := range 32 {
		out = append(out, uint32(1_000_000+1000*k+i))
	}
	return out
}

// kvLoad sends n requests (groups of shared prefixes) through url, 8 at a
// time; offset keeps prompts of successive loads apart.
func kvLoad(t *testing.T, url string, n, offset int) [][]uint32 {
	t.Helper()
	prompts := make([][]uint32, n)
	for i := range prompts {
		prompts[i] = kvPrompt((offset+i)%7, offset+i)
	}
	sem := make(chan struct{}, 8)
	var wg sync.WaitGroup
	for _, pr := range prompts {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			body, _ := json.Marshal(map[string]any{"model": "prefixlb-sim", "prompt": pr, "max_tokens": 2})
			resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
			if err != nil {
				t.Errorf("request: %v", err)
				return
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Errorf("request: status %d", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	return prompts
}

// agree reports whether p's router sees exactly each engine's cache: the
// number of blocks, and the cached prefix of every sample prompt.
func agree(ctx context.Context, p *Proxy, engines []*kvEngine, samples [][]uint32) (bool, string) {
	var m prefixtree.Match
	for i, k := range engines {
		want := k.eng.Stats().CachedBlocks
		p.mu.Lock()
		p.rt.ExpireSpeculative(time.Now())
		got := p.rt.Tree().CachedBlocks(i)
		p.mu.Unlock()
		if got != want {
			return false, fmt.Sprintf("%s: router holds %d blocks, engine %d", k.name, got, want)
		}
		for _, pr := range samples {
			keys := blocks.Keys(nil, pr, 16)
			want, err := k.eng.CachedPrefix(ctx, keys)
			if err != nil {
				return false, err.Error()
			}
			p.mu.Lock()
			p.rt.Tree().Lookup(keys, &m)
			got := m.PerReplica[i]
			p.mu.Unlock()
			if got != want {
				return false, fmt.Sprintf("%s: router matches %d blocks of a prompt, engine %d", k.name, got, want)
			}
		}
	}
	return true, ""
}

// waitAgree polls agree until it holds or the deadline passes, and returns
// how long it took.
func waitAgree(t *testing.T, p *Proxy, engines []*kvEngine, samples [][]uint32, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	why := ""
	for {
		ok, w := agree(ctx, p, engines, samples)
		if ok {
			return time.Since(start)
		}
		why = w
		select {
		case <-ctx.Done():
			t.Fatalf("router and engines disagree after %v: %s", within, why)
		case <-tick.C:
		}
	}
}

// TestKVEventsEndToEnd: real engines publish over loopback ZeroMQ, the
// proxy subscribes, and the router's view agrees with every engine's cache
// after a mixed load with evictions, an engine restart, a cache reset and a
// router restart.
func TestKVEventsEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("real sockets and engines")
	}
	engines := startKVEngines(t, 3)
	p, srv, stopProxy := startKVProxy(t, engines)

	samples := kvLoad(t, srv.URL, 120, 0)
	waitAgree(t, p, engines, samples, 20*time.Second)
	evicted := 0
	for _, r := range p.CacheView().Replicas {
		if r.Router != nil {
			evicted += int(r.Router.Removed)
		}
	}
	if evicted == 0 {
		t.Errorf("the load evicted nothing; it should (capacity %d tokens)", kvEngineCapacity)
	}
	for _, r := range p.CacheView().Replicas {
		if r.Stream == nil || r.Router == nil || r.Router.Stored == 0 {
			t.Errorf("%s: no events applied: %+v", r.Replica, r)
		}
	}

	t.Run("engine restart", func(t *testing.T) {
		k := engines[0]
		before := engines[0].backend()
		k.stop()
		k.start(before.KVEvents, before.KVReplay)
		if k.pubEP != before.KVEvents {
			t.Fatalf("restarted on %s, want %s", k.pubEP, before.KVEvents)
		}
		more := kvLoad(t, srv.URL, 40, 1000)
		waitAgree(t, p, engines, append(samples, more...), 20*time.Second)
		if st := p.CacheView().Replicas[0].Stream; st.Restarts == 0 {
			t.Errorf("the subscriber saw no publisher restart: %+v", st)
		}
	})

	t.Run("reset prefix cache", func(t *testing.T) {
		k := engines[1]
		resp, err := http.Post(k.srv.URL+"/reset_prefix_cache", "", nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("reset: status %d", resp.StatusCode)
		}
		if n := k.eng.Stats().CachedBlocks; n != 0 {
			t.Fatalf("engine holds %d blocks after a reset", n)
		}
		waitAgree(t, p, engines, samples, 10*time.Second)
		if c := p.CacheView().Replicas[1].Router.Cleared; c == 0 {
			t.Error("no AllBlocksCleared reached the router")
		}
	})

	t.Run("debug cache", func(t *testing.T) {
		resp, err := http.Get(srv.URL + "/debug/cache")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var v CacheView
		if err := json.NewDecoder(resp.Body).Decode(&v); err != nil {
			t.Fatal(err)
		}
		if len(v.Replicas) != 3 || v.Replicas[0].Stream == nil || v.Replicas[0].Stream.Blocks[kvevents.MediumGPU] != engines[0].eng.Stats().CachedBlocks {
			t.Errorf("GET /debug/cache: %+v", v)
		}
	})

	t.Run("router restart", func(t *testing.T) {
		// Load the engines again, then replace the router: the new one
		// replays every stream from seq 0 and must agree again.
		samples2 := kvLoad(t, srv.URL, 80, 2000)
		waitAgree(t, p, engines, samples2, 20*time.Second)
		stopProxy()
		start := time.Now()
		p2, _, _ := startKVProxy(t, engines)
		took := waitAgree(t, p2, engines, samples2, 20*time.Second)
		total := 0
		for _, k := range engines {
			total += k.eng.Stats().CachedBlocks
		}
		var seqs []int64
		for _, r := range p2.CacheView().Replicas {
			seqs = append(seqs, r.Stream.LastSeq+1)
		}
		t.Logf("new router agrees with %d engines (%d cached blocks, %v batches replayed) %v after start (%v of polling)",
			len(engines), total, seqs, time.Since(start).Round(time.Millisecond), took.Round(time.Millisecond))
	})
}
