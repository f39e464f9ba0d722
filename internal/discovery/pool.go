package discovery

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
)

// InferencePoolGVR is the InferencePool resource of the Gateway API
// Inference Extension's released v1 API (inference.networking.k8s.io/v1,
// v1.0 and later; internal/deploytest/testdata/crds holds its CRD). It is
// read as unstructured data: the fields used are spec.selector.matchLabels
// and spec.targetPorts[0].number. The endpoint picker's own reference
// (spec.endpointPickerRef) is the gateway's business, not the picker's.
var InferencePoolGVR = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// PoolWatcher follows one InferencePool and the pods it selects: each pod
// with an IP is a replica, ready when its Ready condition is true and it is
// not terminating. Pod annotations (prefixlb.io/...) override Ports.
type PoolWatcher struct {
	cfg    Config
	dyn    dynamic.Interface
	synced chan struct{}
}

// podGVR is core/v1's Pods, read through the dynamic client and converted
// to corev1.Pod.
var podGVR = corev1.SchemeGroupVersion.WithResource("pods")

// NewPoolWatcher returns a watcher that reads the pool and its pods
// through dyn; Run starts it.
func NewPoolWatcher(dyn dynamic.Interface, cfg Config) (*PoolWatcher, error) {
	cfg.defaults()
	if err := cfg.validate("inferencepool"); err != nil {
		return nil, err
	}
	if dyn == nil {
		return nil, fmt.Errorf("discovery: inferencepool: a client is required")
	}
	return &PoolWatcher{cfg: cfg, dyn: dyn, synced: make(chan struct{})}, nil
}

// Synced is closed once the first full list has been applied.
func (w *PoolWatcher) Synced() <-chan struct{} { return w.synced }

// Run follows the pool and its pods until ctx ends.
func (w *PoolWatcher) Run(ctx context.Context) error {
	kick := make(chan struct{}, 1)
	pools := newInformer(w.dyn, InferencePoolGVR, w.cfg.Namespace, "", w.cfg.Resync, nil)
	pods := newInformer(w.dyn, podGVR, w.cfg.Namespace, "", w.cfg.Resync,
		func() runtime.Object { return new(corev1.Pod) })
	stop, ok, err := runInformers(ctx, kicker(kick), pools, pods)
	defer stop()
	if err != nil {
		return fmt.Errorf("discovery: inferencepool %s/%s: %w", w.cfg.Namespace, w.cfg.Name, err)
	}
	if !ok {
		return nil // ctx ended
	}
	st := &state{reg: w.cfg.Registry, log: w.cfg.Logger}
	reconcile := func() {
		want, err := w.desired(pools.GetIndexer(), func() ([]*corev1.Pod, error) {
			return listTyped[*corev1.Pod](pods, w.cfg.Namespace)
		})
		if err != nil {
			w.cfg.Logger.Warn("discovery: inferencepool", "pool", w.cfg.Namespace+"/"+w.cfg.Name, "err", err)
		}
		st.apply(want)
	}
	return follow(ctx, kick, reconcile, w.synced)
}

// poolSpec is the part of an InferencePool the watcher reads.
type poolSpec struct {
	selector labels.Selector
	port     int
}

// readPool reads the selector and the target port of a v1 InferencePool.
// v1 allows up to 8 target ports, each an endpoint on every pod (a
// data-parallel server's ranks); the replicas here are the pods at the first
// one. A pool in a pre-release draft's shape (a flat spec.selector,
// spec.targetPortNumber) is refused with the v1 field it lacks.
func readPool(u *unstructured.Unstructured) (poolSpec, error) {
	ml, found, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil || !found || len(ml) == 0 {
		return poolSpec{}, fmt.Errorf("spec.selector.matchLabels missing or invalid (inference.networking.k8s.io/v1) (%v)", err)
	}
	ports, found, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil || !found || len(ports) == 0 {
		return poolSpec{}, fmt.Errorf("spec.targetPorts missing or invalid (inference.networking.k8s.io/v1) (%v)", err)
	}
	p0, _ := ports[0].(map[string]any)
	n, found, err := unstructured.NestedInt64(p0, "number")
	if err != nil || !found || n < 1 || n > 65535 {
		return poolSpec{}, fmt.Errorf("spec.targetPorts[0].number missing or invalid (%v)", err)
	}
	return poolSpec{selector: labels.SelectorFromSet(ml), port: int(n)}, nil
}

// desired builds the replicas; a missing or invalid pool has none.
func (w *PoolWatcher) desired(pools cache.Store, pods func() ([]*corev1.Pod, error)) (map[string]Replica, error) {
	want := make(map[string]Replica)
	obj, found, err := pools.GetByKey(w.cfg.Namespace + "/" + w.cfg.Name)
	if err != nil {
		return want, err
	}
	if !found {
		return want, apierrors.NewNotFound(InferencePoolGVR.GroupResource(), w.cfg.Name)
	}
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return want, fmt.Errorf("unexpected object %T", obj)
	}
	spec, err := readPool(u)
	if err != nil {
		return want, err
	}
	if w.cfg.Ports.HTTP != 0 {
		spec.port = w.cfg.Ports.HTTP
	}
	list, err := pods()
	if err != nil {
		return want, err
	}
	for _, p := range list {
		if p.Status.PodIP == "" || !spec.selector.Matches(labels.Set(p.Labels)) {
			continue
		}
		r := replicaAt(p.Name, p.Status.PodIP, spec.port, w.cfg.Ports, p.Annotations, podReady(p))
		r.Role = podRole(p.Labels)
		want[p.Name] = r
	}
	return want, nil
}

// LabelRole is llm-d's pod label of a model server's role in a
// disaggregated pool (llm-d's guides and Helm charts: "prefill", "decode",
// or "both" / "prefill-decode" for an aggregated server).
const LabelRole = "llm-d.ai/role"

// podRole is the cluster role a pod's labels give: prefill or decode by
// llm-d's label, "" (both) otherwise.
func podRole(l map[string]string) string {
	switch l[LabelRole] {
	case "prefill":
		return "prefill"
	case "decode":
		return "decode"
	}
	return ""
}

// podReady: the Ready condition is true and the pod is not terminating.
func podReady(p *corev1.Pod) bool {
	if p.DeletionTimestamp != nil {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}
