package epp

import (
	"context"
	"errors"
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// tokenizerRetry is how soon a replica whose /tokenize did not answer is
// checked again when there is no ScrapeInterval to follow.
const tokenizerRetry = 5 * time.Second

// tokenizerChecks are the picker's tokenizer checks, on when the keyer is
// a *proxy.TokenizerKeyer: as prefixlb serve does, each replica's /tokenize
// (vLLM's, or llama.cpp's for a llama.cpp replica, once its kind is known)
// is compared with the keyer's tokenizer (proxy.TokenizerCheck)
// when it joins and whenever it is ready again, and prompts are keyed by
// text chunks (TokenizerKeyer.SetFallback) while any replica in the pool
// mismatches, rather than by token keys that match none of its blocks.
type tokenizerChecks struct {
	keyer  *keying.TokenizerKeyer
	check  *keying.TokenizerCheck // Timeout: Config.ScrapeTimeout
	client *http.Client
	retry  time.Duration // between checks of a replica that did not answer
}

func newTokenizerChecks(k *keying.TokenizerKeyer, cfg *Config) *tokenizerChecks {
	tc := &tokenizerChecks{keyer: k, check: keying.NewTokenizerCheck(k.Tokenizer()), client: &http.Client{},
		retry: cfg.ScrapeInterval}
	tc.check.Timeout = cfg.ScrapeTimeout
	if tc.retry <= 0 {
		tc.retry = tokenizerRetry
	}
	return tc
}

// markTokenizerDue makes r due a tokenizer check and wakes its loop
// (p.mu held).
func (p *Picker) markTokenizerDue(r *replica) {
	if p.tok == nil {
		return
	}
	r.tokDue = true
	select {
	case r.tokWake <- struct{}{}:
	default:
	}
}

// tokenizerLoop checks r's tokenizer whenever it is due and ready: at
// once, when SetReady wakes it, and at every retry tick (the scrape
// interval) while a check got no answer. It is one of r's feeds.
func (p *Picker) tokenizerLoop(ctx context.Context, r *replica) {
	t := time.NewTicker(p.tok.retry)
	defer t.Stop()
	for {
		p.checkTokenizer(ctx, r)
		select {
		case <-ctx.Done():
			return
		case <-r.tokWake:
		case <-t.C:
		}
	}
}

// checkTokenizer runs the check on r if it is due and ready, records what
// it found and sets the keyer's fallback: on while any replica in the pool
// mismatches. A replica without /tokenize (an HTTP error) is "unknown" and
// does not stop token keying; one that did not answer stays due.
func (p *Picker) checkTokenizer(ctx context.Context, r *replica) {
	p.mu.Lock()
	if p.byName[r.Name] != r || !r.tokDue || !r.Ready || r.kindDue {
		// r.kindDue: the check waits for the replica's kind, which says
		// which /tokenize it speaks; the detection wakes it.
		p.mu.Unlock()
		return
	}
	r.tokDue = false // SetReady may make it due again meanwhile
	kind := r.kind
	p.mu.Unlock()

	state, err := p.tok.check.CompareKind(ctx, p.tok.client, "http://"+r.Address, kind)

	p.mu.Lock()
	if ctx.Err() != nil || p.byName[r.Name] != r { // stopping, or r left the pool
		r.tokDue = true
		p.mu.Unlock()
		return
	}
	if errors.Is(err, upstream.ErrNoAnswer) {
		r.tokDue = true
		hook := p.onTokenizer
		p.mu.Unlock()
		p.log.Debug("epp: tokenizer check: no answer; checking again later", "replica", r.Name, "retry_in", p.tok.retry, "err", err)
		if hook != nil {
			hook(r.Name, state, err)
		}
		return
	}
	r.tokState = state
	p.setTokenizerFallback()
	hook := p.onTokenizer
	p.mu.Unlock()
	state.Log(p.log, r.Name, err)
	if hook != nil {
		hook(r.Name, state, err)
	}
}

// setTokenizerFallback turns the keyer's fallback on while a replica in
// the pool mismatches, off otherwise (p.mu held).
func (p *Picker) setTokenizerFallback() {
	if p.tok == nil {
		return
	}
	mismatch := false
	for _, r := range p.slots {
		if r != nil && r.tokState == keying.TokenizerMismatch {
			mismatch = true
			break
		}
	}
	if p.tok.keyer.Fallback() == mismatch {
		return
	}
	p.tok.keyer.SetFallback(mismatch)
	if !mismatch {
		p.log.Info("epp: every checked replica's tokenizer matches again: keying text and chats by token ids")
	}
}
