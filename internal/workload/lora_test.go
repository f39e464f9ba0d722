package workload

import (
	"strings"
	"testing"
)

// TestLoRA: adapters are drawn Zipf (the first the most popular), each
// request carries its adapter and size, and each adapter has its own
// system prompts: no prompt of one adapter starts like another adapter's.
func TestLoRA(t *testing.T) {
	s := DefaultSpec("lora")
	s.Requests = 4000
	reqs, err := Generate(s)
	if err != nil {
		t.Fatal(err)
	}
	count := map[string]int{}
	groups := map[string]map[string]bool{}
	first := map[uint32]string{} // a system prompt's first token → its adapter
	for _, r := range reqs {
		if r.Adapter == "" || r.AdapterBytes != 84_000_000 {
			t.Fatalf("request %d: adapter %q of %d bytes", r.ID, r.Adapter, r.AdapterBytes)
		}
		if !strings.HasPrefix(r.Group, r.Adapter+"/system-") {
			t.Fatalf("request %d: group %q not one of adapter %s's", r.ID, r.Group, r.Adapter)
		}
		count[r.Adapter]++
		if groups[r.Adapter] == nil {
			groups[r.Adapter] = map[string]bool{}
		}
		groups[r.Adapter][r.Group] = true
		if a, ok := first[r.Tokens[0]]; ok && a != r.Adapter {
			t.Fatalf("request %d of %s starts like a prompt of %s", r.ID, r.Adapter, a)
		}
		first[r.Tokens[0]] = r.Adapter
		if n := len(r.Tokens) - s.LoRA.SystemMax; n > s.LoRA.QueryMax {
			t.Fatalf("request %d: %d tokens", r.ID, len(r.Tokens))
		}
	}
	if len(count) > s.LoRA.Adapters {
		t.Errorf("%d adapters, want at most %d", len(count), s.LoRA.Adapters)
	}
	if !(count["adapter-0"] > count["adapter-1"] && count["adapter-1"] > count["adapter-7"] && count["adapter-7"] > count["adapter-31"]) {
		t.Errorf("counts not Zipf-ordered: 0:%d 1:%d 7:%d 31:%d", count["adapter-0"], count["adapter-1"], count["adapter-7"], count["adapter-31"])
	}
	for a, g := range groups {
		if len(g) > s.LoRA.SystemPrompts {
			t.Errorf("adapter %s has %d system prompts, want at most %d", a, len(g), s.LoRA.SystemPrompts)
		}
	}
}
