package sim

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/workload"
)

func qwen(t *testing.T) costmodel.Profile {
	t.Helper()
	p, err := costmodel.Lookup(costmodel.Qwen3_32BH100x2)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func runPD(t *testing.T, name string, replicas, prefill int, link policy.KVLink, reqs []workload.Request) *Result {
	t.Helper()
	pol, err := policy.New(name, policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	res, err := Run(context.Background(), Config{Replicas: replicas, Replica: replica.DefaultConfig(), Profile: qwen(t),
		Policy: pol, KVEvents: true, EventLag: 10 * time.Millisecond, PrefillReplicas: prefill, KVLink: link}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.Records {
		if r.Error != "" {
			t.Fatalf("%s: request %d: %s", name, r.ID, r.Error)
		}
	}
	return res
}

// TestPDTransferBytes: a request whose prompt its decode replica already
// holds moves only the block of its last token; the first one moves all.
func TestPDTransferBytes(t *testing.T) {
	prompt := make([]uint32, 1000) // 63 blocks of 16, the last partial
	for i := range prompt {
		prompt[i] = uint32(7 + i)
	}
	reqs := []workload.Request{
		{ID: 0, Arrival: 0, Tokens: prompt, OutputTokens: 5},
		{ID: 1, Arrival: 10 * time.Second, Tokens: prompt, OutputTokens: 5},
	}
	link := policy.KVLink{BytesPerSecond: 10e9, Latency: time.Millisecond}
	res := runPD(t, "round-robin-pd", 2, 1, link, reqs)
	kv := costmodel.KVBytesOf(qwen(t))
	want := float64((63+1)*16) * kv
	if res.PD.Disaggregated != 2 || res.PD.TransferBytes != want {
		t.Errorf("disaggregated %d, bytes %v; want 2 and %v (63 blocks, then 1)", res.PD.Disaggregated, res.PD.TransferBytes, want)
	}
	if got := res.Replicas[1].KVBlocksPulled; got != 64 {
		t.Errorf("decode replica pulled %d blocks, want 64", got)
	}
	// 63 blocks · 16 · 256 KiB at 10 GB/s ≈ 26.4 ms, then one block in
	// 0.4 ms, each plus 1 ms of latency.
	if got, want := res.PD.TransferMs.Mean, (64*16*kv/10e9*1e3+2)/2; math.Abs(got-want) > 0.01 {
		t.Errorf("mean transfer %.3f ms, want %.3f", got, want)
	}
}

// TestPDLinkSharing: requests disaggregated at the same time share their
// prefill replica's link, so each transfer takes longer than one alone.
func TestPDLinkSharing(t *testing.T) {
	mk := func(n int, gap time.Duration) []workload.Request {
		var reqs []workload.Request
		for i := 0; i < n; i++ {
			toks := make([]uint32, 2000)
			for j := range toks {
				toks[j] = uint32(1 + i*100000 + j)
			}
			reqs = append(reqs, workload.Request{ID: i, Arrival: time.Duration(i) * gap, Tokens: toks, OutputTokens: 4})
		}
		return reqs
	}
	link := policy.KVLink{BytesPerSecond: 1e9}
	alone := runPD(t, "round-robin-pd", 5, 1, link, mk(4, 5*time.Second))
	together := runPD(t, "round-robin-pd", 5, 1, link, mk(4, 0))
	// One prefill replica prefills the first prompt alone (it started the
	// iteration on its arrival), the other three in the next batch; their
	// transfers leave it together, at a third to a quarter of its link
	// each: alone the mean is one transfer's time, together about 3×.
	a, b := alone.PD.TransferMs.Mean, together.PD.TransferMs.Mean
	if !(b > 2.5*a) {
		t.Errorf("mean transfer alone %.1f ms, four at once %.1f ms; want the shared ones ≥ 2.5× slower", a, b)
	}
}

// TestPDRolesInSim: a policy that does not disaggregate runs only on the
// decode replicas; a disaggregating one prefills on the prefill replicas
// and decodes on the others, and each prefill replica publishes its cache.
func TestPDRolesInSim(t *testing.T) {
	reqs := sharedPrefix(200, 4, 3000, 200, 4, 3)
	link := policy.KVLink{BytesPerSecond: 50e9 / 8, Latency: 100 * time.Microsecond}
	res := runPD(t, "e2", 4, 1, link, reqs)
	for _, r := range res.Records {
		if r.Replica == "replica-0" {
			t.Fatalf("e2 ran request %d on the prefill replica", r.ID)
		}
	}
	if res.Replicas[0].Admissions != 0 || res.PD.Disaggregated != 0 {
		t.Errorf("prefill replica admitted %d, %d disaggregated", res.Replicas[0].Admissions, res.PD.Disaggregated)
	}
	for _, name := range []string{"round-robin-pd", "llmd-pd", "dynamo-pd", "e2-pd"} {
		res := runPD(t, name, 4, 1, link, reqs)
		if res.Replicas[0].GenerationTokens > int64(res.Replicas[0].Finished) {
			t.Errorf("%s: the prefill replica decoded", name)
		}
		if name != "e2-pd" && res.PD.Disaggregated == 0 {
			t.Errorf("%s never disaggregated", name)
		}
		t.Logf("%s: %d disaggregated, %d local, %.1f GB moved, transfer mean %.1f ms, events %d",
			name, res.PD.Disaggregated, res.PD.Local, res.PD.TransferBytes/1e9, res.PD.TransferMs.Mean, res.Events)
	}
}

func TestPDConfigErrors(t *testing.T) {
	pol := &policy.RoundRobinPD{}
	mistral, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		t.Fatal(err)
	}
	link := policy.KVLink{BytesPerSecond: 1e9}
	for _, tc := range []struct {
		cfg  Config
		want string
	}{
		{Config{Replicas: 2, Profile: qwen(t), Policy: pol, PrefillReplicas: 2, KVLink: link}, "prefill replicas must be in"},
		{Config{Replicas: 2, Profile: qwen(t), Policy: pol, PrefillReplicas: 1}, "KV link bandwidth"},
		{Config{Replicas: 2, Profile: mistral, Policy: pol, PrefillReplicas: 1, KVLink: link}, "no KV bytes per token"},
	} {
		if err := tc.cfg.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Validate: %v, want %q", err, tc.want)
		}
	}
}
