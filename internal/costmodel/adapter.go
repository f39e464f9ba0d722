package costmodel

import (
	"math"
	"time"
)

// AdapterLoad prices bringing a LoRA adapter into one of a replica's GPU
// adapter slots (vLLM's --max-loras): the adapter's bytes cross the host to
// device link, then a fixed cost. vLLM keeps registered adapters in host
// memory (an LRU of --max-cpu-loras) and copies one into a GPU slot when a
// batch first uses it (LRUCacheWorkerLoRAManager: activate_adapter, then
// set_lora of each LoRA layer), before that step's forward pass; the whole
// step waits for the copy.
type AdapterLoad struct {
	// HostToDeviceBytesPerSecond is the effective bandwidth of the copy.
	HostToDeviceBytesPerSecond float64 `json:"h2d_bytes_per_s"`
	// FixedMS is the cost of an activation beyond the copy, in ms: one
	// copy per LoRA layer and matrix (448 for rank-r adapters on all seven
	// projections of a 32-layer model), their launches, and the Python of
	// the adapter manager.
	FixedMS float64 `json:"fixed_ms"`
}

// DefaultAdapterLoad is the adapter load of a profile that gives none.
// Both figures are assumptions, not measurements:
//   - 25 GB/s: an H100 SXM or A100 host link is PCIe Gen5 / Gen4 x16, 64 /
//     32 GB/s a direction on paper, and pinned copies reach about 80% of
//     that; vLLM's copies are hundreds of small per-layer tensors, so we
//     take 25 GB/s for both (about 3.4 ms for the 84 MB of a rank-16
//     adapter of Llama-3.1-8B on all seven projections in bf16).
//   - 20 ms fixed: hundreds of per-layer copies and kernel launches, and
//     the adapter manager's Python, per activation.
var DefaultAdapterLoad = AdapterLoad{HostToDeviceBytesPerSecond: 25e9, FixedMS: 20}

// Time is the time to load an adapter of bytes bytes: bytes ÷ bandwidth +
// the fixed cost.
func (a AdapterLoad) Time(bytes int64) time.Duration {
	s := a.FixedMS / 1e3
	if a.HostToDeviceBytesPerSecond > 0 && bytes > 0 {
		s += float64(bytes) / a.HostToDeviceBytesPerSecond
	}
	if !(s > 0) || math.IsInf(s, 0) {
		return 0
	}
	return time.Duration(s * float64(time.Second))
}

// AdapterLoader is implemented by profiles that give their adapter load.
type AdapterLoader interface {
	// AdapterLoad is the profile's adapter load.
	AdapterLoad() AdapterLoad
}

// AdapterLoadOf returns p's adapter load if p implements AdapterLoader,
// else DefaultAdapterLoad.
func AdapterLoadOf(p Profile) AdapterLoad {
	if a, ok := p.(AdapterLoader); ok {
		return a.AdapterLoad()
	}
	return DefaultAdapterLoad
}

// adapterLoad is the adapter load of c's profile: c.AdapterLoad if given,
// else DefaultAdapterLoad.
func (c Config) adapterLoad() AdapterLoad {
	if c.AdapterLoad != nil {
		return *c.AdapterLoad
	}
	return DefaultAdapterLoad
}

// orDefault is a, or DefaultAdapterLoad for the zero AdapterLoad (a profile
// built without a Config).
func orDefault(a AdapterLoad) AdapterLoad {
	if a == (AdapterLoad{}) {
		return DefaultAdapterLoad
	}
	return a
}

// validateAdapterLoad checks a profile's adapter_load.
func validateAdapterLoad(bad badFunc, a AdapterLoad) error {
	if err := finite(bad, "adapter_load.h2d_bytes_per_s", a.HostToDeviceBytesPerSecond, true); err != nil {
		return err
	}
	return finite(bad, "adapter_load.fixed_ms", a.FixedMS, false)
}

// AdapterLoad implements AdapterLoader: the config's, by default
// DefaultAdapterLoad.
func (p *prebleMistral) AdapterLoad() AdapterLoad { return orDefault(p.adapter) }

// AdapterLoad implements AdapterLoader: the config's, by default
// DefaultAdapterLoad.
func (l *linear) AdapterLoad() AdapterLoad { return orDefault(l.adapter) }

// AdapterLoad implements AdapterLoader: the config's, by default
// DefaultAdapterLoad.
func (r *roofline) AdapterLoad() AdapterLoad { return orDefault(r.adapter) }

// AdapterLoad implements AdapterLoader: the base profile's (scaling
// compute does not change the host link).
func (s *Scaled) AdapterLoad() AdapterLoad { return AdapterLoadOf(s.base) }
