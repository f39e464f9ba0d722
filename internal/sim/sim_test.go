package sim

import (
	"context"
	"math/rand/v2"
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
