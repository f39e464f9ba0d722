package epp

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"

	"github.com/prefixlb/prefixlb/internal/discovery"
)

func objective(name, pool string, spec map[string]any) *unstructured.Unstructured {
	if pool != "" {
		spec["poolRef"] = map[string]any{"name": pool}
	}
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": discovery.InferenceObjectiveGVR.GroupVersion().String(), "kind": "InferenceObjective",
		"metadata": map[string]any{"name": name, "namespace": "ns"},
		"spec":     spec,
	}}
}

// TestObjectivesFromObjects: priority, the older integer criticality,
// unset as 0; other pools' objectives left out; invalid ones reported.
func TestObjectivesFromObjects(t *testing.T) {
	objs := []*unstructured.Unstructured{
		objective("chat", "qwen", map[string]any{"priority": int64(10)}),
		objective("batch", "qwen", map[string]any{"priority": int64(-5)}),
		objective("old", "qwen", map[string]any{"criticality": int64(3)}),
		objective("plain", "qwen", map[string]any{}),
		objective("elsewhere", "llama", map[string]any{"priority": int64(99)}),
		objective("enum", "qwen", map[string]any{"criticality": "Critical"}),
		objective("nopool", "", map[string]any{"priority": int64(1)}),
	}
	prio, errs := ObjectivesFromObjects(objectsJSON(objs, slog.New(slog.DiscardHandler)), "qwen")
	want := map[string]int{"chat": 10, "batch": -5, "old": 3, "plain": 0}
	if len(prio) != len(want) {
		t.Errorf("got %v, want %v", prio, want)
	}
	for k, v := range want {
		if got, ok := prio[k]; !ok || got != v {
			t.Errorf("%s: %d (%v), want %d", k, got, ok, v)
		}
	}
	if len(errs) != 2 || !strings.Contains(errs[0].Error()+errs[1].Error(), "enum") || !strings.Contains(errs[0].Error()+errs[1].Error(), "poolRef") {
		t.Errorf("errs %v, want the enum criticality and the missing poolRef", errs)
	}
}

// TestWatchObjectives: --watch-objectives follows the cluster: a new
// objective's priority applies, a changed one changes, and the watched
// ones override --objective-priority's while the flag's others stay.
func TestWatchObjectives(t *testing.T) {
	gvr := discovery.InferenceObjectiveGVR
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{gvr: "InferenceObjectiveList"},
		objective("chat", "qwen", map[string]any{"priority": int64(10)}))
	p := newTestPicker(t, Config{Objectives: map[string]int{"chat": 1, "flagonly": 7}}, 2)
	w, err := watchObjectives(dyn, "ns", "qwen", p, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	await := func(what, name string, want int) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for {
			if got, ok := p.objectives.priority(name); ok && got == want {
				return
			}
			if time.Now().After(deadline) {
				got, ok := p.objectives.priority(name)
				t.Fatalf("%s: %s's priority %d (%v), want %d", what, name, got, ok, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	<-w.Synced()
	await("first list", "chat", 10)
	await("the flag's own", "flagonly", 7)
	res := dyn.Resource(gvr).Namespace("ns")
	if _, err := res.Create(ctx, objective("batch", "qwen", map[string]any{"priority": int64(-3)}), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	await("created", "batch", -3)
	if _, err := res.Update(ctx, objective("chat", "qwen", map[string]any{"priority": int64(20)}), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	await("updated", "chat", 20)
	if err := res.Delete(ctx, "chat", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	await("deleted: back to the flag's", "chat", 1)
}
