package router

import (
	"fmt"
	"slices"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// SetRunningAdapters records the LoRA adapters replica id's running
// requests use and those of its waiting requests
// (policy.Replica.RunningAdapters and WaitingAdapters; copied): vLLM's
// vllm:lora_requests_info labels running_lora_adapters and
// waiting_lora_adapters. With MaxAdapters (SetAdapters) they tell e2 when a
// request for another adapter would wait for a slot (adapter_wait).
func (r *Router) SetRunningAdapters(id int, running, waiting []string) error {
	if id < 0 || id >= len(r.reps) {
		return fmt.Errorf("%w: %d", ErrUnknownReplica, id)
	}
	rp := &r.reps[id]
	// Fresh slices: snapshots (Replicas) keep the old ones.
	rp.RunningAdapters = append([]string(nil), running...)
	rp.WaitingAdapters = append([]string(nil), waiting...)
	return nil
}

// addAdapterFlight counts one more (n 1) or one fewer (n −1) request for
// adapter in flight on replica id, owing out output tokens
// (policy.Replica.AdapterFlights). The slice is the router's own and is
// changed in place; snapshots copy it (cloneReplica).
func (r *Router) addAdapterFlight(id int, adapter string, n, out int) {
	if adapter == "" {
		return
	}
	rp := &r.reps[id]
	i := slices.IndexFunc(rp.AdapterFlights, func(f policy.AdapterFlight) bool { return f.Adapter == adapter })
	if i < 0 {
		if n <= 0 {
			return
		}
		rp.AdapterFlights = append(rp.AdapterFlights, policy.AdapterFlight{Adapter: adapter})
		i = len(rp.AdapterFlights) - 1
	}
	f := &rp.AdapterFlights[i]
	f.InFlight += n
	f.DecodeTokens += n * out
	if f.InFlight <= 0 {
		last := len(rp.AdapterFlights) - 1
		rp.AdapterFlights[i] = rp.AdapterFlights[last]
		rp.AdapterFlights[last] = policy.AdapterFlight{}
		rp.AdapterFlights = rp.AdapterFlights[:last]
	}
}

// cloneReplica returns a snapshot of rp that shares nothing the router
// changes in place (AdapterFlights).
func cloneReplica(rp policy.Replica) policy.Replica {
	if rp.AdapterFlights != nil {
		rp.AdapterFlights = slices.Clone(rp.AdapterFlights)
	}
	return rp
}
