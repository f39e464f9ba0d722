package policy

import (
	"slices"
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
// lora scores the replica for the request's target model, the first case
// that holds, in GIE's order:
//
//	1.0  the model is active on r (in its running adapters)
//	0.8  r has room: |active| + |waiting| < max
//	0.6  the model is waiting on r (in its waiting adapters)
//	0    otherwise
//
// GIE's metrics extractor fills active, waiting and max from vLLM's
// vllm:lora_requests_info gauge: running_lora_adapters, waiting_lora_adapters
// and max_lora (pkg/epp/framework/plugins/datalayer/extractor/metrics/
// extractor.go @ 95ad8d606e1fa47ffb1a9891502b36225c16e6b6), which the view
// carries as Replica.RunningAdapters, WaitingAdapters and MaxAdapters. An
// adapter held in an idle slot is not active (vLLM does not report it). A
// base-model request's target model is the base model, which the gauge never
// lists: it scores 0.8 where there is room and 0 elsewhere, as in GIE. A
// replica without the gauge (MaxAdapters 0) has no room: 0. The order makes
// a waiting model on a replica with room score 0.8, not 0.6. GIE's older
// lora-affinity filter (pkg/epp/scheduling/framework/plugins/filter/
// lora_affinity_filter.go, since removed) is not modelled.
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

// loraAffinity is GIE's lora-affinity score of replica rp for adapter a
// (LoraAffinityScorer.Score; see GIELoRA).
func loraAffinity(rp *Replica, a string) float64 {
	active := a != "" && slices.Contains(rp.RunningAdapters, a)
	waiting := a != "" && slices.Contains(rp.WaitingAdapters, a)
	switch {
	case active:
		return 1
	case len(rp.RunningAdapters)+len(rp.WaitingAdapters) < rp.MaxAdapters:
		return 0.8
	case waiting:
		return 0.6
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
