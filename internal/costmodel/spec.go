package costmodel

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// The settings a profile spec can carry after its name (Resolve).
const (
	// SettingTimeScale multiplies every time the profile gives.
	SettingTimeScale = "time_scale"
	// SettingPrefillScale multiplies the prefill chunks' share of a time.
	SettingPrefillScale = "prefill_scale"
	// SettingDecodeScale multiplies the decoding sequences' share of a time.
	SettingDecodeScale = "decode_scale"
)

// settings lists the known settings, in the order error messages give them.
var settings = []string{SettingTimeScale, SettingPrefillScale, SettingDecodeScale}

// Resolve returns the profile a spec names (docs/profiles.md, "Profile
// specs"):
//
//	NAME[:time_scale=X][:prefill_scale=X][:decode_scale=X]
//
// NAME is a built-in profile (Lookup) or the path of a YAML profile (Load):
// a NAME that ends in .yaml or .yml or contains "/" is a path, as the
// command line has always read --profile. Everything after the first ":" is
// settings, so a path cannot contain ":". Each setting is key=value with a
// finite value > 0, each key at most once, in any order:
//
//   - time_scale multiplies every time the profile gives;
//   - prefill_scale multiplies the prefill chunks' share of it;
//   - decode_scale multiplies the decoding sequences' share.
//
// They multiply: the prefill factor is time_scale·prefill_scale and the
// decode factor time_scale·decode_scale (each 1 when not given), and the
// profile is Scale's with those factors, named after the base profile and
// the settings as given ("llama3.1-8b-h100:time_scale=0.5" for that spec;
// a file's profile takes the name in the file). Without settings Resolve
// returns the base profile itself.
//
// Errors wrap ErrUnknownProfile for an unknown NAME, ErrInvalidProfile for
// a bad setting or file contents, or the file's read error. Resolve does no
// I/O but Load's.
func Resolve(spec string) (Profile, error) {
	name, rest, hasSettings := strings.Cut(spec, ":")
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w %q: %s", ErrInvalidProfile, spec, fmt.Sprintf(format, args...))
	}
	if name == "" {
		return nil, bad("missing profile name before the settings (want NAME[:key=value...])")
	}
	var prefill, decode float64 = 1, 1
	if hasSettings {
		seen := map[string]bool{}
		vals := map[string]float64{SettingTimeScale: 1, SettingPrefillScale: 1, SettingDecodeScale: 1}
		for _, kv := range strings.Split(rest, ":") {
			k, v, ok := strings.Cut(kv, "=")
			if !ok || k == "" {
				return nil, bad("setting %q is not key=value (known keys: %s)", kv, strings.Join(settings, ", "))
			}
			if _, known := vals[k]; !known {
				return nil, bad("unknown setting %q (known keys: %s)", k, strings.Join(settings, ", "))
			}
			if seen[k] {
				return nil, bad("setting %q given twice (known keys: %s)", k, strings.Join(settings, ", "))
			}
			seen[k] = true
			f, err := strconv.ParseFloat(v, 64)
			if err != nil && !errors.Is(err, strconv.ErrRange) {
				return nil, bad("%s: %q is not a number", k, v)
			} // out of range: ±Inf or 0, which checkScale explains
			if err := checkScale(k, f); err != "" {
				return nil, bad("%s", err)
			}
			vals[k] = f
		}
		prefill = vals[SettingTimeScale] * vals[SettingPrefillScale]
		decode = vals[SettingTimeScale] * vals[SettingDecodeScale]
		for _, f := range []struct {
			what string
			v    float64
		}{{"time_scale·prefill_scale", prefill}, {"time_scale·decode_scale", decode}} {
			if err := checkScale(f.what, f.v); err != "" {
				return nil, bad("%s", err)
			}
		}
	}
	var p Profile
	var err error
	if strings.HasSuffix(name, ".yaml") || strings.HasSuffix(name, ".yml") || strings.Contains(name, "/") {
		p, err = Load(name)
	} else {
		p, err = Lookup(name)
	}
	if err != nil || !hasSettings {
		return p, err
	}
	return newScaled(p.Name()+":"+rest, p, prefill, decode), nil
}

// checkScale explains why v is not a usable scale factor, or returns "".
func checkScale(what string, v float64) string {
	switch {
	case math.IsNaN(v):
		return fmt.Sprintf("%s: is NaN; want a finite number > 0", what)
	case math.IsInf(v, 0):
		return fmt.Sprintf("%s: is infinite; want a finite number > 0", what)
	case v <= 0:
		return fmt.Sprintf("%s: must be > 0, got %g", what, v)
	}
	return ""
}

// Scaled is a profile whose times are another's, scaled: prefill work by
// one factor, decode work by another (Scale, Resolve). It lets a simulation
// tell the router a profile that is wrong by a known factor while the
// replicas run the true one. KV capacity and batching are the base
// profile's. Like every profile, it is pure and safe for concurrent use.
type Scaled struct {
	name            string
	base            Profile
	prefill, decode float64
}

var (
	_ Profile = (*Scaled)(nil)
	_ Batcher = (*Scaled)(nil)
)

// Scale returns p with its prefill times multiplied by prefill and its
// decode times by decode (see Scaled.Iteration for a batch that holds
// both), named p.Name() followed by ":prefill_scale=X:decode_scale=Y".
// Both factors must be finite and > 0; the error wraps ErrInvalidProfile.
func Scale(p Profile, prefill, decode float64) (Profile, error) {
	if p == nil {
		return nil, fmt.Errorf("%w: scale: nil profile", ErrInvalidProfile)
	}
	for _, f := range []struct {
		what string
		v    float64
	}{{SettingPrefillScale, prefill}, {SettingDecodeScale, decode}} {
		if err := checkScale(f.what, f.v); err != "" {
			return nil, fmt.Errorf("%w %q: scale: %s", ErrInvalidProfile, p.Name(), err)
		}
	}
	name := fmt.Sprintf("%s:%s=%g:%s=%g", p.Name(), SettingPrefillScale, prefill, SettingDecodeScale, decode)
	return newScaled(name, p, prefill, decode), nil
}

func newScaled(name string, p Profile, prefill, decode float64) *Scaled {
	return &Scaled{name: name, base: p, prefill: prefill, decode: decode}
}

// Name is the scaled profile's name: the base profile's name followed by
// its settings (see Resolve and Scale).
func (s *Scaled) Name() string { return s.name }

// Base is the profile s scales.
func (s *Scaled) Base() Profile { return s.base }

// Scales returns the factors of prefill and decode work.
func (s *Scaled) Scales() (prefill, decode float64) { return s.prefill, s.decode }

// KVCapacity is the base profile's: scaling times does not change memory.
func (s *Scaled) KVCapacity() int { return s.base.KVCapacity() }

// Batching is the base profile's (BatchingOf).
func (s *Scaled) Batching() Batching { return BatchingOf(s.base) }

// Prefill is the prefill factor times the base profile's Prefill.
func (s *Scaled) Prefill(newTokens, seqTokens int) time.Duration {
	return scaleDuration(float64(s.base.Prefill(newTokens, seqTokens)) * s.prefill)
}

// Iteration scales the base profile's time of b. With I the base time of
// b, P that of b's prefill chunks alone and D that of its decoding
// sequences alone, a the prefill factor, d the decode factor and
// m = min(a, d):
//
//   - a batch of prefill chunks only (D = 0) takes a·I, and one of decoding
//     sequences only (P = 0) takes d·I, exactly;
//   - a mixed batch takes m·I + (a−m)·P + (d−m)·D: the whole batch scaled by
//     the smaller factor, plus the excess of the larger factor on the part
//     it applies to, alone. It never falls below a·P or d·D (the time of
//     either part alone, scaled) and lies between m·I and max(a, d)·I;
//     with a = d it is a·I.
//
// Every coefficient is ≥ 0 and I, P and D are non-decreasing in every
// input, so Iteration is too, as the Profile contract requires. The
// share-weighted form I·(a·P + d·D)/(P + D) is also exact on pure batches
// but can fall when a batch grows: one cheap prefill chunk added to a
// decode batch moves half the weight to a small prefill factor and roughly
// halves the time.
func (s *Scaled) Iteration(b Batch) time.Duration {
	all := s.base.Iteration(b)
	if all == 0 {
		return 0
	}
	if s.prefill == s.decode {
		// time_scale alone (the common spec): a·I, without pricing the
		// parts (I ≥ P and I ≥ D, so the bound below cannot bind).
		return scaleDuration(float64(all) * s.prefill)
	}
	p := s.base.Iteration(Batch{Prefill: b.Prefill})
	d := s.base.Iteration(Batch{DecodeSeqs: b.DecodeSeqs, DecodeContext: b.DecodeContext})
	switch {
	case d == 0:
		return scaleDuration(float64(all) * s.prefill)
	case p == 0:
		return scaleDuration(float64(all) * s.decode)
	}
	m := math.Min(s.prefill, s.decode)
	ns := m*float64(all) + (s.prefill-m)*float64(p) + (s.decode-m)*float64(d)
	// In exact arithmetic ns ≥ a·P and ns ≥ d·D already (I ≥ P, I ≥ D);
	// the max keeps floating-point rounding from taking a mixed batch below
	// the pure batch it grew from.
	ns = math.Max(ns, math.Max(float64(p)*s.prefill, float64(d)*s.decode))
	return scaleDuration(ns)
}

// scaleDuration rounds a scaled time in nanoseconds to a Duration: 0 stays
// 0, anything above it is at least 1 ns (a batch that computes something
// never becomes free), and absurd times saturate at the largest Duration.
func scaleDuration(ns float64) time.Duration {
	switch {
	case math.IsNaN(ns) || ns >= maxDurationNS:
		return time.Duration(math.MaxInt64)
	case ns <= 0:
		return 0
	case ns < 1:
		return 1
	}
	return time.Duration(math.Round(ns))
}
