package deploytest

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	kjson "k8s.io/apimachinery/pkg/runtime/serializer/json"
	"k8s.io/client-go/kubernetes/scheme"
)

// repoRoot is the repository, from this package's directory.
const repoRoot = "../.."

// crds are the vendored CRDs, compiled once for every test.
var crds = sync.OnceValues(func() (map[schema.GroupVersionKind]*crdVersion, error) {
	return loadCRDs(filepath.Join("testdata", "crds"))
})

var (
	inferencePool = schema.GroupVersionKind{Group: "inference.networking.k8s.io", Version: "v1", Kind: "InferencePool"}
	httpRoute     = schema.GroupVersionKind{Group: "gateway.networking.k8s.io", Version: "v1", Kind: "HTTPRoute"}
)

// notVendored are custom kinds deploy/ uses whose CRD is not in testdata,
// with why; their references are still checked (checkReferences). Any
// other kind that is neither built in nor vendored fails the test.
var notVendored = map[schema.GroupVersionKind]string{
	httpRoute: "Gateway API's HTTPRoute CRD (about 330 KB, with its experimental fields) is not vendored",
}

// strict decodes built-in kinds into their Go types, rejecting unknown and
// duplicate fields as a strict create does.
var strict = kjson.NewSerializerWithOptions(kjson.DefaultMetaFactory, scheme.Scheme, scheme.Scheme,
	kjson.SerializerOptions{Yaml: false, Strict: true})

// validate checks every document and the references between them, and
// returns one line per problem.
func validate(t *testing.T, docs []document) []string {
	t.Helper()
	byKind, err := crds()
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var problems []string
	for _, d := range docs {
		gvk := d.gvk()
		switch {
		case gvk.Kind == "" || gvk.Version == "":
			problems = append(problems, fmt.Sprintf("%s: apiVersion and kind are required", d.source))
		case byKind[gvk] != nil:
			for _, e := range byKind[gvk].check(ctx, d.obj) {
				problems = append(problems, fmt.Sprintf("%s %s/%s: %s", d.source, gvk.Kind, d.name(), e))
			}
		case scheme.Scheme.Recognizes(gvk):
			if _, _, err := strict.Decode(d.json, nil, nil); err != nil {
				problems = append(problems, fmt.Sprintf("%s %s/%s: %v", d.source, gvk.Kind, d.name(), err))
			}
			for _, e := range metadataErrors(d.obj) {
				problems = append(problems, fmt.Sprintf("%s %s: %s", d.source, gvk.Kind, e))
			}
		case notVendored[gvk] != "":
			t.Logf("%s %s/%s: schema not checked: %s", d.source, gvk.Kind, d.name(), notVendored[gvk])
		default:
			problems = append(problems, fmt.Sprintf("%s: no schema for %s: vendor its CRD into testdata/crds", d.source, gvk))
		}
	}
	return append(problems, checkReferences(docs)...)
}

// discoveryArg is the picker's --discovery flag naming its InferencePool.
var discoveryArg = regexp.MustCompile(`^--discovery=inferencepool:[^/]*/(.+)$`)

// checkReferences: each InferencePool's endpoint picker is a Service of the
// set with that port (the CRD's rule makes the port required for a Service,
// but only the set can say it is the right one); each HTTPRoute backend of
// kind InferencePool is a pool of the set; each picker's --discovery names
// a pool of the set.
func checkReferences(docs []document) []string {
	pools := map[string]bool{}
	servicePorts := map[string][]int64{}
	for _, d := range docs {
		switch d.gvk() {
		case inferencePool:
			pools[d.name()] = true
		case schema.GroupVersionKind{Version: "v1", Kind: "Service"}:
			for _, p := range list(d.obj, "spec", "ports") {
				if n, ok := p.(map[string]any)["port"].(int64); ok {
					servicePorts[d.name()] = append(servicePorts[d.name()], n)
				}
			}
		}
	}
	var problems []string
	for _, d := range docs {
		switch d.gvk() {
		case inferencePool:
			ref, _ := get(d.obj, "spec", "endpointPickerRef").(map[string]any)
			if ref == nil {
				continue
			}
			if kind, _ := ref["kind"].(string); kind != "" && kind != "Service" {
				continue
			}
			name, _ := ref["name"].(string)
			port, _ := get(ref, "port", "number").(int64)
			if !slices.Contains(servicePorts[name], port) {
				problems = append(problems, fmt.Sprintf("%s InferencePool/%s: endpointPickerRef %s port %d: no such Service port in the set (have %v)",
					d.source, d.name(), name, port, servicePorts[name]))
			}
		case httpRoute:
			for _, r := range list(d.obj, "spec", "rules") {
				for _, b := range list(r.(map[string]any), "backendRefs") {
					b := b.(map[string]any)
					if b["kind"] == "InferencePool" && !pools[fmt.Sprint(b["name"])] {
						problems = append(problems, fmt.Sprintf("%s HTTPRoute/%s: backendRef InferencePool %v is not in the set", d.source, d.name(), b["name"]))
					}
				}
			}
		case schema.GroupVersionKind{Group: "apps", Version: "v1", Kind: "Deployment"}:
			for _, c := range list(d.obj, "spec", "template", "spec", "containers") {
				for _, a := range list(c.(map[string]any), "args") {
					if m := discoveryArg.FindStringSubmatch(fmt.Sprint(a)); m != nil && !pools[m[1]] {
						problems = append(problems, fmt.Sprintf("%s Deployment/%s: %s: no InferencePool %s in the set", d.source, d.name(), a, m[1]))
					}
				}
			}
		}
	}
	return problems
}

// get is the value at path in obj, nil if any step is missing.
func get(obj map[string]any, path ...string) any {
	var v any = obj
	for _, k := range path {
		m, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = m[k]
	}
	return v
}

// list is the list at path in obj, nil if there is none.
func list(obj map[string]any, path ...string) []any {
	l, _ := get(obj, path...).([]any)
	return l
}

// readFiles reads the documents of every file, in order.
func readFiles(t *testing.T, paths ...string) []document {
	t.Helper()
	var docs []document
	for _, p := range paths {
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		d, err := readDocuments(filepath.ToSlash(strings.TrimPrefix(p, repoRoot+"/")), f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, d...)
	}
	return docs
}

// TestManifests validates deploy/*.yaml, applied together as
// docs/kubernetes.md says.
func TestManifests(t *testing.T) {
	paths, err := filepath.Glob(filepath.Join(repoRoot, "deploy", "*.yaml"))
	if err != nil || len(paths) == 0 {
		t.Fatalf("no manifests in deploy/ (%v)", err)
	}
	docs := readFiles(t, paths...)
	if !slices.ContainsFunc(docs, func(d document) bool { return d.gvk() == inferencePool }) {
		t.Fatal("deploy/ has no InferencePool: nothing was checked against the CRD")
	}
	for _, p := range validate(t, docs) {
		t.Error(p)
	}
}

// TestHelmChart renders the chart with its defaults and with the optional
// parts turned around, and validates each rendering. It needs helm on PATH
// (.ci/run installs it).
func TestHelmChart(t *testing.T) {
	helm, err := exec.LookPath("helm")
	if err != nil {
		t.Skip("helm is not on PATH: the chart is not rendered (install it: go install helm.sh/helm/v3/cmd/helm@v3.16.4)")
	}
	chart := filepath.Join(repoRoot, "deploy", "helm", "prefixlb-epp")
	for _, c := range []struct {
		name string
		set  []string
	}{
		{"defaults", nil},
		{"own redis, no route, no KV events, tokenizer", []string{
			"redis.url=redis://state:6379/1", "route.enabled=false", "picker.kvEventsPort=0", "picker.tokenizer=qwen3",
			"picker.watchModelRewrites=true", "picker.watchObjectives=true",
		}},
		{"FailOpen, one picker, no shared state", []string{
			"pool.failureMode=FailOpen", "replicas=1", "redis.enabled=false", "picker.grpcPort=9100", "pool.name=llama-pool",
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			args := []string{"template", "prefixlb-epp", chart, "--namespace", "llm"}
			for _, s := range c.set {
				args = append(args, "--set", s)
			}
			var stdout, stderr bytes.Buffer
			cmd := exec.Command(helm, args...)
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
			}
			docs, err := readDocuments("helm template ("+c.name+")", &stdout)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.ContainsFunc(docs, func(d document) bool { return d.gvk() == inferencePool }) {
				t.Fatal("the chart rendered no InferencePool")
			}
			for _, p := range validate(t, docs) {
				t.Error(p)
			}
		})
	}
}
