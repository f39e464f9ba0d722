package router

import (
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// PrefillEstimate is req's own prefill on replica id as the router would
// price it were req routed there now (the PendingPrefill it would add):
// its tokens that replica does not cache, under the replica's priced
// profile. 0 for an unknown id or an empty prompt. The tree is only read;
// the router's admission queue asks it of a request that waits, to shed
// one that cannot meet its deadline (admission.Estimator.Service).
func (r *Router) PrefillEstimate(req *policy.Request, id int) time.Duration {
	if id < 0 || id >= len(r.reps) || req.PromptTokens <= 0 {
		return 0
	}
	r.tree.Lookup(req.Keys, &r.match)
	r.prepareView(req.Keys, req.PromptTokens)
	m := r.view.MatchedTokens(id, req)
	return r.priced[id].Prefill(req.PromptTokens-m, r.view.SeqFor(id, req))
}
