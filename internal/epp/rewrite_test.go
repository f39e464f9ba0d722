package epp

import (
	"encoding/json"
	"log/slog"
	"math/rand/v2"
	"strings"
	"testing"
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
