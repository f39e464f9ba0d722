package sim

import (
	"context"
	"crypto/sha256"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/replica"
)

var update = flag.Bool("update", false, "rewrite testdata/vllm-golden.txt from this run")

// goldenRuns are the block-cache (vLLM) runs whose every per-request figure
// testdata/vllm-golden.txt pins: a change to the replica model or the
// simulator that moves any of them fails TestBlockCacheGolden.
func goldenRuns() []struct {
	name string
	cfg  func() Config
} {
	prof, _ := costmodel.Lookup("mistral-7b-a6000")
	small := replica.DefaultConfig()
	small.KVCapacity = 20000 // evictions and preemptions
	lpm := small
	lpm.Local = replica.LocalLPM
	prio := replica.DefaultConfig()
	prio.Local = replica.LocalPriority
	unchunked := small
	unchunked.ChunkBudget = replica.NoChunking
	pol := func(name string) policy.Policy {
		p, err := policy.New(name, policy.DefaultOptions())
		if err != nil {
			panic(err)
		}
		return p
	}
	type run = struct {
		name string
		cfg  func() Config
	}
	return []run{
		{"e2 events", func() Config {
			return Config{Replicas: 3, Replica: replica.DefaultConfig(), Profile: prof, Policy: pol("e2"), KVEvents: true, EventLag: 5 * time.Millisecond, Seed: 42}
		}},
		{"e2 mirror small lpm", func() Config {
			return Config{Replicas: 2, Replica: lpm, Profile: prof, Policy: pol("e2"), Seed: 1}
		}},
		{"llmd-precise events small", func() Config {
			return Config{Replicas: 2, Replica: small, Profile: prof, Policy: pol("llmd-precise"), KVEvents: true, EventLag: time.Millisecond}
		}},
		{"e2-preble priority", func() Config {
			return Config{Replicas: 3, Replica: prio, Profile: prof, Policy: pol("e2-preble"), KVEvents: true, EventLag: 10 * time.Millisecond, Seed: 3}
		}},
		{"round-robin unchunked small", func() Config {
			return Config{Replicas: 2, Replica: unchunked, Profile: prof, Policy: pol("round-robin")}
		}},
	}
}

// TestBlockCacheGolden checks that the block-cache simulation gives exactly
// the figures it gave when the golden file was written (`go test
// ./internal/sim -run Golden -update` rewrites it, for a change meant to
// move them). The digests hash each request's replica, times, cached and
// output tokens and error, and each replica's counters; they are amd64's (other architectures may fuse
// floating-point operations and move a time by a nanosecond).
func TestBlockCacheGolden(t *testing.T) {
	if runtime.GOARCH != "amd64" && !*update {
		t.Skip("the golden digests are amd64's")
	}
	reqs := sharedPrefix(300, 10, 1500, 100, 25, 5)
	var got []string
	for _, g := range goldenRuns() {
		res, err := Run(context.Background(), g.cfg(), reqs)
		if err != nil {
			t.Fatalf("%s: %v", g.name, err)
		}
		h := sha256.New()
		for _, r := range res.Records {
			fmt.Fprintf(h, "%d %s %v %v %v %d %d %q\n", r.ID, r.Replica, r.TTFTMs, r.LatencyMs, r.TPOTMs,
				r.CachedTokens, r.OutputTokens, r.Error)
		}
		fmt.Fprintf(h, "%v\n", res.Span)
		for _, st := range res.Replicas {
			fmt.Fprintf(h, "%d %d %d %d %d %v\n", st.Iterations, st.Preemptions, st.PromptTokensComputed,
				st.PrefixCacheHits, st.CachedBlocks, st.BusyTime)
		}
		got = append(got, fmt.Sprintf("%s: %x", g.name, h.Sum(nil)))
	}
	path := filepath.Join("testdata", "vllm-golden.txt")
	if *update {
		if err := os.WriteFile(path, []byte(strings.Join(got, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	want := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(want) != len(got) {
		t.Fatalf("%d golden digests, %d runs", len(want), len(got))
	}
	for i := range got {
		if got[i] != want[i] {
			t.Errorf("run changed:\n got %s\nwant %s", got[i], want[i])
		}
	}
}
