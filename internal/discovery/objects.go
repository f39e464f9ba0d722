package discovery

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

// InferenceModelRewriteGVR is the Gateway API Inference Extension's
// InferenceModelRewrite (inference.networking.x-k8s.io/v1alpha2; the types
// in kubernetes-sigs/gateway-api-inference-extension
// apix/v1alpha2/inferencemodelrewrite_types.go): model aliases, fallbacks
// and weighted splits for the requests to one InferencePool. GIE's endpoint
// picker reconciles them from the cluster; epp --watch-model-rewrites does
// the same.
var InferenceModelRewriteGVR = schema.GroupVersionResource{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: "inferencemodelrewrites"}

// InferenceObjectiveGVR is the Gateway API Inference Extension's
// InferenceObjective (inference.networking.x-k8s.io/v1alpha2,
// apix/v1alpha2/inferenceobjective_types.go): the priority at which the
// requests naming it (x-gateway-inference-objective) are queued. epp
// --watch-objectives follows them.
var InferenceObjectiveGVR = schema.GroupVersionResource{Group: "inference.networking.x-k8s.io", Version: "v1alpha2", Resource: "inferenceobjectives"}

// ObjectWatcher follows every object of one resource in one namespace and
// hands the whole current list to Apply after each change (and once after
// the first full list). It reads objects as unstructured data, so it needs
// no generated client for a CRD.
type ObjectWatcher struct {
	dyn    dynamic.Interface
	gvr    schema.GroupVersionResource
	ns     string
	resync time.Duration
	apply  func([]*unstructured.Unstructured)
	log    *slog.Logger
	synced chan struct{}
}

// NewObjectWatcher returns a watcher of gvr's objects in namespace; Run
// starts it. apply is called from Run's goroutine only, with the objects
// sorted by name; resync ≤ 0 means no periodic resync; a nil log discards.
func NewObjectWatcher(dyn dynamic.Interface, gvr schema.GroupVersionResource, namespace string, resync time.Duration,
	apply func([]*unstructured.Unstructured), log *slog.Logger) (*ObjectWatcher, error) {
	if dyn == nil || apply == nil {
		return nil, fmt.Errorf("discovery: watch %s: a client and an apply function are required", gvr.Resource)
	}
	if namespace == "" {
		return nil, fmt.Errorf("discovery: watch %s: a namespace is required", gvr.Resource)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &ObjectWatcher{dyn: dyn, gvr: gvr, ns: namespace, resync: max(resync, 0), apply: apply, log: log, synced: make(chan struct{})}, nil
}

// Synced is closed once the first full list has been applied.
func (w *ObjectWatcher) Synced() <-chan struct{} { return w.synced }

// Run follows the objects until ctx ends.
func (w *ObjectWatcher) Run(ctx context.Context) error {
	kick := make(chan struct{}, 1)
	inf := newInformer(w.dyn, w.gvr, w.ns, "", w.resync, nil)
	stop, ok, err := runInformers(ctx, kicker(kick), inf)
	defer stop()
	if err != nil {
		return fmt.Errorf("discovery: watch %s in %s: %w", w.gvr.Resource, w.ns, err)
	}
	if !ok {
		return nil // ctx ended
	}
	reconcile := func() {
		objs, err := listTyped[*unstructured.Unstructured](inf, w.ns)
		if err != nil {
			w.log.Warn("discovery: watch", "resource", w.gvr.Resource, "namespace", w.ns, "err", err)
			return
		}
		slices.SortFunc(objs, func(a, b *unstructured.Unstructured) int { return strings.Compare(a.GetName(), b.GetName()) })
		w.apply(objs)
	}
	return follow(ctx, kick, reconcile, w.synced)
}

// DynamicClient is a dynamic client for kubeconfig's cluster, else
// $KUBECONFIG's, else the in-cluster one.
func DynamicClient(kubeconfig string) (dynamic.Interface, error) {
	rc, err := kubeConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("discovery: kubernetes config: %w", err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("discovery: kubernetes dynamic client: %w", err)
	}
	return dyn, nil
}
