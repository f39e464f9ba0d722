package decisiontest

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/workload"
)

// Request is one OpenAI request of a replayed workload, as a client sends
// it to a front door (`prefixlb serve`, or Envoy in front of `prefixlb
// epp`).
type Request struct {
	// ID is the request's index in the workload.
	ID int
	// Path is /v1/completions or /v1/chat/completions.
	Path string
	// Body is the JSON body.
	Body []byte
	// Session is the x-session-id header ("" none).
	Session string
	// Stream says whether the body asks for a stream.
	Stream bool
}

// Replay is the workload that the front-door tests (internal/proxy's and
// internal/epp's decisions_test.go) replay, sequentially: toolbench
// (popular tools), agent sessions and shared system prompts interleaved,
// n requests in all, in four shapes by turns — a completion of token ids, a
// completion of text, a chat (all three streamed, with usage) and a chat
// that is not streamed — so that every parser and keyer path is taken.
func Replay(n int) ([]Request, error) {
	specs := []workload.Spec{workload.DefaultSpec("toolbench"), workload.DefaultSpec("agent"), workload.DefaultSpec("shared-prefix")}
	specs[0].ToolBench.Tools, specs[0].ToolBench.Zipf = 12, 1.1
	specs[0].ToolBench.DescMedian, specs[0].ToolBench.DescMin, specs[0].ToolBench.DescMax = 700, 300, 1500
	specs[1].Agent.Environments, specs[1].Agent.Concurrent = 6, 3
	specs[2].SharedPrefix.Groups, specs[2].SharedPrefix.SystemTokens, specs[2].SharedPrefix.QuestionTokens = 4, 900, 150
	var lists [][]workload.Request
	for i := range specs {
		specs[i].Requests = n
		specs[i].Seed = 11
		specs[i].Replicas = 3
		reqs, err := workload.Generate(specs[i])
		if err != nil {
			return nil, err
		}
		lists = append(lists, reqs)
	}
	out := make([]Request, 0, n)
	for i := 0; len(out) < n; i++ {
		w := lists[i%len(lists)][i/len(lists)]
		out = append(out, shape(len(out), w))
	}
	return out, nil
}

// word renders token id t as text: one distinct word per id, so that texts
// share exactly the prefixes their token ids share.
func word(t uint32) string { return "w" + strconv.FormatUint(uint64(t%50000), 36) }

func text(ids []uint32) string {
	var b strings.Builder
	for i, t := range ids {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(word(t))
	}
	return b.String()
}

// shape builds request i of the replay from w.
func shape(i int, w workload.Request) Request {
	out := min(max(w.OutputTokens, 1), 8)
	r := Request{ID: i, Session: w.Session, Stream: i%4 != 3}
	body := map[string]any{"model": "m", "max_tokens": out}
	if r.Stream {
		body["stream"] = true
		body["stream_options"] = map[string]any{"include_usage": true}
	}
	switch i % 4 {
	case 0:
		r.Path = "/v1/completions"
		body["prompt"] = w.Tokens
	case 1:
		r.Path = "/v1/completions"
		body["prompt"] = text(w.Tokens)
	default:
		// The system message is the prompt less its last 64 tokens: what
		// requests for one tool, environment or system prompt share.
		r.Path = "/v1/chat/completions"
		cut := max(len(w.Tokens)-64, len(w.Tokens)/2)
		body["messages"] = []map[string]string{
			{"role": "system", "content": text(w.Tokens[:cut])},
			{"role": "user", "content": text(w.Tokens[cut:])},
		}
	}
	b, err := json.Marshal(body)
	if err != nil {
		panic(err)
	}
	r.Body = b
	return r
}

var (
	branchRe  = regexp.MustCompile(`(?:^|;\s*)branch=([^;]*)`)
	matchedRe = regexp.MustCompile(`(?:^|;\s*)matched=(\d+)`)
)

// ParseRoute reads the branch and matched tokens of a decision's
// explanation (policy.Decision.Explain, the x-prefixlb-route header:
// "branch=exploit; matched=4096; r0=...").
func ParseRoute(route string) (branch string, matched int, err error) {
	b := branchRe.FindStringSubmatch(route)
	m := matchedRe.FindStringSubmatch(route)
	if b == nil || m == nil {
		return "", 0, fmt.Errorf("no branch= and matched= in the route explanation %q", route)
	}
	matched, err = strconv.Atoi(m[1])
	return strings.TrimSpace(b[1]), matched, err
}

// ReplayRequests is the length of the replayed workload: under the 50
// requests a replica that e2 and e2-preble wait for before they rebalance
// (WarmupPerReplica), so that no decision depends on the wall clock.
const ReplayRequests = 96

// RaceRequests is how many of them a replay sends under the race detector
// (Run.Prefix).
const RaceRequests = 32

// FrontDoorRun is one replay of Replay(ReplayRequests) through a front
// door (`serve` or `epp`), before three replicas r0, r1, r2.
type FrontDoorRun struct {
	// Policy is the policy spec (policy.Parse).
	Policy string
	// Cluster is "plain" (vLLM replicas, chunk keys, no feeds), "scraped"
	// (their /metrics read once before the replay: a fixed load that
	// differs by replica, which llm-d's scorers read), "llamacpp"
	// (llama-servers of two slots, their slot count read before the
	// replay) or "tokenizer" (prompts keyed by the bundled qwen3
	// tokenizer's ids).
	Cluster string
	// Window is how many requests are in flight when one is decided, it
	// included: 1 sends them one at a time; with more, request k is sent
	// while k-Window+1..k-1 are held by their replicas before their first
	// token, and k-Window+1 is let go once k has been routed.
	Window int
}

// Name is the run's name in the golden files.
func (r FrontDoorRun) Name() string { return fmt.Sprintf("%s w%d %s", r.Cluster, r.Window, r.Policy) }

// Slow reports whether the run takes seconds before its first request (it
// loads the tokenizer: 1.5 s, 13 s under the race detector); the tests
// leave it out under the race detector.
func (r FrontDoorRun) Slow() bool { return r.Cluster == "tokenizer" }

// FrontDoorRuns are the replays pinned for both front doors: one request at
// a time, the policies that do not merely pick the least loaded replica
// (with nothing in flight that is always r0); with four in flight, every
// policy whose decisions do not read the wall clock (not e2-preble, whose
// decode term prices the requests in flight at the TPOT it measured); on
// the other clusters, the policies that read load, slots or token keys.
// E2's windows (3 minutes, an hour for mixing) are longer than any replay,
// and its rebalancing waits for more requests than a replay has (but in
// e2Rebalance, which runs it on every decision, without replication, whose
// trigger is measured TTFTs). The tokenizer run is first: loading the
// tokenizer is the slowest step, and runs go side by side. Calibration is
// off throughout: it learns from wall-clock timings (the simulator's
// goldens cover it).
func FrontDoorRuns() []FrontDoorRun {
	const (
		e2Mixing    = "e2:mixing=true:exploit_assigned_only=true:prefill_weight=2:window=1h:mix_window=1h:mix_hit_ratio=0.5"
		e2Rebalance = "e2:warmup_per_replica=5:min_hot_count=1:rebalance_interval=0s:move_cooldown=0s:replicate=false:movable_load_only=false:history_weight=1"
		llmdWeights = "llmd-precise:prefix_weight=1:kv_weight=3:queue_weight=2"
	)
	runs := []FrontDoorRun{{"e2", "tokenizer", 4}}
	for _, p := range []string{"round-robin", "random", "session", "llmd-precise", "llmd-approx", "dynamo",
		"e2", "e2-preble", e2Mixing, e2Rebalance} {
		runs = append(runs, FrontDoorRun{p, "plain", 1})
	}
	for _, p := range []string{"least-load", "power-of-two", "prefix", "llmd-precise", "llmd-approx", "sglang", "dynamo",
		"e2", e2Rebalance, llmdWeights} {
		runs = append(runs, FrontDoorRun{p, "plain", 4})
	}
	for _, p := range []string{"llmd-precise", "llmd-approx"} {
		runs = append(runs, FrontDoorRun{p, "scraped", 4})
	}
	for _, p := range []string{"llmd-precise", "sglang", "e2"} {
		runs = append(runs, FrontDoorRun{p, "llamacpp", 4})
	}
	return append(runs, FrontDoorRun{"e2-preble", "llamacpp", 1})
}

// Engines returns the three fake replicas of cluster c (FrontDoorRun):
// llama.cpp's for "llamacpp", else vLLM's, each with its own fixed load.
func Engines(c string) []*Engine {
	var es []*Engine
	for i := range 3 {
		e := &Engine{Waiting: i % 2, Running: 2 * i, KVUsage: 0.3 + 0.05*float64(i)}
		if c == "llamacpp" {
			e.Kind = "llamacpp"
		}
		es = append(es, e)
	}
	return es
}

// ReplayFrontDoor replays Replay(ReplayRequests) through a front door once
// per FrontDoorRuns, four runs side by side (each has its own router and
// replicas; each one's requests go in a fixed order), and returns the runs
// in order. Under the race detector only the first RaceRequests requests
// are replayed, the slow runs (a tokenizer to load) are left empty, and
// runs are marked Prefix without a result. An error of any run fails t.
func ReplayFrontDoor(t testing.TB, replay func(FrontDoorRun, []Request) (Run, error)) []Run {
	t.Helper()
	reqs, err := Replay(ReplayRequests)
	if err != nil {
		t.Fatal(err)
	}
	if RaceEnabled {
		reqs = reqs[:RaceRequests]
	}
	runs := FrontDoorRuns()
	out := make([]Run, len(runs))
	errs := make([]error, len(runs))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i, r := range runs {
		out[i] = Run{Name: r.Name(), Prefix: RaceEnabled}
		if RaceEnabled && r.Slow() {
			continue // an empty prefix
		}
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			run, err := replay(r, reqs)
			run.Name, run.Prefix, errs[i] = r.Name(), RaceEnabled, err
			if run.Prefix {
				run.Result = nil
			}
			out[i] = run
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", runs[i].Name(), err)
		}
	}
	return out
}
