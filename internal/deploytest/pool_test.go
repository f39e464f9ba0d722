package deploytest

import (
	"context"
	"strings"
	"testing"
)

// TestInferencePoolSchema shows the check can fail: each case is an
// InferencePool a cluster with the released CRD would accept or reject,
// and want lists a piece of each error expected (none: accepted).
func TestInferencePoolSchema(t *testing.T) {
	byKind, err := crds()
	if err != nil {
		t.Fatal(err)
	}
	crd := byKind[inferencePool]
	if crd == nil {
		t.Fatalf("no CRD serves %s", inferencePool)
	}
	const head = "apiVersion: inference.networking.k8s.io/v1\nkind: InferencePool\nmetadata: {name: pool}\n"
	for _, c := range []struct {
		name string
		spec string
		want []string
	}{
		{
			name: "released v1",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 8000}]\nendpointPickerRef: {name: epp, port: {number: 9002}, failureMode: FailClose}",
		},
		{
			// The manifest deploy/ shipped before: the pre-release draft's
			// portNumber, which v1 does not know, so the port is missing too.
			name: "draft portNumber",
			spec: "selector:\n  matchLabels: {app: vllm-llama3-8b}\ntargetPorts:\n  - number: 8000\nendpointPickerRef:\n  name: prefixlb-epp\n  portNumber: 9002\n  failureMode: FailClose",
			want: []string{`unknown field "spec.endpointPickerRef.portNumber"`, "port is required when kind is 'Service'"},
		},
		{
			name: "Service kind without port",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 8000}]\nendpointPickerRef: {name: epp, kind: Service}",
			want: []string{"spec.endpointPickerRef: Invalid value", "port is required when kind is 'Service'"},
		},
		{
			name: "another kind needs no port",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 8000}]\nendpointPickerRef: {name: epp, group: example.com, kind: Picker}",
		},
		{
			name: "no endpoint picker (optional in v1)",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 8000}]",
		},
		{
			name: "no selector",
			spec: "targetPorts: [{number: 8000}]\nendpointPickerRef: {name: epp, port: {number: 9002}}",
			want: []string{"spec.selector: Required value"},
		},
		{
			name: "no target ports",
			spec: "selector: {matchLabels: {app: vllm}}\nendpointPickerRef: {name: epp, port: {number: 9002}}",
			want: []string{"spec.targetPorts: Required value"},
		},
		{
			name: "draft flat selector and targetPortNumber",
			spec: "selector: {app: vllm}\ntargetPortNumber: 8000\nendpointPickerRef: {name: epp, port: {number: 9002}}",
			want: []string{`unknown field "spec.selector.app"`, `unknown field "spec.targetPortNumber"`, "spec.selector.matchLabels: Required value", "spec.targetPorts: Required value"},
		},
		{
			name: "port out of range",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 0}]\nendpointPickerRef: {name: epp, port: {number: 70000}}",
			want: []string{"spec.targetPorts[0].number: Invalid value: 0", "spec.endpointPickerRef.port.number: Invalid value: 70000"},
		},
		{
			name: "duplicate target ports",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 8000}, {number: 8000}]\nendpointPickerRef: {name: epp, port: {number: 9002}}",
			want: []string{"port number must be unique"},
		},
		{
			name: "unknown failure mode",
			spec: "selector: {matchLabels: {app: vllm}}\ntargetPorts: [{number: 8000}]\nendpointPickerRef: {name: epp, port: {number: 9002}, failureMode: FailSoft}",
			want: []string{`spec.endpointPickerRef.failureMode: Unsupported value: "FailSoft"`},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			doc := head + "spec:\n  " + strings.ReplaceAll(c.spec, "\n", "\n  ") + "\n"
			docs, err := readDocuments(c.name, strings.NewReader(doc))
			if err != nil || len(docs) != 1 {
				t.Fatalf("parse %q: %v (%d documents)", doc, err, len(docs))
			}
			got := crd.check(context.Background(), docs[0].obj)
			for _, w := range c.want {
				if !containsPart(got, w) {
					t.Errorf("errors %q: want one with %q", got, w)
				}
			}
			if len(c.want) == 0 && len(got) > 0 {
				t.Errorf("errors %q: want none", got)
			}
		})
	}
}

// containsPart reports whether some string of errs contains part.
func containsPart(errs []string, part string) bool {
	for _, e := range errs {
		if strings.Contains(e, part) {
			return true
		}
	}
	return false
}

// TestReferences: the cross-object checks catch a picker Service without the
// pool's port, a route to a pool that is not there, and a picker following
// another pool.
func TestReferences(t *testing.T) {
	const set = `apiVersion: inference.networking.k8s.io/v1
kind: InferencePool
metadata: {name: pool}
spec:
  selector: {matchLabels: {app: vllm}}
  targetPorts: [{number: 8000}]
  endpointPickerRef: {name: epp, port: {number: 9002}}
---
apiVersion: v1
kind: Service
metadata: {name: epp}
spec:
  ports: [{name: grpc, port: 9003}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: llm}
spec:
  rules:
    - backendRefs: [{group: inference.networking.k8s.io, kind: InferencePool, name: other}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: epp}
spec:
  template:
    spec:
      containers: [{name: epp, args: [epp, "--discovery=inferencepool:$(POD_NAMESPACE)/pool-2"]}]
`
	docs, err := readDocuments("set", strings.NewReader(set))
	if err != nil {
		t.Fatal(err)
	}
	got := checkReferences(docs)
	for _, w := range []string{"endpointPickerRef epp port 9002: no such Service port", "backendRef InferencePool other is not in the set", "no InferencePool pool-2 in the set"} {
		if !containsPart(got, w) {
			t.Errorf("problems %q: want one with %q", got, w)
		}
	}
	if len(got) != 3 {
		t.Errorf("%d problems %q, want 3", len(got), got)
	}
}

// TestValidate: built-in kinds are decoded strictly, and a kind with no
// schema at all is a failure, not a pass.
func TestValidate(t *testing.T) {
	for _, c := range []struct {
		name, yaml, want string
	}{
		{"typo in a Deployment", "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: epp}\nspec: {replica: 2}\n", `unknown field "spec.replica"`},
		{"Service port as a string", "apiVersion: v1\nkind: Service\nmetadata: {name: epp}\nspec: {ports: [{port: \"9002\"}]}\n", "spec.ports"},
		{"no name", "apiVersion: v1\nkind: ServiceAccount\nmetadata: {}\n", "metadata.name: Required value"},
		{"kind without a schema", "apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n", "no schema for example.com/v1, Kind=Widget"},
	} {
		t.Run(c.name, func(t *testing.T) {
			docs, err := readDocuments(c.name, strings.NewReader(c.yaml))
			if err != nil {
				t.Fatal(err)
			}
			if got := validate(t, docs); !containsPart(got, c.want) {
				t.Errorf("problems %q: want one with %q", got, c.want)
			}
		})
	}
	if _, err := readDocuments("dup", strings.NewReader("apiVersion: v1\nkind: Service\nkind: Service\n")); err == nil || !strings.Contains(err.Error(), `key "kind" already set`) {
		t.Errorf("duplicate key: err %v, want one naming it", err)
	}
}
