package calibrate

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

func lookup(t testing.TB, name string) costmodel.Profile {
	t.Helper()
	p, err := costmodel.Lookup(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func resolve(t testing.TB, spec string) costmodel.Profile {
	t.Helper()
	p, err := costmodel.Resolve(spec)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func newModel(t testing.TB, prior costmodel.Profile) *Model {
	t.Helper()
	m, err := NewModel(prior, DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func ratio(a, b time.Duration) float64 { return float64(a) / float64(b) }

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(*Config)
		field  string
	}{
		{"forget 0", func(c *Config) { c.Forget = 0 }, "forget"},
		{"forget > 1", func(c *Config) { c.Forget = 1.5 }, "forget"},
		{"forget NaN", func(c *Config) { c.Forget = math.NaN() }, "forget"},
		{"prior weight", func(c *Config) { c.PriorWeight = 0 }, "prior_weight"},
		{"shape weight", func(c *Config) { c.ShapeWeight = -1 }, "shape_weight"},
		{"huber", func(c *Config) { c.Huber = 0 }, "huber"},
		{"min ratio", func(c *Config) { c.MinRatio = 2 }, "min_ratio"},
		{"max ratio", func(c *Config) { c.MaxRatio = 0.5 }, "max_ratio"},
		{"min decode", func(c *Config) { c.MinDecodeTokens = 0 }, "min_decode_tokens"},
		{"share", func(c *Config) { c.MaxPrefillShare = 1 }, "max_prefill_share"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := DefaultConfig()
			tc.change(&c)
			err := c.Validate()
			if !errors.Is(err, ErrInvalidConfig) {
				t.Fatalf("err = %v, want ErrInvalidConfig", err)
			}
			if got := err.Error(); !contains(got, tc.field) {
				t.Fatalf("err = %q, want it to name %q", got, tc.field)
			}
		})
	}
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// A model with no observation prices exactly as its prior.
func TestModelWithoutDataIsThePrior(t *testing.T) {
	for _, name := range costmodel.Names() {
		prior := lookup(t, name)
		m := newModel(t, prior)
		for _, c := range []struct{ n, s int }{{1, 1}, {100, 100}, {1000, 3000}, {8000, 8000}, {0, 10}} {
			if got, want := m.Prefill(c.n, c.s), prior.Prefill(c.n, c.s); got != want {
				t.Errorf("%s: Prefill(%d,%d) = %v, want the prior's %v", name, c.n, c.s, got, want)
			}
		}
		for _, b := range []costmodel.Batch{
			{DecodeSeqs: 8, DecodeContext: 8000},
			{Prefill: []costmodel.Chunk{{New: 512, Seq: 1024}}, DecodeSeqs: 4, DecodeContext: 4000},
			{},
		} {
			if got, want := m.Iteration(b), prior.Iteration(b); got != want {
				t.Errorf("%s: Iteration(%+v) = %v, want the prior's %v", name, b, got, want)
			}
		}
		f := m.Fit()
		if f.Prefill != [4]float64{1, 0, 0, 0} || f.Decode != [4]float64{1, 0, 0, 0} {
			t.Errorf("%s: coefficients %v %v, want the prior (1,0,0,0)", name, f.Prefill, f.Decode)
		}
	}
}

// observeTruth feeds m n single-request prefill and decode observations of
// the truth profile, drawn from a spread of sizes, and returns the mean and
// the largest relative error of the fitted prefill and decode step against
// the truth over 300 held-out draws from the same spread: what matters is
// the fit where the replica works (elsewhere the prior answers).
//
// prefillLarge is prefill's error over prompts of 256 new tokens or more:
// between GPU generations a roofline's knee (where prefill stops being bound
// by reading the weights) moves, which four linear features cannot follow on
// the smallest prompts.
func observeTruth(t *testing.T, m *Model, truth costmodel.Profile, n int, seed uint64) (prefill, prefillLarge, decode errStats) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 1))
	drawP := func() (int, int) {
		cached := rng.IntN(4) * 1024
		newT := 64 + rng.IntN(6000)
		return newT, cached + newT
	}
	drawD := func() (int, int) {
		b := 1 + rng.IntN(64)
		return b, b * (500 + rng.IntN(4000))
	}
	for i := 0; i < n; i++ {
		newT, seq := drawP()
		if !m.ObservePrefill([]Work{{New: newT, Seq: seq}}, truth.Prefill(newT, seq).Seconds(), 0, 0, 1) {
			t.Fatal("prefill observation not used")
		}
		b, ctx := drawD()
		step := truth.Iteration(costmodel.Batch{DecodeSeqs: b, DecodeContext: ctx}).Seconds()
		if !m.ObserveDecode(step, float64(b), float64(ctx), 1) {
			t.Fatal("decode observation not used")
		}
	}
	for i := 0; i < 300; i++ {
		newT, seq := drawP()
		e := math.Abs(ratio(m.Prefill(newT, seq), truth.Prefill(newT, seq)) - 1)
		prefill.add(e)
		if newT >= 256 {
			prefillLarge.add(e)
		}
		b, ctx := drawD()
		bt := costmodel.Batch{DecodeSeqs: b, DecodeContext: ctx}
		decode.add(math.Abs(ratio(m.Iteration(bt), truth.Iteration(bt)) - 1))
	}
	return prefill, prefillLarge, decode
}

type errStats struct {
	sum, max float64
	n        int
}

func (e *errStats) add(x float64) { e.sum += x; e.n++; e.max = math.Max(e.max, x) }
func (e errStats) mean() float64  { return e.sum / float64(max(e.n, 1)) }

// The fit learns a replica uniformly slower or faster than its prior, and
// another GPU generation priced by this one's roofline.
func TestModelLearnsTheTruth(t *testing.T) {
	for _, tc := range []struct {
		prior, truth string
		tolP, tolD   float64 // largest relative error (prefill: of prompts ≥ 256 new tokens)
	}{
		{"llama3.1-8b-h100:time_scale=0.5", "llama3.1-8b-h100", 0.02, 0.02},
		{"llama3.1-8b-h100:time_scale=2", "llama3.1-8b-h100", 0.02, 0.02},
		{"qwen3-32b-h100x2:time_scale=0.5", "qwen3-32b-h100x2", 0.02, 0.02},
		{"mistral-7b-a6000:time_scale=0.5", "mistral-7b-a6000", 0.02, 0.02},
		{"llama3.1-8b-h100", "llama3.1-8b-a100", 0.10, 0.02},
		{"llamacpp-tiny-cpu:prefill_scale=0.5:decode_scale=2", "llamacpp-tiny-cpu", 0.02, 0.08},
	} {
		t.Run(tc.prior+"→"+tc.truth, func(t *testing.T) {
			prior, truth := resolve(t, tc.prior), resolve(t, tc.truth)
			m := newModel(t, prior)
			pe, pl, de := observeTruth(t, m, truth, 400, 7)
			t.Logf("prefill error mean %.2f%% max %.2f%% (≥256 tokens: %.2f%%); decode mean %.2f%% max %.2f%%", 100*pe.mean(), 100*pe.max, 100*pl.max, 100*de.mean(), 100*de.max)
			if pl.max > tc.tolP || pe.mean() > 0.03 {
				t.Errorf("fitted prefill off the truth by %.1f%% on average, up to %.1f%% from 256 tokens; want ≤ 3%% and %.0f%% (fit %+v)", 100*pe.mean(), 100*pl.max, 100*tc.tolP, m.Fit())
			}
			if de.max > tc.tolD {
				t.Errorf("fitted decode step off the truth by up to %.1f%%, want ≤ %.0f%% (fit %+v)", 100*de.max, 100*tc.tolD, m.Fit())
			}
			f := m.Fit()
			if f.PrefillError > f.PriorPrefillError || f.DecodeError > f.PriorDecodeError {
				t.Errorf("fit error %.3f/%.3f not below the prior's %.3f/%.3f", f.PrefillError, f.DecodeError, f.PriorPrefillError, f.PriorDecodeError)
			}
		})
	}
}

// A CPU engine's shape (attention growing with new·seq) is learnt from a GPU
// roofline prior, which a speed factor alone cannot do.
func TestModelLearnsAShape(t *testing.T) {
	prior, truth := lookup(t, "llama3.1-8b-h100"), lookup(t, "llamacpp-tiny-cpu")
	m := newModel(t, prior)
	pe, _, de := observeTruth(t, m, truth, 600, 3)
	t.Logf("prefill error mean %.2f%% max %.2f%%; decode mean %.2f%% max %.2f%%", 100*pe.mean(), 100*pe.max, 100*de.mean(), 100*de.max)
	if pe.mean() > 0.10 || pe.max > 0.30 {
		t.Errorf("fitted prefill off the truth by %.1f%% on average, up to %.1f%%; want ≤ 10%% and 30%% (fit %+v)", 100*pe.mean(), 100*pe.max, m.Fit())
	}
	if m.Fit().Prefill[3] <= 0 {
		t.Errorf("new·seq coefficient %v, want > 0: the truth's attention is quadratic", m.Fit().Prefill[3])
	}
}

// Outliers (a prefill that waited behind work the router could not see) move
// the fit much less than they would move a mean.
func TestModelRobustToOutliers(t *testing.T) {
	truth := lookup(t, "llama3.1-8b-h100")
	m := newModel(t, truth)
	rng := rand.New(rand.NewPCG(5, 5))
	for i := 0; i < 1000; i++ {
		n := 500 + rng.IntN(4000)
		y := truth.Prefill(n, n).Seconds()
		if i%10 == 0 {
			y *= 10 // queued behind something unseen
		}
		m.ObservePrefill([]Work{{New: n, Seq: n}}, y, 0, 0, 1)
	}
	// A mean of the ratios would be 1.9.
	if r := ratio(m.Prefill(2000, 2000), truth.Prefill(2000, 2000)); r > 1.25 {
		t.Errorf("fitted/true prefill = %.2f with 10%% of 10× outliers, want ≤ 1.25", r)
	}
}

// Garbage observations are refused, and nothing non-finite reaches the fit.
func TestModelRejectsGarbage(t *testing.T) {
	m := newModel(t, lookup(t, "llama3.1-8b-h100"))
	w := []Work{{New: 100, Seq: 100}}
	for _, y := range []float64{0, -1, math.NaN(), math.Inf(1)} {
		if m.ObservePrefill(w, y, 0, 0, 1) {
			t.Errorf("ObservePrefill(y=%v) used", y)
		}
		if m.ObserveDecode(y, 1, 100, 1) {
			t.Errorf("ObserveDecode(y=%v) used", y)
		}
	}
	if m.ObservePrefill(w, 0.01, 0, 0, 0) {
		t.Error("ObservePrefill with weight 0 used")
	}
	if f := m.Fit(); f.PrefillSamples != 0 || f.DecodeSamples != 0 {
		t.Errorf("samples %d/%d after garbage, want 0", f.PrefillSamples, f.DecodeSamples)
	}
}

// The fitted time stays within [MinRatio, MaxRatio] of the prior whatever
// the data say.
func TestModelClamps(t *testing.T) {
	prior := lookup(t, "llama3.1-8b-h100")
	m := newModel(t, prior)
	for i := 0; i < 300; i++ {
		m.ObservePrefill([]Work{{New: 1000, Seq: 1000}}, 1000*prior.Prefill(1000, 1000).Seconds(), 0, 0, 1)
	}
	if r := ratio(m.Prefill(1000, 1000), prior.Prefill(1000, 1000)); r > DefaultConfig().MaxRatio+1e-9 {
		t.Errorf("fitted/prior = %v, want ≤ MaxRatio %v", r, DefaultConfig().MaxRatio)
	}
}

// Gaps gives the median gap of a stream of any length from a bounded
// sample.
func TestGaps(t *testing.T) {
	var g Gaps
	if m, n := g.Median(); m != 0 || n != 0 {
		t.Fatalf("empty: %v, %d", m, n)
	}
	now := epoch
	g.Token(now)
	// 10,000 gaps: 90% of 10 ms, every tenth 100 ms (an iteration that
	// carried a prefill chunk).
	for i := 0; i < 10000; i++ {
		d := 10 * time.Millisecond
		if i%10 == 9 {
			d = 100 * time.Millisecond
		}
		now = now.Add(d)
		g.Token(now)
	}
	m, n := g.Median()
	if m != 10*time.Millisecond || n != 10000 {
		t.Errorf("median %v over %d gaps, want 10ms over 10000", m, n)
	}
	if len(g.kept) > gapsKept {
		t.Errorf("kept %d gaps, want ≤ %d", len(g.kept), gapsKept)
	}
}

// A prior far off is corrected from the first few observations: they are
// taken whole, before there is a robust scale to call them outliers by.
func TestModelLearnsFromFirstObservations(t *testing.T) {
	truth := lookup(t, "llamacpp-tiny-cpu")
	m := newModel(t, resolve(t, "llamacpp-tiny-cpu:time_scale=0.25"))
	obs := []struct{ n, s int }{{1220, 1220}, {20, 1240}, {30, 30}}
	for _, o := range obs {
		m.ObservePrefill([]Work{{New: o.n, Seq: o.s}}, truth.Prefill(o.n, o.s).Seconds(), 0, 0, 1)
	}
	var pred, meas float64
	for _, o := range obs {
		pred += m.Prefill(o.n, o.s).Seconds()
		meas += truth.Prefill(o.n, o.s).Seconds()
	}
	if r := pred / meas; r < 0.8 || r > 1.25 {
		t.Errorf("after 3 observations the model predicts %.2f× the truth (told 0.25×), want within 25%%", r)
	}
}

// TestIdleSiblingFollowsPool: a replica seen a few times while the pool
// was still at the prior, then given no more work, follows its pool as its
// siblings teach it the cluster's real speed; it does not keep its stale
// early fit (which would make it look slower than its siblings for ever,
// so the router would never send it the work that would correct it).
func TestIdleSiblingFollowsPool(t *testing.T) {
	prior := lookup(t, "llama3.1-8b-h100")
	truth := resolve(t, "llama3.1-8b-h100:time_scale=0.25")
	busy := newModel(t, prior)
	idle := busy.Sibling()
	feed := func(m *Model, n int) {
		for i := range n {
			tok := 512 + 64*(i%16)
			m.ObservePrefill([]Work{{New: tok, Seq: tok}}, truth.Prefill(tok, tok).Seconds(), 0, 0, 1)
		}
	}
	feed(busy, 1)
	feed(idle, 3)
	early := ratio(idle.Prefill(1024, 1024), truth.Prefill(1024, 1024))
	feed(busy, 200)
	got := ratio(idle.Prefill(1024, 1024), truth.Prefill(1024, 1024))
	want := ratio(busy.Prefill(1024, 1024), truth.Prefill(1024, 1024))
	if math.Abs(got-want) > 0.1*want {
		t.Errorf("idle sibling predicts %.2f× the truth (%.2f× after its own 3 observations), its busy sibling %.2f×: want the idle one within 10%% of the busy one", got, early, want)
	}
}
