package sim

import (
	"cmp"
	"slices"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// Oracle returns, per request, the TTFT no router can beat (ALGORITHMS §7):
// the request runs alone on a replica that holds every prefix seen before it,
// so it computes only the tokens beyond the longest earlier shared prefix
// (at block granularity; at least one token, as an engine always recomputes
// the last prompt token).
func Oracle(reqs []workload.Request, prof costmodel.Profile, blockTokens int) []time.Duration {
	seen := make(map[blocks.Key]struct{})
	out := make([]time.Duration, len(reqs))
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	// Requests are processed in arrival order ("earlier" means arrived earlier).
	sortByArrival(order, reqs)
	var keys []blocks.Key
	for _, i := range order {
		keys = blocks.Keys(keys[:0], reqs[i].Tokens, blockTokens)
		hit := 0
		for hit < len(keys) {
			if _, ok := seen[keys[hit]]; !ok {
				break
			}
			hit++
		}
		for _, k := range keys[hit:] {
			seen[k] = struct{}{}
		}
		prompt := len(reqs[i].Tokens)
		cached := min(hit*blockTokens, max(prompt-1, 0))
		out[i] = prof.Prefill(prompt-cached, prompt)
	}
	return out
}

func sortByArrival(order []int, reqs []workload.Request) {
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].Arrival, reqs[b].Arrival) })
}
