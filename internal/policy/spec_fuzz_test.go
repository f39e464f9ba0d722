package policy_test

import (
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// FuzzParse feeds the policy spec parser (the --policy flag and the config's
// policy field) arbitrary specs: it must not panic, and a policy it accepts
// must route a few requests without panicking and onto a replica that is up.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"e2", "round-robin", " e2-preble ",
		"e2-preble:mixing=false:window=1m:balance_threshold=2",
		"e2:window=-1s", "e2:balance_threshold=NaN", "e2:balance_threshold=1e309",
		"e2:name=x:mixing=maybe", "e2:", "e2::", "e2:=", "nope:x=1",
		"e2:window=0s:balance_threshold=0",
		"llmd-precise:prefix_weight=2:kv_weight=1:queue_weight=1:speculative=true",
		"llmd-approx:queue_weight=0:prefix_weight=1e308", "llmd-precise:kv_weight=-0",
		"llmd-approx:speculative=true", "llmd-precise:speculative=1:speculative=0",
	} {
		f.Add(s)
	}
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		p, err := policy.Parse(spec, policy.DefaultOptions())
		if err != nil {
			return
		}
		if p.Name() == "" {
			t.Fatalf("policy from %q has no name", spec)
		}
		rt, err := router.New(router.Config{BlockTokens: 16, Profile: prof, Policy: p, Seed: 1})
		if err != nil {
			return
		}
		for i := range 3 {
			rt.AddReplica(string(rune('a'+i)), false)
		}
		if err := rt.SetUp(1, false, time.Unix(0, 0)); err != nil {
			t.Fatal(err)
		}
		tokens := make([]uint32, 64)
		now := time.Unix(100, 0)
		for i := range 6 {
			tokens[0] = uint32(i % 2)
			req := policy.Request{ID: uint64(i + 1), Keys: blocks.Keys(nil, tokens, 16), PromptTokens: len(tokens), OutputTokens: 8}
			d, err := rt.Route(req, now)
			if err != nil {
				t.Fatalf("spec %q: route: %v", spec, err)
			}
			if d.Replica == 1 {
				t.Fatalf("spec %q routed to a replica that is down", spec)
			}
			now = now.Add(time.Millisecond)
			if i%2 == 1 {
				_ = rt.Finished(uint64(i), 8, -1, true, now)
			}
		}
	})
}
