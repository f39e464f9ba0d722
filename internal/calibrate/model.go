// Package calibrate learns each replica's real prefill and decode speed from
// what the router observes, so that E2 (and every policy that prices work
// in seconds) prices it with the replica's measured speed instead of a
// profile that describes no real machine exactly.
//
// A Model is a costmodel.Profile: the configured profile (the prior)
// corrected by coefficients fitted online. Both fitted times are linear in
// four features, the first of which is the prior's own figure:
//
//	T_prefill(new, seq) = θ₀·P(new, seq) + Rp·(θ₁ + θ₂·new/1024 + θ₃·new·seq/1024²)
//	T_decode(b, c)      = φ₀·D(b, c)     + Rd·(φ₁ + φ₂·b + φ₃·c/1024)
//
// P and D are the prior's prefill and decode-step times (b sequences holding
// c tokens of context in all), Rp = P(1024, 1024) and Rd = D(1, 1024) give
// the corrections the prior's units. The prior is θ = φ = (1, 0, 0, 0): with
// no observation a Model prices exactly as its prior. θ₀ and φ₀ learn a
// replica that is uniformly faster or slower (another GPU generation, a
// profile 2× off); the other terms learn a per-request overhead and a shape
// the prior does not have (a CPU engine's attention, priced by a GPU
// roofline). The estimator (estimator.go) is least squares on relative
// error with stabilised exponential forgetting towards the prior and Huber
// weights.
//
// A Tracker turns one replica's request events into observations. Queue
// time is separated from prefill time without knowing the engine's order of
// service: a replica's prefill is busy from the moment some request routed
// to it has started and not produced its first token until none is left,
// and a work-conserving server's busy period lasts exactly as long as the
// service of the requests that arrived during it — however they queued,
// batched or were reordered (the busy-period identity of queueing theory;
// Kleinrock, "Queueing Systems" vol. 1, §5.9). Each busy period is one
// prefill observation: its length against the sum of its requests' features.
// Decode is observed per request between its first token and its end, less
// the prefill the replica ran meanwhile (chunked prefill shares iterations
// with decodes). llama.cpp's timings (prompt_ms, predicted_ms), when a
// response carries them, are the replica's own measurements and are used
// directly.
//
// Everything here is pure: time is passed in, nothing runs in the
// background, and a Model or Tracker is not safe for concurrent use (the
// router serialises it).
package calibrate

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// ErrInvalidConfig is wrapped by every error Config.Validate returns.
var ErrInvalidConfig = errors.New("calibrate: invalid config")

// Config configures calibration. DefaultConfig gives the settings prefixlb
// uses; Validate names the first bad field.
type Config struct {
	// Forget is λ, the weight each observation leaves to the ones before:
	// the fit remembers about 1/(1−λ) observations (0.995: 200).
	Forget float64 `json:"forget"`
	// PriorWeight is what the profile's speed (θ₀ = φ₀ = 1) is worth to
	// the pool's fit, in observations (0.25): a cluster uniformly faster or
	// slower than its profile is learnt without bias once a few
	// observations are in.
	PriorWeight float64 `json:"prior_weight"`
	// PoolWeight is what the pool's fit is worth to each replica's, in
	// observations (8). Replicas told the same profile form a pool whose
	// fit learns from all of them; each replica's own fit is pulled towards
	// the pool's, so a replica that has been seen little, or unluckily
	// (a few slow observations on a loaded machine), is priced like its
	// peers until its own observations say otherwise — and a policy that
	// avoids a replica it wrongly thinks slow does not starve it of the
	// observations that would correct it.
	PoolWeight float64 `json:"pool_weight"`
	// ShapeWeight is what the prior's shape (no correction terms) is
	// worth, in observations, per term (10): the fit prefers changing the
	// speed to changing the shape, and a shape the data stop showing
	// drifts back to the prior's.
	ShapeWeight float64 `json:"shape_weight"`
	// Huber is the residual, in robust scales, beyond which an observation
	// is down-weighted (2).
	Huber float64 `json:"huber"`
	// MinRatio and MaxRatio bound a fitted time to this range times the
	// prior's (0.01 and 100: a CPU engine priced by a GPU profile is 10–50×
	// slower).
	MinRatio float64 `json:"min_ratio"`
	MaxRatio float64 `json:"max_ratio"`
	// MinDecodeTokens is the least number of tokens a request must decode
	// after its first for its decode to be an observation (4).
	MinDecodeTokens int `json:"min_decode_tokens"`
	// MaxPrefillShare drops a decode observation when the replica's prefill
	// took more than this share of the request's decode time (0.5): the
	// subtraction of that prefill would dominate what is left.
	MaxPrefillShare float64 `json:"max_prefill_share"`
	// NoTimings ignores llama.cpp's timings and learns from the router's
	// own clock only (for comparing the two; off by default).
	NoTimings bool `json:"no_timings"`
	// MaxRate bounds the observations a replica learns from, per second
	// and per phase (prefill, decode; 20): beyond it they are passed over
	// before any work is done, so learning costs the router a bounded
	// amount of CPU whatever the request rate, and the fit's memory (about
	// 1/(1−Forget) observations) spans at least that many seconds over
	// MaxRate. 0: no bound.
	MaxRate float64 `json:"max_rate"`
}

// DefaultConfig returns prefixlb's calibration settings.
func DefaultConfig() Config {
	return Config{
		Forget: 0.995, PriorWeight: 0.25, PoolWeight: 8, ShapeWeight: 10, Huber: 2,
		MinRatio: 0.01, MaxRatio: 100, MinDecodeTokens: 4, MaxPrefillShare: 0.5, MaxRate: 20,
	}
}

// Validate reports the first invalid field.
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...))
	}
	ok := func(x float64) bool { return !math.IsNaN(x) && !math.IsInf(x, 0) }
	switch {
	case !ok(c.Forget) || c.Forget <= 0 || c.Forget > 1:
		return bad("forget", "must be in (0, 1], got %v", c.Forget)
	case !ok(c.PriorWeight) || c.PriorWeight <= 0:
		return bad("prior_weight", "must be > 0, got %v", c.PriorWeight)
	case !ok(c.PoolWeight) || c.PoolWeight <= 0:
		return bad("pool_weight", "must be > 0, got %v", c.PoolWeight)
	case !ok(c.ShapeWeight) || c.ShapeWeight <= 0:
		return bad("shape_weight", "must be > 0, got %v", c.ShapeWeight)
	case !ok(c.Huber) || c.Huber <= 0:
		return bad("huber", "must be > 0, got %v", c.Huber)
	case !ok(c.MinRatio) || c.MinRatio <= 0 || c.MinRatio > 1:
		return bad("min_ratio", "must be in (0, 1], got %v", c.MinRatio)
	case !ok(c.MaxRatio) || c.MaxRatio < 1:
		return bad("max_ratio", "must be ≥ 1, got %v", c.MaxRatio)
	case c.MinDecodeTokens < 1:
		return bad("min_decode_tokens", "must be ≥ 1, got %d", c.MinDecodeTokens)
	case !ok(c.MaxRate) || c.MaxRate < 0:
		return bad("max_rate", "must be ≥ 0 (0: no bound), got %v", c.MaxRate)
	case !ok(c.MaxPrefillShare) || c.MaxPrefillShare < 0 || c.MaxPrefillShare >= 1:
		return bad("max_prefill_share", "must be in [0, 1), got %v", c.MaxPrefillShare)
	}
	return nil
}

// Reference points of the figures Fit reports (and of the metrics
// prefixlb_replica_prefill_seconds_per_1k_tokens and
// prefixlb_replica_decode_step_seconds).
const (
	// RefPrefillTokens: a cold prefill of this many tokens.
	RefPrefillTokens = 1000
	// RefDecodeContext: one sequence decoding with this much context.
	RefDecodeContext = 1000
)

// Model is one replica's calibrated cost model: see the package comment.
// It implements costmodel.Profile (and costmodel.Batcher with its prior's
// batching). Not safe for concurrent use.
type Model struct {
	prior    costmodel.Profile
	cfg      Config
	refP     float64   // seconds: prior P(1024, 1024)
	refD     float64   // seconds: prior D(1, 1024)
	budget   int       // prior's max_num_batched_tokens: the chunk a prefill iteration carries
	pre, dec estimator // the replica's own fit, pulled towards pool's
	pool     *pool
	memo     *priorMemo // the prior's figures, shared with Siblings
	fits     *fitMemo   // this model's fitted figures (not shared)
}

// pool is the fit of every replica told the same profile (a Model and its
// Siblings): it learns from all their observations, from the profile.
type pool struct {
	pre, dec estimator
}

var (
	_ costmodel.Profile = (*Model)(nil)
	_ costmodel.Batcher = (*Model)(nil)
)

// NewModel returns a Model of prior with no observations (it prices exactly
// as prior until it has some).
func NewModel(prior costmodel.Profile, cfg Config) (*Model, error) {
	if prior == nil {
		return nil, fmt.Errorf("%w: no prior profile", ErrInvalidConfig)
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Model{prior: prior, cfg: cfg, memo: newPriorMemo(prior),
		refP:   secs(prior.Prefill(1024, 1024)),
		refD:   secs(prior.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: 1024})),
		budget: costmodel.BatchingOf(prior).MaxBatchedTokens,
	}
	theta := vec{1, 0, 0, 0}
	prec := vec{cfg.PriorWeight, cfg.ShapeWeight, cfg.ShapeWeight, cfg.ShapeWeight}
	m.pool = &pool{pre: newEstimator(theta, prec, cfg.Forget, cfg.Huber), dec: newEstimator(theta, prec, cfg.Forget, cfg.Huber)}
	m.pool.pre.quiet, m.pool.dec.quiet = true, true
	m.fits = &fitMemo{}
	m.own()
	return m, nil
}

// own gives m a fit of its own with no observations, pulled towards its
// pool's.
func (m *Model) own() {
	theta := vec{1, 0, 0, 0}
	prec := vec{m.cfg.PoolWeight, m.cfg.ShapeWeight, m.cfg.ShapeWeight, m.cfg.ShapeWeight}
	m.pre = newEstimator(theta, prec, m.cfg.Forget, m.cfg.Huber)
	m.dec = newEstimator(theta, prec, m.cfg.Forget, m.cfg.Huber)
}

// Sibling returns a new model of the same prior and config for another
// replica told the same profile: its own fit has no observations, it
// shares m's pool (see Config.PoolWeight) and m's memo of the prior's
// figures (the models of replicas that share a profile evaluate it once
// between them).
func (m *Model) Sibling() *Model {
	s := *m
	s.own()
	s.fits = &fitMemo{}
	return &s
}

// preVer and decVer are the versions of the coefficients preTheta and
// decTheta return (0 when they are the prior's): the stamps of the fitMemo.
func (m *Model) preVer() uint64 {
	follow(&m.pre, &m.pool.pre)
	switch {
	case m.pre.n > 0:
		return m.pre.ver<<1 | 1
	case m.pool.pre.n > 0:
		return m.pool.pre.ver << 1
	}
	return 0
}

func (m *Model) decVer() uint64 {
	follow(&m.dec, &m.pool.dec)
	switch {
	case m.dec.n > 0:
		return m.dec.ver<<1 | 1
	case m.pool.dec.n > 0:
		return m.pool.dec.ver << 1
	}
	return 0
}

// preTheta and decTheta are the coefficients the model prices with: its
// own fit once it has observations, the pool's before (nil: the prior's).
func (m *Model) preTheta() *vec {
	switch {
	case m.pre.n > 0:
		return &m.pre.theta
	case m.pool.pre.n > 0:
		return &m.pool.pre.theta
	}
	return nil
}

func (m *Model) decTheta() *vec {
	switch {
	case m.dec.n > 0:
		return &m.dec.theta
	case m.pool.dec.n > 0:
		return &m.pool.dec.theta
	}
	return nil
}

// Memoized implements costmodel.Memoizer: a Model remembers its own
// figures (a policy's per-decision memo of them only costs time).
func (m *Model) Memoized() bool { return true }

// Name implements costmodel.Profile: the prior's name.
func (m *Model) Name() string { return m.prior.Name() }

// KVCapacity implements costmodel.Profile: the prior's.
func (m *Model) KVCapacity() int { return m.prior.KVCapacity() }

// Batching implements costmodel.Batcher: the prior's.
func (m *Model) Batching() costmodel.Batching { return costmodel.BatchingOf(m.prior) }

// Prefill implements costmodel.Profile with the fitted prefill.
func (m *Model) Prefill(newTokens, seqTokens int) time.Duration {
	ver := m.preVer()
	if ver == 0 || newTokens <= 0 {
		return m.memo.prefillOf(newTokens, seqTokens)
	}
	e := &m.fits.prefill[slot(newTokens, seqTokens)]
	if e.ver == ver && e.a == newTokens && e.b == seqTokens {
		return e.v
	}
	p := m.memo.prefillOf(newTokens, seqTokens)
	f := m.prefillFeatures(secs(p), 1, float64(newTokens), float64(newTokens)*float64(max(seqTokens, newTokens)))
	v := m.clamp(dot(*m.preTheta(), f), p)
	*e = fitEntry{a: newTokens, b: seqTokens, ver: ver, v: v}
	return v
}

// Iteration implements costmodel.Profile: a decode-only batch at the
// fitted decode step, a prefill-only one at the fitted prefill, and a mixed
// one from the prior's mixed time I and the ratios a = fitted/prior of its
// prefill part P and d of its decode part D, as costmodel.Scaled does:
// m·I + (a−m)·P + (d−m)·D with m = min(a, d), at least a·P and d·D — exact
// for pure batches, a·I when both ratios agree, and monotone.
func (m *Model) Iteration(b costmodel.Batch) time.Duration {
	if len(b.Prefill) == 1 && b.DecodeSeqs > 0 && b.Prefill[0].New > 0 {
		// One chunk beside decodes (what E2 asks to price the decodes'
		// share of a prefill iteration): every part from the memos.
		c := b.Prefill[0]
		pv, dv := m.preVer(), m.decVer()
		if pv == 0 && dv == 0 {
			all, _, _ := m.memo.mixedOf(c.New, c.Seq, b.DecodeSeqs, b.DecodeContext)
			return all
		}
		ver := pv<<32 ^ dv
		e := &m.fits.mixed[slot(c.New^b.DecodeSeqs<<20, c.Seq^b.DecodeContext<<7)]
		if e.ver == ver && e.n == c.New && e.s == c.Seq && e.seqs == b.DecodeSeqs && e.ctx == b.DecodeContext {
			return e.v
		}
		all, pp, pd := m.memo.mixedOf(c.New, c.Seq, b.DecodeSeqs, b.DecodeContext)
		fp := pp
		if th := m.preTheta(); th != nil {
			fp = m.clamp(dot(*th, m.prefillFeatures(secs(pp), 1, float64(c.New), float64(c.New)*float64(max(c.Seq, c.New)))), pp)
		}
		v := m.mix(all, pp, pd, fp, m.decodeStep(b.DecodeSeqs, b.DecodeContext))
		*e = fitMixed{n: c.New, s: c.Seq, seqs: b.DecodeSeqs, ctx: b.DecodeContext, ver: ver, v: v}
		return v
	}
	if m.preTheta() == nil && m.decTheta() == nil {
		if len(b.Prefill) == 0 {
			return m.memo.decodeOf(b.DecodeSeqs, b.DecodeContext)
		}
		return m.prior.Iteration(b)
	}
	chunks, nw, nws := 0, 0.0, 0.0
	for _, c := range b.Prefill {
		if c.New > 0 {
			chunks++
			nw += float64(c.New)
			nws += float64(c.New) * float64(max(c.Seq, c.New))
		}
	}
	hasD := b.DecodeSeqs > 0
	switch {
	case chunks == 0 && !hasD:
		return m.prior.Iteration(b)
	case chunks == 0:
		return m.decodeStep(b.DecodeSeqs, b.DecodeContext)
	}
	pb := costmodel.Batch{Prefill: b.Prefill}
	pp := m.prior.Iteration(pb)
	fp := pp
	if th := m.preTheta(); th != nil {
		fp = m.clamp(dot(*th, m.prefillFeatures(secs(pp), float64(chunks), nw, nws)), pp)
	}
	if !hasD {
		return fp
	}
	pd := m.memo.decodeOf(b.DecodeSeqs, b.DecodeContext)
	return m.mix(m.prior.Iteration(b), pp, pd, fp, m.decodeStep(b.DecodeSeqs, b.DecodeContext))
}

// mix is a mixed iteration's fitted time from the prior's time of the whole
// (all), of its prefill part (pp) and of its decode part (pd), and the
// fitted times fp and fd of those parts (see Iteration).
func (m *Model) mix(all, pp, pd, fp, fd time.Duration) time.Duration {
	if pp <= 0 || pd <= 0 {
		return all
	}
	ra, rd := secs(fp)/secs(pp), secs(fd)/secs(pd)
	lo := min(ra, rd)
	t := lo*secs(all) + (ra-lo)*secs(pp) + (rd-lo)*secs(pd)
	return fromSeconds(max(t, max(secs(fp), secs(fd))))
}

// decodeStep is the fitted time of a decode-only iteration.
func (m *Model) decodeStep(seqs, context int) time.Duration {
	ver := m.decVer()
	if ver == 0 {
		return m.memo.decodeOf(seqs, context)
	}
	e := &m.fits.decode[slot(seqs, context)]
	if e.ver == ver && e.a == seqs && e.b == context {
		return e.v
	}
	p := m.memo.decodeOf(seqs, context)
	v := m.clamp(dot(*m.decTheta(), m.decodeFeatures(secs(p), float64(seqs), float64(max(context, 0)))), p)
	*e = fitEntry{a: seqs, b: context, ver: ver, v: v}
	return v
}

// prefillFeatures are the prefill features of chunks requests computing nw
// tokens in all, with Σ new·seq = nws, whose prior time is p seconds.
func (m *Model) prefillFeatures(p, chunks, nw, nws float64) vec {
	return vec{p, m.refP * chunks, m.refP * nw / 1024, m.refP * nws / (1024 * 1024)}
}

// decodeFeatures are the decode features of a step of b sequences holding c
// tokens of context in all, whose prior time is p seconds.
func (m *Model) decodeFeatures(p, b, c float64) vec {
	return vec{p, m.refD, m.refD * b, m.refD * c / 1024}
}

// clamp bounds a fitted time t (seconds) to [MinRatio, MaxRatio] times the
// prior's p.
func (m *Model) clamp(t float64, p time.Duration) time.Duration {
	if p <= 0 {
		return p
	}
	// On the router's hot path: nanoseconds and the builtin min and max
	// (math.Min and Max are calls), and a NaN t falls to the prior's.
	ns := t * 1e9
	lo, hi := m.cfg.MinRatio*float64(p), m.cfg.MaxRatio*float64(p)
	if !(ns >= lo) {
		ns = lo
	}
	ns = min(ns, hi)
	if ns >= math.MaxInt64 {
		return time.Duration(math.MaxInt64)
	}
	return max(time.Duration(ns+0.5), 1)
}

// Work is one request's prefill in an observation: New prompt tokens
// computed, ending a sequence of Seq tokens.
type Work struct {
	New, Seq int
}

// ObservePrefill adds one prefill observation: the replica spent seconds
// computing works, while on average decodeBatch sequences holding
// decodeContext tokens of context in all decoded alongside (each prefill
// chunk shares its iteration with them: every work's features are
// stretched by the prior's share of such an iteration that the decodes
// take). weight in (0, 1] scales the observation. It reports whether the
// observation was used.
func (m *Model) ObservePrefill(works []Work, seconds, decodeBatch, decodeContext, weight float64) bool {
	var x vec
	norm := 0.0
	seqs := int(math.Round(max(decodeBatch, 0)))
	ctx := int(math.Round(max(decodeContext, 0)))
	for _, w := range works {
		n, s := max(w.New, 1), max(w.Seq, w.New, 1)
		p := secs(m.memo.prefillOf(n, s))
		stretch := 1.0
		if seqs > 0 {
			c := n
			if m.budget > 0 {
				c = min(n, m.budget)
			}
			with, alone, _ := m.memo.mixedOf(c, c, seqs, ctx)
			if alone > 0 {
				stretch = secs(with) / secs(alone)
			}
		}
		f := m.prefillFeatures(p, 1, float64(n), float64(n)*float64(s))
		for i := range x {
			x[i] += stretch * f[i]
		}
		norm += stretch * p
	}
	return m.learn(&m.pool.pre, &m.pre, x, seconds, norm, weight)
}

// stretch is the prior's ratio of an iteration that computes a full prefill
// chunk (the batching budget's worth of tokens) with batch sequences holding
// ctx tokens of context decoding alongside, to the chunk alone: how much
// longer prefill takes beside that batch (≥ 1).
func (m *Model) stretch(batch, ctx float64) float64 {
	seqs := int(math.Round(max(batch, 0)))
	if seqs == 0 {
		return 1
	}
	c := m.budget
	if c <= 0 {
		c = 2048
	}
	with, alone, _ := m.memo.mixedOf(c, c, seqs, int(math.Round(max(ctx, 0))))
	if alone <= 0 || with < alone {
		return 1
	}
	return secs(with) / secs(alone)
}

// ObserveDecode adds one decode observation: a decode step took seconds
// while on average batch sequences holding context tokens in all decoded.
// weight in (0, 1] scales the observation. It reports whether it was used.
func (m *Model) ObserveDecode(seconds, batch, context, weight float64) bool {
	b := max(batch, 1)
	c := max(context, 0)
	p := secs(m.prior.Iteration(costmodel.Batch{DecodeSeqs: int(math.Round(b)), DecodeContext: int(math.Round(c))}))
	return m.learn(&m.pool.dec, &m.dec, m.decodeFeatures(p, b, c), seconds, p, weight)
}

// learn adds an observation to the pool's fit, then to the replica's own,
// pulled towards the pool's as it now is.
func (m *Model) learn(pool, own *estimator, x vec, y, norm, w float64) bool {
	if !pool.update(x, y, norm, w) {
		return false
	}
	own.prior, own.poolVer = pool.theta, pool.ver // as of the pool's last solve: a few observations old at most
	if own.n == 0 {
		own.theta = pool.theta // its first prediction is the pool's
	}
	return own.update(x, y, norm, w)
}

// follow re-solves a replica's own fit when its pool's has moved since it
// last took the pool's as its prior. Without it, a replica the router
// stopped sending work to (it looked slow after a few unlucky early
// observations) would keep its stale fit for ever while its siblings'
// taught the pool the cluster's real speed: it would look ever slower by
// comparison and never be given the work that would correct it.
func follow(own, pool *estimator) {
	if own.n == 0 || own.poolVer == pool.ver {
		return
	}
	own.prior, own.poolVer = pool.theta, pool.ver
	own.refresh()
}

// Fit is a snapshot of a Model for metrics, dashboards and reports.
type Fit struct {
	// PrefillSamples and DecodeSamples count the observations used.
	PrefillSamples int64 `json:"prefill_samples"`
	DecodeSamples  int64 `json:"decode_samples"`
	// PrefillSecondsPer1K is the fitted time of a cold prefill of
	// RefPrefillTokens tokens, and PriorPrefillSecondsPer1K the prior's.
	PrefillSecondsPer1K      float64 `json:"prefill_seconds_per_1k_tokens"`
	PriorPrefillSecondsPer1K float64 `json:"prior_prefill_seconds_per_1k_tokens"`
	// DecodeStepSeconds is the fitted decode step of one sequence of
	// RefDecodeContext tokens, and PriorDecodeStepSeconds the prior's.
	DecodeStepSeconds      float64 `json:"decode_step_seconds"`
	PriorDecodeStepSeconds float64 `json:"prior_decode_step_seconds"`
	// PrefillError and DecodeError are EWMAs of |predicted/observed − 1|
	// over recent observations, each predicted before the fit learnt from
	// it; PriorPrefillError and PriorDecodeError are the prior's, on the
	// same observations.
	PrefillError      float64 `json:"prefill_error"`
	DecodeError       float64 `json:"decode_error"`
	PriorPrefillError float64 `json:"prior_prefill_error"`
	PriorDecodeError  float64 `json:"prior_decode_error"`
	// PrefillRatio and DecodeRatio are the fit's predicted over the
	// observed seconds over about the last 100 observations, each predicted
	// before the fit learnt from it (1: it agrees with what the replica
	// did); PriorPrefillRatio and PriorDecodeRatio the prior's. 0 before
	// any observation.
	PrefillRatio      float64 `json:"prefill_ratio"`
	DecodeRatio       float64 `json:"decode_ratio"`
	PriorPrefillRatio float64 `json:"prior_prefill_ratio"`
	PriorDecodeRatio  float64 `json:"prior_decode_ratio"`
	// Prefill and Decode are the coefficients (θ and φ of the package
	// comment).
	Prefill [4]float64 `json:"prefill_coefficients"`
	Decode  [4]float64 `json:"decode_coefficients"`
}

// Fit returns the model's current fit.
func (m *Model) Fit() Fit {
	return Fit{
		PrefillSamples: m.pre.n, DecodeSamples: m.dec.n,
		PrefillSecondsPer1K:      secs(m.Prefill(RefPrefillTokens, RefPrefillTokens)),
		PriorPrefillSecondsPer1K: secs(m.prior.Prefill(RefPrefillTokens, RefPrefillTokens)),
		DecodeStepSeconds:        secs(m.decodeStep(1, RefDecodeContext)),
		PriorDecodeStepSeconds:   secs(m.prior.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: RefDecodeContext})),
		PrefillError:             m.pre.errFit, DecodeError: m.dec.errFit,
		PriorPrefillError: m.pre.errPrior, PriorDecodeError: m.dec.errPrior,
		PrefillRatio: ratioOf(m.pre.predSum, m.pre.obsSum), DecodeRatio: ratioOf(m.dec.predSum, m.dec.obsSum),
		PriorPrefillRatio: ratioOf(m.pre.priorSum, m.pre.obsSum), PriorDecodeRatio: ratioOf(m.dec.priorSum, m.dec.obsSum),
		Prefill: m.coeffs(m.preTheta()), Decode: m.coeffs(m.decTheta()),
	}
}

// coeffs is *th, or the prior's coefficients for nil.
func (m *Model) coeffs(th *vec) [4]float64 {
	if th == nil {
		return [4]float64{1, 0, 0, 0}
	}
	return *th
}

// FitOf is the Fit of an uncalibrated profile p: its own figures, fitted
// and prior alike, with no observations.
func FitOf(p costmodel.Profile) Fit {
	pre := secs(p.Prefill(RefPrefillTokens, RefPrefillTokens))
	dec := secs(p.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: RefDecodeContext}))
	return Fit{PrefillSecondsPer1K: pre, PriorPrefillSecondsPer1K: pre, DecodeStepSeconds: dec, PriorDecodeStepSeconds: dec,
		Prefill: [4]float64{1, 0, 0, 0}, Decode: [4]float64{1, 0, 0, 0}}
}

func secs(d time.Duration) float64 { return d.Seconds() }

// ratioOf is a/b, 0 when b is not positive.
func ratioOf(a, b float64) float64 {
	if !(b > 0) {
		return 0
	}
	return a / b
}

// fromSeconds converts seconds to a Duration, at least 1 ns and saturating.
func fromSeconds(s float64) time.Duration {
	ns := s * 1e9
	switch {
	case math.IsNaN(ns) || ns >= math.MaxInt64:
		return time.Duration(math.MaxInt64)
	case ns < 1:
		return 1
	}
	return time.Duration(math.Round(ns))
}
