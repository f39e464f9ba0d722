package router

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/prefixtree"
)

const bt = 16

var t0 = time.Unix(1_700_000_000, 0)

func at(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

func toks(seed uint64, n int) []uint32 {
	rng := rand.New(rand.NewPCG(seed, 3))
	t := make([]uint32, n)
	for i := range t {
		t[i] = rng.Uint32N(1 << 20)
	}
	return t
}

func req(id uint64, tokens []uint32) policy.Request {
	return policy.Request{ID: id, Keys: blocks.Keys(nil, tokens, bt), PromptTokens: len(tokens), OutputTokens: 10}
}

func profile(t testing.TB) costmodel.Profile {
	p, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func newRouter(t testing.TB, pol policy.Policy, mirrorTokens int, replicas ...bool) *Router {
	t.Helper()
	r, err := New(Config{BlockTokens: bt, Profile: profile(t), Policy: pol, Seed: 1, MirrorCapacityTokens: mirrorTokens})
	if err != nil {
		t.Fatal(err)
	}
	for i, events := range replicas {
		r.AddReplica(fmt.Sprint("replica-", i), events)
	}
	return r
}

func TestConfigErrors(t *testing.T) {
	prof := profile(t)
	tests := []struct {
		cfg  Config
		want string
	}{
		{Config{BlockTokens: 0, Profile: prof, Policy: &policy.RoundRobin{}}, "block_tokens"},
		{Config{BlockTokens: bt, Policy: &policy.RoundRobin{}}, "cost profile"},
		{Config{BlockTokens: bt, Profile: prof}, "policy"},
		{Config{BlockTokens: bt, Profile: prof, Policy: &policy.RoundRobin{}, TreeMaxBlocks: -1}, "tree_max_blocks"},
		{Config{BlockTokens: bt, Profile: prof, Policy: &policy.RoundRobin{}, MirrorCapacityTokens: -1}, "mirror_capacity_tokens"},
		{Config{BlockTokens: bt, Profile: prof, Policy: &policy.RoundRobin{}, DefaultOutputTokens: -1}, "default_output_tokens"},
	}
	for _, tt := range tests {
		if _, err := New(tt.cfg); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("New: err %v, want one naming %s", err, tt.want)
		}
	}
}

// TestBadInput: bad input gets an error that names the problem; nothing
// panics and nothing is left in flight.
func TestBadInput(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, false, false)
	good := req(1, toks(1, 64))
	tests := []struct {
		name string
		req  policy.Request
		err  error
		msg  string
	}{
		{"empty prompt", policy.Request{ID: 1}, ErrEmptyPrompt, "empty prompt"},
		{"negative prompt", policy.Request{ID: 1, PromptTokens: -5}, ErrEmptyPrompt, "empty prompt"},
		{"fewer tokens than blocks", policy.Request{ID: 1, Keys: good.Keys, PromptTokens: 63}, ErrBadRequest, "63 prompt tokens but 4 blocks"},
		{"negative output", policy.Request{ID: 1, Keys: good.Keys, PromptTokens: 64, OutputTokens: -1}, ErrBadRequest, "negative output tokens"},
	}
	for _, tt := range tests {
		_, err := r.Route(tt.req, at(0))
		if !errors.Is(err, tt.err) || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("%s: err %v, want %v saying %q", tt.name, err, tt.err, tt.msg)
		}
	}
	if r.InFlight() != 0 {
		t.Fatalf("%d in flight after rejected requests", r.InFlight())
	}
	if _, err := r.Route(good, at(0)); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Route(good, at(0)); !errors.Is(err, ErrDuplicateFlight) {
		t.Errorf("duplicate id: %v", err)
	}
	for _, err := range []error{r.FirstToken(99, at(1)), r.Finished(99, 1, -1, true, at(1))} {
		if !errors.Is(err, ErrUnknownRequest) || !strings.Contains(err.Error(), "99") {
			t.Errorf("unknown request: %v", err)
		}
	}
	for _, tt := range []struct {
		id   int
		kv   float64
		want error
	}{
		{0, math.NaN(), ErrBadLoad}, {0, math.Inf(1), ErrBadLoad}, {0, math.Inf(-1), ErrBadLoad},
		{0, 1.5, ErrBadLoad}, {7, 0.5, ErrUnknownReplica}, {-1, 0.5, ErrUnknownReplica},
		{0, 0.5, nil}, {0, -3, nil}, {0, 1, nil},
	} {
		if err := r.ReplicaLoad(tt.id, 1, 1, tt.kv); !errors.Is(err, tt.want) {
			t.Errorf("ReplicaLoad(%d, kv %v): %v, want %v", tt.id, tt.kv, err, tt.want)
		}
	}
	if err := r.ReplicaLoad(1, -9, -9, -3); err != nil {
		t.Fatal(err)
	}
	if rp, _ := r.Replica(1); rp.Waiting != -1 || rp.Running != -1 || rp.KVUsage != -1 {
		t.Errorf("negative figures are not normalised to unknown: %+v", rp)
	}
	for _, err := range []error{
		r.SetUp(5, false, at(0)), r.SetEvents(-1, true), r.CacheStored(2, 0, false, good.Keys, at(0)),
		r.CacheRemoved(9, good.Keys), r.CacheCleared(3),
	} {
		if !errors.Is(err, ErrUnknownReplica) {
			t.Errorf("unknown replica: %v", err)
		}
	}
	if _, err := r.Replica(4); !errors.Is(err, ErrUnknownReplica) {
		t.Errorf("Replica(4): %v", err)
	}
}

func TestNoReplicaUp(t *testing.T) {
	for _, name := range policy.Names() {
		pol, err := policy.New(name, policy.DefaultOptions())
		if err != nil {
			t.Fatal(err)
		}
		r := newRouter(t, pol, 0)
		if _, err := r.Route(req(1, toks(1, 64)), at(0)); !errors.Is(err, policy.ErrNoReplica) {
			t.Errorf("%s with no replicas: %v, want ErrNoReplica", name, err)
		}
		r.AddReplica("a", false)
		if err := r.SetUp(0, false, at(0)); err != nil {
			t.Fatal(err)
		}
		if _, err := r.Route(req(2, toks(1, 64)), at(0)); !errors.Is(err, policy.ErrNoReplica) {
			t.Errorf("%s with its only replica down: %v, want ErrNoReplica", name, err)
		}
		if r.InFlight() != 0 {
			t.Errorf("%s: a failed route left a request in flight", name)
		}
	}
}

// TestMirrorMode: for a replica without KV events the router marks the
// routed path cached and evicts its least recently used unreferenced blocks
// beyond MirrorCapacityTokens.
func TestMirrorMode(t *testing.T) {
	r := newRouter(t, policy.LeastLoad{}, 8*bt, false)
	a, b, c, d := toks(1, 64), toks(2, 64), toks(3, 64), toks(4, 64)
	route := func(id uint64, tokens []uint32, ms int, finish bool) {
		t.Helper()
		if _, err := r.Route(req(id, tokens), at(ms)); err != nil {
			t.Fatal(err)
		}
		if finish {
			if err := r.Finished(id, 10, -1, true, at(ms)); err != nil {
				t.Fatal(err)
			}
		}
	}
	cached := func(tokens []uint32) int {
		var m prefixtree.Match
		r.Tree().Lookup(blocks.Keys(nil, tokens, bt), &m)
		return m.PerReplica[0]
	}
	route(1, a, 1, true)
	route(2, b, 2, false) // b stays in flight
	if got := r.Tree().CachedBlocks(0); got != 8 {
		t.Fatalf("mirror caches %d blocks, want 8", got)
	}
	route(3, c, 3, true) // over capacity: a (LRU, unreferenced) goes
	route(4, d, 4, true) // over again: b is referenced, so c goes
	for _, tt := range []struct {
		name   string
		tokens []uint32
		want   int
	}{{"a", a, 0}, {"b", b, 4}, {"c", c, 0}, {"d", d, 4}} {
		if got := cached(tt.tokens); got != tt.want {
			t.Errorf("prompt %s: %d blocks cached, want %d", tt.name, got, tt.want)
		}
	}
	// A repeat hits: the decision reports the mirrored tokens.
	dec, err := r.Route(req(5, d), at(5))
	if err != nil || dec.MatchedTokens != 64 {
		t.Errorf("repeat of d: matched %d (%v), want 64", dec.MatchedTokens, err)
	}
	// Switching events on drops the mirror: events are the truth.
	if err := r.SetEvents(0, true); err != nil {
		t.Fatal(err)
	}
	if got := r.Tree().CachedBlocks(0); got != 0 {
		t.Errorf("after SetEvents the mirror still holds %d blocks", got)
	}
}

// TestEventMode: a replica with KV events is cached only as its events say.
// speculating wraps a policy so that it asks for speculative entries.
type speculating struct{ policy.Policy }

func (speculating) Speculative() bool { return true }

func TestEventMode(t *testing.T) {
	r := newRouter(t, speculating{policy.LeastLoad{}}, 0, true)
	a := req(1, toks(1, 64))
	if _, err := r.Route(a, at(0)); err != nil {
		t.Fatal(err)
	}
	var m prefixtree.Match
	cached := func() int {
		r.Tree().Lookup(a.Keys, &m)
		return m.PerReplica[0]
	}
	// Routing marks the prompt speculatively (the engine's events lag);
	// with no event to confirm it, the mark expires.
	if got := cached(); got != 4 {
		t.Fatalf("routing marked %d blocks speculatively on an event replica, want 4", got)
	}
	r.ExpireSpeculative(at(0).Add(DefaultSpeculativeTTL))
	if got := cached(); got != 0 {
		t.Fatalf("unconfirmed speculative marks left %d blocks cached", got)
	}
	steps := []struct {
		name string
		do   func() error
		want int
	}{
		{"stored head", func() error { return r.CacheStored(0, 0, false, a.Keys[:2], at(1)) }, 2},
		{"stored tail below block 1", func() error { return r.CacheStored(0, a.Keys[1], true, a.Keys[2:], at(2)) }, 4},
		{"stored nothing", func() error { return r.CacheStored(0, a.Keys[3], true, nil, at(2)) }, 4},
		{"removed block 2", func() error { return r.CacheRemoved(0, a.Keys[2:3]) }, 2},
		{"removed unknown keys", func() error { return r.CacheRemoved(0, []blocks.Key{12345}) }, 2},
		{"re-stored block 2", func() error { return r.CacheStored(0, a.Keys[1], true, a.Keys[2:3], at(3)) }, 4},
		{"cleared", func() error { return r.CacheCleared(0) }, 0},
	}
	for _, s := range steps {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.name, err)
		}
		if got := cached(); got != s.want {
			t.Errorf("after %s: %d blocks cached, want %d", s.name, got, s.want)
		}
	}
	// Blocks the router never saw (events from another router's traffic).
	other := blocks.Keys(nil, toks(9, 48), bt)
	if err := r.CacheStored(0, other[0], true, other[1:], at(4)); !errors.Is(err, prefixtree.ErrUnknownParent) {
		t.Errorf("unknown parent: %v, want ErrUnknownParent", err)
	}
	if err := r.CacheStored(0, 0, false, other, at(4)); err != nil || r.Tree().CachedBlocks(0) != 3 {
		t.Errorf("stored from the root: %v, %d blocks cached", err, r.Tree().CachedBlocks(0))
	}
}

func zeroLoad(t *testing.T, r *Router) {
	t.Helper()
	for _, rp := range r.Replicas() {
		if rp.InFlight != 0 || rp.Prefilling != 0 || rp.Decoding != 0 || rp.PendingPrefill != 0 ||
			rp.PendingPrefillTokens != 0 || rp.DecodeTokens != 0 || rp.DecodeContextTokens != 0 {
			t.Errorf("replica %d not idle after every request finished: %+v", rp.ID, rp)
		}
	}
	if r.InFlight() != 0 {
		t.Errorf("%d requests still in flight", r.InFlight())
	}
}

// TestInFlightAccounting: the per-replica figures follow each request
// through routing, first token and finish, back to zero.
func TestInFlightAccounting(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, false, false)
	prof := profile(t)
	shared := toks(1, 512)
	r1 := req(1, append(append([]uint32{}, shared...), toks(2, 64)...))
	r1.OutputTokens = 0 // the default, 256
	if _, err := r.Route(r1, at(0)); err != nil {
		t.Fatal(err)
	}
	rp, _ := r.Replica(0)
	want := policy.Replica{InFlight: 1, Prefilling: 1, PendingPrefill: prof.Prefill(576, 576), PendingPrefillTokens: 576, DecodeTokens: 256}
	if rp.InFlight != want.InFlight || rp.Prefilling != want.Prefilling || rp.PendingPrefill != want.PendingPrefill ||
		rp.PendingPrefillTokens != want.PendingPrefillTokens || rp.DecodeTokens != want.DecodeTokens {
		t.Fatalf("after Route: %+v, want %+v", rp, want)
	}
	if err := r.FirstToken(1, at(100)); err != nil {
		t.Fatal(err)
	}
	if err := r.FirstToken(1, at(150)); err != nil { // a second first token is ignored
		t.Fatal(err)
	}
	rp, _ = r.Replica(0)
	if rp.Prefilling != 0 || rp.PendingPrefill != 0 || rp.Decoding != 1 || rp.DecodeContextTokens != 576+128 {
		t.Fatalf("after FirstToken: %+v", rp)
	}
	// Replica 1, then 0 again (a hit on the shared part: less to prefill).
	r2, r3 := req(2, toks(3, 100)), req(3, append(append([]uint32{}, shared...), toks(4, 64)...))
	for _, q := range []policy.Request{r2, r3} {
		if _, err := r.Route(q, at(200)); err != nil {
			t.Fatal(err)
		}
	}
	rp, _ = r.Replica(0)
	if rp.PendingPrefillTokens != 64 || rp.InFlight != 2 {
		t.Errorf("hit request: pending %d tokens, in flight %d, want 64 and 2", rp.PendingPrefillTokens, rp.InFlight)
	}
	if err := r.Finished(2, 0, -1, false, at(300)); err != nil { // failed before its first token
		t.Fatal(err)
	}
	if err := r.Finished(1, 256, 0, true, at(400)); err != nil {
		t.Fatal(err)
	}
	if err := r.Finished(3, 10, 512, true, at(400)); err != nil {
		t.Fatal(err)
	}
	zeroLoad(t, r)
	st := r.Stats()
	if st.Routed != 3 || st.Finished != 2 || st.Failed != 1 || st.PredictionsChecked != 2 || st.PredictionsExact != 2 || st.PredictedTokens != 512 || st.ReportedTokens != 512 {
		t.Errorf("stats %+v", st)
	}
	if err := r.Finished(3, 10, -1, true, at(500)); !errors.Is(err, ErrUnknownRequest) {
		t.Errorf("second Finished: %v", err)
	}
}

// refsEqual checks every node on the prompts against want(replica, key).
func refsEqual(t *testing.T, r *Router, prompts [][]blocks.Key, want func(r int, k blocks.Key) int) {
	t.Helper()
	for _, p := range prompts {
		for _, k := range p {
			n, _, ok := r.Tree().Find(k)
			if !ok {
				t.Fatalf("key %x of a routed prompt left the tree", k)
			}
			for rep := 0; rep < r.Tree().Replicas(); rep++ {
				if got, w := n.Ref(rep), want(rep, k); got != w {
					t.Fatalf("key %x: Ref(%d) = %d, want %d", k, rep, got, w)
				}
			}
		}
	}
}

// TestRefsAfterSplits: Finished looks the path up again, so refs stay right
// when later requests and KV events split the nodes a request passed.
func TestRefsAfterSplits(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, true, false, true)
	shared := toks(1, 256)
	var reqs []policy.Request
	var prompts [][]blocks.Key
	held := map[int]map[blocks.Key]int{0: {}, 1: {}, 2: {}}
	route := func(tokens []uint32) {
		q := req(uint64(len(reqs)+1), tokens)
		d, err := r.Route(q, at(len(reqs)))
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range q.Keys {
			held[d.Replica][k]++
		}
		reqs = append(reqs, q)
		prompts = append(prompts, q.Keys)
	}
	route(append(append([]uint32{}, shared...), toks(2, 256)...)) // one long node
	route(append(append([]uint32{}, shared...), toks(3, 128)...)) // splits it at 16 blocks
	route(shared[:128])                                           // splits the shared part at 8
	route(append(append([]uint32{}, shared...), toks(2, 96)...))  // splits the first tail at 6
	// Events split more: a single block removed from the middle.
	if err := r.CacheStored(0, 0, false, prompts[0], at(10)); err != nil {
		t.Fatal(err)
	}
	if err := r.CacheRemoved(0, prompts[0][20:21]); err != nil {
		t.Fatal(err)
	}
	refsEqual(t, r, prompts, func(rep int, k blocks.Key) int { return held[rep][k] })
	for i, q := range reqs {
		if i%2 == 0 {
			if err := r.FirstToken(q.ID, at(20)); err != nil {
				t.Fatal(err)
			}
		}
		if err := r.Finished(q.ID, 5, -1, true, at(30)); err != nil {
			t.Fatal(err)
		}
	}
	refsEqual(t, r, prompts, func(int, blocks.Key) int { return 0 })
	zeroLoad(t, r)
}

// lockedRouter is how the proxy uses the router: one mutex around it.
type lockedRouter struct {
	mu   sync.Mutex // guards r and tick
	r    *Router
	tick int
}

func (l *lockedRouter) now() time.Time { l.tick++; return at(l.tick) }

// TestConcurrentRouter runs every policy behind a mutex with many goroutines
// routing, reporting first tokens and finishing at once (run with -race), and
// checks that all in-flight accounting returns to zero.
func TestConcurrentRouter(t *testing.T) {
	for _, name := range policy.Names() {
		t.Run(name, func(t *testing.T) {
			pol, err := policy.New(name, policy.DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			l := &lockedRouter{r: newRouter(t, pol, 64*bt, false, true, false, false)}
			const workers, each = 8, 60
			prompts := make([][]uint32, 16)
			for i := range prompts {
				prompts[i] = append(toks(uint64(i%4), 256), toks(uint64(100+i), 32*(i%5))...)
			}
			var wg sync.WaitGroup
			errs := make(chan error, workers)
			for w := 0; w < workers; w++ {
				wg.Add(1)
				go func(w int) {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(uint64(w), 1))
					for i := 0; i < each; i++ {
						id := uint64(w*each + i + 1)
						q := req(id, prompts[rng.IntN(len(prompts))])
						l.mu.Lock()
						d, err := l.r.Route(q, l.now())
						if err == nil && !l.r.reps[d.Replica].Up {
							err = fmt.Errorf("routed to down replica %d", d.Replica)
						}
						if i%10 == 0 {
							_ = l.r.SetUp(rng.IntN(4), rng.IntN(3) > 0, l.now())
							_ = l.r.ReplicaLoad(rng.IntN(4), rng.IntN(5), rng.IntN(5), rng.Float64())
						}
						if err == nil && d.Replica == 1 {
							_ = l.r.CacheStored(1, 0, false, q.Keys, l.now())
						}
						l.mu.Unlock()
						if errors.Is(err, policy.ErrNoReplica) {
							continue
						}
						if err != nil {
							errs <- err
							return
						}
						l.mu.Lock()
						ferr := l.r.FirstToken(id, l.now())
						l.mu.Unlock()
						l.mu.Lock()
						if err := l.r.Finished(id, 7, -1, rng.IntN(8) > 0, l.now()); err != nil && ferr == nil {
							ferr = err
						}
						l.mu.Unlock()
						if ferr != nil {
							errs <- ferr
							return
						}
					}
				}(w)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Fatal(err)
			}
			l.mu.Lock()
			defer l.mu.Unlock()
			zeroLoad(t, l.r)
			var keys [][]blocks.Key
			for _, p := range prompts {
				keys = append(keys, blocks.Keys(nil, p, bt))
			}
			refsEqual(t, l.r, keys, func(int, blocks.Key) int { return 0 })
		})
	}
}

func TestSetExternalLoad(t *testing.T) {
	pol, err := policy.New("least-load", policy.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{BlockTokens: 16, Profile: profile(t), Policy: pol})
	if err != nil {
		t.Fatal(err)
	}
	a, b := r.AddReplica("a", false), r.AddReplica("b", false)
	now := time.Unix(100, 0)
	// Another router has 3 requests on a: least-load must pick b twice.
	if err := r.SetExternalLoad(a, ExternalLoad{InFlight: 3, DecodeTokens: 30}); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		d, err := r.Route(policy.Request{ID: uint64(i + 1), PromptTokens: 32}, now)
		if err != nil {
			t.Fatal(err)
		}
		if d.Replica != b {
			t.Fatalf("request %d went to %d, want %d", i+1, d.Replica, b)
		}
	}
	// Replacing, not adding: the figure drops back.
	if err := r.SetExternalLoad(a, ExternalLoad{InFlight: 1}); err != nil {
		t.Fatal(err)
	}
	got, _ := r.Replica(a)
	if got.InFlight != 1 || got.DecodeTokens != 0 {
		t.Fatalf("replica a = in flight %d, decode %d; want 1, 0", got.InFlight, got.DecodeTokens)
	}
	if err := r.Finished(1, 1, -1, true, now); err != nil {
		t.Fatal(err)
	}
	if err := r.SetExternalLoad(a, ExternalLoad{}); err != nil {
		t.Fatal(err)
	}
	if got, _ := r.Replica(a); got.InFlight != 0 {
		t.Fatalf("replica a in flight %d after clearing, want 0", got.InFlight)
	}
	if err := r.SetExternalLoad(7, ExternalLoad{}); err == nil {
		t.Fatal("SetExternalLoad(7) on 2 replicas: no error")
	}
}
