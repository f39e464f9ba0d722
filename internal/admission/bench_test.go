package admission

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// BenchmarkAdmit is the queue's cost to a decision below saturation: the
// pass-through of Arrive (the pool judged from the router's view, nothing
// waiting). It reports the p99 of single calls, timed one by one.
func BenchmarkAdmit(b *testing.B) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		b.Fatal(err)
	}
	for _, est := range []bool{false, true} {
		for _, n := range []int{4, 16, 64} {
			b.Run(fmt.Sprintf("replicas=%d/decode-aware=%v", n, est), func(b *testing.B) {
				q, err := New(Default())
				if err != nil {
					b.Fatal(err)
				}
				reps := pool(n, 2)
				if est {
					// The estimator prices every replica: decodes running, an
					// engine queue, prefill queued.
					q.SetEstimator(&DecodeAware{Profile: func(int) costmodel.Profile { return prof }})
					for i := range reps {
						reps[i].Decoding, reps[i].DecodeContextTokens, reps[i].InFlight = 32, 32*2048, 34
						reps[i].DecodeTokens, reps[i].PendingPrefill, reps[i].Running = 32*200, 100*time.Millisecond, 32
					}
				}
				reps[n-1].Waiting = 0 // the last one has room: the whole view is read
				tk := &Ticket{Arrival: t0}
				lat := make([]time.Duration, 0, min(b.N, 1<<20))
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					start := time.Now()
					// A 2 s TTFT SLO: the SLO fraction's bookkeeping runs.
					*tk = Ticket{ID: uint64(i), Arrival: t0, Deadline: t0.Add(2 * time.Second)}
					if v, _ := q.Arrive(tk, reps, t0); v != Pass {
						b.Fatal("not passed")
					}
					if len(lat) < cap(lat) {
						lat = append(lat, time.Since(start))
					}
				}
				b.StopTimer()
				slices.Sort(lat)
				if len(lat) > 0 {
					b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds()), "p99-ns")
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			})
		}
	}
}

// BenchmarkQueueSaturated is one request's way through a saturated queue
// (arrive, wait among 512 others of 8 tenants in 2 priorities, dispatch).
func BenchmarkQueueSaturated(b *testing.B) {
	q, err := New(Default())
	if err != nil {
		b.Fatal(err)
	}
	busy, idle := pool(8, 10), pool(8, 0)
	tks := make([]Ticket, 512)
	for i := range tks {
		tks[i] = Ticket{ID: uint64(i), Priority: i % 2, Tenant: fmt.Sprint(i % 8), Arrival: t0, Deadline: t0.Add(time.Hour)}
		q.Arrive(&tks[i], busy, t0)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		tk := q.Next(idle, t0, nil)
		*tk = Ticket{ID: tk.ID, Priority: tk.Priority, Tenant: tk.Tenant, Arrival: t0, Deadline: t0.Add(time.Hour)}
		q.Arrive(tk, busy, t0)
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
}
