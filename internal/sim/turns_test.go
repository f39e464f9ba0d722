package sim

import (
	"context"
	"math"
	"testing"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// TestAwaitPreviousTurn checks the closed loop within a conversation: a
// request marked AwaitPrevious arrives once its session's previous request
// has finished, even when its own arrival is earlier, and at its own
// arrival when that is later; other sessions are not held.
func TestAwaitPreviousTurn(t *testing.T) {
	prof, err := costmodel.Lookup("mistral-7b-a6000")
	if err != nil {
		t.Fatal(err)
	}
	pol, err := policy.New("round-robin", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	prompt := func(n int) []uint32 {
		ids := make([]uint32, n)
		for i := range ids {
			ids[i] = uint32(i + 1)
		}
		return ids
	}
	reqs := []workload.Request{
		{ID: 0, Session: "a", Tokens: prompt(2000), OutputTokens: 50},
		{ID: 1, Session: "b", Tokens: prompt(100), OutputTokens: 5},
		{ID: 2, Session: "a", Tokens: prompt(2100), OutputTokens: 5, AwaitPrevious: true},
		{ID: 3, Session: "b", Tokens: prompt(200), OutputTokens: 5, AwaitPrevious: true, Arrival: 1e11}, // 100 s
	}
	res, err := Run(context.Background(), Config{Replicas: 2, Replica: replica.DefaultConfig(), Profile: prof, Policy: pol}, reqs)
	if err != nil {
		t.Fatal(err)
	}
	r := res.Records
	for i, rec := range r {
		if rec.Error != "" {
			t.Fatalf("request %d: %s", i, rec.Error)
		}
	}
	end0 := r[0].ArrivalS + r[0].LatencyMs/1000
	if math.Abs(r[2].ArrivalS-end0) > 1e-6 {
		t.Errorf("turn 2 of a arrived at %.6f s, want at turn 1's end %.6f s", r[2].ArrivalS, end0)
	}
	if r[1].ArrivalS != 0 || r[3].ArrivalS != 100 {
		t.Errorf("b's turns arrived at %.3f and %.3f s, want 0 and 100 (its own arrival, after turn 1's end)", r[1].ArrivalS, r[3].ArrivalS)
	}
}
