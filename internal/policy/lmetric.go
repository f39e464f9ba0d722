package policy

import "time"

// LMetric is the scheduling score of Zhang et al., "LMetric: Simple is
// Better – Multiplication May Be All You Need for LLM Request Scheduling"
// (OSDI '26; arXiv:2603.15202): route each request to the replica with the
// smallest product of two indicators, the prompt tokens it would have to
// prefill there (the prompt minus what the replica caches of it: the
// KV-cache indicator) and the replica's current batch size (the
// load-balancing indicator). A product, unlike a weighted sum, needs no
// weights: scaling either indicator scales every replica's score alike,
// so the ordering does not depend on it.
//
// The batch size is the engine's running requests as scraped
// (vllm:num_requests_running; the replica model's in sim), never fewer
// than the requests the router itself has in flight there (a scrape lags a
// burst, and requests routed since count too). The paper notes the
// multiplication's one blind spot: a zero in either indicator makes the
// score 0 whatever the other says (an idle replica that caches nothing
// ties with a busy one that caches everything). Ties are broken here by
// fewer uncached tokens, then by the smaller batch, then uniformly at
// random: an idle cluster routes by cache affinity, and a fully cached
// prompt goes to the least busy of the replicas that hold it.
type LMetric struct{}

var _ Policy = LMetric{}

// Name implements Policy.
func (LMetric) Name() string { return "lmetric" }

// BatchSize is the batch size LMetric reads of rp: the engine's running
// requests when scraped, at least the router's own in flight there.
func (LMetric) BatchSize(rp *Replica) int { return max(rp.Running, rp.InFlight, 0) }

// Route implements Policy.
func (p LMetric) Route(req *Request, v *View, now time.Time) (Decision, error) {
	d := Decision{Branch: "lmetric", Replica: -1, Candidates: make([]Candidate, 0, len(v.Replicas))}
	var best struct {
		score           float64
		uncached, batch int
		ties            int
	}
	for i := range v.Replicas {
		rp := &v.Replicas[i]
		if !rp.Up {
			continue
		}
		m := v.MatchedTokens(i, req)
		uncached := max(req.PromptTokens-m, 0)
		batch := p.BatchSize(rp)
		score := float64(uncached) * float64(batch)
		d.Candidates = append(d.Candidates, Candidate{Replica: i, MatchedTokens: m, Score: score})
		better := d.Replica < 0 || score < best.score ||
			(score == best.score && (uncached < best.uncached || (uncached == best.uncached && batch < best.batch)))
		same := d.Replica >= 0 && score == best.score && uncached == best.uncached && batch == best.batch
		switch {
		case better:
			best.score, best.uncached, best.batch, best.ties = score, uncached, batch, 1
			d.Replica, d.MatchedTokens = i, m
		case same:
			best.ties++
			if v.Rand.IntN(best.ties) == 0 {
				d.Replica, d.MatchedTokens = i, m
			}
		}
	}
	if d.Replica < 0 {
		return Decision{}, ErrNoReplica
	}
	return d, nil
}
