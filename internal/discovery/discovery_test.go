package discovery

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	dynamicfake "k8s.io/client-go/dynamic/fake"
)

// registry records what it is told and signals every change.
type registry struct {
	reps    chan map[string]Replica // the state after each call
	cur     map[string]Replica
	removed []string
}

func newRegistry() *registry {
	return &registry{reps: make(chan map[string]Replica, 100), cur: map[string]Replica{}}
}

func (r *registry) Add(x Replica) { r.cur[x.Name] = x; r.reps <- maps.Clone(r.cur) }
func (r *registry) Remove(name string) {
	delete(r.cur, name)
	r.removed = append(r.removed, name)
	r.reps <- maps.Clone(r.cur)
}
func (r *registry) SetReady(name string, ready bool) {
	x := r.cur[name]
	x.Ready = ready
	r.cur[name] = x
	r.reps <- maps.Clone(r.cur)
}

// await waits for the registry to reach a state where check passes.
func (r *registry) await(t *testing.T, what string, check func(map[string]Replica) bool) {
	t.Helper()
	timeout := time.After(10 * time.Second)
	for {
		select {
		case s := <-r.reps:
			if check(s) {
				return
			}
		case <-timeout:
			t.Fatalf("timed out waiting for %s; registry has %v", what, r.snapshotUnsafe())
		}
	}
}

func (r *registry) snapshotUnsafe() map[string]Replica { return r.cur }

// readyNames returns name → ready.
func readyNames(s map[string]Replica) map[string]bool {
	out := map[string]bool{}
	for n, r := range s {
		out[n] = r.Ready
	}
	return out
}

func is(want map[string]bool) func(map[string]Replica) bool {
	return func(s map[string]Replica) bool { return maps.Equal(readyNames(s), want) }
}

func ptr[T any](v T) *T { return &v }

func slice(name string, eps ...discoveryv1.Endpoint) *discoveryv1.EndpointSlice {
	return &discoveryv1.EndpointSlice{
		ObjectMeta:  metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: map[string]string{discoveryv1.LabelServiceName: "vllm"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Ports: []discoveryv1.EndpointPort{
			{Name: ptr("http"), Port: ptr(int32(8000))},
			{Name: ptr(PortNameKVEvents), Port: ptr(int32(5557))},
		},
		Endpoints: eps,
	}
}

func endpoint(pod, ip string, ready bool) discoveryv1.Endpoint {
	return discoveryv1.Endpoint{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: ptr(ready)},
		TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: pod}}
}

// scheme knows the typed objects the tests build, so that the dynamic fake
// can store them as unstructured data.
func scheme(t *testing.T) *runtime.Scheme {
	t.Helper()
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if err := discoveryv1.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	return s
}

// typedObjects writes typed objects through a dynamic client, as the typed
// clientset's namespaced interfaces would.
type typedObjects struct{ ri dynamic.ResourceInterface }

func objectsOf(dyn dynamic.Interface, gvr schema.GroupVersionResource, ns string) typedObjects {
	return typedObjects{dyn.Resource(gvr).Namespace(ns)}
}

func toUnstructured(obj runtime.Object) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(obj)
	if err != nil {
		return nil, err
	}
	return &unstructured.Unstructured{Object: m}, nil
}

func (o typedObjects) Create(ctx context.Context, obj runtime.Object, opts metav1.CreateOptions) (*unstructured.Unstructured, error) {
	u, err := toUnstructured(obj)
	if err != nil {
		return nil, err
	}
	return o.ri.Create(ctx, u, opts)
}

func (o typedObjects) Update(ctx context.Context, obj runtime.Object, opts metav1.UpdateOptions) (*unstructured.Unstructured, error) {
	u, err := toUnstructured(obj)
	if err != nil {
		return nil, err
	}
	return o.ri.Update(ctx, u, opts)
}

func (o typedObjects) UpdateStatus(ctx context.Context, obj runtime.Object, opts metav1.UpdateOptions) (*unstructured.Unstructured, error) {
	u, err := toUnstructured(obj)
	if err != nil {
		return nil, err
	}
	return o.ri.UpdateStatus(ctx, u, opts)
}

func (o typedObjects) Delete(ctx context.Context, name string, opts metav1.DeleteOptions) error {
	return o.ri.Delete(ctx, name, opts)
}

func start(t *testing.T, run func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	})
}

var quiet = slog.New(slog.DiscardHandler)

func TestServiceWatcher(t *testing.T) {
	ctx := context.Background()
	cs := dynamicfake.NewSimpleDynamicClient(scheme(t), slice("vllm-a", endpoint("p0", "10.0.0.1", true), endpoint("p1", "10.0.0.2", false)))
	reg := newRegistry()
	w, err := NewServiceWatcher(cs, Config{Namespace: "ns", Name: "vllm", Registry: reg, Logger: quiet,
		Ports: Ports{KVTopic: "kv@{ip}:{port}@m"}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, w.Run)
	reg.await(t, "p0 ready, p1 not", is(map[string]bool{"p0": true, "p1": false}))
	<-w.Synced()
	got := reg.cur["p0"]
	want := Replica{Name: "p0", Address: "10.0.0.1:8000", MetricsURL: "http://10.0.0.1:8000/metrics",
		KVEvents: "tcp://10.0.0.1:5557", KVReplay: "tcp://10.0.0.1:5558", KVTopic: "kv@10.0.0.1:8000@m", Ready: true}
	if got != want {
		t.Errorf("p0 = %+v\nwant %+v", got, want)
	}

	slices := objectsOf(cs, endpointSliceGVR, "ns")
	// p1 turns ready, p2 appears in a second slice.
	if _, err := slices.Update(ctx, slice("vllm-a", endpoint("p0", "10.0.0.1", true), endpoint("p1", "10.0.0.2", true)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "p1 ready", is(map[string]bool{"p0": true, "p1": true}))
	if _, err := slices.Create(ctx, slice("vllm-b", endpoint("p2", "10.0.0.3", true)), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "p2 added", is(map[string]bool{"p0": true, "p1": true, "p2": true}))
	// p0 terminates: unready; then it leaves.
	term := endpoint("p0", "10.0.0.1", true)
	term.Conditions.Terminating = ptr(true)
	if _, err := slices.Update(ctx, slice("vllm-a", term, endpoint("p1", "10.0.0.2", true)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "p0 terminating", is(map[string]bool{"p0": false, "p1": true, "p2": true}))
	if _, err := slices.Update(ctx, slice("vllm-a", endpoint("p1", "10.0.0.2", true)), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "p0 removed", is(map[string]bool{"p1": true, "p2": true}))
	// A slice of another Service changes nothing; deleting ours removes its pods.
	other := slice("other", endpoint("x", "10.1.0.1", true))
	other.Labels[discoveryv1.LabelServiceName] = "other"
	if _, err := slices.Create(ctx, other, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := slices.Delete(ctx, "vllm-b", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "p2 removed", is(map[string]bool{"p1": true}))
	if fmt.Sprint(reg.removed) != "[p0 p2]" {
		t.Errorf("removed %v, want [p0 p2]", reg.removed)
	}
}

func pool(labels map[string]any, port int64) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "pool", "namespace": "ns"},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": labels},
			"targetPorts":       []any{map[string]any{"number": port}},
			"endpointPickerRef": map[string]any{"name": "prefixlb-epp", "port": map[string]any{"number": int64(9002)}},
		},
	}}
}

func pod(name, ip string, ready bool, labels, ann map[string]string) *corev1.Pod {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", Labels: labels, Annotations: ann},
		Status:     corev1.PodStatus{PodIP: ip, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

func TestPoolWatcher(t *testing.T) {
	ctx := context.Background()
	app := map[string]string{"app": "vllm"}
	ann := map[string]string{AnnotationKVEventsPort: "5557", AnnotationKVTopic: "kv@{ip}:{port}@llama"}
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(scheme(t),
		map[schema.GroupVersionResource]string{InferencePoolGVR: "InferencePoolList"}, pool(map[string]any{"app": "vllm"}, 8000),
		pod("v0", "10.0.0.1", true, app, ann),
		pod("v1", "10.0.0.2", false, map[string]string{"app": "vllm", LabelRole: "prefill"}, nil),
		pod("other", "10.0.0.9", true, map[string]string{"app": "web"}, nil),
		pod("pending", "", false, app, nil),
	)
	reg := newRegistry()
	w, err := NewPoolWatcher(dyn, Config{Namespace: "ns", Name: "pool", Registry: reg, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	start(t, w.Run)
	reg.await(t, "v0 ready, v1 not", is(map[string]bool{"v0": true, "v1": false}))
	if got := reg.cur["v0"]; got.KVEvents != "tcp://10.0.0.1:5557" || got.KVTopic != "kv@10.0.0.1:8000@llama" || got.Address != "10.0.0.1:8000" {
		t.Errorf("v0 = %+v: want the annotations' KV events and topic", got)
	}
	if got := reg.cur["v1"]; got.KVEvents != "" || got.Role != "prefill" {
		t.Errorf("v1 = %+v: want no KV events (no annotation, no flag), role prefill (llm-d's label)", got)
	}
	if got := reg.cur["v0"].Role; got != "" {
		t.Errorf("v0's role %q, want both (no label)", got)
	}

	pods := objectsOf(dyn, podGVR, "ns")
	if _, err := pods.UpdateStatus(ctx, pod("v1", "10.0.0.2", true, app, nil), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "v1 ready", is(map[string]bool{"v0": true, "v1": true}))
	if _, err := pods.Create(ctx, pod("v2", "10.0.0.3", true, app, nil), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "v2 added", is(map[string]bool{"v0": true, "v1": true, "v2": true}))
	if _, err := pods.UpdateStatus(ctx, pod("v0", "10.0.0.1", false, app, ann), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "v0 unready", is(map[string]bool{"v0": false, "v1": true, "v2": true}))
	if err := pods.Delete(ctx, "v1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "v1 removed", is(map[string]bool{"v0": false, "v2": true}))

	// The pool's selector changes: other pods are selected instead.
	if _, err := dyn.Resource(InferencePoolGVR).Namespace("ns").Update(ctx, pool(map[string]any{"app": "web"}, 9000), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "selector moved", is(map[string]bool{"other": true}))
	if got := reg.cur["other"].Address; got != "10.0.0.9:9000" {
		t.Errorf("other's address %q, want the new target port", got)
	}
	// The pool is deleted: nothing to route to.
	if err := dyn.Resource(InferencePoolGVR).Namespace("ns").Delete(ctx, "pool", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	reg.await(t, "pool gone", is(map[string]bool{}))
}

func TestPodRole(t *testing.T) {
	for label, want := range map[string]string{"prefill": "prefill", "decode": "decode", "both": "", "prefill-decode": "", "": "", "Prefill": ""} {
		if got := podRole(map[string]string{LabelRole: label}); got != want {
			t.Errorf("%s=%q: role %q, want %q", LabelRole, label, got, want)
		}
	}
}

func TestParseTarget(t *testing.T) {
	for _, c := range []struct {
		in             string
		kind, ns, name string
		ok             bool
	}{
		{"service:default/vllm", "service", "default", "vllm", true},
		{"inferencepool:ml/pool", "inferencepool", "ml", "pool", true},
		{"service:vllm", "", "", "", false},
		{"pods:a/b", "", "", "", false},
	} {
		k, ns, n, err := ParseTarget(c.in)
		if (err == nil) != c.ok || k != c.kind || ns != c.ns || n != c.name {
			t.Errorf("ParseTarget(%q) = %q %q %q %v", c.in, k, ns, n, err)
		}
	}
}
