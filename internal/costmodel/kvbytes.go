package costmodel

// KVSizer is implemented by profiles that know how many bytes of KV cache
// one token takes on their replica: what moves over the network when a
// disaggregated request's KV goes from its prefill replica to its decode
// replica (vLLM's NixlConnector reads the KV blocks themselves, so the bytes
// are the blocks' bytes). It is optional, as Batcher is: see KVBytesOf.
type KVSizer interface {
	// KVBytesPerToken is the KV cache one token takes over all layers, in
	// bytes.
	KVBytesPerToken() float64
}

// KVBytesOf returns p's KV bytes per token if p implements KVSizer, else 0
// (unknown: a fitted profile that gives times and a capacity only).
func KVBytesOf(p Profile) float64 {
	if s, ok := p.(KVSizer); ok {
		return s.KVBytesPerToken()
	}
	return 0
}

// KVBytesPerToken implements KVSizer: the model's
// 2·Layers·KVHeads·HeadDim·DTypeBytes (Model.KVBytesPerToken), the same
// figure that divides the free memory into the KV capacity. For Qwen3-32B
// (config.json: 64 layers, 8 KV heads, head_dim 128, bf16) it is
// 2·64·8·128·2 = 262,144 bytes, 256 KiB per token.
func (r *roofline) KVBytesPerToken() float64 { return r.kvPerToken }

// KVBytesPerToken implements KVSizer: the base profile's (scaling times
// does not change memory); 0 when the base gives none.
func (s *Scaled) KVBytesPerToken() float64 { return KVBytesOf(s.base) }
