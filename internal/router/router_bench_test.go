package router

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

// benchWorkload is a pool of prompts that share system prompts, the shape of
// the Preble and llm-d benchmarks: every prompt is one of a few long shared
// prefixes followed by a private suffix of the same length.
type benchWorkload struct {
	promptTokens int
	fill         []policy.Request // routed before the timer: they fill the tree
	pool         []benchRequest   // routed in turn under the timer
}

// benchRequest is one request of the timed pool. In BenchmarkRouteChurn its
// keys from fresh on are salted with the iteration number before routing, so
// that they are new to the tree every time, however long the benchmark runs.
type benchRequest struct {
	req   policy.Request
	fresh int // index of the first salted key; len(req.Keys) for none
}

// benchTokens returns n pseudo-random token ids drawn from seed.
func benchTokens(seed uint64, n int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 0x70c))
	t := make([]uint32, n)
	for i := range t {
		t[i] = rng.Uint32N(150000)
	}
	return t
}

// newBenchWorkload builds prompts of promptTokens tokens: half a shared
// prefix (one of `groups`), half a private suffix. The fill holds enough
// prompts for the tree to pass minBlocks; the pool mixes repeats of filled
// prompts (half: hits in the tree, and on a replica if it still caches
// them), new suffixes on known prefixes (a quarter: partial hits), and
// prompts never seen (a quarter: misses).
func newBenchWorkload(promptTokens, groups, minBlocks, poolSize int) *benchWorkload {
	const bt = blocks.DefaultBlockSize
	half := promptTokens / 2
	prefixes := make([][]uint32, groups)
	for g := range prefixes {
		prefixes[g] = benchTokens(uint64(g)+1, half)
	}
	seq := uint64(1 << 32)
	prompt := func(g int) policy.Request {
		seq++
		toks := append(append(make([]uint32, 0, promptTokens), prefixes[g]...), benchTokens(seq, promptTokens-half)...)
		return policy.Request{Keys: blocks.Keys(nil, toks, bt), PromptTokens: promptTokens, OutputTokens: 128}
	}
	w := &benchWorkload{promptTokens: promptTokens}
	blocksIn := groups * half / bt
	for i := 0; blocksIn < minBlocks || i < groups; i++ {
		w.fill = append(w.fill, prompt(i%groups))
		blocksIn += (promptTokens - half) / bt
	}
	for i := 0; i < poolSize; i++ {
		switch i % 4 {
		case 0, 1:
			req := w.fill[(i*7919)%len(w.fill)]
			w.pool = append(w.pool, benchRequest{req: req, fresh: len(req.Keys)})
		case 2:
			req := prompt((i * 31) % groups)
			w.pool = append(w.pool, benchRequest{req: req, fresh: half / bt})
		default:
			req := prompt((i * 31) % groups)
			w.pool = append(w.pool, benchRequest{req: req, fresh: 0})
		}
	}
	return w
}

// BenchmarkRoute measures one routing decision of every policy on 8 mirrored
// replicas of Mistral-7B/A6000 whose tree already holds 100k blocks. Each
// iteration routes a prompt from a precomputed pool and finishes it at once,
// so in-flight load stays bounded and the decision's own cost is what is
// measured (tree lookup and insertion, the policy, the mirror's LRU eviction,
// the observer). The pool's new prompts miss on their first pass and hit the
// tree (not necessarily a replica's mirrored cache) after that.
//
// The policies that price work in seconds (e2, e2-preble) run twice,
// calibrate=off and calibrate=on: with calibration the router prices each
// replica with its own calibrated model (internal/calibrate), which the fill
// teaches (its requests get a first token and finish with token gaps), so
// that the timed decisions price with learnt models. What learning itself
// costs per request is BenchmarkRouteCalibration's.
//
//	go test -run XXX -bench BenchmarkRoute -benchtime 2s -cpu 1 ./internal/router/
func BenchmarkRoute(b *testing.B) { benchRoutePolicies(b, false, 0) }

// BenchmarkRouteChurn is BenchmarkRoute in the steady state of a busy
// router: half the requests carry keys the tree has never seen (salted per
// iteration), and the tree is bounded at 200k blocks, so every miss inserts
// and the bound evicts as much: the key index churns.
func BenchmarkRouteChurn(b *testing.B) { benchRoutePolicies(b, true, 200_000) }

func benchRoutePolicies(b *testing.B, fresh bool, maxBlocks int) {
	prof, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		b.Fatal(err)
	}
	sizes := []struct {
		name   string
		tokens int
		groups int
		pool   int
	}{
		{"4k", 4096, 64, 2048},
		{"60k", 61440, 8, 256},
	}
	workloads := make([]*benchWorkload, len(sizes))
	for _, pname := range policy.Names() {
		cals := []bool{false}
		if !fresh && (pname == "e2" || pname == "e2-preble") {
			cals = []bool{false, true}
		}
		b.Run("policy="+pname, func(b *testing.B) {
			for si, sz := range sizes {
				for _, cal := range cals {
					name := "prompt=" + sz.name
					if len(cals) > 1 {
						name += map[bool]string{false: "/calibrate=off", true: "/calibrate=on"}[cal]
					}
					b.Run(name, func(b *testing.B) {
						if workloads[si] == nil {
							workloads[si] = newBenchWorkload(sz.tokens, sz.groups, 100_000, sz.pool)
						}
						benchRoute(b, prof, pname, workloads[si], fresh, maxBlocks, cal, 0)
					})
				}
			}
		})
	}
}

// BenchmarkRouteFullCaches is BenchmarkRoute's 60k-token prompts on loaded
// replicas with full caches, the state of a capacity search's overloaded
// probes: 512 requests stay in flight (each finishes 512 decisions after it
// was routed), so the LRU end of every replica's full cache is the
// prefixes its queued requests hold, which E2's eviction term must not
// count (docs/performance.md, "E2 on full caches").
//
//	go test -run XXX -bench BenchmarkRouteFullCaches -benchtime 2s -cpu 1 ./internal/router/
func BenchmarkRouteFullCaches(b *testing.B) {
	prof, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		b.Fatal(err)
	}
	w := newBenchWorkload(61440, 8, 100_000, 256)
	for _, pname := range []string{"prefix", "llmd-precise", "sglang", "e2"} {
		b.Run("policy="+pname+"/prompt=60k/inflight=512", func(b *testing.B) {
			benchRoute(b, prof, pname, w, false, 0, false, 512)
		})
	}
}

// benchRoute times decisions of policy pname on w's pool after routing its
// fill. inflight > 0 keeps that many requests in flight (a request
// finishes inflight decisions after it was routed); 0 finishes each at
// once.
func benchRoute(b *testing.B, prof costmodel.Profile, pname string, w *benchWorkload, fresh bool, maxBlocks int, cal bool, inflight int) {
	pol, err := policy.New(pname, policy.DefaultOptions())
	if err != nil {
		b.Fatal(err)
	}
	cfg := Config{BlockTokens: blocks.DefaultBlockSize, Profile: prof, Policy: pol, Seed: 1, TreeMaxBlocks: maxBlocks}
	if cal {
		c := calibrate.DefaultConfig()
		cfg.Calibrate = &c
	}
	r, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 8; i++ {
		r.AddReplica(fmt.Sprintf("replica-%d", i), false)
	}
	now := benchClock()
	const step = 5 * time.Millisecond // 200 requests/s on the injected clock
	id := uint64(0)
	route := func(req policy.Request) {
		id++
		req.ID = id
		if _, err := r.Route(req, now); err != nil {
			b.Fatal(err)
		}
		switch {
		case inflight == 0:
			if err := r.Finished(id, req.OutputTokens, -1, true, now); err != nil {
				b.Fatal(err)
			}
		case id > uint64(inflight):
			if err := r.Finished(id-uint64(inflight), req.OutputTokens, -1, true, now); err != nil {
				b.Fatal(err)
			}
		}
		now = now.Add(step)
	}
	for i, req := range w.fill {
		if cal && i%2 == 0 {
			// Teach the replicas' models what the profile says (so that
			// the decisions timed are those of the profile, priced
			// through learnt models): the first token after the profile's
			// prefill of what the replica lacked, the end 64 steps later.
			id++
			req.ID = id
			d, err := r.Route(req, now)
			if err != nil {
				b.Fatal(err)
			}
			first := now.Add(prof.Prefill(req.PromptTokens-d.MatchedTokens, req.PromptTokens))
			_ = r.FirstToken(id, first)
			step := prof.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: req.PromptTokens})
			fin := Finish{OutputTokens: 65, CachedTokens: d.MatchedTokens, OK: true, ITL: step, ITLSamples: 64}
			if err := r.Finish(id, fin, first.Add(64*step)); err != nil {
				b.Fatal(err)
			}
			now = first.Add(64*step + time.Second)
			continue
		}
		route(req)
	}
	if cal {
		// Every replica prices with a learnt fit: its own, or its pool's
		// (the replicas it shares the profile with) if e2 sent it none of
		// the teaching requests.
		learnt := 0
		for i := range r.reps {
			if fit, _, _ := r.Calibration(i); fit.PrefillSamples > 0 && fit.DecodeSamples > 0 {
				learnt++
			}
		}
		if learnt == 0 {
			b.Fatal("no replica learnt anything in the fill")
		}
	}
	if got := r.Tree().Blocks(); got < 100_000 {
		b.Fatalf("tree holds %d blocks after the fill, want ≥ 100000", got)
	}
	buf := make([]blocks.Key, 0, w.promptTokens/blocks.DefaultBlockSize)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		br := &w.pool[i%len(w.pool)]
		req := br.req
		if fresh && br.fresh < len(req.Keys) {
			// New keys for this iteration: the router holds them only until
			// Finished, so one buffer serves every iteration.
			salt := blocks.Key(uint64(i+1) * 0x9e3779b97f4a7c15)
			buf = append(buf[:0], req.Keys...)
			for k := br.fresh; k < len(buf); k++ {
				buf[k] ^= salt
			}
			req.Keys = buf
		}
		route(req)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
}

// BenchmarkRouteCalibration measures a request's whole passage through the
// core — Route, FirstToken and Finish with the stream's token gaps, as the
// proxy makes them — with calibration off and on, for the policies that
// price work in seconds and a baseline: what learning each replica's speed
// costs the router. Each request's first token comes 20 ms after routing
// and it finishes 64 tokens later, so busy periods open and close and every
// finish is a decode observation.
//
//	go test -run XXX -bench BenchmarkRouteCalibration -benchtime 2s -count 5 -cpu 1 ./internal/router/
func BenchmarkRouteCalibration(b *testing.B) {
	prof, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		b.Fatal(err)
	}
	w := newBenchWorkload(4096, 64, 100_000, 2048)
	for _, pname := range []string{"e2", "llmd-precise", "round-robin"} {
		for _, cal := range []bool{false, true} {
			name := "policy=" + pname + "/calibrate=off"
			if cal {
				name = "policy=" + pname + "/calibrate=on"
			}
			b.Run(name, func(b *testing.B) { benchLifecycle(b, prof, pname, w, cal) })
		}
	}
}

func benchLifecycle(b *testing.B, prof costmodel.Profile, pname string, w *benchWorkload, cal bool) {
	pol, err := policy.New(pname, policy.DefaultOptions())
	if err != nil {
		b.Fatal(err)
	}
	cfg := Config{BlockTokens: blocks.DefaultBlockSize, Profile: prof, Policy: pol, Seed: 1}
	if cal {
		c := calibrate.DefaultConfig()
		cfg.Calibrate = &c
	}
	r, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 8; i++ {
		r.AddReplica(fmt.Sprintf("replica-%d", i), false)
	}
	now := benchClock()
	const step = 5 * time.Millisecond
	id := uint64(0)
	// Requests overlap: each finishes four arrivals after it came, so the
	// core always has a few in flight on each replica.
	const lag = 4
	var open [lag]uint64
	route := func(req policy.Request, k int) {
		id++
		req.ID = id
		if _, err := r.Route(req, now); err != nil {
			b.Fatal(err)
		}
		if err := r.FirstToken(id, now.Add(20*time.Millisecond)); err != nil {
			b.Fatal(err)
		}
		if prev := open[k%lag]; prev != 0 {
			fin := Finish{OutputTokens: 65, CachedTokens: -1, OK: true, ITL: 8 * time.Millisecond, ITLSamples: 64}
			if err := r.Finish(prev, fin, now.Add(20*time.Millisecond)); err != nil {
				b.Fatal(err)
			}
		}
		open[k%lag] = id
		now = now.Add(step)
	}
	for i, req := range w.fill {
		route(req, i)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		route(w.pool[i%len(w.pool)].req, i)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "requests/s")
}

// benchClock is the benchmarks' injected clock's start: the time now, which
// carries a monotonic reading as the time.Now() that prefixlb serve passes
// the router does. Without one (time.Unix), time.Time.Sub takes Go's slow
// path, and the calibration tracker's bookkeeping would be timed at a cost
// serve does not pay. Decisions depend only on differences between times.
func benchClock() time.Time { return time.Now() }
