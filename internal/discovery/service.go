package discovery

import (
	"context"
	"fmt"

	discoveryv1 "k8s.io/api/discovery/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
)

// ServiceWatcher follows the EndpointSlices of one Service: every endpoint
// with an address is a replica, ready as its ready condition says (absent:
// ready, as Kubernetes defines it).
type ServiceWatcher struct {
	cfg    Config
	dyn    dynamic.Interface
	synced chan struct{}
}

// endpointSliceGVR is discovery.k8s.io/v1's EndpointSlices, read through
// the dynamic client and converted to discoveryv1.EndpointSlice.
var endpointSliceGVR = discoveryv1.SchemeGroupVersion.WithResource("endpointslices")

// NewServiceWatcher returns a watcher that reads EndpointSlices through
// dyn; Run starts it.
func NewServiceWatcher(dyn dynamic.Interface, cfg Config) (*ServiceWatcher, error) {
	cfg.defaults()
	if err := cfg.validate("service"); err != nil {
		return nil, err
	}
	if dyn == nil {
		return nil, fmt.Errorf("discovery: service: a client is required")
	}
	return &ServiceWatcher{cfg: cfg, dyn: dyn, synced: make(chan struct{})}, nil
}

// Synced is closed once the first full list has been applied.
func (w *ServiceWatcher) Synced() <-chan struct{} { return w.synced }

// Run follows the Service's EndpointSlices until ctx ends.
func (w *ServiceWatcher) Run(ctx context.Context) error {
	sl := labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: w.cfg.Name})
	inf := newInformer(w.dyn, endpointSliceGVR, w.cfg.Namespace, sl.String(), w.cfg.Resync,
		func() runtime.Object { return new(discoveryv1.EndpointSlice) })
	kick := make(chan struct{}, 1)
	stop, ok, err := runInformers(ctx, kicker(kick), inf)
	defer stop()
	if err != nil {
		return fmt.Errorf("discovery: service %s/%s: %w", w.cfg.Namespace, w.cfg.Name, err)
	}
	if !ok {
		return nil // ctx ended
	}
	st := &state{reg: w.cfg.Registry, log: w.cfg.Logger}
	reconcile := func() {
		all, err := listTyped[*discoveryv1.EndpointSlice](inf, w.cfg.Namespace)
		if err != nil {
			w.cfg.Logger.Warn("discovery: list endpointslices", "err", err)
			return
		}
		var slices []*discoveryv1.EndpointSlice
		for _, s := range all {
			if sl.Matches(labels.Set(s.Labels)) {
				slices = append(slices, s)
			}
		}
		st.apply(w.desired(slices))
	}
	return follow(ctx, kick, reconcile, w.synced)
}

// desired builds the replicas from the slices. An endpoint in several
// slices (during a slice update) is ready if any says so.
func (w *ServiceWatcher) desired(slices []*discoveryv1.EndpointSlice) map[string]Replica {
	want := make(map[string]Replica)
	for _, s := range slices {
		if s.AddressType != discoveryv1.AddressTypeIPv4 && s.AddressType != discoveryv1.AddressTypeIPv6 {
			continue
		}
		httpPort, over := w.slicePorts(s)
		if httpPort == 0 {
			continue
		}
		for _, ep := range s.Endpoints {
			if len(ep.Addresses) == 0 {
				continue
			}
			ip := ep.Addresses[0]
			name := ip
			if ep.TargetRef != nil && ep.TargetRef.Name != "" {
				name = ep.TargetRef.Name
			}
			ready := ep.Conditions.Ready == nil || *ep.Conditions.Ready
			if ep.Conditions.Terminating != nil && *ep.Conditions.Terminating {
				ready = false
			}
			r := replicaAt(name, ip, httpPort, w.cfg.Ports, over, ready)
			if old, ok := want[name]; ok && old.Ready {
				r.Ready = true
			}
			want[name] = r
		}
	}
	return want
}

// slicePorts picks the HTTP port and the named overrides of a slice.
func (w *ServiceWatcher) slicePorts(s *discoveryv1.EndpointSlice) (int, map[string]string) {
	over := map[string]string{}
	httpPort, first := 0, 0
	for _, p := range s.Ports {
		if p.Port == nil {
			continue
		}
		name := ""
		if p.Name != nil {
			name = *p.Name
		}
		n := int(*p.Port)
		if first == 0 {
			first = n
		}
		switch name {
		case PortNameMetrics:
			over[AnnotationMetricsPort] = fmt.Sprint(n)
		case PortNameKVEvents:
			over[AnnotationKVEventsPort] = fmt.Sprint(n)
		case PortNameKVReplay:
			over[AnnotationKVReplayPort] = fmt.Sprint(n)
		}
		want := w.cfg.Ports.HTTPName
		if want == "" {
			want = "http"
		}
		if name == want {
			httpPort = n
		}
	}
	if w.cfg.Ports.HTTP != 0 {
		return w.cfg.Ports.HTTP, over
	}
	if httpPort == 0 && w.cfg.Ports.HTTPName == "" {
		httpPort = first
	}
	return httpPort, over
}

// follow reconciles once, closes synced, then reconciles at every kick
// until ctx ends: the loop every watcher runs over its informers.
func follow(ctx context.Context, kick <-chan struct{}, reconcile func(), synced chan struct{}) error {
	reconcile()
	close(synced)
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-kick:
			reconcile()
		}
	}
}

// kicker turns every informer event into a non-blocking signal: the
// reconcile that follows reads the whole state from the lister.
func kicker(kick chan struct{}) cache.ResourceEventHandlerFuncs {
	k := func() {
		select {
		case kick <- struct{}{}:
		default:
		}
	}
	return cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { k() },
		UpdateFunc: func(any, any) { k() },
		DeleteFunc: func(any) { k() },
	}
}
