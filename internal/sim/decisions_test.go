package sim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/decisiontest"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
	"github.com/prefixlb/prefixlb/internal/sim"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// decisionsGolden pins every decision of the runs of decisionRuns, and the
// whole sim.Result of each, as the simulator made them when it was
// recorded. It may be regenerated (`go test ./internal/sim -run
// TestDecisionsUnchanged -update-golden`) only for an intended, documented
// change of decisions.
var decisionsGolden = filepath.Join("testdata", "decisions-sim.txt")

// simWorkload is a built-in workload, small enough for a test.
type simWorkload struct {
	name string
	rate float64 // requests per second (Poisson)
	tune func(s *workload.Spec)
}

// simWorkloads are the workloads of decisionRuns: every generator, sized to
// a few hundred requests that load three replicas.
var simWorkloads = map[string]simWorkload{
	"toolbench":    {"toolbench", 40, func(s *workload.Spec) { s.ToolBench.Tools, s.ToolBench.Zipf = 60, 1.1 }},
	"agent":        {"agent", 40, func(s *workload.Spec) { s.Agent.Environments = 40 }},
	"programming":  {"programming", 20, nil},
	"videoqa":      {"videoqa", 10, func(s *workload.Spec) { s.VideoQA.Videos, s.VideoQA.SecondsMax = 20, 20 }},
	"loogle":       {"loogle", 4, func(s *workload.Spec) { s.LooGLE.Documents, s.LooGLE.DocMin, s.LooGLE.DocMax = 8, 4000, 8000 }},
	"coding-agent": {"coding-agent", 4, func(s *workload.Spec) { s.CodingAgent.PrefixMin, s.CodingAgent.PrefixMax = 9000, 16000 }},
	"rag":          {"rag", 30, func(s *workload.Spec) { s.RAG.Corpus = 300 }},
	"shared-prefix": {"shared-prefix", 6, func(s *workload.Spec) {
		s.SharedPrefix.Groups, s.SharedPrefix.SystemTokens, s.SharedPrefix.QuestionTokens, s.SharedPrefix.Output = 12, 2500, 400, 100
	}},
	// For llama.cpp on a CPU (llamacpp-tiny-cpu): what three of them serve.
	"toolbench-cpu": {"toolbench", 1, func(s *workload.Spec) { s.ToolBench.Tools, s.ToolBench.Zipf = 60, 1.1 }},
	"agent-cpu":     {"agent", 2, func(s *workload.Spec) { s.Agent.Environments = 40 }},
}

// requestsPerRun is the size of every run's workload; raceRequests how many
// of them a run takes under the race detector.
const (
	requestsPerRun = 240
	raceRequests   = 30
)

func loadWorkload(t *testing.T, name string, replicas int) []workload.Request {
	t.Helper()
	w, ok := simWorkloads[name]
	if !ok {
		t.Fatalf("no workload %q", name)
	}
	f := workload.DefaultFlags()
	f.Spec = workload.DefaultSpec(w.name)
	f.Spec.Requests = requestsPerRun
	f.Spec.Replicas = replicas
	f.Spec.Seed = 7
	if w.tune != nil {
		w.tune(&f.Spec)
	}
	f.Arrival.Rate = w.rate
	reqs, _, err := f.Load()
	if err != nil {
		t.Fatalf("workload %s: %v", name, err)
	}
	return reqs
}

// decisionRun is one simulation: a workload, a policy spec (policy.Parse)
// and the cluster.
type decisionRun struct {
	workload string
	policy   string
	// engine is "" (vLLM: block cache, KV events after 10 ms) or one of the
	// variants below; cluster sets the rest of the config.
	engine  string
	cluster func(c *sim.Config)
}

func (r decisionRun) name() string {
	n := r.workload + " " + r.policy
	if r.engine != "" {
		n += " " + r.engine
	}
	return n
}

// decisionRuns are the simulations pinned: every policy on toolbench with KV
// events and on one other workload; e2 and a few baselines on the cache
// models and settings that take other code paths (mirrored caches, slot
// caches, small caches that evict, calibration on a mixed cluster, other
// local schedulers, CPU sharing).
func decisionRuns() []decisionRun {
	all := []string{"round-robin", "random", "least-load", "power-of-two", "session", "prefix",
		"llmd-precise", "llmd-approx", "sglang", "dynamo", "e2", "e2-preble",
		// Non-default settings of e2, e2-preble and llm-d's scorers.
		"e2:mixing=true:exploit_assigned_only=true:prefill_weight=2:eviction_weight=2:window=1m:mix_window=20s",
		"e2:warmup_per_replica=5:min_hot_count=1:rebalance_interval=0s:move_cooldown=0s:movable_load_only=false:history_weight=1:replicate_ttft_ratio=1.2",
		"e2:include_prefill=false:marginal_decode=false:decode_weight=1:self_decode_weight=0:tie_break_in_flight=false:eviction_recompute=true",
		"e2-preble:mixing=false:window=30s:mix_window=10s:balance_threshold=1.2",
		"llmd-precise:speculative=true:prefix_weight=2:kv_weight=1:queue_weight=1",
		"llmd-approx:prefix_weight=3:queue_weight=2",
	}
	others := []string{"agent", "programming", "videoqa", "loogle", "coding-agent", "rag", "shared-prefix"}
	var runs []decisionRun
	for i, p := range all {
		runs = append(runs, decisionRun{workload: "toolbench", policy: p})
		runs = append(runs, decisionRun{workload: others[i%len(others)], policy: p})
	}
	mirror := func(c *sim.Config) { c.KVEvents = false }
	small := func(c *sim.Config) { c.Replica.KVCapacity = 10000 }
	lpm := func(c *sim.Config) { c.Replica.Local = replica.LocalLPM }
	prio := func(c *sim.Config) { c.Replica.Local = replica.LocalPriority }
	specOff := func(c *sim.Config) { c.SpeculativeTTL = -1; c.EventLag = 50 * time.Millisecond }
	for _, p := range []string{"round-robin", "llmd-precise", "llmd-approx", "sglang", "dynamo", "e2", "e2-preble"} {
		runs = append(runs, decisionRun{workload: "agent", policy: p, engine: "mirror", cluster: mirror})
		runs = append(runs, decisionRun{workload: "shared-prefix", policy: p, engine: "evicting", cluster: small})
		runs = append(runs, decisionRun{workload: "toolbench-cpu", policy: p, engine: "llamacpp", cluster: llamaCpp})
	}
	for _, p := range []string{"least-load", "llmd-precise", "e2", "e2-preble"} {
		runs = append(runs, decisionRun{workload: "toolbench", policy: p, engine: "calibrated-mixed", cluster: calibratedMixed})
	}
	runs = append(runs,
		decisionRun{workload: "toolbench", policy: "e2", engine: "evicting-mirror", cluster: func(c *sim.Config) { small(c); mirror(c) }},
		decisionRun{workload: "agent", policy: "e2", engine: "lpm", cluster: lpm},
		decisionRun{workload: "rag", policy: "e2-preble", engine: "priority", cluster: prio},
		decisionRun{workload: "toolbench", policy: "e2", engine: "no-speculation", cluster: specOff},
		decisionRun{workload: "toolbench", policy: "llmd-precise:speculative=true", engine: "no-speculation", cluster: specOff},
		decisionRun{workload: "agent-cpu", policy: "e2", engine: "llamacpp-calibrated-2cores", cluster: func(c *sim.Config) {
			llamaCpp(c)
			cal := calibrate.DefaultConfig()
			c.Calibrate = &cal
			c.HostCores = 2
		}},
	)
	return runs
}

// llamaCpp models llama.cpp's llama-server as `prefixlb sim --engine
// llamacpp` does: two slots, n_batch 2048, no KV events, the tiny CPU
// profile (its workloads, *-cpu, arrive at what three such replicas serve).
func llamaCpp(c *sim.Config) {
	prof := mustProfile(costmodel.LlamaCppTinyCPU)
	c.Profile = prof
	c.Replica.Slots = 2
	c.Replica.ChunkBudget = replica.LlamaCppBatch
	c.Replica.MaxRunning = 0
	c.KVEvents = false
}

// calibratedMixed is a cluster of two H100s and one A100 whose router is
// told every replica is an H100 and learns each one's speed.
func calibratedMixed(c *sim.Config) {
	h, a := mustProfile(costmodel.Llama31_8BH100), mustProfile(costmodel.Llama31_8BA100)
	c.Profiles = []costmodel.Profile{h, h, a}
	c.RouterProfiles = []costmodel.Profile{h, h, h}
	cal := calibrate.DefaultConfig()
	c.Calibrate = &cal
}

func mustProfile(name string) costmodel.Profile {
	p, err := costmodel.Resolve(name)
	if err != nil {
		panic(err)
	}
	return p
}

// recorder wraps a policy and records every decision it makes. It
// implements policy.Observer and policy.Speculator by forwarding (and, for
// a policy without them, doing what the router does without them), so the
// router treats it as it treats the policy; TestDecisionsUnchanged checks
// that the wrapped run's result is the bare run's.
type recorder struct {
	policy.Policy
	decisions []decisiontest.Decision
	scores    []byte
}

func (r *recorder) Route(req *policy.Request, v *policy.View, now time.Time) (policy.Decision, error) {
	d, err := r.Policy.Route(req, v, now)
	if err != nil {
		return d, err
	}
	r.decisions = append(r.decisions, decisiontest.Decision{ID: req.ID, Replica: v.Replicas[d.Replica].Name,
		Branch: d.Branch, Matched: d.MatchedTokens})
	r.scores = strconv.AppendUint(r.scores, req.ID, 10)
	for _, c := range d.Candidates {
		r.scores = append(r.scores, ' ')
		r.scores = strconv.AppendInt(r.scores, int64(c.Replica), 10)
		r.scores = append(r.scores, '=')
		r.scores = strconv.AppendFloat(r.scores, c.Score, 'g', -1, 64)
	}
	r.scores = append(r.scores, '\n')
	return d, nil
}

func (r *recorder) Routed(req *policy.Request, d *policy.Decision, v *policy.View, now time.Time) {
	if o, ok := r.Policy.(policy.Observer); ok {
		o.Routed(req, d, v, now)
	}
}

func (r *recorder) FirstToken(id uint64, replica int, ttft time.Duration, now time.Time) {
	if o, ok := r.Policy.(policy.Observer); ok {
		o.FirstToken(id, replica, ttft, now)
	}
}

func (r *recorder) Finished(id uint64, replica int, outputTokens int, ok bool, now time.Time) {
	if o, isObs := r.Policy.(policy.Observer); isObs {
		o.Finished(id, replica, outputTokens, ok, now)
	}
}

func (r *recorder) ReplicaDown(replica int, now time.Time) {
	if o, ok := r.Policy.(policy.Observer); ok {
		o.ReplicaDown(replica, now)
	}
}

func (r *recorder) Speculative() bool {
	s, ok := r.Policy.(policy.Speculator)
	return ok && s.Speculative()
}

// TestDecisionsUnchanged replays decisionRuns through the simulator and
// compares every decision (request, replica, branch, matched tokens) and
// every run's whole sim.Result (as JSON) with testdata/decisions-sim.txt.
// Issue 15's restructuring must leave them all as they are.
func TestDecisionsUnchanged(t *testing.T) {
	if runtime.GOARCH != "amd64" && !decisiontest.Updating() {
		t.Skip("the golden results are amd64's (other architectures may fuse floating-point operations)")
	}
	runs := decisionRuns()
	reqs := map[string][]workload.Request{}
	for _, r := range runs {
		if reqs[r.workload] == nil {
			reqs[r.workload] = loadWorkload(t, r.workload, 3)
			if decisiontest.RaceEnabled {
				// Under the race detector, the first requests of each
				// workload: the decisions on them are the first ones of
				// the whole run (later arrivals come later in virtual
				// time), compared with the golden's first ones.
				reqs[r.workload] = reqs[r.workload][:raceRequests]
			}
		}
	}
	// The recorder's transparency is checked once per policy spec (it
	// depends on the interfaces the policy implements, not on the run), not
	// under the race detector.
	checkWrap := make([]bool, len(runs))
	specs := map[string]bool{}
	for i, r := range runs {
		checkWrap[i] = !specs[r.policy] && !decisiontest.RaceEnabled
		specs[r.policy] = true
	}
	out := make([]decisiontest.Run, len(runs))
	errs := make([]error, len(runs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, runtime.GOMAXPROCS(0))
	for i, r := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			out[i], errs[i] = simulate(r, reqs[r.workload], checkWrap[i])
			if decisiontest.RaceEnabled {
				out[i].Prefix, out[i].Result, out[i].Scores = true, nil, nil
			}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", runs[i].name(), err)
		}
	}
	decisiontest.Check(t, decisionsGolden,
		"Every decision of `prefixlb sim`'s core (internal/sim) on a fixed set of runs: TestDecisionsUnchanged\n"+
			"(internal/sim/decisions_test.go). result= is the checksum of the run's sim.Result as JSON.", out)
}

// simulate runs r with a recorder around its policy, and with checkWrap
// also bare: the two results must then be the same.
func simulate(r decisionRun, reqs []workload.Request, checkWrap bool) (decisiontest.Run, error) {
	cfg := func(pol policy.Policy) sim.Config {
		c := sim.Config{Replicas: 3, Replica: replica.DefaultConfig(), Profile: mustProfile(costmodel.Llama31_8BH100),
			Policy: pol, KVEvents: true, EventLag: 10 * time.Millisecond, Seed: 1}
		if r.cluster != nil {
			r.cluster(&c)
		}
		return c
	}
	newPolicy := func() (policy.Policy, error) { return policy.Parse(r.policy, policy.DefaultOptions()) }
	inner, err := newPolicy()
	if err != nil {
		return decisiontest.Run{}, err
	}
	rec := &recorder{Policy: inner}
	res, err := sim.Run(context.Background(), cfg(rec), reqs)
	if err != nil {
		return decisiontest.Run{}, err
	}
	js, err := json.Marshal(res)
	if err != nil {
		return decisiontest.Run{}, err
	}
	if checkWrap {
		bare, err := newPolicy()
		if err != nil {
			return decisiontest.Run{}, err
		}
		res2, err := sim.Run(context.Background(), cfg(bare), reqs)
		if err != nil {
			return decisiontest.Run{}, err
		}
		js2, err := json.Marshal(res2)
		if err != nil {
			return decisiontest.Run{}, err
		}
		if string(js) != string(js2) {
			return decisiontest.Run{}, fmt.Errorf("the run with its policy wrapped to record decisions differs from the bare run: " +
				"the router checks an interface of the policy that the recorder in decisions_test.go does not forward")
		}
	}
	return decisiontest.Run{Name: r.name(), Decisions: rec.decisions, Result: js, Scores: rec.scores}, nil
}
