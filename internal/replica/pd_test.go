package replica

import (
	"errors"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// TestRemoteKV follows the decode leg of a disaggregated request: admitted
// with its blocks reserved, it pulls only the blocks the replica does not
// cache, waits for them, recomputes its last prompt token and decodes.
func TestRemoteKV(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 64 * 16}, Role: RoleDecode})
	mirror := map[blocks.Key]bool{}
	var got []Event
	run := func(now time.Time) time.Time { // steps until idle, returning when
		for {
			end, ev, busy := r.Step(now, nil)
			applyCacheEvents(mirror, ev)
			checkMirror(t, r, mirror)
			got = append(got, ev...)
			if !busy {
				return now
			}
			now = end
		}
	}
	// A local request caches blocks 1 2 3.
	if err := r.Submit(req(1, 48, 1, 1, 2, 3), t0); err != nil {
		t.Fatal(err)
	}
	now := run(t0)
	free := r.Stats().FreeBlocks
	// The remote one shares them and has 2 more: it pulls 2 blocks.
	rr := req(2, 80, 3, 1, 2, 3, 4, 5)
	rr.RemoteKV = true
	if err := r.Submit(rr, now); err != nil {
		t.Fatal(err)
	}
	now = run(now) // admits it, then idles: it awaits its KV
	if st := r.Stats(); st.FreeBlocks != free-2 || st.Running != 1 {
		t.Errorf("awaiting: free %d running %d, want %d and 1 (its 2 blocks reserved)", st.FreeBlocks, st.Running, free-2)
	}
	arrived := now.Add(5 * time.Millisecond)
	ev, err := r.KVArrived(2, arrived)
	if err != nil {
		t.Fatal(err)
	}
	applyCacheEvents(mirror, ev)
	got = append(got, ev...)
	run(arrived)
	diff(t, showAll(got, nil), []string{
		"0s Admitted #1 hit=0",
		"1.48ms Stored [1 2 3]",
		"1.48ms FirstToken #1",
		"1.48ms Finished #1 n=1",
		"1.48ms Admitted #2 hit=48",
		"1.48ms KVPull",
		// Block 5 ends the prompt: it is cached once the last token is
		// recomputed, in one iteration of 1 ms + 10 µs; then 2 decodes.
		"6.48ms Stored [4] parent=3",
		"7.49ms Stored [5] parent=4",
		"7.49ms FirstToken #2",
		"8.5ms Token #2 n=2",
		"9.51ms Token #2 n=3",
		"9.51ms Finished #2 n=3",
	})
	for _, e := range got {
		if e.Kind == KVPull && e.N != 2 {
			t.Errorf("KVPull N = %d, want 2 (blocks 4 and 5; 1-3 are cached)", e.N)
		}
	}
	if st := r.Stats(); st.KVBlocksPulled != 2 || st.PromptTokensComputed != 48+1 {
		t.Errorf("KVBlocksPulled %d PromptTokensComputed %d, want 2 and 49", st.KVBlocksPulled, st.PromptTokensComputed)
	}
	if _, err := r.KVArrived(2, arrived); !errors.Is(err, ErrNotAwaitingKV) {
		t.Errorf("KVArrived twice: %v, want ErrNotAwaitingKV", err)
	}
}

// TestRemoteKVHeldPrompt: a decode replica that caches the whole prompt
// pulls nothing but the last block, which vLLM always recomputes.
func TestRemoteKVHeldPrompt(t *testing.T) {
	r := newReplica(t, Config{Profile: linear{kv: 64 * 16}})
	drive(t, r, []arrival{{0, req(1, 64, 1, 1, 2, 3, 4)}})
	rr := req(2, 70, 2, 1, 2, 3, 4)
	rr.RemoteKV = true
	if err := r.Submit(rr, t0.Add(time.Second)); err != nil {
		t.Fatal(err)
	}
	_, ev, busy := r.Step(t0.Add(time.Second), nil)
	if busy {
		t.Error("Step busy with only a request awaiting its KV")
	}
	var pull *Event
	for i := range ev {
		if ev[i].Kind == KVPull {
			pull = &ev[i]
		}
	}
	// 70 tokens: 5 blocks, 4 cached (the hit may cover all 4: 69/16 = 4).
	if pull == nil || pull.N != 1 {
		t.Fatalf("KVPull = %+v, want N=1 (the partial last block)", pull)
	}
}

// TestRemoteKVNotPreempted: a decode short of blocks preempts the youngest
// request that is not awaiting its KV, never the target of a transfer.
func TestRemoteKVNotPreempted(t *testing.T) {
	// 6 blocks: a decode of 16 + 60 tokens needs 5 of them; the remote
	// request reserves 2.
	r := newReplica(t, Config{Profile: linear{kv: 6 * 16}})
	if err := r.Submit(req(1, 16, 60, 1), t0); err != nil {
		t.Fatal(err)
	}
	now := t0
	for i := 0; i < 3; i++ { // prefill, then two decodes
		end, _, _ := r.Step(now, nil)
		now = end
	}
	rr := req(2, 20, 2, 2)
	rr.RemoteKV = true
	if err := r.Submit(rr, now); err != nil {
		t.Fatal(err)
	}
	var all []Event
	for i := 0; i < 200; i++ {
		end, ev, busy := r.Step(now, nil)
		all = append(all, ev...)
		if !busy {
			break
		}
		now = end
	}
	for _, e := range all {
		if e.Kind == Preempted && e.RequestID == 2 {
			t.Fatalf("the request awaiting its KV was preempted")
		}
	}
	if st := r.Stats(); st.Preemptions == 0 {
		t.Errorf("no preemption: the test no longer runs out of blocks")
	}
}

func TestRoleSubmit(t *testing.T) {
	p := newReplica(t, Config{Profile: linear{kv: 64 * 16}, Role: RolePrefill})
	if err := p.Submit(req(1, 20, 1, 1), t0); err != nil {
		t.Errorf("prefill replica, one output token: %v", err)
	}
	if err := p.Submit(req(2, 20, 2, 1), t0); !errors.Is(err, ErrRole) {
		t.Errorf("prefill replica, two output tokens: %v, want ErrRole", err)
	}
	rr := req(3, 20, 1, 1)
	rr.RemoteKV = true
	if err := p.Submit(rr, t0); !errors.Is(err, ErrRole) {
		t.Errorf("prefill replica, remote KV: %v, want ErrRole", err)
	}
	if _, err := New(Config{Profile: linear{kv: 64 * 16}, Role: "mixed"}); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("Role mixed: %v, want ErrInvalidConfig", err)
	}
	s := newReplica(t, Config{Profile: linear{kv: 64 * 16}, Slots: 2, ChunkBudget: 64})
	if err := s.Submit(rr, t0); !errors.Is(err, ErrInvalidRequest) {
		t.Errorf("slot cache, remote KV: %v, want ErrInvalidRequest", err)
	}
}
