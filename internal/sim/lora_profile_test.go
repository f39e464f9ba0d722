package sim

import (
	"context"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// explainedE2 is e2 with every decision explained and kept, and whether
// each replica held the request's adapter when it decided.
type explainedE2 struct {
	*policy.E2
	decs map[uint64]policy.Decision
	held map[uint64][]bool
}

func (p *explainedE2) Route(req *policy.Request, v *policy.View, now time.Time) (policy.Decision, error) {
	req.Explain = true
	d, err := p.E2.Route(req, v, now)
	p.decs[req.ID] = d
	h := make([]bool, len(v.Replicas))
	for i := range v.Replicas {
		h[i] = v.Replicas[i].HoldsAdapter(req.Adapter)
	}
	p.held[req.ID] = h
	return d, err
}

// TestLoRAProfileE2 profiles e2 on docs/lora.md's target run (the lora
// workload, 4,000 requests, 8 replicas of llama3.1-8b-h100 with max_loras
// 4, KV events after 10 ms): how often it sends a request to a replica
// that must load the adapter, the mean of each term there against the best
// replica that held it, and what the slow requests paid. It only reports;
// it runs when PREFIXLB_LORA_PROFILE is set (to the rate, 12 by default):
//
//	PREFIXLB_LORA_PROFILE=12 go test -run TestLoRAProfileE2 -v ./internal/sim
func TestLoRAProfileE2(t *testing.T) {
	env, ok := os.LookupEnv("PREFIXLB_LORA_PROFILE")
	if !ok {
		t.Skip("set PREFIXLB_LORA_PROFILE=RATE to profile e2 on the lora target run")
	}
	rate, err := strconv.ParseFloat(env, 64)
	if err != nil || rate <= 0 {
		rate = 12
	}
	f := workload.DefaultFlags()
	f.Spec = workload.DefaultSpec("lora")
	f.Spec.Requests = 4000
	f.Arrival.Process, f.Arrival.Rate = workload.ArrivalPoisson, rate
	reqs, _, err := f.Load()
	if err != nil {
		t.Fatal(err)
	}
	prof, err := costmodel.Lookup("llama3.1-8b-h100")
	if err != nil {
		t.Fatal(err)
	}
	rc := replica.DefaultConfig()
	rc.MaxLoras = 4
	e2, err := policy.NewE2(policy.DefaultE2Config())
	if err != nil {
		t.Fatal(err)
	}
	p := &explainedE2{E2: e2, decs: map[uint64]policy.Decision{}, held: map[uint64][]bool{}}
	res, err := Run(context.Background(), Config{Replicas: 8, Replica: rc, Profile: prof, Policy: p,
		KVEvents: true, EventLag: 10 * time.Millisecond, Seed: 1, Rate: rate}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	ttft := make([]float64, 0, len(res.Records))
	for _, r := range res.Records {
		ttft = append(ttft, r.TTFTMs)
	}
	slices.Sort(ttft)
	p90 := ttft[len(ttft)*9/10]
	t.Logf("rate %g: TTFT p50 %.1f p90 %.1f p99 %.1f ms; %.1f adapter loads/min", rate,
		ttft[len(ttft)/2], p90, ttft[len(ttft)*99/100], res.AdapterLoadsPerMinute())

	var load, loadHolderUp int
	var chosen, holder [policy.NumE2Terms]float64
	for id, d := range p.decs {
		h := p.held[id]
		if h[d.Replica] {
			continue
		}
		load++
		var ch, best *policy.Candidate
		for i := range d.Candidates {
			c := &d.Candidates[i]
			if c.Replica == d.Replica {
				ch = c
			}
			if h[c.Replica] && (best == nil || c.Score < best.Score) {
				best = c
			}
		}
		if best == nil || ch == nil {
			continue
		}
		loadHolderUp++
		for k := range policy.NumE2Terms {
			chosen[k] += ch.Terms[k]
			holder[k] += best.Terms[k]
		}
	}
	t.Logf("%d decisions chose a replica that must load the adapter; in %d of them one that held it was up", load, loadHolderUp)
	t.Logf("mean term (ms): chosen, best holder")
	for k := range policy.NumE2Terms {
		n := float64(max(loadHolderUp, 1))
		t.Logf("  %-17s %8.2f %8.2f", policy.E2Term(k), chosen[k]/n*1e3, holder[k]/n*1e3)
	}
	var waitCands, waitDecs int
	var waitSum float64
	for _, d := range p.decs {
		any := false
		for _, c := range d.Candidates {
			if x := c.Terms[policy.E2AdapterWait]; x > 0 {
				waitCands++
				waitSum += x
				any = true
			}
		}
		if any {
			waitDecs++
		}
	}
	t.Logf("adapter_wait > 0 for %d candidates in %d decisions, %.0f ms on average there",
		waitCands, waitDecs, waitSum/float64(max(waitCands, 1))*1e3)
	var toLoad, toHolder float64
	var nLoad, nHolder int
	for _, r := range res.Records {
		if d := p.decs[uint64(r.ID)]; p.held[uint64(r.ID)][d.Replica] {
			toHolder += r.TTFTMs
			nHolder++
		} else {
			toLoad += r.TTFTMs
			nLoad++
		}
	}
	t.Logf("mean TTFT: %.1f ms where the adapter was held (%d), %.1f ms where it was loaded (%d)",
		toHolder/float64(max(nHolder, 1)), nHolder, toLoad/float64(max(nLoad, 1)), nLoad)
	var slow, slowLoad, slowMiss int
	for _, r := range res.Records {
		if r.TTFTMs < p90 {
			continue
		}
		d := p.decs[uint64(r.ID)]
		slow++
		if !p.held[uint64(r.ID)][d.Replica] {
			slowLoad++
		} else if r.PromptTokens-d.MatchedTokens > 400 {
			slowMiss++
		}
	}
	t.Logf("requests at or above p90 (%d): %d loaded their adapter, %d more missed over 400 prompt tokens", slow, slowLoad, slowMiss)
}
