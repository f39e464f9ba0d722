package discovery

import (
	"os"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// TestReadPool reads InferencePools of the released v1 API, deploy/'s own
// among them, and refuses the pre-release draft's shape.
func TestReadPool(t *testing.T) {
	manifest, err := os.ReadFile("../../deploy/inferencepool.yaml")
	if err != nil {
		t.Fatal(err)
	}
	deployed, _, _ := strings.Cut(string(manifest), "\n---\n")
	for _, c := range []struct {
		name     string
		yaml     string
		selector string
		port     int
		err      string
	}{
		{name: "deploy/inferencepool.yaml", yaml: deployed, selector: "app=vllm-llama3-8b", port: 8000},
		{
			name:     "two target ports: the first",
			yaml:     "spec: {selector: {matchLabels: {app: vllm, tier: gpu}}, targetPorts: [{number: 8001}, {number: 8002}], endpointPickerRef: {name: epp, port: {number: 9002}}}",
			selector: "app=vllm,tier=gpu", port: 8001,
		},
		{
			name: "draft: flat selector, targetPortNumber",
			yaml: "spec: {selector: {app: vllm}, targetPortNumber: 8000, extensionRef: {name: epp}}",
			err:  "spec.selector.matchLabels missing",
		},
		{name: "no target ports", yaml: "spec: {selector: {matchLabels: {app: vllm}}}", err: "spec.targetPorts missing"},
		{name: "port out of range", yaml: "spec: {selector: {matchLabels: {app: vllm}}, targetPorts: [{number: 70000}]}", err: "spec.targetPorts[0].number"},
	} {
		t.Run(c.name, func(t *testing.T) {
			j, err := yaml.YAMLToJSON([]byte(c.yaml))
			if err != nil {
				t.Fatal(err)
			}
			// As the dynamic client decodes it: integers stay int64.
			var u unstructured.Unstructured
			if err := u.UnmarshalJSON(append(j[:len(j)-1], []byte(`,"apiVersion":"inference.networking.k8s.io/v1","kind":"InferencePool"}`)...)); err != nil {
				t.Fatal(err)
			}
			got, err := readPool(&u)
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("err %v, want one with %q", err, c.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got.selector.String() != c.selector || got.port != c.port {
				t.Errorf("got selector %q port %d, want %q %d", got.selector, got.port, c.selector, c.port)
			}
		})
	}
}
