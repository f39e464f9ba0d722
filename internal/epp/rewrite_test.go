package epp

import (
	"context"
	"encoding/json"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"sigs.k8s.io/yaml"

	"github.com/prefixlb/prefixlb/internal/discovery"
)

const rewriteYAML = `
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata:
  name: canary
  creationTimestamp: "2026-11-02T10:00:00Z"
spec:
  poolRef:
    group: inference.networking.k8s.io
    name: qwen
  rules:
    - matches:
        - model: {type: Exact, value: sql}
      targets:
        - {modelRewrite: sql-v1, weight: 1}
        - {modelRewrite: sql-v2, weight: 3}
    - targets:
        - modelRewrite: base
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata:
  name: older-alias
  creationTimestamp: "2026-10-01T10:00:00Z"
spec:
  poolRef: {name: qwen}
  rules:
    - matches:
        - model: {value: sql}
        - model: {value: chat}
      targets:
        - modelRewrite: chat-v7
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata: {name: other-pool}
spec:
  poolRef: {name: llama}
  rules:
    - targets: [{modelRewrite: nope}]
`

// TestModelRewrites: GIE's InferenceModelRewrite semantics — an exact match
// wins over a generic rule, the oldest resource over a newer one, weights
// split traffic in proportion, other pools' rewrites are not read.
func TestModelRewrites(t *testing.T) {
	rs, err := ParseModelRewrites([]byte(rewriteYAML), "qwen")
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 {
		t.Fatalf("%d rewrites for pool qwen, want 2", len(rs))
	}
	w := &rewriter{rng: rand.New(rand.NewPCG(1, 2))}
	w.set(rs)
	// The older resource's exact rule wins for sql and chat.
	for _, m := range []string{"sql", "chat"} {
		if got := w.rewrite(m); got != "chat-v7" {
			t.Errorf("%s → %s, want chat-v7 (the older resource's exact match)", m, got)
		}
	}
	if got := w.rewrite("anything"); got != "base" {
		t.Errorf("generic rule: anything → %s, want base", got)
	}
	if got := w.rewrite(""); got != "base" {
		t.Errorf("no model → %s, want base (the generic rule)", got)
	}
	// Without the older one, the canary's weights split sql 1:3.
	w.set(rs[:1])
	n := map[string]int{}
	for range 4000 {
		n[w.rewrite("sql")]++
	}
	if v2 := float64(n["sql-v2"]) / 4000; v2 < 0.7 || v2 > 0.8 || n["sql-v1"]+n["sql-v2"] != 4000 {
		t.Errorf("split %v: want about 1:3", n)
	}
	for _, tc := range []struct{ doc, want string }{
		{"kind: InferenceModelRewrite\nspec: {rules: [{targets: [{modelRewrite: x}]}]}", "poolRef.name is required"},
		{"kind: InferenceModelRewrite\nspec: {poolRef: {name: p}, rules: [{targets: [{modelRewrite: x, weight: 1}, {modelRewrite: y2}]}]}", "must be set for all"},
		{"kind: InferenceModelRewrite\nspec: {poolRef: {name: p}, rules: [{matches: [{model: {type: Regex, value: x}}], targets: [{modelRewrite: y2}]}]}", "want Exact"},
		{"kind: InferenceModelRewrite\nspec: {poolRef: {name: p}, rules: [{targets: []}]}", "at least one target"},
		{"kind: InferencePool\nspec: {}", "want InferenceModelRewrite"},
		{"kind: [", "document 0"},
	} {
		if _, err := ParseModelRewrites([]byte(tc.doc), ""); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want %q", tc.doc, err, tc.want)
		}
	}
}

// TestServerRewritesModel: the body the gateway forwards carries the
// rewritten model, with its new content-length; the rest is unchanged.
func TestServerRewritesModel(t *testing.T) {
	p := newTestPicker(t, Config{}, 2)
	rs, err := ParseModelRewrites([]byte(rewriteYAML), "qwen")
	if err != nil {
		t.Fatal(err)
	}
	p.SetModelRewrites(rs)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{Logger: slog.New(slog.DiscardHandler)})))
	body := `{"model":"chat","prompt":"hello there","max_tokens":3}`
	e.request("/v1/completions", []byte(body), 8, nil)
	r := e.recv()
	length := ""
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == "content-length" {
			length = string(h.GetHeader().GetRawValue())
		}
	}
	var out []byte
	for {
		sr := e.recv().GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		out = append(out, sr.Body...)
		if sr.EndOfStream {
			break
		}
	}
	var m map[string]any
	if err := json.Unmarshal(out, &m); err != nil {
		t.Fatal(err)
	}
	if m["model"] != "chat-v7" || m["prompt"] != "hello there" || m["max_tokens"] != float64(3) {
		t.Errorf("forwarded body %s", out)
	}
	if length != itoa(len(out)) {
		t.Errorf("content-length %q, body %d bytes", length, len(out))
	}
}

func itoa(n int) string { b, _ := json.Marshal(n); return string(b) }

// TestWatchModelRewrites: --watch-model-rewrites follows the cluster's
// InferenceModelRewrites: those of the pool apply, a deleted one stops
// applying, an invalid one is skipped while the others stay.
func TestWatchModelRewrites(t *testing.T) {
	var objs []runtime.Object
	for _, doc := range strings.Split(rewriteYAML, "\n---") {
		u := &unstructured.Unstructured{}
		js, err := yaml.YAMLToJSON([]byte(doc))
		if err != nil {
			t.Fatal(err)
		}
		if err := u.UnmarshalJSON(js); err != nil {
			t.Fatal(err)
		}
		u.SetNamespace("ns")
		objs = append(objs, u)
	}
	gvr := discovery.InferenceModelRewriteGVR
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{gvr: "InferenceModelRewriteList"}, objs...)
	p := newTestPicker(t, Config{}, 2)
	w, err := watchRewrites(dyn, "ns", "qwen", p, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	await := func(what, model, want string) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for p.rw.rewrite(model) != want {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %s → %s, want %s", what, model, p.rw.rewrite(model), want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	<-w.Synced()
	await("first list", "chat", "chat-v7")
	if got := p.rw.rewrite("anything"); got != "base" {
		t.Errorf("anything → %s, want base (the other pool's rewrite is not read)", got)
	}
	res := dyn.Resource(gvr).Namespace("ns")
	if err := res.Delete(ctx, "older-alias", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	await("older-alias deleted", "chat", "base")
	bad := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": gvr.GroupVersion().String(), "kind": "InferenceModelRewrite",
		"metadata": map[string]any{"name": "bad", "namespace": "ns"},
		"spec":     map[string]any{"poolRef": map[string]any{"name": "qwen"}, "rules": []any{map[string]any{"targets": []any{}}}},
	}}
	if _, err := res.Create(ctx, bad, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	alias := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": gvr.GroupVersion().String(), "kind": "InferenceModelRewrite",
		"metadata": map[string]any{"name": "zz-alias", "namespace": "ns"},
		"spec": map[string]any{"poolRef": map[string]any{"name": "qwen"}, "rules": []any{map[string]any{
			"matches": []any{map[string]any{"model": map[string]any{"value": "chat"}}},
			"targets": []any{map[string]any{"modelRewrite": "chat-v8"}}}}},
	}}
	if _, err := res.Create(ctx, alias, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	await("a new alias beside an invalid one", "chat", "chat-v8")
	if got := p.rw.rewrite("sql"); got != "sql-v1" && got != "sql-v2" {
		t.Errorf("sql → %s, want the canary's split to stay", got)
	}
}
