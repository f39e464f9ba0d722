package workload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"time"
)

// ErrArrival is wrapped by every arrival-process error.
var ErrArrival = errors.New("workload: arrival")

// Arrival process names accepted by ArrivalSpec.Process.
const (
	// ArrivalAuto keeps a trace's own timestamps and applies Poisson at Rate
	// to a generated workload.
	ArrivalAuto = "auto"
	// ArrivalTrace keeps the requests' timestamps (scaled by TimeScale).
	ArrivalTrace = "trace"
	// ArrivalPoisson is a Poisson process at Rate (exponential gaps).
	ArrivalPoisson = "poisson"
	// ArrivalGamma has gamma-distributed gaps with mean 1/Rate and coefficient
	// of variation CV (CV 1 is Poisson; larger is burstier).
	ArrivalGamma = "gamma"
	// ArrivalRamp is Poisson with a piecewise-constant rate (Stages).
	ArrivalRamp = "ramp"
	// ArrivalTimestamps takes the gaps of a list of timestamps (the Azure
	// trace's, TimestampsFile), scaled by TimeScale: Preble's "Azure arrival
	// pattern" applied to its tool and video workloads.
	ArrivalTimestamps = "azure"
)

// Stage is one step of a rate ramp: Poisson at Rate for Duration.
type Stage struct {
	Rate     float64       `json:"rate"`
	Duration time.Duration `json:"duration"`
}

// ParseStages parses a ramp written "rate:duration,rate:duration,...", e.g.
// "3:60s,10:60s,60:120s" (llm-d's warm-up then 3→60 QPS sweep is such a list).
func ParseStages(s string) ([]Stage, error) {
	var out []Stage
	for part := range strings.SplitSeq(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		r, d, ok := strings.Cut(part, ":")
		if !ok {
			return nil, fmt.Errorf("%w: ramp stage %q: want rate:duration", ErrArrival, part)
		}
		rate, err := strconv.ParseFloat(r, 64)
		if err != nil || rate <= 0 || math.IsInf(rate, 0) {
			return nil, fmt.Errorf("%w: ramp stage %q: rate must be a positive number", ErrArrival, part)
		}
		dur, err := time.ParseDuration(d)
		if err != nil || dur <= 0 {
			return nil, fmt.Errorf("%w: ramp stage %q: duration must be positive, like 60s", ErrArrival, part)
		}
		out = append(out, Stage{Rate: rate, Duration: dur})
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: empty ramp", ErrArrival)
	}
	return out, nil
}

// Poisson overwrites the requests' arrivals with a Poisson process at rate
// requests per second, in list order (the first request arrives at 0, like
// Preble's calc_send_out_times). List order is kept, so a session's steps stay
// in order.
func Poisson(reqs []Request, rate float64, r *rand.Rand) error {
	if !(rate > 0) || math.IsInf(rate, 0) {
		return fmt.Errorf("%w: poisson rate %g must be positive", ErrArrival, rate)
	}
	t := 0.0
	for i := range reqs {
		if i > 0 {
			t += r.ExpFloat64() / rate
		}
		reqs[i].Arrival = seconds(t)
	}
	return nil
}

// Gamma overwrites arrivals with gaps drawn from a gamma distribution of mean
// 1/rate and coefficient of variation cv (shape 1/cv², scale cv²/rate), the
// usual burstiness knob of serving benchmarks (vLLM's --burstiness is 1/cv²).
func Gamma(reqs []Request, rate, cv float64, r *rand.Rand) error {
	if !(rate > 0) || math.IsInf(rate, 0) {
		return fmt.Errorf("%w: gamma rate %g must be positive", ErrArrival, rate)
	}
	if !(cv > 0) || math.IsInf(cv, 0) {
		return fmt.Errorf("%w: gamma cv %g must be positive", ErrArrival, cv)
	}
	shape := 1 / (cv * cv)
	scale := cv * cv / rate
	t := 0.0
	for i := range reqs {
		if i > 0 {
			t += gammaSample(r, shape) * scale
		}
		reqs[i].Arrival = seconds(t)
	}
	return nil
}

// gammaSample draws Gamma(shape, 1) by Marsaglia and Tsang (2000), with the
// U^(1/k) boost for shape < 1.
func gammaSample(r *rand.Rand, k float64) float64 {
	if k < 1 {
		u := r.Float64()
		for u == 0 {
			u = r.Float64()
		}
		return gammaSample(r, k+1) * math.Pow(u, 1/k)
	}
	d := k - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := r.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := r.Float64()
		if u < 1-0.0331*x*x*x*x || math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}

// Ramp overwrites arrivals with a Poisson process whose rate steps through
// stages (each Rate for Duration), in list order. Requests left after the last
// stage continue at its rate. Because Poisson gaps are memoryless, a stage
// boundary simply restarts the gap at the new rate.
func Ramp(reqs []Request, stages []Stage, r *rand.Rand) error {
	if len(stages) == 0 {
		return fmt.Errorf("%w: ramp needs at least one stage", ErrArrival)
	}
	for i, st := range stages {
		if !(st.Rate > 0) || math.IsInf(st.Rate, 0) || st.Duration <= 0 {
			return fmt.Errorf("%w: ramp stage %d: rate %g and duration %v must be positive", ErrArrival, i, st.Rate, st.Duration)
		}
	}
	t, stage := 0.0, 0
	end := stages[0].Duration.Seconds()
	for i := range reqs {
		if i > 0 {
			for {
				next := t + r.ExpFloat64()/stages[stage].Rate
				if next <= end || stage == len(stages)-1 {
					t = next
					break
				}
				t = end
				stage++
				end += stages[stage].Duration.Seconds()
			}
		}
		reqs[i].Arrival = seconds(t)
	}
	return nil
}

// FromTimestamps overwrites arrivals with the given timestamps, relative to
// the first and divided by scale (scale 2 replays twice as fast), in list
// order. With more requests than timestamps, the pattern repeats, each repeat
// starting one mean gap after the previous one ends.
func FromTimestamps(reqs []Request, ts []time.Duration, scale float64) error {
	if len(ts) == 0 {
		return fmt.Errorf("%w: no timestamps", ErrArrival)
	}
	if !(scale > 0) || math.IsInf(scale, 0) {
		return fmt.Errorf("%w: time scale %g must be positive", ErrArrival, scale)
	}
	for i := 1; i < len(ts); i++ {
		if ts[i] < ts[i-1] {
			return fmt.Errorf("%w: timestamp %d (%v) is before the one preceding it", ErrArrival, i, ts[i])
		}
	}
	base := ts[0]
	span := ts[len(ts)-1] - base
	period := span
	if len(ts) > 1 {
		period += span / time.Duration(len(ts)-1)
	}
	for i := range reqs {
		rep, j := i/len(ts), i%len(ts)
		t := float64(ts[j]-base) + float64(rep)*float64(period)
		reqs[i].Arrival = time.Duration(t / scale)
	}
	return nil
}

// ScaleTime divides every arrival by scale (scale 2 replays twice as fast):
// a trace's own timestamps, time-scaled.
func ScaleTime(reqs []Request, scale float64) error {
	if !(scale > 0) || math.IsInf(scale, 0) {
		return fmt.Errorf("%w: time scale %g must be positive", ErrArrival, scale)
	}
	if scale == 1 {
		return nil
	}
	for i := range reqs {
		reqs[i].Arrival = time.Duration(float64(reqs[i].Arrival) / scale)
	}
	return nil
}

func seconds(t float64) time.Duration { return time.Duration(t * float64(time.Second)) }

// ArrivalSpec chooses and parameterizes an arrival process; Apply runs it.
type ArrivalSpec struct {
	// Process is one of auto, trace, poisson, gamma, ramp, azure (see the
	// Arrival* constants). "" means auto.
	Process string `json:"process"`
	// Rate is requests per second for poisson and gamma, and for auto on a
	// generated workload.
	Rate float64 `json:"rate"`
	// CV is gamma's coefficient of variation of the gaps.
	CV float64 `json:"cv"`
	// Stages is the ramp (ParseStages parses the flag form).
	Stages []Stage `json:"stages,omitempty"`
	// TimeScale divides trace-derived times (trace, azure): 2 is twice as fast.
	TimeScale float64 `json:"time_scale"`
	// Timestamps are the arrivals the azure process replays; a caller fills
	// them, e.g. from ReadTrace of an Azure CSV (Flags does so from
	// --arrival-trace).
	Timestamps []time.Duration `json:"-"`
}

// DefaultArrival returns auto at 10 requests/s, CV 1, time scale 1.
func DefaultArrival() ArrivalSpec {
	return ArrivalSpec{Process: ArrivalAuto, Rate: 10, CV: 1, TimeScale: 1}
}

// Apply overwrites reqs' arrivals with the process, drawing from a generator
// seeded by seed. fromTrace says whether the requests carry a trace's own
// timestamps (auto keeps them, scaled) or were generated (auto is Poisson).
// Requests are neither reordered nor renumbered: the processes assign
// non-decreasing arrivals in list order.
func (a *ArrivalSpec) Apply(reqs []Request, seed int64, fromTrace bool) error {
	r := newRand(seed, 0xa77)
	p := a.Process
	if p == "" || p == ArrivalAuto {
		p = ArrivalPoisson
		if fromTrace {
			p = ArrivalTrace
		}
	}
	switch p {
	case ArrivalTrace:
		return ScaleTime(reqs, a.TimeScale)
	case ArrivalPoisson:
		return Poisson(reqs, a.Rate, r)
	case ArrivalGamma:
		return Gamma(reqs, a.Rate, a.CV, r)
	case ArrivalRamp:
		return Ramp(reqs, a.Stages, r)
	case ArrivalTimestamps:
		return FromTimestamps(reqs, a.Timestamps, a.TimeScale)
	}
	return fmt.Errorf("%w: unknown process %q (known: auto, trace, poisson, gamma, ramp, azure)", ErrArrival, a.Process)
}
