package router

import (
	"errors"
	"testing"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// TestKVCapacity: a replica's KV capacity is the engine's figure when one
// was set, else the configured mirror capacity, else its profile's; each
// source is reported, policies see the figure, and a mirrored cache is
// bounded by it — per replica, in a pool of two cache sizes.
func TestKVCapacity(t *testing.T) {
	r := newRouter(t, &policy.RoundRobin{}, 0, false, false)
	profileKV := profile(t).KVCapacity()
	for id := range 2 {
		if n, src := r.KVCapacity(id); n != profileKV || src != CapacityProfile {
			t.Errorf("replica %d before the engine said: %d %q, want %d %q", id, n, src, profileKV, CapacityProfile)
		}
	}
	if err := r.SetKVCapacity(0, 20*bt, "engine:vllm-metrics"); err != nil {
		t.Fatal(err)
	}
	if err := r.SetKVCapacity(1, 200*bt, "engine:llamacpp-props"); err != nil {
		t.Fatal(err)
	}
	for id, want := range []struct {
		n   int
		src string
	}{{20 * bt, "engine:vllm-metrics"}, {200 * bt, "engine:llamacpp-props"}} {
		if n, src := r.KVCapacity(id); n != want.n || src != want.src {
			t.Errorf("replica %d: %d %q, want %d %q", id, n, src, want.n, want.src)
		}
		if rp, _ := r.Replica(id); rp.KVCapacity != want.n {
			t.Errorf("replica %d: policy.Replica.KVCapacity %d, want %d", id, rp.KVCapacity, want.n)
		}
		v, _ := r.CacheView(id)
		if v.ConfiguredCapacityTokens != want.n || v.ConfiguredCapacitySource != want.src || v.CapacityTokens != want.n {
			t.Errorf("replica %d: cache view %+v", id, v)
		}
	}
	// Round robin puts 30 blocks on each replica, then one more block each
	// once they finished: replica 0's mirror keeps at most 20 (its LRU
	// prompt goes whole), replica 1's all 31.
	for i, n := range []int{30, 30, 1, 1} {
		q := req(uint64(i+1), toks(uint64(i+1), n*bt))
		d, err := r.Route(q, at(i))
		if err != nil {
			t.Fatal(err)
		}
		if d.Replica != i%2 {
			t.Fatalf("request %d went to %d", i, d.Replica)
		}
		if err := r.Finished(q.ID, 1, -1, true, at(10+i)); err != nil {
			t.Fatal(err)
		}
	}
	if got := r.tree.CachedBlocks(0); got > 20 {
		t.Errorf("replica 0 holds %d blocks, want at most 20", got)
	}
	if got := r.tree.CachedBlocks(1); got != 31 {
		t.Errorf("replica 1 holds %d blocks, want 31", got)
	}
	// 0 forgets the engine's figure; the profile's is back.
	if err := r.SetKVCapacity(0, 0, "ignored"); err != nil {
		t.Fatal(err)
	}
	if n, src := r.KVCapacity(0); n != profileKV || src != CapacityProfile {
		t.Errorf("after forgetting: %d %q", n, src)
	}
	if err := r.SetKVCapacity(0, -1, ""); !errors.Is(err, ErrBadLoad) {
		t.Errorf("negative capacity: %v, want ErrBadLoad", err)
	}
	if err := r.SetKVCapacity(5, 10, ""); !errors.Is(err, ErrUnknownReplica) {
		t.Errorf("unknown replica: %v, want ErrUnknownReplica", err)
	}
	// A configured mirror capacity is the fallback before the profile's.
	rc := newRouter(t, &policy.RoundRobin{}, 64*bt, false)
	if n, src := rc.KVCapacity(0); n != 64*bt || src != CapacityConfig {
		t.Errorf("configured: %d %q", n, src)
	}
}
