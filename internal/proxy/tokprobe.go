package proxy

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// tokUnknown is keying.TokenizerUnknown as a gauge value.
const tokUnknown = -1

// tokenizerProbe is the state of the proxy's tokenizer checks: which
// replicas are due a probe, and what each last probe found.
type tokenizerProbe struct {
	keyer *keying.TokenizerKeyer
	check *keying.TokenizerCheck

	mu    sync.Mutex // guards due and state
	due   []bool
	state []keying.TokenizerState
}

// newTokenizerProbe prepares the probe for n replicas, all due.
func newTokenizerProbe(k *keying.TokenizerKeyer, n int) *tokenizerProbe {
	tp := &tokenizerProbe{keyer: k, check: keying.NewTokenizerCheck(k.Tokenizer()), due: make([]bool, n), state: make([]keying.TokenizerState, n)}
	for i := range n {
		tp.due[i], tp.state[i] = true, keying.TokenizerUnknown
	}
	return tp
}

// markDue makes replica id due a probe (it was re-admitted).
func (tp *tokenizerProbe) markDue(id int) {
	tp.mu.Lock()
	tp.due[id] = true
	tp.mu.Unlock()
}

// isDue reports whether replica id is due a probe.
func (tp *tokenizerProbe) isDue(id int) bool {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return tp.due[id]
}

// set records replica id's state and returns whether any replica
// mismatches now.
func (tp *tokenizerProbe) set(id int, state keying.TokenizerState) (anyMismatch bool) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	tp.due[id] = false
	tp.state[id] = state
	return slices.Contains(tp.state, keying.TokenizerMismatch)
}

// probeTokenizer compares the local tokenizer with replica b's /tokenize
// (TokenizerCheck, in the shape of b's backend kind), if b is due a probe, and sets the keyer's fallback: on
// while any replica mismatches. A replica without /tokenize (an HTTP
// error) is "unknown" and does not stop token keying; one that did not
// answer stays due.
func (p *Proxy) probeTokenizer(ctx context.Context, b *backend) {
	tp := p.tokProbe
	if tp == nil || !tp.isDue(b.id) {
		return
	}
	check := *tp.check
	check.Timeout = p.cfg.HealthTimeout // each request, as a health check
	state, err := check.CompareKind(ctx, p.checks, b.url.String(), p.engineOf(b.id).kind)
	if ctx.Err() != nil {
		return
	}
	if errors.Is(err, upstream.ErrNoAnswer) {
		p.log.Debug("tokenizer probe: no answer; retrying after the next health check", "replica", b.name, "err", err)
		return
	}
	anyMismatch := tp.set(b.id, state)
	p.m.tokMatch.WithLabelValues(b.name).Set(float64(state))
	state.Log(p.log, b.name, err)
	if was := tp.keyer.Fallback(); was != anyMismatch {
		tp.keyer.SetFallback(anyMismatch)
		if !anyMismatch {
			p.log.Info("every probed replica's tokenizer matches again: keying text and chats by token ids")
		}
	}
	p.m.tokFallback.Set(boolFloat(anyMismatch))
	if p.hookProbe != nil {
		p.hookProbe(b.name, int(state))
	}
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
