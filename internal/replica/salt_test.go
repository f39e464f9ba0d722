package replica

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// TestSaltCacheApart: requests with the same keys under different cache
// salts (or a salt and none) never hit each other's blocks, as vLLM
// folds cache_salt into the first block's hash; the same salt hits; a
// salted adapter's request is apart from both. BlocksStored events report
// the caller's keys and the request's salt.
func TestSaltCacheApart(t *testing.T) {
	r := newLoRAReplica(t, 0)
	keys := []blocks.Key{11, 12, 13, 14}
	mk := func(id uint64, adapter, salt string) *Request {
		q := req(id, 80, 1, keys...)
		q.Adapter, q.Salt = adapter, salt
		return q
	}
	ev := runLoRA(t, r, []arrival{
		{0, mk(1, "", "a")},
		{100 * time.Millisecond, mk(2, "", "b")},
		{200 * time.Millisecond, mk(3, "", "")},
		{300 * time.Millisecond, mk(4, "", "a")},
		{400 * time.Millisecond, mk(5, "lora", "a")},
		{500 * time.Millisecond, mk(6, "", "b")},
	})
	hits := map[uint64]int{}
	salts := map[string]int{}
	for _, e := range ev {
		switch e.Kind {
		case Admitted:
			hits[e.RequestID] = e.HitTokens
		case BlocksStored:
			salts[e.Salt]++
			if e.Keys[0] != 11 {
				t.Errorf("BlocksStored reports %v, want the request's keys", e.Keys)
			}
		}
	}
	want := map[uint64]int{1: 0, 2: 0, 3: 0, 4: 64, 5: 0, 6: 64}
	for id, w := range want {
		if hits[id] != w {
			t.Errorf("request %d: hit %d tokens, want %d", id, hits[id], w)
		}
	}
	if salts["a"] != 2 || salts["b"] != 1 || salts[""] != 1 {
		t.Errorf("BlocksStored salts %v, want a:2 (base and adapter), b:1, none:1", salts)
	}
	for _, c := range []struct {
		adapter, salt string
		want          int
	}{{"", "a", 4}, {"", "b", 4}, {"", "", 4}, {"lora", "a", 4}, {"", "c", 0}, {"lora", "", 0}} {
		if got := r.CachedPrefixAs(c.adapter, c.salt, keys); got != c.want {
			t.Errorf("CachedPrefixAs(%q, %q) = %d, want %d", c.adapter, c.salt, got, c.want)
		}
	}
}
