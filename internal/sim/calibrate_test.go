package sim

import (
	"context"
	"math"
	"testing"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

func resolve(t testing.TB, spec string) costmodel.Profile {
	t.Helper()
	p, err := costmodel.Resolve(spec)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func repeat(p costmodel.Profile, n int) []costmodel.Profile {
	out := make([]costmodel.Profile, n)
	for i := range out {
		out[i] = p
	}
	return out
}

// calRun simulates reqs with e2 on the given true profiles, the router told
// told (nil: the truth), calibrating or not; it returns the result and its
// mean TTFT.
func calRun(t *testing.T, reqs []workload.Request, truth, told []costmodel.Profile, cal bool) (*Result, float64) {
	t.Helper()
	pol, err := policy.New("e2", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	cfg := Config{Replicas: len(truth), Replica: replica.DefaultConfig(), Profile: truth[0], Profiles: truth,
		RouterProfiles: told, Policy: pol, KVEvents: true, Seed: 1}
	if cal {
		c := calibrate.DefaultConfig()
		cfg.Calibrate = &c
	}
	res, err := Run(context.Background(), cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	r := report.Build("e2", 0, res.Records, 0)
	if r.Errors != 0 {
		t.Fatalf("%d errors", r.Errors)
	}
	return res, r.TTFT.Mean
}

// The router learns each replica's true speed from what the simulated
// replicas do — a profile 2× too fast, and a mixed cluster told one GPU for
// all — and e2 priced with what it learnt does about as well as e2 told the
// truth.
func TestCalibrationLearnsTheReplicas(t *testing.T) {
	h100, a100 := resolve(t, "llama3.1-8b-h100"), resolve(t, "llama3.1-8b-a100")
	for _, tc := range []struct {
		name  string
		truth []costmodel.Profile
		told  []costmodel.Profile
		rate  float64
		// how close the fitted figures must come to the true ones
		prefillTol, decodeTol float64
	}{
		{"2x too fast", repeat(h100, 4), repeat(resolve(t, "llama3.1-8b-h100:time_scale=0.5"), 4), 40, 0.15, 0.05},
		{"mixed told h100", []costmodel.Profile{h100, h100, a100, a100}, repeat(h100, 4), 30, 0.45, 0.05},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reqs := sharedPrefix(3000, 40, 1500, 200, tc.rate, 3)
			_, trueTTFT := calRun(t, reqs, tc.truth, nil, false)
			_, blindTTFT := calRun(t, reqs, tc.truth, tc.told, false)
			res, calTTFT := calRun(t, reqs, tc.truth, tc.told, true)
			t.Logf("mean TTFT: told the truth %.1f ms, told %s %.1f ms, calibrated %.1f ms", trueTTFT, tc.told[0].Name(), blindTTFT, calTTFT)
			if len(res.Calibration) != len(tc.truth) {
				t.Fatalf("%d calibrations for %d replicas", len(res.Calibration), len(tc.truth))
			}
			for i, c := range res.Calibration {
				pe := c.Fit.PrefillSecondsPer1K/c.TruePrefillSecondsPer1K - 1
				de := c.Fit.DecodeStepSeconds/c.TrueDecodeStepSeconds - 1
				t.Logf("replica %d: prefill %+.1f%% (%d samples), decode %+.1f%% (%d samples)", i, 100*pe, c.Fit.PrefillSamples, 100*de, c.Fit.DecodeSamples)
				if math.Abs(pe) > tc.prefillTol || math.Abs(de) > tc.decodeTol {
					t.Errorf("replica %d: fitted prefill %+.1f%%, decode step %+.1f%% off the truth; want within %.0f%% and %.0f%% (told %+.0f%%, %+.0f%%)",
						i, 100*pe, 100*de, 100*tc.prefillTol, 100*tc.decodeTol,
						100*(c.Fit.PriorPrefillSecondsPer1K/c.TruePrefillSecondsPer1K-1), 100*(c.Fit.PriorDecodeStepSeconds/c.TrueDecodeStepSeconds-1))
				}
			}
			if calTTFT > 1.10*trueTTFT {
				t.Errorf("calibrated e2's mean TTFT %.1f ms is more than 10%% above e2 told the truth (%.1f ms)", calTTFT, trueTTFT)
			}
		})
	}
}

// With calibration on, a router that has not observed anything prices
// exactly as its profiles: until the first observation the decisions are
// the uncalibrated ones. A replica not observed yet is priced as its pool
// (the replicas told the same profile) has learnt.
func TestCalibrationStartsAtTheProfile(t *testing.T) {
	prof := resolve(t, "mistral-7b-a6000")
	reqs := sharedPrefix(1, 2, 500, 50, 10, 1) // one request: no observation before it is routed
	a, _ := calRun(t, reqs, repeat(prof, 3), nil, false)
	b, _ := calRun(t, reqs, repeat(prof, 3), nil, true)
	if a.Records[0].Replica != b.Records[0].Replica || a.Records[0].TTFTMs != b.Records[0].TTFTMs {
		t.Errorf("first decision differs with calibration: %+v vs %+v", a.Records[0], b.Records[0])
	}
	unseen := 0
	for i, c := range b.Calibration {
		if c.Fit.PrefillSamples != 0 {
			continue
		}
		unseen++
		if p := b.Calibration[0].Fit; c.Fit.PrefillSecondsPer1K == c.Fit.PriorPrefillSecondsPer1K || (i > 1 && c.Fit != b.Calibration[1].Fit) {
			t.Errorf("replica %d: not observed, fitted prefill %v: want its pool's (replica 0 was observed: %v), the same for every unobserved replica",
				i, c.Fit.PrefillSecondsPer1K, p.PrefillSecondsPer1K)
		}
	}
	if unseen != 2 {
		t.Errorf("%d replicas not observed, want 2 (one request)", unseen)
	}
}

// llama.cpp replicas report their own timings; the router learns the slot
// replicas' speed from them. A slot replica's prefill depends on what the
// other slot holds (llama.cpp attends over the whole KV buffer), which the
// router's prefill(new, prompt) cannot see: the fit learns the average, so
// it is held against what the replicas did over the run (the timings),
// not against the profile at one point.
func TestCalibrationFromTimings(t *testing.T) {
	truth := resolve(t, "llamacpp-tiny-cpu")
	told := resolve(t, "llamacpp-tiny-cpu:time_scale=0.5")
	reqs := sharedPrefix(300, 6, 600, 100, 1, 5)
	run := func(noTimings bool) *Result {
		pol, err := policy.New("e2", policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		rc := replica.DefaultConfig()
		rc.Slots = 2
		c := calibrate.DefaultConfig()
		c.NoTimings = noTimings
		res, err := Run(context.Background(), Config{Replicas: 2, Replica: rc, Profile: truth, RouterProfiles: repeat(told, 2),
			Policy: pol, Calibrate: &c}, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	// Learning from the router's own clock (busy periods, token gaps),
	// the model still agrees with the replicas' timings.
	for i, cal := range run(true).Calibration {
		p, d := cal.Stats.TimedPrefill.Ratio(), cal.Stats.TimedDecode.Ratio()
		t.Logf("clock only, replica %d: predicted/timings prefill %.3f, decode %.3f; stats %+v", i, p, d, cal.Stats)
		if cal.Stats.PrefillTimings != 0 || cal.Stats.PrefillPeriods == 0 {
			t.Errorf("replica %d: learnt from timings with NoTimings, or from no busy period", i)
		}
		if math.Abs(p-1) > 0.25 || math.Abs(d-1) > 0.25 {
			t.Errorf("replica %d: learning from the clock, predicted/timings prefill %.3f, decode %.3f; want within 25%%", i, p, d)
		}
	}
	res := run(false)
	for i, cal := range res.Calibration {
		f := cal.Fit
		t.Logf("replica %d: predicted/observed prefill %.3f (told %.3f), decode %.3f (told %.3f); stats %+v",
			i, f.PrefillRatio, f.PriorPrefillRatio, f.DecodeRatio, f.PriorDecodeRatio, cal.Stats)
		if cal.Stats.PrefillTimings == 0 {
			t.Errorf("replica %d: no prefill observation from timings", i)
		}
		if math.Abs(f.PrefillRatio-1) > 0.15 || math.Abs(f.DecodeRatio-1) > 0.15 {
			t.Errorf("replica %d: predicted/observed prefill %.3f, decode %.3f over the last observations; want within 15%%", i, f.PrefillRatio, f.DecodeRatio)
		}
		if f.PriorPrefillRatio > 0.7 || f.PriorDecodeRatio > 0.7 {
			t.Errorf("replica %d: the told profile's ratios %.3f/%.3f, want about 0.5 (it is 2× too fast)", i, f.PriorPrefillRatio, f.PriorDecodeRatio)
		}
	}
}
