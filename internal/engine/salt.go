package engine

import (
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/replica"
)

// addEvent converts one cache event into the pending batch (kvAdapter.add)
// and gives a GPU BlockStored the extra_keys vLLM sends with it: the
// adapter's name on each block and the request's cache salt on a prompt's
// first block (kvevents.ExtraKeys; vllm/v1/core/block_pool.py,
// cache_full_blocks). A router reads the salt back (BlockStored.Salt) and
// keys the blocks under the salted chain, as it keys the request. Events
// of requests with neither go out as before, without extra_keys.
func (a *kvAdapter) addEvent(ev replica.Event) {
	n := len(a.batch)
	a.add(ev)
	if ev.Kind != replica.BlocksStored || ev.Medium != "" || len(a.batch) != n+1 || (ev.Adapter == "" && ev.Salt == "") {
		return
	}
	bs, ok := a.batch[n].(kvevents.BlockStored)
	if !ok {
		return
	}
	bs.ExtraKeys = kvevents.ExtraKeys(len(bs.BlockHashes), ev.Adapter, ev.Salt, !ev.HasParent)
	a.batch[n] = bs
}
