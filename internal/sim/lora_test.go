package sim

import (
	"context"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// TestAdapterKeys: the simulator keys an adapter's request from the
// adapter's seed — apart from the base model's and another adapter's,
// the same for the same adapter.
func TestAdapterKeys(t *testing.T) {
	tokens := make([]uint32, 64)
	base := blocks.Keys(nil, tokens, 16)
	a1 := blocks.SeededKeys(nil, blocks.AdapterSeed("a"), tokens, 16)
	a2 := blocks.SeededKeys(nil, blocks.AdapterSeed("a"), tokens, 16)
	b := blocks.SeededKeys(nil, blocks.AdapterSeed("b"), tokens, 16)
	for i := range base {
		if a1[i] == base[i] || a1[i] == b[i] || a1[i] != a2[i] {
			t.Fatalf("block %d: base %x a %x %x b %x", i, base[i], a1[i], a2[i], b[i])
		}
	}
}

// TestLoRARun: a lora workload on replicas with two adapter slots loads
// adapters, reports them per minute, and the router hears the residency.
func TestLoRARun(t *testing.T) {
	s := workload.DefaultSpec("lora")
	s.Requests, s.LoRA.Adapters = 300, 8
	reqs, err := workload.Generate(s)
	if err != nil {
		t.Fatal(err)
	}
	arr := workload.ArrivalSpec{Process: "poisson", Rate: 20}
	if err := arr.Apply(reqs, 1, false); err != nil {
		t.Fatal(err)
	}
	prof, _ := costmodel.Lookup("llama3.1-8b-h100")
	rc := replica.DefaultConfig()
	rc.MaxLoras = 2
	for _, name := range []string{"e2", "gie-lora"} {
		pol, _ := policy.New(name, policy.DefaultOptions())
		res, err := Run(context.Background(), Config{Replicas: 3, Replica: rc, Profile: prof, Policy: pol, KVEvents: true}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		if res.AdapterLoadsPerMinute() <= 0 {
			t.Errorf("%s: no adapter loads", name)
		}
		for _, rec := range res.Records {
			if rec.Error != "" {
				t.Fatalf("%s: request %d: %s", name, rec.ID, rec.Error)
			}
		}
	}
}

// runningSpy routes round-robin and records the adapter figures the
// router shows it.
type runningSpy struct {
	policy.RoundRobin
	running, waiting, flights, over int
}

func (s *runningSpy) Route(req *policy.Request, v *policy.View, now time.Time) (policy.Decision, error) {
	for _, rp := range v.Replicas {
		if len(rp.RunningAdapters) > 0 {
			s.running++
		}
		if len(rp.WaitingAdapters) > 0 {
			s.waiting++
		}
		if len(rp.AdapterFlights) > 0 {
			s.flights++
		}
		if len(rp.RunningAdapters) > rp.MaxAdapters {
			s.over++
		}
	}
	return s.RoundRobin.Route(req, v, now)
}

// TestLoRARunningAdapters: the router hears each replica's running and
// waiting adapters as vllm:lora_requests_info reports them (never more
// running than max_loras) and counts its own requests per adapter.
func TestLoRARunningAdapters(t *testing.T) {
	s := workload.DefaultSpec("lora")
	s.Requests, s.LoRA.Adapters = 300, 8
	reqs, err := workload.Generate(s)
	if err != nil {
		t.Fatal(err)
	}
	if err := (&workload.ArrivalSpec{Process: "poisson", Rate: 40}).Apply(reqs, 1, false); err != nil {
		t.Fatal(err)
	}
	prof, _ := costmodel.Lookup("llama3.1-8b-h100")
	rc := replica.DefaultConfig()
	rc.MaxLoras = 2
	spy := &runningSpy{}
	if _, err := Run(context.Background(), Config{Replicas: 2, Replica: rc, Profile: prof, Policy: spy, KVEvents: true}, reqs); err != nil {
		t.Fatal(err)
	}
	if spy.running == 0 || spy.waiting == 0 || spy.flights == 0 || spy.over > 0 {
		t.Errorf("views with running %d, waiting %d, flights %d, over max_loras %d: want the first three > 0, the last 0",
			spy.running, spy.waiting, spy.flights, spy.over)
	}
}
