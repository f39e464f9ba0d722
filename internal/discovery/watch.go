package discovery

import (
	"context"
	"fmt"
	"os"

	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Watcher feeds a Registry until its context ends.
type Watcher interface {
	// Run watches until ctx ends.
	Run(ctx context.Context) error
	// Synced is closed once the first full list has been registered.
	Synced() <-chan struct{}
}

var (
	_ Watcher = (*Static)(nil)
	_ Watcher = (*ServiceWatcher)(nil)
	_ Watcher = (*PoolWatcher)(nil)
)

// NewWatcher watches target ("service:NS/NAME" or "inferencepool:NS/NAME")
// through the Kubernetes API: kubeconfig's cluster, else $KUBECONFIG's,
// else the in-cluster config. cfg's Namespace and Name are set from target.
func NewWatcher(target, kubeconfig string, cfg Config) (Watcher, error) {
	kind, ns, name, err := ParseTarget(target)
	if err != nil {
		return nil, err
	}
	cfg.Namespace, cfg.Name = ns, name
	rc, err := kubeConfig(kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("discovery: kubernetes config: %w", err)
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("discovery: kubernetes dynamic client: %w", err)
	}
	if kind == "service" {
		return NewServiceWatcher(dyn, cfg)
	}
	return NewPoolWatcher(dyn, cfg)
}

// kubeConfig is path's config, else $KUBECONFIG's, else the in-cluster one.
func kubeConfig(path string) (*rest.Config, error) {
	if path == "" {
		path = os.Getenv("KUBECONFIG")
	}
	if path == "" {
		return rest.InClusterConfig()
	}
	return clientcmd.BuildConfigFromFlags("", path)
}
