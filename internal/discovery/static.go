package discovery

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// Static is a fixed list of replicas ("ip:port,ip:port", --backend), each
// ready, with its metrics page and KV-event sockets placed by ports as a
// pod's are. It is a watcher that registers them once.
type Static struct {
	replicas []Replica
	reg      Registry
	synced   chan struct{}
}

// NewStatic parses list. Metrics -1 in ports leaves the replicas
// unscraped.
func NewStatic(list string, ports Ports, reg Registry) (*Static, error) {
	if reg == nil {
		return nil, fmt.Errorf("discovery: static: a registry is required")
	}
	if ports.MetricsPath == "" {
		ports.MetricsPath = "/metrics"
	}
	s := &Static{reg: reg, synced: make(chan struct{})}
	for _, b := range strings.Split(list, ",") {
		b = strings.TrimSpace(b)
		host, port, err := net.SplitHostPort(b)
		if err != nil {
			return nil, fmt.Errorf("discovery: backend %q: want ip:port: %w", b, err)
		}
		n, err := strconv.Atoi(port)
		if err != nil || n <= 0 || n > 65535 {
			return nil, fmt.Errorf("discovery: backend %q: port %q is not a port number", b, port)
		}
		s.replicas = append(s.replicas, replicaAt(b, host, n, ports, nil, true))
	}
	return s, nil
}

// Replicas returns the parsed replicas.
func (s *Static) Replicas() []Replica { return s.replicas }

// Synced is closed once the replicas are registered.
func (s *Static) Synced() <-chan struct{} { return s.synced }

// Run registers the replicas and waits for ctx to end.
func (s *Static) Run(ctx context.Context) error {
	for _, r := range s.replicas {
		s.reg.Add(r)
	}
	close(s.synced)
	<-ctx.Done()
	return nil
}
