package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/prefixlb/prefixlb/internal/openai"
)

// PoolConfig is one model pool of a multi-pool serve: a Config of its own
// (backends, policy, profile, tokenizer, block size, KV events...) and the
// models it serves.
type PoolConfig struct {
	// Name names the pool in logs, the metrics' pool label and the
	// dashboard's path (/pools/NAME/ui/).
	Name string
	// Models are the model names (and LoRA adapters) its replicas serve:
	// a request's "model" picks the pool that lists it.
	Models []string
	// Default makes the pool take requests that name no model (given its
	// first model, when it lists one).
	Default bool
	// Config is the pool's router: every field of a single serve.
	Config Config
}

// Pools is serve in front of several model pools: each pool is a Proxy
// (its own replicas, router, prefix tree, policy and metrics), and a
// request goes to the pool whose Models list its "model" — the way the
// Gateway API Inference Extension routes a model to its InferencePool.
// GET /v1/models merges the pools' lists; /metrics is every pool's, each
// series labelled pool; each pool's dashboard and debug endpoints are under
// /pools/NAME/.
type Pools struct {
	pools   []*namedProxy
	byModel map[string]*namedProxy
	def     *namedProxy // takes requests without a model (nil: none)
	log     *slog.Logger
	maxBody int64
	// bodyTimeout bounds reading a request's body here, before its pool
	// reads it again (the longest of the pools' BodyReadTimeout; 0: none).
	bodyTimeout time.Duration
}

type namedProxy struct {
	name   string
	models []string
	p      *Proxy
	h      http.Handler // p.Handler()
}

// NewPools builds the pools (each Config validated as New does).
func NewPools(pools []PoolConfig, logger *slog.Logger) (*Pools, error) {
	if len(pools) == 0 {
		return nil, errors.New("proxy: pools: at least one pool is required")
	}
	if logger == nil {
		logger = slog.Default()
	}
	ps := &Pools{byModel: map[string]*namedProxy{}, log: logger}
	names := map[string]bool{}
	for i, pc := range pools {
		where := fmt.Sprintf("pools[%d]", i)
		if pc.Name == "" || strings.ContainsAny(pc.Name, "/ ") {
			return nil, fmt.Errorf("proxy: config: %s.name: a name without '/' or spaces is required, got %q", where, pc.Name)
		}
		if names[pc.Name] {
			return nil, fmt.Errorf("proxy: config: %s.name: duplicate pool %q", where, pc.Name)
		}
		names[pc.Name] = true
		if len(pc.Models) == 0 && !pc.Default {
			return nil, fmt.Errorf("proxy: config: %s.models: pool %s serves no model and is not the default", where, pc.Name)
		}
		cfg := pc.Config
		if cfg.KVEventsListen != "" {
			// Each pool would bind the same socket; one listener shared by
			// the pools is not built.
			return nil, fmt.Errorf("proxy: config: %s.kv_events_listen: not with pools (give each backend kv_events instead)", where)
		}
		if cfg.Logger == nil {
			cfg.Logger = logger
		}
		cfg.Logger = cfg.Logger.With("pool", pc.Name)
		p, err := New(cfg)
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", pc.Name, err)
		}
		np := &namedProxy{name: pc.Name, models: pc.Models, p: p, h: p.Handler()}
		for _, m := range pc.Models {
			if other, ok := ps.byModel[m]; ok {
				return nil, fmt.Errorf("proxy: config: %s.models: model %q is pool %s's already", where, m, other.name)
			}
			ps.byModel[m] = np
		}
		if pc.Default {
			if ps.def != nil {
				return nil, fmt.Errorf("proxy: config: %s.default: pools %s and %s are both the default", where, ps.def.name, pc.Name)
			}
			ps.def = np
		}
		ps.pools = append(ps.pools, np)
		ps.maxBody = max(ps.maxBody, cfg.MaxBodyBytes)
		ps.bodyTimeout = max(ps.bodyTimeout, cfg.BodyReadTimeout)
	}
	if ps.def == nil && len(ps.pools) == 1 {
		ps.def = ps.pools[0] // the only pool takes what names no model
	}
	return ps, nil
}

// Pool returns pool name's Proxy (nil: none).
func (ps *Pools) Pool(name string) *Proxy {
	for _, np := range ps.pools {
		if np.name == name {
			return np.p
		}
	}
	return nil
}

// Handler serves the pools: /v1/* by model, GET /v1/models merged,
// /metrics, GET /health (200 while every pool has a replica up), and each
// pool's own endpoints under /pools/NAME/ (/pools/NAME/ui/,
// /pools/NAME/debug/route, ...).
func (ps *Pools) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /v1/models", ps.serveModels)
	mux.HandleFunc("/v1/", ps.serveInference)
	mux.HandleFunc("GET /health", ps.serveHealth)
	mux.Handle("GET /metrics", promhttp.HandlerFor(ps, promhttp.HandlerOpts{}))
	for _, np := range ps.pools {
		mux.Handle("/pools/"+np.name+"/", http.StripPrefix("/pools/"+np.name, np.h))
	}
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeErrorStatus(w, http.StatusNotFound, fmt.Errorf("no route for %s %s", r.Method, r.URL.Path))
	})
	return mux
}

// serveInference reads the body's model and hands the request to its pool.
func (ps *Pools) serveInference(w http.ResponseWriter, r *http.Request) {
	// A client that sends its body too slowly is cut off here as its pool
	// would cut it off (BodyReadTimeout), not held while the model is read.
	rc := http.NewResponseController(w)
	if ps.bodyTimeout > 0 {
		_ = rc.SetReadDeadline(time.Now().Add(ps.bodyTimeout))
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, ps.maxBody))
	if ps.bodyTimeout > 0 {
		_ = rc.SetReadDeadline(time.Time{})
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeErrorStatus(w, http.StatusRequestEntityTooLarge, fmt.Errorf("request body over %d bytes", ps.maxBody))
			return
		}
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			w.Header().Set("Connection", "close")
			writeErrorStatus(w, http.StatusRequestTimeout, fmt.Errorf("request body not read within %v", ps.bodyTimeout))
			return
		}
		writeErrorStatus(w, http.StatusBadRequest, fmt.Errorf("read request body: %w", err))
		return
	}
	var m struct {
		Model *string `json:"model"`
	}
	if len(bytes.TrimSpace(body)) > 0 {
		if err := json.Unmarshal(body, &m); err != nil {
			writeError(w, fmt.Errorf("%w: %v", openai.ErrBadRequest, err))
			return
		}
	}
	np, err := ps.poolFor(m.Model)
	if err != nil {
		if errors.Is(err, errModelNotFound) {
			writeModelNotFound(w, err)
			return
		}
		writeErrorStatus(w, http.StatusBadRequest, err)
		return
	}
	if (m.Model == nil || *m.Model == "") && len(np.models) > 0 {
		// The default pool's first model, as a replica serving several
		// needs to be told (and serve's parser requires one).
		if body, err = withModel(body, np.models[0]); err != nil {
			writeError(w, fmt.Errorf("%w: %v", openai.ErrBadRequest, err))
			return
		}
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	np.h.ServeHTTP(w, r)
}

// withModel sets body's "model" to model.
func withModel(body []byte, model string) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	if m == nil {
		m = map[string]json.RawMessage{}
	}
	m["model"], _ = json.Marshal(model)
	return json.Marshal(m)
}

// errModelNotFound: no pool serves the request's model.
var errModelNotFound = errors.New("model not found")

// poolFor is the pool of model (nil: the body named none).
func (ps *Pools) poolFor(model *string) (*namedProxy, error) {
	if model == nil || *model == "" {
		if ps.def == nil {
			return nil, fmt.Errorf("%w: you must provide a model parameter (no default pool; known: %s)", openai.ErrBadRequest, ps.known())
		}
		return ps.def, nil
	}
	if np, ok := ps.byModel[*model]; ok {
		return np, nil
	}
	return nil, fmt.Errorf("%w: the model `%s` does not exist (known: %s)", errModelNotFound, *model, ps.known())
}

func (ps *Pools) known() string {
	var out []string
	for m := range ps.byModel {
		out = append(out, m)
	}
	slices.Sort(out)
	return strings.Join(out, ", ")
}

// writeModelNotFound answers 404 in OpenAI's shape for an unknown model:
// {"error": {"message", "type": "invalid_request_error", "param":
// "model", "code": "model_not_found"}}.
func writeModelNotFound(w http.ResponseWriter, err error) {
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": err.Error(), "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusNotFound)
	_, _ = w.Write(body)
}

// serveModels merges the pools' model lists: each pool's replicas' (its
// own Proxy's /v1/models), and the models the pool is configured with that
// no replica listed, each id once.
func (ps *Pools) serveModels(w http.ResponseWriter, r *http.Request) {
	seen := map[string]bool{}
	data := []json.RawMessage{}
	add := func(m json.RawMessage) {
		var id struct {
			ID string `json:"id"`
		}
		if json.Unmarshal(m, &id) == nil && id.ID != "" && !seen[id.ID] {
			seen[id.ID] = true
			data = append(data, m)
		}
	}
	for _, np := range ps.pools {
		models, err := np.p.models(r.Context())
		if err != nil {
			ps.log.Debug("list models", "pool", np.name, "err", err)
		}
		for _, m := range models {
			add(m)
		}
		for _, name := range np.models {
			b, _ := json.Marshal(map[string]string{"id": name, "object": "model", "owned_by": "prefixlb"})
			add(b)
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// serveHealth answers 200 while every pool has a replica up, else 503.
func (ps *Pools) serveHealth(w http.ResponseWriter, r *http.Request) {
	status := http.StatusOK
	pools := map[string]any{}
	for _, np := range ps.pools {
		up := np.p.upCount()
		if up == 0 {
			status = http.StatusServiceUnavailable
		}
		pools[np.name] = map[string]int{"replicas_up": up}
	}
	word := "ok"
	if status != http.StatusOK {
		word = "a pool has no replica up"
	}
	writeJSON(w, status, map[string]any{"status": word, "pools": pools})
}

// Gather implements prometheus.Gatherer: every pool's metrics, each series
// labelled pool="NAME", and the process's (Go runtime, process) once.
func (ps *Pools) Gather() ([]*dto.MetricFamily, error) {
	byName := map[string]*dto.MetricFamily{}
	var order []string
	for i, np := range ps.pools {
		fams, err := np.p.m.Reg.Gather()
		if err != nil {
			return nil, fmt.Errorf("pool %s: %w", np.name, err)
		}
		for _, f := range fams {
			process := strings.HasPrefix(f.GetName(), "go_") || strings.HasPrefix(f.GetName(), "process_")
			if process && i > 0 {
				continue // the same process: once
			}
			out, ok := byName[f.GetName()]
			if !ok {
				out = &dto.MetricFamily{Name: f.Name, Help: f.Help, Type: f.Type}
				byName[f.GetName()] = out
				order = append(order, f.GetName())
			}
			for _, m := range f.Metric {
				if !process {
					label := "pool"
					m.Label = append([]*dto.LabelPair{{Name: &label, Value: &np.name}}, m.Label...)
					slices.SortFunc(m.Label, func(a, b *dto.LabelPair) int { return strings.Compare(a.GetName(), b.GetName()) })
				}
				out.Metric = append(out.Metric, m)
			}
		}
	}
	slices.Sort(order)
	out := make([]*dto.MetricFamily, 0, len(order))
	for _, n := range order {
		out = append(out, byName[n])
	}
	return out, nil
}

// RunAndServe runs every pool's feeds and serves Handler on ln until ctx
// ends, then drains as Proxy.RunAndServe does.
func (ps *Pools) RunAndServe(ctx context.Context, ln net.Listener) error {
	feeds, stop := context.WithCancel(context.WithoutCancel(ctx))
	defer stop()
	var g errgroup.Group
	for _, np := range ps.pools {
		g.Go(func() error { return np.p.Run(feeds) })
	}
	first := ps.pools[0].p
	err := first.serveHandler(ctx, ln, ps.Handler())
	stop()
	if ferr := g.Wait(); ferr != nil && err == nil {
		err = ferr
	}
	return err
}

// Close releases the pools' idle connections.
func (ps *Pools) Close() {
	for _, np := range ps.pools {
		np.p.Close()
	}
}
