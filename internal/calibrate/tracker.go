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
	ctx    int // decode context it counts for (prompt + half its output)
	guess  int // prompt tokens the router predicted the replica computes

	started, first, tainted bool
	firstAt                 time.Time
	period                  *period
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
	PrefillPeriods, PrefillTimings           int64
	DecodeITL, DecodeTimings, DecodeRequests int64
	// Skipped counts what could not be used, by reason (the Skip
	// constants).
	Skipped map[string]int64
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
}

// NewTracker returns a tracker feeding m.
func NewTracker(m *Model) *Tracker {
	return &Tracker{m: m, cfg: m.cfg, stats: Stats{Skipped: map[string]int64{}}}
}

// Model returns the model the tracker feeds.
func (t *Tracker) Model() *Model { return t.m }

// Stats returns the tracker's counters (a copy).
func (t *Tracker) Stats() Stats {
	s := t.stats
	s.Skipped = make(map[string]int64, len(t.stats.Skipped))
	for k, v := range t.stats.Skipped {
		s.Skipped[k] = v
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

// Start records that request f begins to prefill on the replica at now:
// when it is routed to a replica with a block cache (the engine's queue is
// opaque: waiting there is part of the busy period), or when it takes a
// slot on one with slots (waiting for a slot is not prefill). prompt is its
// prompt tokens, guess the tokens the router predicts the replica computes,
// out its expected output tokens.
func (t *Tracker) Start(f *Flight, prompt, guess, out int, now time.Time) {
	if f.started || f.first {
		return
	}
	t.advance(now)
	*f = Flight{prompt: prompt, guess: guess, ctx: prompt + out/2, started: true}
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
	if f.started && !f.first {
		t.endPrefill(f, now)
	}
	if f.first {
		t.decoding--
		t.decodeCtx -= f.ctx
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
			t.observeTimedPrefill(f, rep, tm)
		case !f.first:
			p.setTaint(SkipNoFirstToken)
		default:
			computed := f.guess
			if rep.CachedTokens >= 0 {
				computed = f.prompt - min(rep.CachedTokens, f.prompt)
			}
			p.works = append(p.works, Work{New: computed, Seq: f.prompt})
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

// observeTimedPrefill learns from llama.cpp's own prefill measurement.
func (t *Tracker) observeTimedPrefill(f *Flight, rep Report, tm *Timings) {
	computed := tm.PromptN
	if computed <= 0 {
		computed = f.guess
	}
	t.one[0] = Work{New: computed, Seq: f.prompt}
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
