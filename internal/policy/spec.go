package policy

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Parse builds a policy from a spec "NAME[:key=value[:key=value...]]".
// Settings apply to:
//
//   - e2, e2-preble and e2-pd: E2Config's JSON field names, durations as Go
//     durations ("e2-preble:mixing=false:window=1m");
//   - llmd-precise and llmd-approx: prefix_weight, kv_weight and
//     queue_weight (finite, ≥ 0), and for llmd-precise speculative (a bool:
//     the plugin's speculativeIndexing), e.g. llm-d's newest guide,
//     "llmd-precise:prefix_weight=2:kv_weight=1:queue_weight=1:speculative=true".
//
// A policy built with settings reports the whole spec as its name (an e2
// "name" field overrides it); without, NAME. An unknown key is an error that
// lists the known ones.
func Parse(spec string, o Options) (Policy, error) {
	spec = strings.TrimSpace(spec)
	name, rest, hasRest := strings.Cut(spec, ":")
	if !hasRest {
		return New(name, o)
	}
	settings, err := splitSettings(spec, rest)
	if err != nil {
		return nil, err
	}
	switch name {
	case "e2":
		return parseE2(spec, o.E2, settings)
	case "e2-preble":
		return parseE2(spec, o.E2Preble, settings)
	case "e2-pd":
		p, err := parseE2(spec, o.E2PD, settings)
		if err != nil {
			return nil, err
		}
		return NewE2PD(p.(*E2).Config())
	case "llmd-precise", "llmd-approx":
		return parseLLMD(spec, name, o, settings)
	}
	return nil, fmt.Errorf("policy: %q: only e2, e2-preble, e2-pd, llmd-precise and llmd-approx take settings", spec)
}

// setting is one key=value of a spec.
type setting struct{ key, value string }

func splitSettings(spec, rest string) ([]setting, error) {
	var out []setting
	for _, kv := range strings.Split(rest, ":") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("policy: %q: setting %q is not field=value", spec, kv)
		}
		out = append(out, setting{k, v})
	}
	return out, nil
}

// parseE2 applies settings to cfg through its JSON form.
func parseE2(spec string, cfg E2Config, settings []setting) (Policy, error) {
	cfg.Name = spec
	raw, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	fields := map[string]any{}
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, err
	}
	for _, st := range settings {
		k, v := st.key, st.value
		old, known := fields[k]
		if !known {
			keys := make([]string, 0, len(fields))
			for f := range fields {
				keys = append(keys, f)
			}
			slices.Sort(keys)
			return nil, fmt.Errorf("policy: %q: unknown e2 field %q (known: %s)", spec, k, strings.Join(keys, ", "))
		}
		switch old.(type) {
		case bool:
			b, err := strconv.ParseBool(v)
			if err != nil {
				return nil, fmt.Errorf("policy: %q: field %s: %w", spec, k, err)
			}
			fields[k] = b
		case string:
			fields[k] = v
		case float64:
			if d, err := time.ParseDuration(v); err == nil && strings.ContainsAny(v, "smhµnu") {
				fields[k] = float64(d)
				continue
			}
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return nil, fmt.Errorf("policy: %q: field %s: %w", spec, k, err)
			}
			if !finite(f) {
				return nil, fmt.Errorf("policy: %q: field %s: %v is not a finite number", spec, k, f)
			}
			fields[k] = f
		}
	}
	raw, err = json.Marshal(fields)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	dec.DisallowUnknownFields()
	var out E2Config
	if err := dec.Decode(&out); err != nil {
		return nil, fmt.Errorf("policy: %q: %w", spec, err)
	}
	return NewE2(out)
}

// parseLLMD builds llmd-precise or llmd-approx with the scorer weights (and
// llmd-precise's speculative indexing) the settings give.
func parseLLMD(spec, name string, o Options, settings []setting) (Policy, error) {
	p, err := New(name, o)
	if err != nil {
		return nil, err
	}
	var wp, wkv, wq *float64
	var speculative *bool
	switch q := p.(type) {
	case *LLMDPrecise:
		wp, wkv, wq, speculative = &q.PrefixWeight, &q.KVWeight, &q.QueueWeight, &q.SpeculativeIndexing
		q.name = spec
	case *LLMDApprox:
		wp, wkv, wq = &q.PrefixWeight, &q.KVWeight, &q.QueueWeight
		q.name = spec
	default:
		return nil, fmt.Errorf("policy: %q: %s takes no settings", spec, name)
	}
	known := []string{"kv_weight", "prefix_weight", "queue_weight"}
	if speculative != nil {
		known = append(known, "speculative")
	}
	for _, st := range settings {
		var w *float64
		switch st.key {
		case "prefix_weight":
			w = wp
		case "kv_weight":
			w = wkv
		case "queue_weight":
			w = wq
		case "speculative":
			if speculative == nil {
				break
			}
			b, err := strconv.ParseBool(st.value)
			if err != nil {
				return nil, fmt.Errorf("policy: %q: speculative: %w", spec, err)
			}
			*speculative = b
			continue
		}
		if w == nil {
			return nil, fmt.Errorf("policy: %q: unknown %s setting %q (known: %s)", spec, name, st.key, strings.Join(known, ", "))
		}
		f, err := strconv.ParseFloat(st.value, 64)
		if err != nil {
			return nil, fmt.Errorf("policy: %q: %s: %w", spec, st.key, err)
		}
		if !finite(f) || f < 0 {
			return nil, fmt.Errorf("policy: %q: %s must be a finite number ≥ 0, got %v", spec, st.key, f)
		}
		*w = f
	}
	return p, nil
}
