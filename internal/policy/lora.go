package policy

import (
	"time"
)

// DefaultGIELoRAWeight is GIELoRA's weight of the lora-affinity scorer: 1,
// the weight GIE gives a scorer its config names without one, as its
// integration harness's default profile does (test/integration/epp in
// kubernetes-sigs/gateway-api-inference-extension lists queue-scorer,
// kv-cache-utilization-scorer, prefix-cache-scorer and lora-affinity-scorer
// with no weights). `gie-lora:lora_weight=W` is not parsed; build others
// with NewGIELoRA.
const DefaultGIELoRAWeight = 1

// GIELoRA is a Gateway API Inference Extension scheduler with its
// lora-affinity scorer (kubernetes-sigs/gateway-api-inference-extension
// pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go
// @ 33173e4c83e87fece15b50f3ded861a3c0edb0ea) added to the precise
// prefix, KV-cache and queue scorers of llmd-precise (weights 3/2/2, GIE's
// default profile, config/charts/inferencepool/templates/epp-config.yaml):
//
//	score(r) = 3·prefix(r) + 2·kv(r) + 2·queue(r) + LoRAWeight·lora(r)
//
// lora scores the replica for the request's adapter (its target model):
//
//	1.0  the adapter is active on r
//	0.8  r has room to load one more: |active| + |waiting| < max
//	0.6  the adapter is waiting on r
//	0    otherwise
//
// GIE reads active and waiting adapters from vLLM's
// vllm:lora_requests_info gauge (running_lora_adapters,
// waiting_lora_adapters, max_lora). The router gives policies the adapters
// a replica holds in its slots (Replica.Adapters) and not the waiting ones,
// so here "active" is "held" (a superset of running: it also credits an
// idle resident adapter, which GIE's data would not show), and the 0.6
// case does not arise. A base-model request, or a replica whose slots are
// unknown (MaxAdapters 0), scores 1: every replica serves the base model.
// GIE's older lora-affinity filter (pkg/epp/scheduling/framework/plugins/
// filter/lora_affinity_filter.go, since removed) is not modelled.
type GIELoRA struct {
	// LoRAWeight weighs the lora-affinity scorer.
	LoRAWeight float64
	prefix     []float64
}

var _ Policy = (*GIELoRA)(nil)

// NewGIELoRA returns GIE's scheduler with lora-affinity weighted w.
func NewGIELoRA(w float64) *GIELoRA { return &GIELoRA{LoRAWeight: w} }

// Name implements Policy.
func (p *GIELoRA) Name() string { return "gie-lora" }

// loraAffinity is GIE's lora-affinity score of replica rp for adapter a.
func loraAffinity(rp *Replica, a string) float64 {
	switch {
	case a == "" || rp.MaxAdapters <= 0:
		return 1
	case rp.HoldsAdapter(a):
		return 1
	case len(rp.Adapters) < rp.MaxAdapters:
		return 0.8
	}
	return 0
}

// Route implements Policy: the highest weighted score wins, ties at random
// (scoreLLMD's rules for the other three scorers).
func (p *GIELoRA) Route(req *Request, v *View, now time.Time) (Decision, error) {
	p.prefix = precisePrefixScores(p.prefix, req, v)
	return scoreGIE(req, v, p.prefix, v.Match.PerReplica, 3, 2, 2, p.LoRAWeight,
		func(rp *Replica) float64 { return loraAffinity(rp, req.Adapter) }, "gie-lora")
}
