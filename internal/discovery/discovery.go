// Package discovery finds the replicas a router fronts: in Kubernetes the
// ready endpoints of a Service (its EndpointSlices) or the pods an
// InferencePool selects, or a static list. Replicas that appear, disappear
// or change readiness are reported to a Registry (a cluster.Pool, under
// epp or serve).
//
// It reads only endpointslices (Service mode), or pods and inferencepools
// (InferencePool mode), with get/list/watch: deploy/ grants nothing more.
package discovery

import (
	"fmt"
	"log/slog"
	"maps"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/prefixlb/prefixlb/internal/cluster"
)

// Replica is one model-server pod: the replica of a cluster.Pool that
// discovery registers (Name the pod's, Address its "ip:port", its metrics
// page and KV-event sockets placed by ports, Ready its readiness).
type Replica = cluster.Replica

// Registry receives the replicas. Calls come from one goroutine at a time.
type Registry interface {
	// Add adds a replica, or replaces the one of the same name.
	Add(r Replica)
	// Remove removes the replica called name.
	Remove(name string)
	// SetReady changes replica name's readiness.
	SetReady(name string, ready bool)
}

// Annotations a pod (InferencePool mode) may carry to override Ports.
const (
	AnnotationHTTPPort     = "prefixlb.io/http-port"
	AnnotationMetricsPort  = "prefixlb.io/metrics-port"
	AnnotationKVEventsPort = "prefixlb.io/kv-events-port"
	AnnotationKVReplayPort = "prefixlb.io/kv-replay-port"
	AnnotationKVTopic      = "prefixlb.io/kv-topic"
)

// Port names an EndpointSlice (Service mode) may carry to override Ports.
const (
	PortNameMetrics  = "metrics"
	PortNameKVEvents = "kv-events"
	PortNameKVReplay = "kv-replay"
)

// Ports says where each replica listens. Zero fields take the defaults
// given; annotations and named ports override them per pod or Service.
type Ports struct {
	// HTTP is the OpenAI API port (0: the InferencePool's targetPort, or
	// the Service's port named HTTPName, else its first port).
	HTTP int
	// HTTPName is the Service port to use in Service mode ("": "http" if
	// there is one, else the first).
	HTTPName string
	// Metrics is the Prometheus port (0: the HTTP port; -1: not scraped).
	Metrics int
	// MetricsPath is the metrics page's path (default "/metrics").
	MetricsPath string
	// KVEvents is the KV-event PUB port (0: no KV events: the picker
	// mirrors the replica's cache from its own decisions).
	KVEvents int
	// KVReplay is the replay port (0: KVEvents + 1, vLLM's convention;
	// -1: none).
	KVReplay int
	// KVTopic is the subscription prefix; "{ip}" and "{port}" are replaced
	// by the pod's IP and HTTP port ("": every topic).
	KVTopic string
}

// Config is what both watchers share.
type Config struct {
	// Namespace and Name name the Service or the InferencePool.
	Namespace, Name string
	// Ports says where replicas listen.
	Ports Ports
	// Registry receives the replicas. Required.
	Registry Registry
	// Resync re-lists everything this often (0: 10 minutes).
	Resync time.Duration
	// Logger (nil: slog.Default()).
	Logger *slog.Logger
}

func (c *Config) defaults() {
	if c.Resync == 0 {
		c.Resync = 10 * time.Minute
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Ports.MetricsPath == "" {
		c.Ports.MetricsPath = "/metrics"
	}
}

func (c *Config) validate(what string) error {
	switch {
	case c.Namespace == "" || c.Name == "":
		return fmt.Errorf("discovery: %s namespace and name are required", what)
	case c.Registry == nil:
		return fmt.Errorf("discovery: %s: a registry is required", what)
	}
	return nil
}

// ParseTarget reads "service:NS/NAME" or "inferencepool:NS/NAME".
func ParseTarget(s string) (kind, ns, name string, err error) {
	kind, rest, ok := strings.Cut(s, ":")
	ns, name, ok2 := strings.Cut(rest, "/")
	if !ok || !ok2 || ns == "" || name == "" || (kind != "service" && kind != "inferencepool") {
		return "", "", "", fmt.Errorf("discovery: target %q: want service:NAMESPACE/NAME or inferencepool:NAMESPACE/NAME", s)
	}
	return kind, ns, name, nil
}

// replicaAt builds the replica at ip from the ports, with per-pod
// overrides (annotations or named ports, by the annotation names).
func replicaAt(name, ip string, httpPort int, p Ports, over map[string]string, ready bool) Replica {
	port := func(key string, def int) int {
		if v, ok := over[key]; ok {
			if n, err := strconv.Atoi(v); err == nil && n > 0 && n < 65536 {
				return n
			}
		}
		return def
	}
	httpPort = port(AnnotationHTTPPort, httpPort)
	r := Replica{Name: name, Address: net.JoinHostPort(ip, strconv.Itoa(httpPort)), Ready: ready}
	metrics := p.Metrics
	if metrics == 0 {
		metrics = httpPort
	}
	if metrics = port(AnnotationMetricsPort, metrics); metrics > 0 {
		r.MetricsURL = "http://" + net.JoinHostPort(ip, strconv.Itoa(metrics)) + p.MetricsPath
	}
	if kv := port(AnnotationKVEventsPort, p.KVEvents); kv > 0 {
		r.KVEvents = "tcp://" + net.JoinHostPort(ip, strconv.Itoa(kv))
		replay := p.KVReplay
		if replay == 0 {
			replay = kv + 1
		}
		if replay = port(AnnotationKVReplayPort, replay); replay > 0 {
			r.KVReplay = "tcp://" + net.JoinHostPort(ip, strconv.Itoa(replay))
		}
		topic := p.KVTopic
		if t, ok := over[AnnotationKVTopic]; ok {
			topic = t
		}
		r.KVTopic = strings.NewReplacer("{ip}", ip, "{port}", strconv.Itoa(httpPort)).Replace(topic)
	}
	return r
}

// state is what the registry was last told, so that a reconcile reports
// only differences.
type state struct {
	reg Registry
	log *slog.Logger
	cur map[string]Replica
}

// apply brings the registry to want.
func (s *state) apply(want map[string]Replica) {
	if s.cur == nil {
		s.cur = make(map[string]Replica)
	}
	for name := range s.cur {
		if _, ok := want[name]; !ok {
			s.reg.Remove(name)
			delete(s.cur, name)
			s.log.Info("discovery: replica gone", "replica", name)
		}
	}
	for name, r := range want {
		old, ok := s.cur[name]
		switch {
		case !ok:
			s.reg.Add(r)
			s.log.Info("discovery: replica found", "replica", name, "address", r.Address, "ready", r.Ready)
		case old.Ready != r.Ready && sameButReady(old, r):
			s.reg.SetReady(name, r.Ready)
		case old != r:
			s.reg.Add(r)
		}
	}
	s.cur = maps.Clone(want)
}

func sameButReady(a, b Replica) bool {
	a.Ready = b.Ready
	return a == b
}
