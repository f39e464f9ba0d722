package sim

import (
	"context"
	"math/rand/v2"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// sharedPrefix builds groups×questions distinct prompts of prefix+question
// tokens and n requests picking among them, Poisson at rate.
func sharedPrefix(n, groups, prefix, question int, rate float64, seed uint64) []workload.Request {
	rng := rand.New(rand.NewPCG(seed, 1))
	prefixes := make([][]uint32, groups)
	for g := range prefixes {
		prefixes[g] = make([]uint32, prefix)
		for i := range prefixes[g] {
			prefixes[g][i] = uint32(100 + rng.IntN(100000))
		}
	}
	reqs := make([]workload.Request, n)
	t := time.Duration(0)
	for i := range reqs {
		g := rng.IntN(groups)
		toks := append(append([]uint32(nil), prefixes[g]...), make([]uint32, question)...)
		for j := prefix; j < len(toks); j++ {
			toks[j] = uint32(100 + rng.IntN(100000))
		}
		t += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		reqs[i] = workload.Request{ID: i, Arrival: t, Tokens: toks, OutputTokens: 20}
	}
	return reqs
}

func TestRunSmoke(t *testing.T) {
	prof, err := costmodel.Lookup("mistral-7b-a6000")
	if err != nil {
		t.Fatal(err)
	}
	reqs := sharedPrefix(400, 8, 2000, 100, 20, 1)
	for _, name := range []string{"round-robin", "e2", "llmd-precise"} {
		pol, err := policy.New(name, policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		res, err := Run(context.Background(), Config{Replicas: 4, Replica: replica.DefaultConfig(), Profile: prof, Policy: pol, KVEvents: name == "llmd-precise"}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		r := report.Build(name, 20, res.Records, 0)
		t.Logf("%s: ttft mean %.1f p99 %.1f hit %.3f errors %d branches %v", name, r.TTFT.Mean, r.TTFT.P99, r.PrefixHitRatio, r.Errors, res.Branches)
		if r.Errors != 0 {
			t.Fatalf("%s: %d errors", name, r.Errors)
		}
	}
}

// TestDeterministic runs the same workload twice per policy: every
// per-request figure must be identical.
func TestDeterministic(t *testing.T) {
	prof, err := costmodel.Lookup("mistral-7b-a6000")
	if err != nil {
		t.Fatal(err)
	}
	reqs := sharedPrefix(300, 6, 1500, 80, 30, 7)
	slots := replica.DefaultConfig()
	slots.Slots = 2
	for _, name := range []string{"random", "power-of-two", "e2", "e2-preble", "llmd-precise", "dynamo", "e2 slots", "prefix slots"} {
		var runs [2]*Result
		name, slotted := strings.CutSuffix(name, " slots")
		for i := range runs {
			pol, err := policy.New(name, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			cfg := Config{Replicas: 3, Replica: replica.DefaultConfig(), Profile: prof, Policy: pol, KVEvents: true, EventLag: 5 * time.Millisecond, Seed: 42}
			if slotted {
				cfg.Replica, cfg.KVEvents = slots, false
			}
			runs[i], err = Run(context.Background(), cfg, reqs)
			if err != nil {
				t.Fatal(err)
			}
		}
		for i := range runs[0].Records {
			if !reflect.DeepEqual(runs[0].Records[i], runs[1].Records[i]) {
				t.Fatalf("%s: request %d differs between identical runs:\n%+v\n%+v", name, i, runs[0].Records[i], runs[1].Records[i])
			}
		}
	}
}

// TestEventsReachRouter checks that with KV events on, the router's view of
// each replica's cache agrees with the replica's own cache at the end of a
// run (every event delivered, none refused).
func TestEventsReachRouter(t *testing.T) {
	prof, err := costmodel.Lookup("mistral-7b-a6000")
	if err != nil {
		t.Fatal(err)
	}
	rc := replica.DefaultConfig()
	rc.KVCapacity = 20000 // small: evictions happen
	reqs := sharedPrefix(400, 12, 1500, 100, 20, 3)
	pol, _ := policy.New("llmd-precise", policy.DefaultOptions())
	res, err := Run(context.Background(), Config{Replicas: 2, Replica: rc, Profile: prof, Policy: pol, KVEvents: true, EventLag: time.Millisecond}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	if res.Events == 0 {
		t.Fatal("no cache events reached the router")
	}
	if res.UnknownParents != 0 {
		t.Fatalf("%d stored events had a parent the router did not know", res.UnknownParents)
	}
	for i, st := range res.Replicas {
		if got, want := res.RouterCachedBlocks[i], st.CachedBlocks; got != want {
			t.Errorf("replica %d: router believes %d blocks cached, replica holds %d", i, got, want)
		}
	}
}

// TestOracleBound checks the oracle on a hand-computable workload: the
// second of two identical prompts computes only its last block.
func TestOracleBound(t *testing.T) {
	prof, _ := costmodel.Lookup("mistral-7b-a6000")
	toks := make([]uint32, 64)
	for i := range toks {
		toks[i] = uint32(100 + i)
	}
	reqs := []workload.Request{{Tokens: toks, Arrival: 0}, {Tokens: toks, Arrival: time.Second}}
	got := Oracle(reqs, prof, 16)
	if want := prof.Prefill(64, 64); got[0] != want {
		t.Errorf("first: got %v, want %v", got[0], want)
	}
	if want := prof.Prefill(16, 64); got[1] != want {
		t.Errorf("second: got %v, want %v (one recomputed block)", got[1], want)
	}
}

// BenchmarkSim10k simulates 10,000 shared-prefix requests on 8 replicas of
// Qwen3-32B with e2 and reports the wall time of one whole simulation.
// Target (issue 3): ≤ 10 s on one core.
func BenchmarkSim10k(b *testing.B) {
	prof, _ := costmodel.Lookup("qwen3-32b-h100x2")
	spec := workload.DefaultSpec("toolbench")
	spec.Requests = 10000
	spec.Replicas = 8
	spec.ToolBench.Zipf = 1.1
	reqs, err := workload.Generate(spec)
	if err != nil {
		b.Fatal(err)
	}
	if err := workload.Poisson(reqs, 60, rand.New(rand.NewPCG(1, 2))); err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		pol, _ := policy.New("e2", policy.DefaultOptions())
		res, err := Run(context.Background(), Config{Replicas: 8, Replica: replica.DefaultConfig(), Profile: prof, Policy: pol, KVEvents: true, EventLag: 10 * time.Millisecond}, reqs)
		if err != nil {
			b.Fatal(err)
		}
		if n := len(res.Records); n != 10000 {
			b.Fatalf("%d records", n)
		}
	}
	b.ReportMetric(b.Elapsed().Seconds()/float64(b.N), "s/sim")
	b.ReportMetric(float64(10000*b.N)/b.Elapsed().Seconds(), "requests/s")
}

// TestSlotCacheHitsLess runs a workload of many distinct prefixes (12
// system prompts of 1,500 tokens, on 3 replicas) on llama.cpp slot caches
// of 2 slots and on block caches of the same capacity: the slots hold at
// most 6 prompts at once, so their hit ratio must be well below the block
// caches'. The router, told the slots, predicts nearly all their hits.
func TestSlotCacheHitsLess(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.LlamaCppTinyCPU)
	if err != nil {
		t.Fatal(err)
	}
	reqs := sharedPrefix(400, 12, 1500, 100, 1, 9)
	for _, name := range []string{"round-robin", "e2"} {
		hit := map[int]float64{}
		for _, slots := range []int{0, 2} {
			pol, err := policy.New(name, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			rc := replica.Config{ChunkBudget: replica.LlamaCppBatch, Slots: slots}
			res, err := Run(context.Background(), Config{Replicas: 3, Replica: rc, Profile: prof, Policy: pol, Seed: 1}, reqs)
			if err != nil {
				t.Fatal(err)
			}
			r := report.Build(name, 1, res.Records, 0)
			if r.Errors != 0 {
				t.Fatalf("%s slots=%d: %d errors", name, slots, r.Errors)
			}
			hit[slots] = r.PrefixHitRatio
			exact := float64(res.Router.PredictionsExact) / float64(res.Router.PredictionsChecked)
			t.Logf("%s slots=%d: hit %.3f, ttft mean %.0f ms, router predicted %.0f%% of hits within a block",
				name, slots, r.PrefixHitRatio, r.TTFT.Mean, 100*exact)
			if slots > 0 && exact < 0.9 {
				t.Errorf("%s: the router predicted %.0f%% of the slot caches' hits, want ≥ 90%%", name, 100*exact)
			}
		}
		if hit[2] > 0.6*hit[0] {
			t.Errorf("%s: slot-cache hit ratio %.3f, block cache %.3f: want the slots well below", name, hit[2], hit[0])
		}
	}
}

// TestSlotCacheRouterTold checks that the simulator tells the router about
// the slots: on one replica with one slot, requests one at a time over 3
// prefixes overwrite each other, and only a router that models the slot
// predicts every request's (mostly zero) cached tokens; a block-cache
// mirror would believe all 3 prefixes cached.
func TestSlotCacheRouterTold(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.LlamaCppTinyCPU)
	if err != nil {
		t.Fatal(err)
	}
	reqs := sharedPrefix(60, 3, 1000, 50, 0.2, 4)
	pol, _ := policy.New("round-robin", policy.DefaultOptions())
	res, err := Run(context.Background(), Config{Replicas: 1, Replica: replica.Config{Slots: 1}, Profile: prof, Policy: pol}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	st := res.Router
	if st.PredictionsChecked != 60 || st.PredictionsExact != st.PredictionsChecked {
		t.Errorf("router predicted %d of %d requests' cached tokens within a block (%d predicted, %d reported), want all",
			st.PredictionsExact, st.PredictionsChecked, st.PredictedTokens, st.ReportedTokens)
	}
}

// TestHostCores: replicas sharing a host's cores (CPU engines) run slower
// when more of them compute at once than there are cores; with a core each
// nothing changes.
func TestHostCores(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.LlamaCppTinyCPU)
	if err != nil {
		t.Fatal(err)
	}
	reqs := sharedPrefix(120, 6, 1500, 100, 2, 5)
	run := func(cores int) report.Result {
		pol, err := policy.New("round-robin", policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		rc := replica.Config{ChunkBudget: replica.LlamaCppBatch, Slots: 2}
		res, err := Run(context.Background(), Config{Replicas: 3, Replica: rc, Profile: prof, Policy: pol, Seed: 1, HostCores: cores}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return report.Build("round-robin", 2, res.Records, 0)
	}
	own, three, two, one := run(0), run(3), run(2), run(1)
	if three.TTFT != own.TTFT {
		t.Errorf("3 cores for 3 replicas: TTFT %+v, want the unshared %+v", three.TTFT, own.TTFT)
	}
	if !(one.TTFT.Mean > two.TTFT.Mean && two.TTFT.Mean > own.TTFT.Mean) {
		t.Errorf("mean TTFT with 1, 2 cores and unshared: %.0f, %.0f, %.0f ms; want it to fall as cores are added",
			one.TTFT.Mean, two.TTFT.Mean, own.TTFT.Mean)
	}
	if err := (&Config{Replicas: 1, Profile: prof, Policy: &policy.RoundRobin{}, HostCores: -1}).Validate(); err == nil {
		t.Error("negative host cores: no error")
	}
}
