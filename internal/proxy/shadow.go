package proxy

// The shadow policy (Config.ShadowPolicy): with an endpoint picker
// routing, serve's own core runs beside it as a student under teacher
// forcing. For each request the picker routes, the core is asked where
// the shadow policy would send it (router.Predict) and, in the same
// critical section, the request is committed to the replica the picker
// chose (router.Assign), so that the policy's state (its prefix history,
// its in-flight counts) follows the real decisions, not its own. The
// request's first token and end reach the core as on serve's own path
// (firstToken, finishWith). Agreement is counted in
// prefixlb_shadow_decisions_total and, with Config.ShadowLog, each
// decision is written as one JSON line to classify the disagreements
// (docs/peers.md, "Agreement: our llmd copies against the real EPP").
//
// The shadow never changes where a request goes and never fails one: a
// request it cannot key, predict or commit is counted
// (prefixlb_shadow_errors_total) and proceeds. Its costs are bounded: the
// keying serve's own path does, one core call under the core's lock, a
// response watcher holding at most MaxResponseBytes, and a log queue of
// shadowLogQueue records that drops (and counts) what a slow disk cannot
// take.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/bits"
	"net/http"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// shadowLogQueue bounds the shadow log's records waiting for the writer.
const shadowLogQueue = 4096

// Stages a shadowed request can fail at, as prefixlb_shadow_errors_total's
// labels.
const (
	shadowKey      = "key"      // the request could not be parsed or keyed
	shadowEndpoint = "endpoint" // the picker's endpoint is none of serve's replicas
	shadowPredict  = "predict"  // the policy could not decide
	shadowAssign   = "assign"   // the core could not commit the flight to the picker's replica
)

// shadow is the shadow policy's counters and log.
type shadow struct {
	policy    string
	decisions *prometheus.CounterVec // policy, agree
	errors    *prometheus.CounterVec // stage
	dropped   prometheus.Counter
	// warned counts errors, to log the 1st, 2nd, 4th, 8th, ... of them.
	warned atomic.Uint64
	// queue feeds the log's writer (run); nil without a log. file is the
	// log, closed once by closeLog.
	queue     chan *shadowRecord
	file      *os.File
	closeOnce sync.Once
}

// newShadow makes the shadow's metrics on reg and opens its log (append;
// created if absent) when path is set.
func newShadow(policyName, path string, reg prometheus.Registerer) (*shadow, error) {
	s := &shadow{
		policy: policyName,
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_shadow_decisions_total",
			Help: "Requests the endpoint picker routed that the shadow policy (--shadow-policy) also decided, by whether it chose the picker's replica (agree=true|false).",
		}, []string{"policy", "agree"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_shadow_errors_total",
			Help: "Shadow policy failures by stage (key, endpoint, predict, assign): the request went on where the picker sent it.",
		}, []string{"stage"}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "prefixlb_shadow_log_dropped_total",
			Help: "Shadow log records dropped because the writer fell behind.",
		}),
	}
	s.decisions.WithLabelValues(policyName, "true")
	s.decisions.WithLabelValues(policyName, "false")
	for _, st := range []string{shadowKey, shadowEndpoint, shadowPredict, shadowAssign} {
		s.errors.WithLabelValues(st)
	}
	for _, c := range []prometheus.Collector{s.decisions, s.errors, s.dropped} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	if path != "" {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
		if err != nil {
			return nil, fmt.Errorf("shadow_log: %w", err)
		}
		s.file, s.queue = f, make(chan *shadowRecord, shadowLogQueue)
	}
	return s, nil
}

// run writes the log's records until ctx ends, then what is queued, and
// closes the log. Without a log it returns at once.
func (s *shadow) run(ctx context.Context) {
	if s.queue == nil {
		return
	}
	defer s.closeLog()
	w := bufio.NewWriter(s.file)
	enc := json.NewEncoder(w)
	write := func(r *shadowRecord) {
		_ = enc.Encode(r)
	}
	for {
		select {
		case r := <-s.queue:
			write(r)
			// Flush when nothing else waits: a log that is read while the
			// run goes on is whole up to the last decision.
			if len(s.queue) == 0 {
				_ = w.Flush()
			}
		case <-ctx.Done():
			for {
				select {
				case r := <-s.queue:
					write(r)
				default:
					_ = w.Flush()
					return
				}
			}
		}
	}
}

// closeLog closes the log file (once).
func (s *shadow) closeLog() {
	if s.file != nil {
		s.closeOnce.Do(func() { _ = s.file.Close() })
	}
}

// record queues r for the log, or drops it when the queue is full.
func (s *shadow) record(r *shadowRecord) {
	if s.queue == nil {
		return
	}
	select {
	case s.queue <- r:
	default:
		s.dropped.Inc()
	}
}

// shadowRecord is one line of the shadow log.
type shadowRecord struct {
	RequestID string    `json:"request_id"`
	Time      time.Time `json:"time"`
	Policy    string    `json:"policy"`
	// Endpoint is the picker's endpoint ("host:port"); Picked the replica
	// it is, Shadow the replica the shadow policy chose ("" on an error).
	Endpoint string `json:"endpoint"`
	Picked   string `json:"picked"`
	Shadow   string `json:"shadow"`
	Agree    bool   `json:"agree"`
	// PromptTokens is the prompt's length as serve keyed it; Branch the
	// shadow decision's.
	PromptTokens int    `json:"prompt_tokens"`
	Branch       string `json:"branch,omitempty"`
	// Replicas is each replica as the shadow saw it at the decision.
	Replicas []shadowReplica `json:"replicas,omitempty"`
	// Error is the stage and error of a failed shadow step.
	Error string `json:"error,omitempty"`
}

// shadowReplica is one replica's terms in a shadow decision: its score and
// matched tokens where the decision exposes them (policy.Candidate), and
// the load the core had for it.
type shadowReplica struct {
	Name          string   `json:"name"`
	Score         *float64 `json:"score,omitempty"`
	MatchedTokens *int     `json:"matched_tokens,omitempty"`
	Waiting       int      `json:"waiting"`
	Running       int      `json:"running"`
	KVUsage       float64  `json:"kv_usage"`
	InFlight      int      `json:"in_flight"`
}

// shadowFlight is one request's shadow: its key, the flight committed in
// the core, and the watcher of its response.
type shadowFlight struct {
	req      policy.Request
	rid      string
	endpoint string // the replica's address the flight is committed to
	assigned bool   // a flight req.ID is in the core, not yet finished
	watch    openai.Watcher
}

// shadowStart keys the request for the shadow before the picker is asked
// (as serve's own path keys it). A request that cannot be keyed is counted
// and goes unshadowed: nil.
func (p *Proxy) shadowStart(r *http.Request, kind openai.Kind, body []byte) *shadowFlight {
	req, err := openai.ParseRequest(kind, body)
	if err == nil {
		var keys []blocks.Key
		var tokens int
		if keys, tokens, err = p.pool.Key(req); err == nil {
			f := &shadowFlight{req: policy.Request{Keys: keys, PromptTokens: tokens, Estimated: req.TokensEstimated, OutputTokens: req.MaxTokens,
				Session: r.Header.Get(HeaderSession), Unary: !req.Stream, Adapter: req.Adapter}}
			if f.req.Session == "" {
				f.req.Session = req.User
			}
			f.watch.Max = int(p.cfg.MaxResponseBytes)
			return f
		}
	}
	p.shadowFailed(shadowKey, "", err)
	return nil
}

// shadowFailed counts a failed shadow step and logs some of them.
func (p *Proxy) shadowFailed(stage, rid string, err error) {
	s := p.shadow
	s.errors.WithLabelValues(stage).Inc()
	if n := s.warned.Add(1); bits.OnesCount64(n) == 1 {
		p.log.Warn("shadow policy: request not shadowed (it goes where the picker sent it)", "stage", stage,
			"request_id", rid, "err", err, "errors_so_far", n)
	}
	if s.queue != nil {
		s.record(&shadowRecord{RequestID: rid, Time: time.Now(), Policy: s.policy, Error: stage + ": " + err.Error()})
	}
}

// shadowDecide asks the shadow policy where f would go and commits f to
// the replica at endpoint, the picker's choice, in one critical section:
// no other request is decided in between. It counts agreement and queues
// the log's record.
func (p *Proxy) shadowDecide(f *shadowFlight, endpoint string) {
	s := p.shadow
	f.req.ID = p.nextID.Add(1)
	now := time.Now()
	p.mu.Lock()
	m := p.pool.ByAddress(endpoint)
	if m == nil {
		p.mu.Unlock()
		p.shadowFailed(shadowEndpoint, f.rid, fmt.Errorf("the picker's endpoint %s is none of serve's replicas", endpoint))
		return
	}
	picked, pickedName := m.ID, m.Name
	d, perr := p.rt.Predict(f.req, now)
	var rec *shadowRecord
	if perr == nil {
		rec = &shadowRecord{RequestID: f.rid, Time: now, Policy: s.policy, Endpoint: endpoint, Picked: pickedName,
			Agree: d.Replica == picked, PromptTokens: f.req.PromptTokens, Branch: d.Branch}
		if sm := p.pool.Member(d.Replica); sm != nil {
			rec.Shadow = sm.Name
		}
		if s.queue != nil {
			rec.Replicas = p.shadowReplicasLocked(&d)
		}
	}
	_, aerr := p.rt.Assign(f.req, picked, now)
	p.mu.Unlock()
	if perr != nil {
		p.shadowFailed(shadowPredict, f.rid, perr)
	} else {
		s.decisions.WithLabelValues(s.policy, strconv.FormatBool(rec.Agree)).Inc()
		s.record(rec)
	}
	if aerr != nil {
		p.shadowFailed(shadowAssign, f.rid, aerr)
		return
	}
	f.endpoint, f.assigned = endpoint, true
}

// shadowReplicasLocked is every replica's terms in d, with the core's
// load (Mu held).
func (p *Proxy) shadowReplicasLocked(d *policy.Decision) []shadowReplica {
	reps := p.rt.Load()
	out := make([]shadowReplica, 0, len(reps))
	for i := range reps {
		rp := &reps[i]
		sr := shadowReplica{Name: rp.Name, Waiting: rp.Waiting, Running: rp.Running, KVUsage: rp.KVUsage, InFlight: rp.InFlight}
		for j := range d.Candidates {
			if c := &d.Candidates[j]; c.Replica == i && c.Leg == "" {
				score, matched := c.Score, c.MatchedTokens
				sr.Score, sr.MatchedTokens = &score, &matched
			}
		}
		out = append(out, sr)
	}
	return out
}

// shadowServed moves f's flight to endpoint when the request was served
// there rather than at the picker's first choice (which refused the
// connection): the failed flight ends, a new one is committed.
func (p *Proxy) shadowServed(f *shadowFlight, endpoint string) {
	if !f.assigned || f.endpoint == endpoint {
		return
	}
	p.finish(f.req.ID, 0, -1, false)
	f.assigned = false
	f.req.ID = p.nextID.Add(1)
	now := time.Now()
	p.mu.Lock()
	var err error
	if m := p.pool.ByAddress(endpoint); m == nil {
		err = fmt.Errorf("the served endpoint %s is none of serve's replicas", endpoint)
	} else {
		_, err = p.rt.Assign(f.req, m.ID, now)
	}
	p.mu.Unlock()
	if err != nil {
		p.shadowFailed(shadowAssign, f.rid, err)
		return
	}
	f.endpoint, f.assigned = endpoint, true
}

// shadowFeed reads a chunk of the response on the side; the first output
// token is reported to the core.
func (p *Proxy) shadowFeed(f *shadowFlight, b []byte) {
	if f.assigned && f.watch.Feed(b) {
		p.firstToken(f.req.ID)
	}
}

// shadowFinish reports the end of f's flight to the core, as serve's own
// path does: the output and cached tokens the response reported, ok for a
// response that came whole with a 2xx status.
func (p *Proxy) shadowFinish(f *shadowFlight, ok bool) {
	if !f.assigned {
		return
	}
	f.assigned = false
	out, cached := f.watch.Result()
	fin := router.Finish{OutputTokens: out, CachedTokens: cached, PromptTokens: f.watch.PromptTokens(), OK: ok, Timings: f.watch.Timings.Calibration()}
	fin.ITL, fin.ITLSamples = f.watch.Gaps.Median()
	if !ok {
		fin.CachedTokens = -1
	}
	p.finishWith(f.req.ID, fin)
}

// shadowTee is a response body that passes what is read to the shadow's
// watcher.
type shadowTee struct {
	r io.Reader
	p *Proxy
	f *shadowFlight
}

func (t *shadowTee) Read(b []byte) (int, error) {
	n, err := t.r.Read(b)
	if n > 0 {
		t.p.shadowFeed(t.f, b[:n])
	}
	return n, err
}
