package epp

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"sigs.k8s.io/yaml"
)

// Model rewrites, as the Gateway API Inference Extension defines them: an
// InferenceModelRewrite (inference.networking.x-k8s.io/v1alpha2; the types
// in kubernetes-sigs/gateway-api-inference-extension
// apix/v1alpha2/inferencemodelrewrite_types.go) maps the "model" of a
// request to its pool onto one or more target models, weighted — model
// aliases, a generic fallback, canary splits between adapters. The picker
// rewrites the request body's model before it is routed (the rewritten
// model is what the replicas serve, and keys an adapter's request).
//
// Precedence, as the spec states it: a rule whose matches name the model
// exactly wins over a generic rule (no matches); among several, the oldest
// rewrite resource wins, then the first rule in its list. Targets are
// chosen in proportion to their weights (all weights unset: equally).

// ModelRewrite is one InferenceModelRewrite of the pool.
type ModelRewrite struct {
	// Name and Created identify the resource; Created orders precedence.
	Name    string
	Created time.Time
	// Rules, in order.
	Rules []RewriteRule
}

// RewriteRule is one rule: its exact model matches (none: every model)
// and its weighted targets.
type RewriteRule struct {
	Matches []string
	Targets []RewriteTarget
}

// RewriteTarget is a target model and its weight (0: unset).
type RewriteTarget struct {
	Model  string
	Weight int32
}

// rewriter holds the pool's rewrites, ready to apply. A pool without any
// (the usual case) costs Pick one atomic load.
type rewriter struct {
	rewrites atomic.Pointer[[]ModelRewrite] // by precedence: oldest first
	mu       sync.Mutex                     // guards rng
	rng      *rand.Rand
}

// set installs rs, ordered by creation time (then name).
func (w *rewriter) set(rs []ModelRewrite) {
	rs = slices.Clone(rs)
	slices.SortStableFunc(rs, func(a, b ModelRewrite) int {
		if c := a.Created.Compare(b.Created); c != 0 {
			return c
		}
		return cmp.Compare(a.Name, b.Name)
	})
	w.rewrites.Store(&rs)
}

// rewrite returns the model a request for model goes to (model itself when
// no rule matches).
func (w *rewriter) rewrite(model string) string {
	rp := w.rewrites.Load()
	if rp == nil || len(*rp) == 0 {
		return model
	}
	rs := *rp
	var generic *RewriteRule
	for i := range rs {
		for j := range rs[i].Rules {
			r := &rs[i].Rules[j]
			if len(r.Matches) == 0 {
				if generic == nil {
					generic = r
				}
				continue
			}
			if model != "" && slices.Contains(r.Matches, model) {
				return w.pick(r.Targets, model)
			}
		}
	}
	if generic != nil {
		return w.pick(generic.Targets, model)
	}
	return model
}

// pick chooses a target by weight.
func (w *rewriter) pick(ts []RewriteTarget, model string) string {
	if len(ts) == 0 {
		return model
	}
	if len(ts) == 1 {
		return ts[0].Model
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	total := int64(0)
	for _, t := range ts {
		total += int64(max(t.Weight, 0))
	}
	if total == 0 {
		return ts[w.rng.IntN(len(ts))].Model
	}
	n := w.rng.Int64N(total)
	for _, t := range ts {
		if n -= int64(max(t.Weight, 0)); n < 0 {
			return t.Model
		}
	}
	return ts[len(ts)-1].Model
}

// rewriteManifest is the part of an InferenceModelRewrite prefixlb reads.
type rewriteManifest struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name              string    `json:"name"`
		CreationTimestamp time.Time `json:"creationTimestamp"`
	} `json:"metadata"`
	Spec struct {
		PoolRef *struct {
			Name string `json:"name"`
		} `json:"poolRef"`
		Rules []struct {
			Matches []struct {
				Model *struct {
					Type  string `json:"type"`
					Value string `json:"value"`
				} `json:"model"`
			} `json:"matches"`
			Targets []struct {
				Weight       int32  `json:"weight"`
				ModelRewrite string `json:"modelRewrite"`
			} `json:"targets"`
		} `json:"rules"`
	} `json:"spec"`
}

// ParseModelRewrites reads InferenceModelRewrite manifests (YAML
// documents separated by "---", as kubectl applies them) and keeps those
// whose poolRef names pool ("": every one). Errors name the document.
func ParseModelRewrites(data []byte, pool string) ([]ModelRewrite, error) {
	var out []ModelRewrite
	for i, doc := range bytes.Split(data, []byte("\n---")) {
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		js, err := yaml.YAMLToJSON(doc)
		if err != nil {
			return nil, fmt.Errorf("epp: model rewrites: document %d: %w", i, err)
		}
		if string(bytes.TrimSpace(js)) == "null" {
			continue
		}
		r, poolRef, err := decodeRewrite(js)
		if err != nil {
			return nil, fmt.Errorf("epp: model rewrites: document %d%w", i, err)
		}
		if pool != "" && poolRef != pool {
			continue
		}
		out = append(out, r)
	}
	return out, nil
}

// ModelRewritesFromObjects converts InferenceModelRewrites as the API
// server returns them (each object's JSON) and keeps those whose poolRef
// names pool. An invalid object is skipped and reported in errs, naming
// it; the others still apply, as GIE's controller treats them one by one.
func ModelRewritesFromObjects(objs [][]byte, pool string) (rs []ModelRewrite, errs []error) {
	for _, js := range objs {
		r, poolRef, err := decodeRewrite(js)
		if err != nil {
			errs = append(errs, fmt.Errorf("epp: model rewrite%w", err))
			continue
		}
		if poolRef == pool {
			rs = append(rs, r)
		}
	}
	return rs, errs
}

// decodeRewrite decodes one InferenceModelRewrite's JSON; its error reads
// after "document N" or "model rewrite": " (NAME): why" or ": why".
func decodeRewrite(js []byte) (ModelRewrite, string, error) {
	var m rewriteManifest
	if err := json.Unmarshal(js, &m); err != nil {
		return ModelRewrite{}, "", fmt.Errorf(": %w", err)
	}
	r, err := m.rewrite()
	if err != nil {
		return ModelRewrite{}, "", fmt.Errorf(" (%s): %w", m.Metadata.Name, err)
	}
	return r, m.Spec.PoolRef.Name, nil
}

// rewrite checks m as the CRD's schema does and converts it.
func (m *rewriteManifest) rewrite() (ModelRewrite, error) {
	if m.Kind != "InferenceModelRewrite" {
		return ModelRewrite{}, fmt.Errorf("kind %q, want InferenceModelRewrite", m.Kind)
	}
	if m.Spec.PoolRef == nil || m.Spec.PoolRef.Name == "" {
		return ModelRewrite{}, errors.New("spec.poolRef.name is required")
	}
	r := ModelRewrite{Name: m.Metadata.Name, Created: m.Metadata.CreationTimestamp}
	for i, rule := range m.Spec.Rules {
		var rr RewriteRule
		for _, mt := range rule.Matches {
			if mt.Model == nil || mt.Model.Value == "" {
				return r, fmt.Errorf("rules[%d].matches: model.value is required", i)
			}
			if mt.Model.Type != "" && mt.Model.Type != "Exact" {
				return r, fmt.Errorf("rules[%d].matches: model.type %q, want Exact", i, mt.Model.Type)
			}
			rr.Matches = append(rr.Matches, mt.Model.Value)
		}
		if len(rule.Targets) == 0 {
			return r, fmt.Errorf("rules[%d].targets: at least one target is required", i)
		}
		weighted := 0
		for j, t := range rule.Targets {
			if t.ModelRewrite == "" {
				return r, fmt.Errorf("rules[%d].targets[%d].modelRewrite is required", i, j)
			}
			if t.Weight < 0 || t.Weight > 1000000 {
				return r, fmt.Errorf("rules[%d].targets[%d].weight %d out of [1, 1000000]", i, j, t.Weight)
			}
			if t.Weight > 0 {
				weighted++
			}
			rr.Targets = append(rr.Targets, RewriteTarget{Model: t.ModelRewrite, Weight: t.Weight})
		}
		if weighted != 0 && weighted != len(rule.Targets) {
			return r, fmt.Errorf("rules[%d].targets: a weight set for one target must be set for all", i)
		}
		r.Rules = append(r.Rules, rr)
	}
	return r, nil
}

// withModel returns body with its "model" set to model.
func withModel(body []byte, model string) ([]byte, error) {
	var m map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&m); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, errors.New("trailing data after the body")
	}
	if m == nil {
		m = map[string]json.RawMessage{}
	}
	var err error
	if m["model"], err = json.Marshal(model); err != nil {
		return nil, err
	}
	return json.Marshal(m)
}
