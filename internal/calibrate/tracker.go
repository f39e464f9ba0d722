package calibrate

import (
	"math"
	"time"
)

// Flight is the calibration state of one request in flight on a replica.
// The router keeps it inside its own record of the request and passes it to
// the Tracker's methods; the zero Flight is a request not yet started.
type Flight struct {
	prompt int // prompt tokens
	seq    int // the sequence its prefill is priced at (≥ prompt: a slot cache's span)
	ctx    int // decode context it counts for (prompt + half its output)
	guess  int // prompt tokens the router predicted the replica computes

	started, first, tainted bool
	// unary: the client asked for no stream, so no first token will be
	// seen; its prefill is taken to end at unaryEnd (the model's estimate).
	unary    bool
	unaryEnd time.Time
	firstAt  time.Time
	period   *period
	// The tracker's integrals when the first token came.
	decode0, ctx0, busy0 float64
}

// period is one prefill busy period of a replica: from a start with no other
// request prefilling to the first token that leaves none. It becomes an
// observation once every request that started in it has finished (their
// reported cached tokens give the work).
type period struct {
	start, end time.Time
	closed     bool
	members    int // requests that started in it and have not finished
	// taint, when set, is why the period cannot be an observation (a Skip
	// constant, or taintTimed: a member was measured by the replica).
	taint string
	works []Work
	// integrals at the start and the end, for the mean decode batch
	decode0, ctx0, decode1, ctx1 float64
	// startBatch and startCtx are the decode batch running when the
	// period began: its first request waited, on average, for half of
	// that batch's iteration to end before its prefill could start.
	startBatch, startCtx int
}

// Report is what a replica said about a finished request.
type Report struct {
	// OK is false for a failed request (nothing is learnt from it).
	OK bool
	// OutputTokens is the number of tokens generated.
	OutputTokens int
	// CachedTokens is the prompt tokens the replica served from its cache,
	// -1 when it did not say (the router's prediction stands in).
	CachedTokens int
	// Timings is llama.cpp's timings of the request, nil when absent.
	Timings *Timings
	// ITL is the median gap between the request's streamed tokens, as the
	// front door saw them (0: not measured), over ITLSamples gaps. The
	// median is a decode-only iteration's time even when some of the
	// iterations also carried other requests' prefill chunks.
	ITL        time.Duration
	ITLSamples int
}

// Timings is the part of llama.cpp's timings object calibration reads
// (server.cpp at c392e50: prompt_ms runs from the slot starting the prompt
// to the first token; predicted_ms from the first token to the last, over
// predicted_n − 1 decode steps).
type Timings struct {
	PromptN     int
	PromptMs    float64
	PredictedN  int
	PredictedMs float64
}

// Skip reasons, the label values of the skipped-observation counter.
const (
	SkipNoFirstToken = "no_first_token" // a non-streamed or failed request: no prefill end seen
	SkipFailed       = "failed"         // a failed request
	SkipExternal     = "external"       // other routers' requests shared the replica
	SkipReplicaDown  = "replica_down"   // the replica left while its prefill was busy
	SkipPrefillShare = "prefill_share"  // prefill took too much of a decode to subtract
	SkipShortDecode  = "short_decode"   // too few tokens decoded
	SkipUnusable     = "unusable"       // a figure out of range (zero time, NaN)
	SkipRate         = "rate"           // beyond Config.MaxRate: passed over, not wrong
)

// taintTimed marks a period one of whose requests carried llama.cpp's
// timings: that request is learnt from directly, which is not a skip.
const taintTimed = "timed"

// Stats counts a Tracker's observations.
type Stats struct {
	// PrefillPeriods and PrefillTimings count prefill observations from
	// busy periods and from llama.cpp's timings; DecodeITL, DecodeTimings
	// and DecodeRequests decode observations from the median gap between
	// streamed tokens, from timings, and from the router's clock (first
	// token to end).
	PrefillPeriods int64 `json:"prefill_periods"`
	PrefillTimings int64 `json:"prefill_timings"`
	DecodeITL      int64 `json:"decode_itl"`
	DecodeTimings  int64 `json:"decode_timings"`
	DecodeRequests int64 `json:"decode_clock"`
	// TimedPrefill and TimedDecode hold the model as it is now against
	// llama.cpp's own measurements (timings) of the last requests that
	// carried them (up to timedKept), whether or not the model learns from
	// timings (Config.NoTimings): how well the fit reproduces what the
	// engine measured over that stretch of its work.
	TimedPrefill Agreement `json:"timings_prefill"`
	TimedDecode  Agreement `json:"timings_decode"`
	// Skipped counts what could not be used, by reason (the Skip
	// constants).
	Skipped map[string]int64 `json:"skipped"`
}

// Agreement compares a model's predictions with measurements of the same
// requests: the sums of predicted and measured seconds.
type Agreement struct {
	Predicted float64 `json:"predicted_s"`
	Measured  float64 `json:"measured_s"`
	// N counts the requests compared.
	N int64 `json:"requests"`
}

// Ratio is predicted over measured seconds (1: the model agrees), 0 with
// nothing compared.
func (a Agreement) Ratio() float64 { return ratioOf(a.Predicted, a.Measured) }

// timedKept is how many requests with timings a Tracker keeps to hold its
// model against (Stats.TimedPrefill).
const timedKept = 256

// timedObs is one request's llama.cpp timings, in the terms of the model:
// its prefill (new tokens n ending a sequence of s, beside decodes that
// stretched it by stretch) took prefill seconds; its decode steps over an
// average batch of b sequences holding c tokens took step seconds each.
type timedObs struct {
	n, s           int
	stretch        float64
	prefill        float64
	b, c           int
	step           float64
	hasPre, hasDec bool
}

// Tracker turns one replica's request events into observations for its
// Model (see the package comment). Methods take the time of the event;
// times must not go backwards. Not safe for concurrent use.
type Tracker struct {
	m     *Model
	cfg   Config
	stats Stats

	last       time.Time
	prefilling int // started, no first token
	decoding   int
	decodeCtx  int
	// ∫ decoding dt, ∫ decodeCtx dt, ∫ [prefilling > 0] dt, in seconds.
	intDecode, intCtx, intBusy float64
	open                       *period
	external                   bool
	free                       []*period
	one                        [1]Work
	timed                      []timedObs // ring of the last timedKept
	timedNext                  int
	// budgetPre and budgetDec are the MaxRate token buckets of the two
	// phases (observations the replica may still learn from now), and
	// budgetAt when they were last filled.
	budgetPre, budgetDec float64
	budgetAt             time.Time
	unary                []*Flight // non-streamed requests still counted as prefilling
}

// NewTracker returns a tracker feeding m.
func NewTracker(m *Model) *Tracker {
	return &Tracker{m: m, cfg: m.cfg, stats: Stats{Skipped: map[string]int64{}}, budgetPre: rateBurst, budgetDec: rateBurst}
}

// rateBurst is how many observations of a phase a replica may learn from
// at once when it has been quiet (the MaxRate bucket's depth).
const rateBurst = 8

// allow takes one observation from a phase's MaxRate bucket at now,
// reporting whether there was one.
func (t *Tracker) allow(bucket *float64, now time.Time) bool {
	if t.cfg.MaxRate <= 0 {
		return true
	}
	if dt := now.Sub(t.budgetAt).Seconds(); dt > 0 {
		if !t.budgetAt.IsZero() {
			t.budgetPre = min(rateBurst, t.budgetPre+dt*t.cfg.MaxRate)
			t.budgetDec = min(rateBurst, t.budgetDec+dt*t.cfg.MaxRate)
		}
		t.budgetAt = now
	}
	if *bucket < 1 {
		t.skip(SkipRate)
		return false
	}
	*bucket--
	return true
}

// Model returns the model the tracker feeds.
func (t *Tracker) Model() *Model { return t.m }

// Stats returns the tracker's counters (a copy), with the model as it is
// now held against the timings it kept.
func (t *Tracker) Stats() Stats {
	s := t.stats
	s.Skipped = make(map[string]int64, len(t.stats.Skipped))
	for k, v := range t.stats.Skipped {
		s.Skipped[k] = v
	}
	for _, o := range t.timed {
		if o.hasPre {
			s.TimedPrefill.Predicted += t.m.Prefill(o.n, o.s).Seconds() * o.stretch
			s.TimedPrefill.Measured += o.prefill
			s.TimedPrefill.N++
		}
		if o.hasDec {
			s.TimedDecode.Predicted += t.m.decodeStep(o.b, o.c).Seconds()
			s.TimedDecode.Measured += o.step
			s.TimedDecode.N++
		}
	}
	return s
}

func (t *Tracker) skip(reason string) { t.stats.Skipped[reason]++ }

// advance brings the integrals to now.
func (t *Tracker) advance(now time.Time) {
	if t.last.IsZero() {
		t.last = now
		return
	}
	// Non-streamed requests whose prefill should be over by now stop
	// counting as prefilling at their estimated end.
	for len(t.unary) > 0 {
		k := 0
		for i, f := range t.unary {
			if f.unaryEnd.Before(t.unary[k].unaryEnd) {
				k = i
			}
		}
		f := t.unary[k]
		if f.unaryEnd.After(now) {
			break
		}
		t.integrate(f.unaryEnd)
		t.endUnary(k)
	}
	t.integrate(now)
}

// integrate brings the integrals to now.
func (t *Tracker) integrate(now time.Time) {
	dt := now.Sub(t.last).Seconds()
	if dt <= 0 {
		return
	}
	t.intDecode += dt * float64(t.decoding)
	t.intCtx += dt * float64(t.decodeCtx)
	if t.prefilling > 0 {
		t.intBusy += dt
	}
	t.last = now
}

// endUnary ends the prefill of t.unary[k] (a non-streamed request) as if
// its first token came now: it counts as decoding from then on, and teaches
// nothing (its prefill's end was not seen).
func (t *Tracker) endUnary(k int) {
	f := t.unary[k]
	t.unary[k] = t.unary[len(t.unary)-1]
	t.unary[len(t.unary)-1] = nil
	t.unary = t.unary[:len(t.unary)-1]
	t.endPrefill(f, t.last)
	f.first, f.tainted, f.firstAt = true, true, t.last
	t.decoding++
	t.decodeCtx += f.ctx
	f.decode0, f.ctx0, f.busy0 = t.intDecode, t.intCtx, t.intBusy
}

// dropUnary forgets f if it is on the non-streamed list.
func (t *Tracker) dropUnary(f *Flight) {
	for i, g := range t.unary {
		if g == f {
			t.unary[i] = t.unary[len(t.unary)-1]
			t.unary[len(t.unary)-1] = nil
			t.unary = t.unary[:len(t.unary)-1]
			return
		}
	}
}

// Start records that request f begins to prefill on the replica at now:
// when it is routed to a replica with a block cache (the engine's queue is
// opaque: waiting there is part of the busy period), or when it takes a
// slot on one with slots (waiting for a slot is not prefill). prompt is its
// prompt tokens, seq the sequence its prefill is priced at (the prompt, or
// on a slot cache every slot's tokens with it: policy.Replica.SlotSpan),
// guess the tokens the router predicts the replica computes, out its
// expected output tokens.
func (t *Tracker) Start(f *Flight, prompt, seq, guess, out int, now time.Time) {
	if f.started || f.first {
		return
	}
	t.advance(now)
	*f = Flight{prompt: prompt, seq: max(seq, prompt), guess: guess, ctx: prompt + out/2, started: true}
	if t.prefilling == 0 || t.open == nil {
		t.open = t.newPeriod(now)
		if t.external {
			t.open.setTaint(SkipExternal)
		}
	}
	t.prefilling++
	f.period = t.open
	t.open.members++
}

// StartUnary is Start for a request whose client asked for no stream: the
// front door will see only its end, not its first token. Its busy period
// cannot be an observation (it holds work whose end is not seen), and so
// that it does not hold the replica "prefilling" until it finishes, its
// prefill is taken to end when the model says it would: the other requests'
// periods and decodes after that stay usable.
func (t *Tracker) StartUnary(f *Flight, prompt, seq, guess, out int, now time.Time) {
	if f.started || f.first {
		return
	}
	t.Start(f, prompt, seq, guess, out, now)
	f.unary = true
	f.unaryEnd = now.Add(t.m.Prefill(max(guess, 1), f.seq))
	f.period.setTaint(SkipNoFirstToken)
	t.unary = append(t.unary, f)
}

func (t *Tracker) newPeriod(now time.Time) *period {
	var p *period
	if n := len(t.free); n > 0 {
		p = t.free[n-1]
		t.free = t.free[:n-1]
		works := p.works[:0]
		*p = period{works: works}
	} else {
		p = &period{}
	}
	p.start, p.decode0, p.ctx0 = now, t.intDecode, t.intCtx
	p.startBatch, p.startCtx = t.decoding, t.decodeCtx
	return p
}

// FirstToken records request f's first output token at now.
func (t *Tracker) FirstToken(f *Flight, now time.Time) {
	if f.first {
		return
	}
	t.advance(now)
	if !f.started {
		// The router's model had it waiting (a slot it thought busy):
		// its prefill ran unseen, and whatever period is open holds
		// work that is not its own.
		f.tainted = true
		if t.open != nil {
			t.open.setTaint(SkipUnusable)
		}
	} else {
		t.endPrefill(f, now)
	}
	f.first, f.firstAt = true, now
	t.decoding++
	t.decodeCtx += f.ctx
	f.decode0, f.ctx0, f.busy0 = t.intDecode, t.intCtx, t.intBusy
}

// endPrefill takes a started request out of the prefilling count, closing
// the busy period when it was the last.
func (t *Tracker) endPrefill(f *Flight, now time.Time) {
	t.prefilling--
	if t.prefilling == 0 && t.open != nil {
		t.open.closed, t.open.end = true, now
		t.open.decode1, t.open.ctx1 = t.intDecode, t.intCtx
		t.open = nil
	}
}

// Finished records the end of request f at now with the replica's report,
// and learns what it can from it.
func (t *Tracker) Finished(f *Flight, rep Report, now time.Time) {
	t.advance(now)
	if f.unary && !f.first {
		t.dropUnary(f)
	}
	if f.started && !f.first {
		t.endPrefill(f, now)
	}
	if f.first {
		t.decoding--
		t.decodeCtx -= f.ctx
	}
	if rep.OK && rep.Timings != nil && f.started {
		t.agree(f, rep, now)
	}
	tm := rep.Timings
	if t.cfg.NoTimings {
		tm = nil
	}
	if p := f.period; p != nil {
		switch {
		case !rep.OK:
			p.setTaint(SkipFailed)
		case tm != nil && tm.PromptMs > 0:
			// The replica measured this prefill itself: learn it directly
			// and keep the period to the others.
			p.setTaint(taintTimed)
			t.observeTimedPrefill(f, rep, tm, now)
		case !f.first:
			p.setTaint(SkipNoFirstToken)
		default:
			computed := f.guess
			if rep.CachedTokens >= 0 {
				computed = f.prompt - min(rep.CachedTokens, f.prompt)
			}
			p.works = append(p.works, Work{New: computed, Seq: f.seq})
		}
		p.members--
		if p.closed && p.members == 0 {
			t.emit(p)
		}
	}
	if rep.OK && f.first && !f.tainted {
		t.observeDecode(f, rep, tm, now)
	}
	*f = Flight{}
}

// cleanDecode is the most of a request's decode that prefill may have shared
// for its timings to be held against the decode model (Tracker.agree).
const cleanDecode = 0.05

// agree keeps llama.cpp's timings of request f, in the model's terms, to
// hold the model against (Stats): its prefill, stretched by the decodes
// beside it now, against prompt_ms; and, when no prefill ran beside its
// decode, its decode step over the batch it decoded with, against
// predicted_ms over predicted_n − 1 steps.
func (t *Tracker) agree(f *Flight, rep Report, now time.Time) {
	tm := rep.Timings
	var o timedObs
	if tm.PromptMs > 0 && tm.PromptN > 0 {
		o.n, o.s, o.prefill, o.hasPre = tm.PromptN, f.seq, tm.PromptMs/1e3, true
		o.stretch = t.m.stretch(float64(t.decoding), float64(t.decodeCtx))
	}
	// Decode is compared only where no prefill ran beside it (its busy
	// share under cleanDecode): llama.cpp's predicted_ms counts every step,
	// the ones stalled by another slot's prompt batch too, while the model
	// prices a decode step (E2 prices the stall separately).
	if wall := now.Sub(f.firstAt).Seconds(); f.first && tm.PredictedN >= 2 && tm.PredictedMs > 0 && wall > 0 &&
		(t.intBusy-f.busy0) <= cleanDecode*wall {
		batch := (t.intDecode - f.decode0) / wall
		ctx := (t.intCtx - f.ctx0) / wall
		if step := tm.PredictedMs / 1e3 / float64(tm.PredictedN-1); step > 0 && !math.IsInf(step, 0) {
			o.b, o.c, o.step, o.hasDec = int(math.Round(max(batch, 1))), int(math.Round(ctx)), step, true
		}
	}
	if !o.hasPre && !o.hasDec {
		return
	}
	if len(t.timed) < timedKept {
		t.timed = append(t.timed, o)
		return
	}
	t.timed[t.timedNext] = o
	t.timedNext = (t.timedNext + 1) % timedKept
}

// observeTimedPrefill learns from llama.cpp's own prefill measurement.
func (t *Tracker) observeTimedPrefill(f *Flight, rep Report, tm *Timings, now time.Time) {
	if !t.allow(&t.budgetPre, now) {
		return
	}
	computed := tm.PromptN
	if computed <= 0 {
		computed = f.guess
	}
	t.one[0] = Work{New: computed, Seq: f.seq}
	batch, ctx := 0.0, 0.0
	if t.decoding > 0 {
		// Who decoded beside it is not recorded per request; the replica's
		// batch now is the estimate (llama.cpp runs a few slots).
		batch, ctx = float64(t.decoding), float64(t.decodeCtx)
	}
	if t.m.ObservePrefill(t.one[:], tm.PromptMs/1e3, batch, ctx, 1) {
		t.stats.PrefillTimings++
	} else {
		t.skip(SkipUnusable)
	}
}

// emit turns a finished busy period into an observation and recycles it.
func (t *Tracker) emit(p *period) {
	d := p.end.Sub(p.start).Seconds()
	switch {
	case p.taint == taintTimed:
	case p.taint != "":
		t.skip(p.taint)
	case d <= 0 || len(p.works) == 0:
		t.skip(SkipUnusable)
	case !t.allow(&t.budgetPre, p.end):
	default:
		batch := (p.decode1 - p.decode0) / d
		ctx := (p.ctx1 - p.ctx0) / d
		if p.startBatch > 0 {
			// The replica was mid-iteration (a decode step) when the
			// period began: on average half of it passed before the
			// first prefill could start.
			d -= t.m.decodeStep(p.startBatch, p.startCtx).Seconds() / 2
		}
		if t.m.ObservePrefill(p.works, d, batch, ctx, 1) {
			t.stats.PrefillPeriods++
		} else {
			t.skip(SkipUnusable)
		}
	}
	t.free = append(t.free, p)
}

// observeDecode learns request f's decode step, over the decode batch
// the replica ran on average meanwhile: the median gap between its
// streamed tokens when the front door measured them; else the time from its
// first token to its end (or llama.cpp's predicted_ms) less the prefill the
// replica ran meanwhile, over its decode steps.
func (t *Tracker) observeDecode(f *Flight, rep Report, tm *Timings, now time.Time) {
	if !t.allow(&t.budgetDec, now) {
		return
	}
	wall := now.Sub(f.firstAt).Seconds()
	if !(wall > 0) {
		t.skip(SkipUnusable)
		return
	}
	busy := t.intBusy - f.busy0
	share := busy / wall
	batch := (t.intDecode - f.decode0) / wall
	ctx := (t.intCtx - f.ctx0) / wall
	var step float64
	kind := &t.stats.DecodeRequests
	switch {
	case rep.ITL > 0 && rep.ITLSamples >= t.cfg.MinDecodeTokens:
		// More than half the gaps would have to carry prefill chunks
		// to move the median.
		if share > t.cfg.MaxPrefillShare {
			t.skip(SkipPrefillShare)
			return
		}
		step, kind = rep.ITL.Seconds(), &t.stats.DecodeITL
	default:
		steps, span := rep.OutputTokens-1, wall
		if tm != nil && tm.PredictedN >= 2 && tm.PredictedMs > 0 {
			steps, span, kind = tm.PredictedN-1, tm.PredictedMs/1e3, &t.stats.DecodeTimings
		}
		if steps < t.cfg.MinDecodeTokens {
			t.skip(SkipShortDecode)
			return
		}
		if share > t.cfg.MaxPrefillShare {
			t.skip(SkipPrefillShare)
			return
		}
		// The busy time holds the prefill chunks and the decode steps
		// that rode with them; only the chunks' part is not this
		// request's decode. (The decode that rides with a chunk costs
		// less than a step of its own, so this is low by up to that
		// share; the median gap has no such bias.)
		prefill := busy
		if busy > 0 {
			prefill = busy / t.m.stretch(batch, ctx)
		}
		step = (span - prefill*span/wall) / float64(steps)
	}
	if !(step > 0) || math.IsInf(step, 0) {
		t.skip(SkipUnusable)
		return
	}
	if t.m.ObserveDecode(step, batch, ctx, 1-share) {
		*kind++
	} else {
		t.skip(SkipUnusable)
	}
}

// SetExternal says whether other routers have requests on the replica (a
// shared pool): while they do, busy periods hold work this router cannot
// attribute, and are not used.
func (t *Tracker) SetExternal(on bool) {
	t.external = on
	if on && t.open != nil {
		t.open.setTaint(SkipExternal)
	}
}

// Down records that the replica left the pool at now: an open busy period
// is abandoned (its requests will fail or be retried elsewhere).
func (t *Tracker) Down(now time.Time) {
	t.advance(now)
	if t.open != nil {
		t.open.setTaint(SkipReplicaDown)
	}
}

// setTaint records why p cannot be an observation; the first reason wins,
// except that any reason overrides taintTimed (a timed member alone does
// not spoil the others, but it does not make the period usable either).
func (p *period) setTaint(reason string) {
	if p.taint == "" || p.taint == taintTimed {
		p.taint = reason
	}
}
