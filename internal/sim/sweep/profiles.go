package sweep

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/prefixlb/prefixlb/internal/costmodel"
)

// ParseReplicaProfiles resolves --replica-profiles for n replicas: specs
// separated by commas, SPEC*N standing for N of one.
func ParseReplicaProfiles(list string, n int) ([]costmodel.Profile, error) {
	var out []costmodel.Profile
	for _, item := range strings.Split(list, ",") {
		item = strings.TrimSpace(item)
		count := 1
		if i := strings.LastIndex(item, "*"); i >= 0 {
			c, err := strconv.Atoi(item[i+1:])
			if err != nil || c < 1 {
				return nil, fmt.Errorf("--replica-profiles: %q: the count after * must be a positive integer", item)
			}
			item, count = item[:i], c
		}
		if item == "" {
			return nil, fmt.Errorf("--replica-profiles: an empty profile in %q", list)
		}
		p, err := costmodel.Resolve(item)
		if err != nil {
			return nil, fmt.Errorf("--replica-profiles: %w", err)
		}
		for ; count > 0; count-- {
			out = append(out, p)
		}
	}
	if len(out) != n {
		return nil, fmt.Errorf("--replica-profiles names %d replicas, --replicas is %d", len(out), n)
	}
	return out, nil
}

// Profiles are the profiles of one simulated cluster.
type Profiles struct {
	// Base is --profile: every replica's true profile unless Replicas is
	// set, and the label of the results.
	Base costmodel.Profile
	// Replicas is --replica-profiles, one per replica (nil: Base for all).
	Replicas []costmodel.Profile
	// Router is --router-profile, one per replica (nil: each replica's
	// own true one).
	Router []costmodel.Profile
}

// ResolveProfiles resolves the profiles of n replicas: base (--profile),
// replicas (--replica-profiles, "" for none) and router (--router-profile,
// "" for none).
func ResolveProfiles(base, replicas, router string, n int) (*Profiles, error) {
	b, err := costmodel.Resolve(base)
	if err != nil {
		return nil, err
	}
	sp := &Profiles{Base: b}
	if replicas != "" {
		if sp.Replicas, err = ParseReplicaProfiles(replicas, n); err != nil {
			return nil, err
		}
	}
	if router != "" {
		rp, err := costmodel.Resolve(router)
		if err != nil {
			return nil, fmt.Errorf("--router-profile: %w", err)
		}
		for i := 0; i < n; i++ {
			sp.Router = append(sp.Router, rp)
		}
	}
	return sp, nil
}

// Distinct lists each different true profile once, in replica order (a
// profile resolved twice, as in A,B,A, counts twice; A*2 counts once).
func (sp *Profiles) Distinct() []costmodel.Profile {
	if len(sp.Replicas) == 0 {
		return []costmodel.Profile{sp.Base}
	}
	var out []costmodel.Profile
	for _, p := range sp.Replicas {
		seen := false
		for _, q := range out {
			seen = seen || q == p
		}
		if !seen {
			out = append(out, p)
		}
	}
	return out
}

// Fastest is the true profile with the shortest 1,000-token prefill: the
// oracle's replica (no router beats a request alone on the fastest one).
func (sp *Profiles) Fastest() costmodel.Profile {
	best := sp.Base
	for i, p := range sp.Distinct() {
		if i == 0 || p.Prefill(1000, 1000) < best.Prefill(1000, 1000) {
			best = p
		}
	}
	return best
}

// ParseRates parses --rates, comma-separated positive numbers; empty: def
// alone.
func ParseRates(s string, def float64) ([]float64, error) {
	if strings.TrimSpace(s) == "" {
		return []float64{def}, nil
	}
	var out []float64
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("--rates: %q is not a positive number", f)
		}
		out = append(out, v)
	}
	return out, nil
}
