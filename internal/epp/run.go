package epp

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/dynamic"

	"github.com/prefixlb/prefixlb/internal/discovery"
	"github.com/prefixlb/prefixlb/internal/sharedstate"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// RunConfig is a whole endpoint picker, as `prefixlb epp` runs it.
type RunConfig struct {
	// Picker is the routing core's configuration (its Shared is set from
	// State).
	Picker Config
	// GRPCListen is the ext_proc address (gRPC health is served there too);
	// HealthListen a second gRPC health address for probes ("": none);
	// MetricsListen the HTTP address of /metrics and /debug/replicas ("":
	// none).
	GRPCListen, HealthListen, MetricsListen string
	// Explain says which requests get x-prefixlb-route and
	// x-prefixlb-route-terms on their way to the replica
	// (ServerConfig.Explain; "": trusted); AdminToken is the token
	// tenancy.ExplainTrusted asks for.
	Explain    tenancy.Explain
	AdminToken string
	// Backends is a static replica list "ip:port,.."; Discovery a
	// Kubernetes target ("service:NS/NAME", "inferencepool:NS/NAME").
	// Exactly one is set. Kubeconfig is the cluster's ("": $KUBECONFIG,
	// else in-cluster). Ports place each replica's metrics and KV events.
	Backends, Discovery, Kubeconfig string
	Ports                           discovery.Ports
	// ModelRewrites is a file of InferenceModelRewrite manifests ("":
	// none): those whose poolRef names the --discovery target's pool (every
	// one with static backends) rewrite a request's model (rewrite.go).
	ModelRewrites string
	// WatchModelRewrites follows the InferenceModelRewrite objects of the
	// --discovery inferencepool's namespace in the cluster, as GIE's own
	// picker does, instead of a file: each change applies at once.
	WatchModelRewrites bool
	// WatchObjectives follows the InferenceObjective objects of the
	// --discovery inferencepool's namespace: the priority of each naming
	// the pool (over Picker.Objectives').
	WatchObjectives bool
	// State is the Redis URL of the shared in-flight state ("": none);
	// StateTTL how long a dead router's counts outlive it; RouterID this
	// router's id in it ("": $POD_NAME, else hostname-pid); Pool its key
	// namespace ("": from the target).
	State, RouterID, Pool string
	StateTTL              time.Duration
	// DrainTimeout bounds the graceful stop at shutdown: streams still open
	// after it (a long generation's response path, or a client holding a
	// request unfinished) are cut (0: DefaultDrainTimeout).
	DrainTimeout time.Duration
	// Logger receives the logs (nil: slog.Default()).
	Logger *slog.Logger
	// Limits bound the ext_proc streams, their buffered bodies and the
	// gRPC servers (zero fields: DefaultLimits').
	Limits Limits
}

// Run builds the picker, its replica source and shared state, serves
// ext_proc (and health and metrics) until ctx ends, then drains: the gRPC
// servers stop gracefully before the picker's feeds end. It reports
// NOT_SERVING until the replica source has synced once.
func Run(ctx context.Context, rc RunConfig) error {
	log := rc.Logger
	if log == nil {
		log = slog.Default()
	}
	rc.Picker.Logger = log
	if rc.Explain != "" {
		if err := rc.Explain.Validate(); err != nil {
			return fmt.Errorf("epp: --explain: %w", err)
		}
	}
	if (rc.Backends == "") == (rc.Discovery == "") {
		return errors.New("epp: give exactly one of --backend and --discovery")
	}
	if rc.DrainTimeout < 0 {
		return fmt.Errorf("epp: --drain-timeout must be ≥ 0, got %v", rc.DrainTimeout)
	}
	if err := rc.Limits.Validate(); err != nil {
		return err
	}
	var runners []func(context.Context) error
	if rc.State != "" {
		id := rc.RouterID
		if id == "" {
			id = os.Getenv("POD_NAME")
		}
		pool := rc.Pool
		if pool == "" {
			pool = strings.NewReplacer(":", "-", "/", "-").Replace(rc.Discovery + rc.Backends)
		}
		rs, err := sharedstate.NewRedis(sharedstate.RedisConfig{URL: rc.State, Pool: pool, Router: id, TTL: rc.StateTTL})
		if err != nil {
			return fmt.Errorf("epp: --state: %w", err)
		}
		defer rs.Close()
		if err := rs.Ping(ctx); err != nil {
			log.Warn("epp: shared state unreachable at start; routing on local counts until it answers", "err", err)
		}
		rc.Picker.Shared = rs
		runners = append(runners, rs.Run)
		log.Info("epp: shared in-flight state", "redis", redactURL(rc.State), "router", rs.Router(), "pool", pool)
	}
	p, err := NewPicker(rc.Picker)
	if err != nil {
		return err
	}
	if rc.WatchModelRewrites {
		if rc.ModelRewrites != "" {
			return errors.New("epp: give one of --model-rewrites and --watch-model-rewrites")
		}
		w, err := rewriteWatcher(rc.Discovery, rc.Kubeconfig, p, log)
		if err != nil {
			return err
		}
		runners = append(runners, w.Run)
	}
	if rc.WatchObjectives {
		ns, pool, dyn, err := clusterPool("--watch-objectives", rc.Discovery, rc.Kubeconfig)
		if err != nil {
			return err
		}
		w, err := watchObjectives(dyn, ns, pool, p, log)
		if err != nil {
			return err
		}
		runners = append(runners, w.Run)
	}
	if rc.ModelRewrites != "" {
		data, err := os.ReadFile(rc.ModelRewrites)
		if err != nil {
			return fmt.Errorf("epp: --model-rewrites: %w", err)
		}
		pool := ""
		if rc.Discovery != "" {
			_, _, pool, _ = discovery.ParseTarget(rc.Discovery)
		}
		rs, err := ParseModelRewrites(data, pool)
		if err != nil {
			return fmt.Errorf("epp: --model-rewrites %s: %w", rc.ModelRewrites, err)
		}
		p.SetModelRewrites(rs)
		log.Info("epp: model rewrites", "file", rc.ModelRewrites, "rewrites", len(rs), "pool", pool)
	}
	runners = append(runners, p.Run)
	srv := NewServer(p, ServerConfig{Explain: rc.Explain, AdminToken: rc.AdminToken, Logger: log, Limits: rc.Limits})
	var source discovery.Watcher
	if rc.Backends != "" {
		if rc.Picker.ScrapeInterval <= 0 {
			rc.Ports.Metrics = -1
		}
		if source, err = discovery.NewStatic(rc.Backends, rc.Ports, p.pool); err != nil {
			return fmt.Errorf("epp: --backend: %w", err)
		}
	} else if source, err = discovery.NewWatcher(rc.Discovery, rc.Kubeconfig,
		discovery.Config{Ports: rc.Ports, Registry: p.pool, Logger: log}); err != nil {
		return err
	}
	runners = append(runners, source.Run)

	var listeners []net.Listener
	closeAll := func() {
		for _, l := range listeners {
			l.Close()
		}
	}
	listen := func(flag, addr string) (net.Listener, error) {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("epp: --%s: %w", flag, err)
		}
		listeners = append(listeners, ln)
		return ln, nil
	}
	g := grpc.NewServer(rc.Limits.ServerOptions()...)
	srv.Register(g)
	healthpb.RegisterHealthServer(g, srv.Health())
	ln, err := listen("grpc-listen", rc.GRPCListen)
	if err != nil {
		return err
	}
	servers := []*grpc.Server{g}
	if rc.HealthListen != "" {
		hg := grpc.NewServer(rc.Limits.ServerOptions()...)
		healthpb.RegisterHealthServer(hg, srv.Health())
		if _, err := listen("health-listen", rc.HealthListen); err != nil {
			return err
		}
		servers = append(servers, hg)
	}
	var metricsSrv *http.Server
	var metricsLn net.Listener
	if rc.MetricsListen != "" {
		if metricsLn, err = listen("metrics-listen", rc.MetricsListen); err != nil {
			return err
		}
		listeners = listeners[:len(listeners)-1] // served by metricsSrv, not gRPC
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", p.MetricsHandler())
		mux.Handle("GET /debug/replicas", p.DebugHandler())
		metricsSrv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	}
	srv.SetServing(false)
	log.Info("prefixlb epp", "grpc", ln.Addr().String(), "health", rc.HealthListen, "metrics", rc.MetricsListen,
		"policy", rc.Picker.Policy, "profile", rc.Picker.Profile, "tokenizer", rc.Picker.Tokenizer,
		"backend_kind", rc.Picker.BackendKind, "discovery", rc.Discovery, "backends", rc.Backends)

	// The feeds run until the servers have drained, so that streams in
	// flight finish against a live picker.
	feeds, stopFeeds := context.WithCancel(context.WithoutCancel(ctx))
	defer stopFeeds()
	eg, egCtx := errgroup.WithContext(ctx)
	for _, run := range runners {
		eg.Go(func() error { return run(feeds) })
	}
	for i, s := range servers {
		eg.Go(func() error {
			if err := s.Serve(listeners[i]); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
				return fmt.Errorf("epp: grpc serve: %w", err)
			}
			return nil
		})
	}
	if metricsSrv != nil {
		eg.Go(func() error {
			if err := metricsSrv.Serve(metricsLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("epp: metrics serve: %w", err)
			}
			return nil
		})
	}
	eg.Go(func() error {
		select {
		case <-source.Synced():
			srv.SetServing(true)
			log.Info("epp: replicas discovered; serving", "ready", p.Ready())
		case <-egCtx.Done():
		}
		<-egCtx.Done()
		srv.SetServing(false)
		drainServers(servers, cmp.Or(rc.DrainTimeout, DefaultDrainTimeout), log)
		if metricsSrv != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			_ = metricsSrv.Shutdown(sctx)
			cancel()
		}
		stopFeeds()
		return nil
	})
	return eg.Wait()
}

// DefaultDrainTimeout is how long the picker's shutdown waits for open
// ext_proc streams, as serve's drain_timeout.
const DefaultDrainTimeout = 30 * time.Second

// drainServers stops the servers gracefully, and forcibly once timeout has
// passed: a stream left open (a client that never finishes its body, a
// gateway that never ends a response) cannot hold the shutdown.
func drainServers(servers []*grpc.Server, timeout time.Duration, log *slog.Logger) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, s := range servers {
			s.GracefulStop()
		}
	}()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		log.Warn("epp: drain timeout: closing the streams still open", "drain_timeout", timeout)
		for _, s := range servers {
			s.Stop()
		}
		<-done
	}
}

// redactURL hides a password in a Redis URL for logs.
func redactURL(u string) string {
	if at := strings.LastIndex(u, "@"); at >= 0 {
		if i := strings.Index(u, "://"); i >= 0 && i < at {
			return u[:i+3] + "***" + u[at:]
		}
	}
	return u
}

// rewriteWatcher follows the InferenceModelRewrites of target's namespace
// ("inferencepool:NS/NAME") and installs those naming its pool on p.
func rewriteWatcher(target, kubeconfig string, p *Picker, log *slog.Logger) (*discovery.ObjectWatcher, error) {
	ns, pool, dyn, err := clusterPool("--watch-model-rewrites", target, kubeconfig)
	if err != nil {
		return nil, err
	}
	return watchRewrites(dyn, ns, pool, p, log)
}

// clusterPool is the namespace and pool of target ("inferencepool:NS/NAME",
// which flag needs) and a client of its cluster.
func clusterPool(flag, target, kubeconfig string) (ns, pool string, dyn dynamic.Interface, err error) {
	kind, ns, pool, err := discovery.ParseTarget(target)
	if err != nil || kind != "inferencepool" {
		return "", "", nil, fmt.Errorf("epp: %s needs --discovery inferencepool:NS/NAME (got %q)", flag, target)
	}
	dyn, err = discovery.DynamicClient(kubeconfig)
	return ns, pool, dyn, err
}

// watchObjectives follows the InferenceObjectives of ns and installs the
// priorities of those naming pool on p.
func watchObjectives(dyn dynamic.Interface, ns, pool string, p *Picker, log *slog.Logger) (*discovery.ObjectWatcher, error) {
	return discovery.NewObjectWatcher(dyn, discovery.InferenceObjectiveGVR, ns, 0, func(objs []*unstructured.Unstructured) {
		prio, errs := ObjectivesFromObjects(objectsJSON(objs, log), pool)
		for _, err := range errs {
			log.Warn("epp: inference objective skipped", "err", err)
		}
		p.SetObjectives(prio)
		log.Info("epp: inference objectives from the cluster", "namespace", ns, "pool", pool, "objectives", len(prio), "invalid", len(errs))
	}, log)
}

// objectsJSON is each object's JSON (one that cannot be written is logged
// and left out).
func objectsJSON(objs []*unstructured.Unstructured, log *slog.Logger) [][]byte {
	raw := make([][]byte, 0, len(objs))
	for _, o := range objs {
		js, err := o.MarshalJSON()
		if err != nil {
			log.Warn("epp: cluster object", "kind", o.GetKind(), "name", o.GetName(), "err", err)
			continue
		}
		raw = append(raw, js)
	}
	return raw
}

// watchRewrites is rewriteWatcher over a given client (tests give a fake).
func watchRewrites(dyn dynamic.Interface, ns, pool string, p *Picker, log *slog.Logger) (*discovery.ObjectWatcher, error) {
	return discovery.NewObjectWatcher(dyn, discovery.InferenceModelRewriteGVR, ns, 0, func(objs []*unstructured.Unstructured) {
		rs, errs := ModelRewritesFromObjects(objectsJSON(objs, log), pool)
		for _, err := range errs {
			log.Warn("epp: model rewrite skipped", "err", err)
		}
		p.SetModelRewrites(rs)
		log.Info("epp: model rewrites from the cluster", "namespace", ns, "pool", pool, "rewrites", len(rs), "invalid", len(errs))
	}, log)
}
