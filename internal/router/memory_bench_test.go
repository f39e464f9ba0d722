package router

import (
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// treeHeapProfile names a file for BenchmarkTreeMemory to write a heap
// profile to while the churned router is still live (the -memprofile the
// testing package writes comes after the router is gone). Pair it with
// -memprofilerate 1 for exact figures.
var treeHeapProfile = flag.String("tree-heap-profile", "", "BenchmarkTreeMemory: write a heap profile of the churned router to this file")

// treeMemBlocks is BenchmarkTreeMemory's tree bound. The default bound
// (prefixtree.DefaultMaxBlocks, 2M) takes minutes and a GiB to churn: run it
// with -tree-memory-blocks=2097152 and -bench 'TreeMemory/policy=e2/replicas=3/cache=events'.
var treeMemBlocks = flag.Int("tree-memory-blocks", 100_000, "BenchmarkTreeMemory: the tree's bound in blocks")

// memWorkloads are cycled batch by batch, as the one-hour soak cycles them
// minute by minute (internal/chaos, soakWorkloads and genWorkload).
var memWorkloads = []string{"toolbench", "shared-prefix", "agent"}

// memBatch generates batch m of the memory benchmark's workload: 600
// requests (a minute of the soak at 10 requests/s) of the m-th workload in
// turn, seeded by m, with the soak's parameters.
func memBatch(b *testing.B, m, replicas int) []workload.Request {
	name := memWorkloads[m%len(memWorkloads)]
	s := workload.DefaultSpec(name)
	s.Requests, s.Seed, s.Replicas = 600, int64(m+1), replicas
	s.OutputTokens = 100
	switch name {
	case "toolbench":
		s.ToolBench.Tools, s.ToolBench.Zipf = 8, 1.1
	case "shared-prefix":
		s.SharedPrefix = workload.SharedPrefixParams{Groups: 6, SystemTokens: 1500, Questions: 4, QuestionTokens: 200, Output: 40}
	case "agent":
		s.Agent.Environments = 10
	}
	reqs, err := workload.Generate(s)
	if err != nil {
		b.Fatal(err)
	}
	return reqs
}

// BenchmarkTreeMemory measures the live heap the routing core keeps per
// block of its prefix tree once the tree's bound has churned: the figure
// behind --tree-max-blocks' help. The router (llama3.1-8b-h100, the soak's
// profile) routes the soak's workloads (toolbench, shared-prefix and agent in
// turn, new prompts every batch) at 10 requests/s on the injected clock until
// its tree has reached its bound (100k blocks; -tree-memory-blocks) and then
// evicted twice the nodes it held; then the heap with the router live is
// compared with the heap once it is dropped, both after runtime.GC().
//
// The cache modes:
//   - events: the replicas are models of vLLM engines (internal/replica)
//     whose KV events the router applies as the proxy would. The engines
//     evict single blocks, and the router splits its nodes to follow.
//   - chunks: the same, but the router keys prompts differently from the
//     engines' blocks, as `prefixlb serve` without --tokenizer keys text by
//     chunks while the events carry token ids (docs/kubernetes.md, "Keys"):
//     the events build a tree of their own beside the routed prompts, which
//     only speculative entries mark cached. This is the soak's setup.
//   - mirror: the router mirrors the replicas' caches from its own
//     decisions, about five requests in flight.
//
// Run it, and profile where the memory goes, with
//
//	go test -run XXX -bench TreeMemory -benchtime 1x ./internal/router/
//	go test -run XXX -bench 'TreeMemory/policy=e2/replicas=3/cache=events' -benchtime 1x -memprofilerate 1 \
//	    ./internal/router/ -args -tree-heap-profile=/tmp/tree.heap
//	go tool pprof -sample_index=inuse_space -top /tmp/tree.heap
//
// Metrics: B/block (live heap over tree blocks), B/node, blocks/node and
// live-MiB. The log line adds what the whole test process held at the end
// of the churn, before the GC: its heap resident (HeapSys−HeapReleased) and
// RSS, against its live heap after the GC, the ratio that turns the live
// figure into a process's RSS.
func BenchmarkTreeMemory(b *testing.B) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		b.Fatal(err)
	}
	cases := []struct {
		policy   string
		replicas int
		cache    string
	}{
		{"e2", 3, "chunks"},
		{"e2", 3, "events"},
		{"e2", 3, "mirror"},
		{"e2", 8, "events"},
		{"least-load", 3, "events"},
		{"prefix", 3, "events"},
	}
	for _, c := range cases {
		b.Run(fmt.Sprintf("policy=%s/replicas=%d/cache=%s", c.policy, c.replicas, c.cache), func(b *testing.B) {
			b.ReportAllocs()
			var m treeMem
			for i := 0; i < b.N; i++ {
				m = treeMemory(b, prof, c.policy, c.replicas, c.cache, *treeMemBlocks)
			}
			b.ReportMetric(m.live/float64(m.blocks), "B/block")
			b.ReportMetric(m.live/float64(m.nodes), "B/node")
			b.ReportMetric(float64(m.blocks)/float64(m.nodes), "blocks/node")
			b.ReportMetric(m.live/(1<<20), "live-MiB")
		})
	}
}

// treeMem is what one churn measured.
type treeMem struct {
	live          float64 // bytes of live heap the router holds
	blocks, nodes int
}

// memEngine is one modelled engine of the events mode and the state of its
// step loop.
type memEngine struct {
	rep  *replica.Replica
	end  time.Time // end of the iteration in progress, while busy
	busy bool
	ev   []replica.Event
	hit  map[uint64]int // cached prompt tokens by request, from Admitted
}

// treeMemory runs one churn of a router bounded at maxBlocks and measures
// the live heap it holds.
func treeMemory(b *testing.B, prof costmodel.Profile, pname string, replicas int, cache string, maxBlocks int) treeMem {
	events := cache != "mirror"
	pol, err := policy.New(pname, policy.DefaultOptions())
	if err != nil {
		b.Fatal(err)
	}
	r, err := New(Config{BlockTokens: blocks.DefaultBlockSize, Profile: prof, Policy: pol, Seed: 1, TreeMaxBlocks: maxBlocks})
	if err != nil {
		b.Fatal(err)
	}
	engines := make([]*memEngine, replicas)
	for i := range engines {
		r.AddReplica(fmt.Sprintf("replica-%d", i), events)
		if events {
			rep, err := replica.New(replica.Config{Profile: prof})
			if err != nil {
				b.Fatal(err)
			}
			engines[i] = &memEngine{rep: rep, hit: make(map[uint64]int)}
		}
	}
	now := time.Unix(1_700_000_000, 0)
	const (
		step     = 100 * time.Millisecond // 10 requests/s, the soak's rate
		inFlight = 5                      // cache=mirror: requests in flight
	)
	// deliver applies engine i's events to the router, as the proxy's KV
	// event subscriber and response streams would.
	deliver := func(i int, e *memEngine) {
		for _, ev := range e.ev {
			var err error
			switch ev.Kind {
			case replica.Admitted:
				if _, seen := e.hit[ev.RequestID]; !seen {
					e.hit[ev.RequestID] = ev.HitTokens
				}
			case replica.FirstToken:
				err = r.FirstToken(ev.RequestID, ev.At)
			case replica.Finished:
				err = r.Finished(ev.RequestID, ev.N, e.hit[ev.RequestID], true, ev.At)
				delete(e.hit, ev.RequestID)
			case replica.BlocksStored:
				// An unknown parent (evicted from the bounded tree) is what
				// the proxy logs and replays; skip it as the simulator does.
				_ = r.CacheStored(i, ev.Parent, ev.HasParent, ev.Keys, ev.At)
			case replica.BlocksRemoved:
				err = r.CacheRemoved(i, ev.Keys)
			case replica.AllCleared:
				err = r.CacheCleared(i)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
	}
	advance := func(now time.Time) {
		for i, e := range engines {
			for e.busy && !e.end.After(now) {
				e.end, e.ev, e.busy = e.rep.Step(e.end, e.ev[:0])
				deliver(i, e)
			}
		}
	}
	var (
		id      uint64
		pending []uint64 // cache=mirror: in flight, oldest first
		// trace sums the decisions, so that a change meant to save memory
		// can be checked to route exactly as before (the log line shows it).
		trace uint64
	)
	fullNodes := -1 // nodes when the tree first reached its bound
	for m := 0; fullNodes < 0 || r.Tree().Evictions() < 2*fullNodes; m++ {
		for _, wr := range memBatch(b, m, replicas) {
			id++
			// Keys are the router's (and the engine's) until the request
			// finishes: a fresh slice each.
			keys := blocks.Keys(nil, wr.Tokens, blocks.DefaultBlockSize)
			engineKeys := keys
			if cache == "chunks" {
				// Text chunks: the same prefixes, other keys.
				keys = chunkKeys(wr.Tokens)
			}
			req := policy.Request{ID: id, Keys: keys, PromptTokens: len(wr.Tokens), OutputTokens: wr.OutputTokens}
			if events {
				advance(now)
			}
			d, err := r.Route(req, now)
			if err != nil {
				b.Fatal(err)
			}
			trace = trace*1099511628211 + uint64(d.Replica+1)*(1+uint64(d.MatchedTokens))
			if events {
				e := engines[d.Replica]
				if err := e.rep.Submit(&replica.Request{ID: id, Keys: engineKeys, PromptTokens: req.PromptTokens, OutputTokens: req.OutputTokens}, now); err != nil {
					b.Fatal(err)
				}
				if !e.busy {
					e.end, e.ev, e.busy = e.rep.Step(now, e.ev[:0])
					deliver(d.Replica, e)
				}
			} else {
				pending = append(pending, id)
				if len(pending) > inFlight {
					old := pending[0]
					pending = pending[1:]
					if err := r.FirstToken(old, now); err != nil {
						b.Fatal(err)
					}
					if err := r.Finished(old, req.OutputTokens, -1, true, now); err != nil {
						b.Fatal(err)
					}
				}
			}
			now = now.Add(step)
		}
		if fullNodes < 0 && r.Tree().Blocks() >= maxBlocks {
			fullNodes = r.Tree().Nodes()
		}
	}
	b.StopTimer()

	t := r.Tree()
	got := treeMem{blocks: t.Blocks(), nodes: t.Nodes()}
	evictions, routed := t.Evictions(), r.Stats().Routed
	var busy runtime.MemStats
	runtime.ReadMemStats(&busy)
	rss := vmRSS()
	runtime.GC()
	var with runtime.MemStats
	runtime.ReadMemStats(&with)
	if *treeHeapProfile != "" {
		f, err := os.Create(*treeHeapProfile)
		if err != nil {
			b.Fatal(err)
		}
		if err := pprof.WriteHeapProfile(f); err != nil {
			b.Fatal(err)
		}
		if err := f.Close(); err != nil {
			b.Fatal(err)
		}
	}
	// The engines' models are not the router's: measure without them too.
	runtime.KeepAlive(r)
	r, pol = nil, nil
	runtime.GC()
	var without runtime.MemStats
	runtime.ReadMemStats(&without)
	runtime.KeepAlive(engines)
	got.live = float64(with.HeapAlloc) - float64(without.HeapAlloc)
	resident := float64(busy.HeapSys - busy.HeapReleased)
	b.Logf("%s, %d replicas, cache=%s: %d blocks in %d nodes (%.2f blocks/node), %d evictions, %d requests (decisions %016x); router live heap %.1f MiB (%.0f B/block); process: live heap %.1f MiB, heap resident %.1f MiB (%.2f×), RSS %.1f MiB",
		pname, replicas, cache, got.blocks, got.nodes, float64(got.blocks)/float64(got.nodes), evictions, routed, trace,
		got.live/(1<<20), got.live/float64(got.blocks),
		float64(with.HeapAlloc)/(1<<20), resident/(1<<20), resident/float64(with.HeapAlloc), rss/(1<<20))
	b.StartTimer()
	return got
}

// vmRSS is the process's resident set in bytes, from /proc (0 where there is
// none).
func vmRSS() float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "VmRSS:" && f[2] == "kB" {
			kb, err := strconv.ParseFloat(f[1], 64)
			if err != nil {
				return 0
			}
			return kb * 1024
		}
	}
	return 0
}

// chunkKeys keys tokens as the router keys text by chunks: blocks over the
// same prompt (so prompts share exactly the prefixes they share as tokens),
// chained from another start, so that no key is an engine block's.
func chunkKeys(tokens []uint32) []blocks.Key {
	const salt = 0x5bd1e995
	t := make([]uint32, len(tokens))
	for i, x := range tokens {
		t[i] = x ^ salt
	}
	return blocks.Keys(nil, t, blocks.DefaultBlockSize)
}
