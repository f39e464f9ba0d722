package calibrate

import (
	"math"
	"math/rand/v2"
	"sort"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

var epoch = time.Unix(1_700_000_000, 0)

type tev struct {
	at   time.Time
	kind int // 0 start, 1 first token, 2 finish
	i    int
}

// fcfsQueue simulates n requests arriving at rate λ (Poisson) at one server
// that prefills them one at a time in arrival order, each taking the truth's
// prefill time, and answers one token each. It returns the events in time
// order, the prompts, and the mean TTFT over the mean service time.
func fcfsQueue(truth costmodel.Profile, n int, rate float64, seed uint64) ([]tev, []int, float64) {
	rng := rand.New(rand.NewPCG(seed, 2))
	var evs []tev
	prompts := make([]int, n)
	at, free := 0.0, 0.0
	var ttft, svc float64
	for i := 0; i < n; i++ {
		at += rng.ExpFloat64() / rate
		prompts[i] = 256 + rng.IntN(4000)
		s := truth.Prefill(prompts[i], prompts[i]).Seconds()
		start := math.Max(at, free)
		free = start + s
		ttft += free - at
		svc += s
		d := func(x float64) time.Time { return epoch.Add(time.Duration(x * 1e9)) }
		evs = append(evs, tev{d(at), 0, i}, tev{d(free), 1, i}, tev{d(free), 2, i})
	}
	sort.SliceStable(evs, func(a, b int) bool {
		if !evs[a].at.Equal(evs[b].at) {
			return evs[a].at.Before(evs[b].at)
		}
		return evs[a].kind < evs[b].kind
	})
	return evs, prompts, ttft / svc
}

// Busy periods separate queueing from prefill: at 80% load a request's TTFT
// is several times its prefill, yet the fit learns the prefill itself.
func TestTrackerSeparatesQueueing(t *testing.T) {
	truth := lookup(t, "llama3.1-8b-h100")
	prior := resolve(t, "llama3.1-8b-h100:time_scale=0.5")
	mean := truth.Prefill(2000, 2000).Seconds()
	evs, prompts, inflation := fcfsQueue(truth, 3000, 0.8/mean, 11)
	if inflation < 2 {
		t.Fatalf("test setup: mean TTFT only %.2f× the prefill; want heavy queueing", inflation)
	}
	tr := NewTracker(newModel(t, prior))
	fl := make([]Flight, len(prompts))
	for _, e := range evs {
		switch e.kind {
		case 0:
			tr.Start(&fl[e.i], prompts[e.i], prompts[e.i], prompts[e.i], 1, e.at)
		case 1:
			tr.FirstToken(&fl[e.i], e.at)
		case 2:
			tr.Finished(&fl[e.i], Report{OK: true, OutputTokens: 1, CachedTokens: 0}, e.at)
		}
	}
	st := tr.Stats()
	if st.PrefillPeriods < 100 {
		t.Fatalf("%d busy periods observed, want many (stats %+v)", st.PrefillPeriods, st)
	}
	for _, n := range []int{500, 2000, 4000} {
		if r := ratio(tr.Model().Prefill(n, n), truth.Prefill(n, n)); math.Abs(r-1) > 0.05 {
			t.Errorf("fitted/true prefill of %d tokens = %.3f (TTFT/prefill %.1f), want within 5%%", n, r, inflation)
		}
	}
}

// A request's decode is learnt from its first token to its end; with
// llama.cpp's timings, from predicted_ms over predicted_n − 1 steps.
func TestTrackerDecode(t *testing.T) {
	truth := lookup(t, "llamacpp-tiny-cpu")
	prior := resolve(t, "llamacpp-tiny-cpu:decode_scale=3")
	for _, timed := range []bool{false, true} {
		tr := NewTracker(newModel(t, prior))
		now := epoch
		for i := 0; i < 200; i++ {
			var f Flight
			prompt := 500 + 10*i
			tr.Start(&f, prompt, prompt, prompt, 64, now)
			now = now.Add(truth.Prefill(prompt, prompt))
			tr.FirstToken(&f, now)
			// Alone on the replica: a batch of one whose context is the
			// prompt and half the output, as the tracker counts it.
			step := truth.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: prompt + 32})
			rep := Report{OK: true, OutputTokens: 64, CachedTokens: 0}
			if timed {
				// The replica's own clock; the router's is made useless.
				rep.Timings = &Timings{PromptN: prompt, PromptMs: float64(truth.Prefill(prompt, prompt)) / 1e6,
					PredictedN: 64, PredictedMs: float64(63*step) / 1e6}
				now = now.Add(63 * step * 2)
			} else {
				now = now.Add(63 * step)
			}
			tr.Finished(&f, rep, now)
			now = now.Add(time.Second)
		}
		st := tr.Stats()
		if timed && (st.DecodeTimings != 200 || st.PrefillTimings != 200) {
			t.Errorf("timed: stats %+v, want 200 timed decode and prefill observations", st)
		}
		if !timed && (st.DecodeRequests != 200 || st.PrefillPeriods != 200) {
			t.Errorf("clocked: stats %+v, want 200 decode and 200 period observations", st)
		}
		b := costmodel.Batch{DecodeSeqs: 1, DecodeContext: 2000}
		if r := ratio(tr.Model().Iteration(b), truth.Iteration(b)); math.Abs(r-1) > 0.05 {
			t.Errorf("timed=%v: fitted/true decode step = %.3f, want within 5%%", timed, r)
		}
		if r := ratio(tr.Model().Prefill(1000, 1000), truth.Prefill(1000, 1000)); math.Abs(r-1) > 0.05 {
			t.Errorf("timed=%v: fitted/true prefill = %.3f, want within 5%%", timed, r)
		}
	}
}

// What cannot be attributed is not learnt, and says why.
func TestTrackerSkips(t *testing.T) {
	prior := lookup(t, "llama3.1-8b-h100")
	t.Run("non-streamed", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		var f Flight
		tr.Start(&f, 1000, 1000, 1000, 10, epoch)
		tr.Finished(&f, Report{OK: true, OutputTokens: 10, CachedTokens: -1}, epoch.Add(time.Second))
		st := tr.Stats()
		if st.PrefillPeriods != 0 || st.Skipped[SkipNoFirstToken] != 1 {
			t.Errorf("stats %+v, want one period skipped as %s", st, SkipNoFirstToken)
		}
	})
	t.Run("failed", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		var f Flight
		tr.Start(&f, 1000, 1000, 1000, 10, epoch)
		tr.FirstToken(&f, epoch.Add(100*time.Millisecond))
		tr.Finished(&f, Report{OK: false, OutputTokens: 3, CachedTokens: -1}, epoch.Add(time.Second))
		st := tr.Stats()
		if st.PrefillPeriods != 0 || st.DecodeRequests != 0 || st.Skipped[SkipFailed] != 1 {
			t.Errorf("stats %+v, want nothing learnt and one %s", st, SkipFailed)
		}
	})
	t.Run("external", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		tr.SetExternal(true)
		var f Flight
		tr.Start(&f, 1000, 1000, 1000, 1, epoch)
		tr.FirstToken(&f, epoch.Add(100*time.Millisecond))
		tr.Finished(&f, Report{OK: true, OutputTokens: 1, CachedTokens: 0}, epoch.Add(100*time.Millisecond))
		if st := tr.Stats(); st.PrefillPeriods != 0 || st.Skipped[SkipExternal] != 1 {
			t.Errorf("stats %+v, want the period skipped as %s", st, SkipExternal)
		}
	})
	t.Run("replica down", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		var f Flight
		tr.Start(&f, 1000, 1000, 1000, 1, epoch)
		tr.Down(epoch.Add(time.Millisecond))
		tr.Finished(&f, Report{OK: false, CachedTokens: -1}, epoch.Add(2*time.Millisecond))
		if st := tr.Stats(); st.PrefillPeriods != 0 || st.Skipped[SkipReplicaDown] != 1 {
			t.Errorf("stats %+v, want the period skipped as %s", st, SkipReplicaDown)
		}
	})
	t.Run("short decode", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		var f Flight
		tr.Start(&f, 1000, 1000, 1000, 2, epoch)
		tr.FirstToken(&f, epoch.Add(100*time.Millisecond))
		tr.Finished(&f, Report{OK: true, OutputTokens: 2, CachedTokens: 0}, epoch.Add(110*time.Millisecond))
		if st := tr.Stats(); st.DecodeRequests != 0 || st.Skipped[SkipShortDecode] != 1 || st.PrefillPeriods != 1 {
			t.Errorf("stats %+v, want a period and a %s", st, SkipShortDecode)
		}
	})
	t.Run("prefill share", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		var a, b Flight
		tr.Start(&a, 1000, 1000, 1000, 20, epoch)
		tr.FirstToken(&a, epoch.Add(10*time.Millisecond))
		// b prefills for most of a's decode.
		tr.Start(&b, 8000, 8000, 8000, 1, epoch.Add(11*time.Millisecond))
		tr.FirstToken(&b, epoch.Add(200*time.Millisecond))
		tr.Finished(&b, Report{OK: true, OutputTokens: 1, CachedTokens: 0}, epoch.Add(200*time.Millisecond))
		tr.Finished(&a, Report{OK: true, OutputTokens: 20, CachedTokens: 0}, epoch.Add(210*time.Millisecond))
		if st := tr.Stats(); st.DecodeRequests != 0 || st.Skipped[SkipPrefillShare] != 1 {
			t.Errorf("stats %+v, want a's decode skipped as %s", st, SkipPrefillShare)
		}
	})
	t.Run("unseen start", func(t *testing.T) {
		tr := NewTracker(newModel(t, prior))
		var a, b Flight
		tr.Start(&a, 1000, 1000, 1000, 1, epoch)
		tr.FirstToken(&b, epoch.Add(5*time.Millisecond)) // b never started in the router's model
		tr.FirstToken(&a, epoch.Add(10*time.Millisecond))
		tr.Finished(&a, Report{OK: true, OutputTokens: 1, CachedTokens: 0}, epoch.Add(10*time.Millisecond))
		tr.Finished(&b, Report{OK: true, OutputTokens: 10, CachedTokens: 0}, epoch.Add(30*time.Millisecond))
		if st := tr.Stats(); st.PrefillPeriods != 0 || st.DecodeRequests != 0 {
			t.Errorf("stats %+v, want nothing learnt", st)
		}
	})
}

// A period becomes an observation only when its last request finishes, with
// the cached tokens the replica reported.
func TestTrackerUsesReportedCachedTokens(t *testing.T) {
	truth := lookup(t, "llama3.1-8b-h100")
	tr := NewTracker(newModel(t, truth))
	now := epoch
	for i := 0; i < 300; i++ {
		var f Flight
		// The router guessed a full miss; the replica had 3,000 cached.
		tr.Start(&f, 4000, 4000, 4000, 1, now)
		now = now.Add(truth.Prefill(1000, 4000))
		tr.FirstToken(&f, now)
		tr.Finished(&f, Report{OK: true, OutputTokens: 1, CachedTokens: 3000}, now)
		now = now.Add(time.Second)
	}
	if r := ratio(tr.Model().Prefill(1000, 4000), truth.Prefill(1000, 4000)); math.Abs(r-1) > 0.03 {
		t.Errorf("fitted/true = %.3f, want within 3%%: the report, not the guess, gives the work", r)
	}
}

// FuzzTracker drives a tracker with arbitrary event sequences: it must not
// panic, and the model must stay finite and positive.
func FuzzTracker(f *testing.F) {
	f.Add([]byte{0, 1, 2, 0, 0, 1, 1, 2, 2, 3, 4})
	f.Add([]byte{0, 0, 0, 5, 1, 2, 6, 7, 2, 2})
	prior, err := costmodel.Lookup("llama3.1-8b-h100")
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, ops []byte) {
		m, err := NewModel(prior, DefaultConfig())
		if err != nil {
			t.Fatal(err)
		}
		tr := NewTracker(m)
		fl := make([]Flight, 4)
		now := epoch
		for i, op := range ops {
			k := int(op>>4) % len(fl)
			now = now.Add(time.Duration(op&0x7) * 3 * time.Millisecond)
			switch op & 0x7 {
			case 0, 5:
				tr.Start(&fl[k], 100+int(op), 100+int(op), 50+int(op), int(op%9), now)
			case 1, 6:
				tr.FirstToken(&fl[k], now)
			case 2, 7:
				rep := Report{OK: op&0x8 == 0, OutputTokens: int(op % 11), CachedTokens: int(op%3) - 1}
				if i%3 == 0 {
					rep.Timings = &Timings{PromptN: int(op), PromptMs: float64(op), PredictedN: int(op % 5), PredictedMs: float64(op % 7)}
				}
				tr.Finished(&fl[k], rep, now)
			case 3:
				tr.SetExternal(op&0x8 != 0)
			case 4:
				tr.Down(now)
			}
		}
		for _, n := range []int{1, 100, 5000} {
			if d := m.Prefill(n, n); d <= 0 {
				t.Fatalf("Prefill(%d) = %v", n, d)
			}
		}
		fit := m.Fit()
		for _, v := range append(fit.Prefill[:], fit.Decode[:]...) {
			if math.IsNaN(v) || math.IsInf(v, 0) {
				t.Fatalf("non-finite coefficient in %+v", fit)
			}
		}
	})
}

// A non-streamed request in flight does not stop the replica's other
// requests from teaching: its prefill is taken to end when the model says.
func TestTrackerUnaryDoesNotBlock(t *testing.T) {
	truth := lookup(t, "llama3.1-8b-h100")
	tr := NewTracker(newModel(t, truth))
	var u Flight
	tr.StartUnary(&u, 150, 150, 150, 200, epoch)
	now := epoch.Add(50 * time.Millisecond)
	for i := 0; i < 8; i++ {
		var f Flight
		tr.Start(&f, 1000, 1000, 1000, 8, now)
		now = now.Add(truth.Prefill(1000, 1000))
		tr.FirstToken(&f, now)
		now = now.Add(7 * 10 * time.Millisecond)
		tr.Finished(&f, Report{OK: true, OutputTokens: 8, CachedTokens: 0, ITL: 10 * time.Millisecond, ITLSamples: 7}, now)
		now = now.Add(20 * time.Millisecond)
	}
	tr.Finished(&u, Report{OK: true, OutputTokens: 200, CachedTokens: 0}, now)
	st := tr.Stats()
	if st.PrefillPeriods != 8 || st.DecodeITL != 8 || st.Skipped[SkipNoFirstToken] != 1 {
		t.Errorf("stats %+v, want 8 periods and 8 decode observations learnt, and the unary request's period skipped", st)
	}
}
