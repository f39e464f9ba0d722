package epp

import (
	"encoding/json"
	"fmt"
	"maps"
	"sync/atomic"
)

// InferenceObjectives, as the Gateway API Inference Extension defines them
// (inference.networking.x-k8s.io/v1alpha2, apix/v1alpha2/
// inferenceobjective_types.go): a request names one in
// x-gateway-inference-objective and is queued at its priority while the
// pool is saturated (higher first, negative allowed, unset 0). Alpha
// releases called the integer field criticality before priority; both are
// read, priority first.

// objectives holds the priority of each objective a request may name:
// --objective-priority's, overridden by the cluster's when watched.
type objectives struct {
	static  map[string]int
	current atomic.Pointer[map[string]int]
}

// init installs the static priorities.
func (o *objectives) init(static map[string]int) {
	o.static = maps.Clone(static)
	m := maps.Clone(static)
	o.current.Store(&m)
}

// set installs the watched priorities over the static ones.
func (o *objectives) set(watched map[string]int) {
	m := maps.Clone(o.static)
	if m == nil {
		m = map[string]int{}
	}
	maps.Copy(m, watched)
	o.current.Store(&m)
}

// priority is objective name's priority and whether it is known.
func (o *objectives) priority(name string) (int, bool) {
	m := o.current.Load()
	if m == nil {
		return 0, false
	}
	p, ok := (*m)[name]
	return p, ok
}

// SetObjectives installs the priorities of the pool's InferenceObjectives
// (name → priority), over Config.Objectives'.
func (p *Picker) SetObjectives(prio map[string]int) { p.objectives.set(prio) }

// objectiveManifest is the part of an InferenceObjective prefixlb reads.
type objectiveManifest struct {
	Kind     string `json:"kind"`
	Metadata struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Priority    *int            `json:"priority"`
		Criticality json.RawMessage `json:"criticality"`
		PoolRef     *struct {
			Name string `json:"name"`
		} `json:"poolRef"`
	} `json:"spec"`
}

// ObjectivesFromObjects reads InferenceObjectives as the API server returns
// them (each object's JSON) and returns the priority of those whose
// poolRef names pool. An invalid object is skipped and reported in errs.
func ObjectivesFromObjects(objs [][]byte, pool string) (prio map[string]int, errs []error) {
	prio = map[string]int{}
	for _, js := range objs {
		var m objectiveManifest
		if err := json.Unmarshal(js, &m); err != nil {
			errs = append(errs, fmt.Errorf("epp: inference objective: %w", err))
			continue
		}
		name := m.Metadata.Name
		switch {
		case m.Kind != "InferenceObjective":
			errs = append(errs, fmt.Errorf("epp: inference objective %s: kind %q", name, m.Kind))
			continue
		case m.Spec.PoolRef == nil || m.Spec.PoolRef.Name == "":
			errs = append(errs, fmt.Errorf("epp: inference objective %s: spec.poolRef.name is required", name))
			continue
		case m.Spec.PoolRef.Name != pool:
			continue
		}
		p := 0
		if m.Spec.Priority != nil {
			p = *m.Spec.Priority
		} else if len(m.Spec.Criticality) > 0 {
			// The alpha field before priority was an integer; older still,
			// an enum (Critical, Standard, Sheddable) that has no number.
			if err := json.Unmarshal(m.Spec.Criticality, &p); err != nil {
				errs = append(errs, fmt.Errorf("epp: inference objective %s: spec.criticality %s is not an integer priority", name, m.Spec.Criticality))
				continue
			}
		}
		prio[name] = p
	}
	return prio, errs
}
