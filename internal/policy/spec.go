package policy

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Parse builds a policy from a spec "NAME[:field=value[:field=value...]]",
// where fields are E2Config's JSON names (durations as Go durations, e.g.
// "e2-preble:mixing=false:window=1m"). Fields apply to e2 and e2-preble only.
// The policy keeps NAME as its reported name unless a name field is given.
func Parse(spec string, o Options) (Policy, error) {
	name, rest, hasRest := strings.Cut(strings.TrimSpace(spec), ":")
	if !hasRest {
		return New(name, o)
	}
	var cfg *E2Config
	switch name {
	case "e2":
		cfg = &o.E2
	case "e2-preble":
		cfg = &o.E2Preble
	default:
		return nil, fmt.Errorf("policy: %q: only e2 and e2-preble take settings", spec)
	}
	cfg.Name = spec
	raw, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	fields := map[string]any{}
	if err := json.Unmarshal(raw, &fields); err != nil {
		return nil, err
	}
	for _, kv := range strings.Split(rest, ":") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return nil, fmt.Errorf("policy: %q: setting %q is not field=value", spec, kv)
		}
		old, known := fields[k]
		if !known {
			return nil, fmt.Errorf("policy: %q: unknown e2 field %q", spec, k)
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
