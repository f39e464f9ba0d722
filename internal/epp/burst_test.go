package epp

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/openai"

	"github.com/prefixlb/prefixlb/internal/sharedstate"
)

// spread is max/min of the replicas' true in-flight counts (every
// router's requests on them); +Inf-free: a replica with none counts 0.5.
func spread(routers []*Picker) (ratio float64, counts []int) {
	byName := map[string]int{}
	var names []string
	for _, p := range routers {
		for _, r := range p.Replicas() {
			if _, ok := byName[r.Name]; !ok {
				names = append(names, r.Name)
			}
			byName[r.Name] += r.InFlight
		}
	}
	for _, n := range names {
		counts = append(counts, byName[n])
	}
	return maxMin(counts), counts
}

// maxMin is max/min of counts, a 0 counting 0.5.
func maxMin(counts []int) float64 {
	lo, hi := 1<<30, 0
	for _, c := range counts {
		lo, hi = min(lo, c), max(hi, c)
	}
	return float64(hi) / max(float64(lo), 0.5)
}

// burstBody is request k of a burst: a distinct prompt of 1-8k tokens.
func burstBody(rng *rand.Rand, k int) []byte {
	words := 200 + rng.IntN(1800)
	return completionBody(fmt.Sprintf("request %d: %s", k, strings.Repeat("lorem ipsum ", words)), true)
}

// burst sends n requests, round-robin over routers, none finishing, and
// returns the worst spread seen once every replica could have had one
// (k ≥ replicas) and the final one.
func burst(t *testing.T, routers []*Picker, replicas, n int, seed uint64) (worst, final float64, counts []int) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 1))
	for k := range n {
		body := burstBody(rng, k)
		if _, err := routers[k%len(routers)].Pick(context.Background(), Input{Kind: openai.KindCompletion, Body: body}); err != nil {
			t.Fatal(err)
		}
		if k+1 >= replicas {
			r, _ := spread(routers)
			worst = max(worst, r)
		}
	}
	final, counts = spread(routers)
	return worst, final, counts
}

// burstRouters returns k pickers over the same replicas, sharing through
// shared[i] when given.
func burstRouters(t *testing.T, policy string, replicas int, shared []Shared) []*Picker {
	var out []*Picker
	for i, s := range shared {
		p := newTestPicker(t, Config{Policy: policy, Shared: s, Seed: uint64(i + 1)}, replicas)
		out = append(out, p)
	}
	return out
}

// TestBurstSpread: under a burst, two routers that share in-flight load
// spread requests as one router does; two that do not, pick the same
// replicas at the same moments.
func TestBurstSpread(t *testing.T) {
	const replicas, n = 4, 30
	redisAddr := os.Getenv("PREFIXLB_TEST_REDIS")
	if redisAddr == "" {
		redisAddr = "127.0.0.1:6379"
	}
	haveRedis := false
	if c, err := net.DialTimeout("tcp", redisAddr, 200*time.Millisecond); err == nil {
		c.Close()
		haveRedis = true
	}
	for _, pol := range []string{"e2", "least-load"} {
		t.Run(pol, func(t *testing.T) {
			one, oneFinal, oneCounts := burst(t, burstRouters(t, pol, replicas, []Shared{nil}), replicas, n, 7)
			two, twoFinal, twoCounts := burst(t, burstRouters(t, pol, replicas, []Shared{nil, nil}), replicas, n, 7)
			m := sharedstate.NewMemory()
			mem, memFinal, memCounts := burst(t, burstRouters(t, pol, replicas, []Shared{m.Client("a"), m.Client("b")}), replicas, n, 7)
			t.Logf("%s, %d replicas, burst of %d: worst max/min in flight (final, counts)", pol, replicas, n)
			t.Logf("  one router:               %.2f (%.2f %v)", one, oneFinal, oneCounts)
			t.Logf("  two routers, no sharing:  %.2f (%.2f %v)", two, twoFinal, twoCounts)
			t.Logf("  two routers, shared mem:  %.2f (%.2f %v)", mem, memFinal, memCounts)
			if mem > one+0.01 {
				t.Errorf("two routers sharing load: worst spread %.2f, want ≤ one router's %.2f", mem, one)
			}
			if haveRedis {
				pool := fmt.Sprintf("burst-%s-%d", pol, time.Now().UnixNano())
				var shared []Shared
				for _, id := range []string{"a", "b"} {
					r, err := sharedstate.NewRedis(sharedstate.RedisConfig{URL: "redis://" + redisAddr + "/0", Pool: pool, Router: id, Timeout: time.Second})
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { r.Close() })
					shared = append(shared, r)
				}
				red, redFinal, redCounts := burst(t, burstRouters(t, pol, replicas, shared), replicas, n, 7)
				t.Logf("  two routers, Redis:       %.2f (%.2f %v)", red, redFinal, redCounts)
				if red > one+0.01 {
					t.Errorf("two routers sharing through Redis: worst spread %.2f, want ≤ one router's %.2f", red, one)
				}
			} else {
				t.Logf("  two routers, Redis:       skipped (no server at %s)", redisAddr)
			}
		})
	}
}
