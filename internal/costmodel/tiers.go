package costmodel

// Cache tiers. vLLM's CPU offloading and LMCache keep KV blocks evicted from
// the GPU in host memory (and LMCache on local disk); a request whose prefix
// is there loads it instead of recomputing it. Its cost is the bytes over
// the tier's bandwidth to the GPU.

// Media of the cache tiers KV events name (vLLM's BlockStored medium).
const (
	MediumCPU  = "CPU"
	MediumDisk = "DISK"
)

// Default tier bandwidths to the GPU, in bytes per second: what a profile
// that does not say (TierBandwidther) is priced with. Assumptions, stated:
// host memory over PCIe Gen5 x16 (64 GB/s each way on paper), at the ~25
// GB/s pinned-memory copies reach in practice; local NVMe at ~3 GB/s. An
// unknown medium is priced as disk.
const (
	DefaultCPUBandwidth  = 25e9
	DefaultDiskBandwidth = 3e9
)

// TierBandwidther is a profile that knows its tiers' bandwidths to the GPU.
type TierBandwidther interface {
	// TierBandwidth is medium's bandwidth to the GPU in bytes per second
	// (0: use the default).
	TierBandwidth(medium string) float64
}

// TierBandwidth is the bandwidth, bytes per second, at which p's replica
// loads KV from tier medium to its GPU: p's own (TierBandwidther), else the
// defaults.
func TierBandwidth(p Profile, medium string) float64 {
	if t, ok := p.(TierBandwidther); ok {
		if bw := t.TierBandwidth(medium); bw > 0 {
			return bw
		}
	}
	if medium == MediumCPU {
		return DefaultCPUBandwidth
	}
	return DefaultDiskBandwidth
}
