package discovery

import (
	"context"
	"fmt"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
)

// Informers are built here over the dynamic client rather than taken from
// client-go's informer factories: the typed clientset and the all-groups
// factory (k8s.io/client-go/informers, which dynamicinformer also imports)
// would link every API group's client, informer and lister into the binary
// to watch three resources (docs/kubernetes.md, "Build graph").

// newInformer is a shared informer of gvr's objects in namespace ns that
// match the label selector ("": all), listed and watched through dyn. With
// a non-nil typed, the informer's store holds typed objects: each
// unstructured object is converted once, as it arrives, into typed().
func newInformer(dyn dynamic.Interface, gvr schema.GroupVersionResource, ns, selector string, resync time.Duration,
	typed func() runtime.Object) cache.SharedIndexInformer {
	ri := dyn.Resource(gvr).Namespace(ns)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = selector
			return ri.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = selector
			return ri.Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformerWithOptions(cache.ToListWatcherWithWatchListSemantics(lw, dyn), &unstructured.Unstructured{},
		cache.SharedIndexInformerOptions{
			ResyncPeriod:      resync,
			Indexers:          cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc},
			ObjectDescription: gvr.String(),
		})
	if typed != nil {
		// The informer has not started, so SetTransform cannot fail.
		_ = inf.SetTransform(toTyped(gvr, typed))
	}
	return inf
}

// toTyped converts an unstructured object into typed() with the default
// converter. Objects already converted (the delta FIFO may pass one twice)
// are returned as they are.
func toTyped(gvr schema.GroupVersionResource, typed func() runtime.Object) cache.TransformFunc {
	return func(obj any) (any, error) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return obj, nil
		}
		out := typed()
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, out); err != nil {
			return nil, fmt.Errorf("discovery: convert %s %s/%s: %w", gvr.Resource, u.GetNamespace(), u.GetName(), err)
		}
		return out, nil
	}
}

// runInformers runs infs until ctx ends, with handler on each, and waits
// for their first lists. It returns ok false if ctx ended first, and a stop
// function that waits for the informers' goroutines to exit after ctx ends.
func runInformers(ctx context.Context, handler cache.ResourceEventHandler, infs ...cache.SharedIndexInformer) (stop func(), ok bool, err error) {
	for _, inf := range infs {
		if _, err := inf.AddEventHandler(handler); err != nil {
			return func() {}, false, err
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	synced := make([]cache.InformerSynced, len(infs))
	for i, inf := range infs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			inf.RunWithContext(ctx)
		}()
		synced[i] = inf.HasSynced
	}
	stop = func() {
		cancel()
		wg.Wait()
	}
	return stop, cache.WaitForCacheSync(ctx.Done(), synced...), nil
}

// listTyped returns the objects of type T in inf's store in namespace ns.
func listTyped[T any](inf cache.SharedIndexInformer, ns string) ([]T, error) {
	objs, err := inf.GetIndexer().ByIndex(cache.NamespaceIndex, ns)
	if err != nil {
		return nil, err
	}
	out := make([]T, 0, len(objs))
	for _, o := range objs {
		if t, ok := o.(T); ok {
			out = append(out, t)
		}
	}
	return out, nil
}
