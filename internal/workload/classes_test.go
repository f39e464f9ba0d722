package workload

import (
	"math"
	"testing"
)

func TestParseShares(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []Share
		ok   bool
	}{
		{"", nil, true},
		{"a:4,b:1", []Share{{"a", 4}, {"b", 1}}, true},
		{" high : 0.2 , low:0.8", []Share{{"high", 0.2}, {"low", 0.8}}, true},
		{"a", nil, false},
		{"a:0", nil, false},
		{"a:-1", nil, false},
		{"a:x", nil, false},
		{":1", nil, false},
		{"a:1,a:2", nil, false},
		{"a:Inf", nil, false},
	} {
		got, err := ParseShares(tc.in)
		if (err == nil) != tc.ok {
			t.Errorf("ParseShares(%q) error %v, want ok=%v", tc.in, err, tc.ok)
			continue
		}
		if len(got) != len(tc.want) {
			t.Errorf("ParseShares(%q) = %v, want %v", tc.in, got, tc.want)
			continue
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Errorf("ParseShares(%q) = %v, want %v", tc.in, got, tc.want)
			}
		}
	}
	if _, err := ParsePriorities("urgent:1"); err == nil {
		t.Error("ParsePriorities accepted a name it does not know")
	}
	if p, err := ParsePriorities("high:1,-5:1,low:2"); err != nil || p[0] != 1 || p[1] != -5 || p[2] != -1 {
		t.Errorf("ParsePriorities = %v, %v", p, err)
	}
}

func TestAssignClasses(t *testing.T) {
	reqs := make([]Request, 20000)
	for i := range reqs {
		reqs[i].ID = i
		if i%2 == 0 {
			reqs[i].Session = string(rune('A' + i%40))
		}
	}
	if err := AssignClasses(reqs, "high:0.2,low:0.8", "a:4,b:1", 1); err != nil {
		t.Fatal(err)
	}
	var a, lone, loneHigh int
	bySession := map[string]Request{}
	for _, r := range reqs {
		if r.Session != "" {
			if s, ok := bySession[r.Session]; ok && (s.Priority != r.Priority || s.Tenant != r.Tenant) {
				t.Fatalf("session %s changes class", r.Session)
			}
			bySession[r.Session] = r
			continue
		}
		lone++
		if r.Priority == 1 {
			loneHigh++
		}
		if r.Tenant == "a" {
			a++
		}
	}
	if got := float64(loneHigh) / float64(lone); math.Abs(got-0.2) > 0.02 {
		t.Errorf("high share %.3f, want 0.2", got)
	}
	if got := float64(a) / float64(lone); math.Abs(got-0.8) > 0.02 {
		t.Errorf("tenant a share %.3f, want 0.8", got)
	}
	again := make([]Request, len(reqs))
	for i := range again {
		again[i] = Request{ID: i, Session: reqs[i].Session}
	}
	_ = AssignClasses(again, "high:0.2,low:0.8", "a:4,b:1", 1)
	for i := range again {
		if again[i].Priority != reqs[i].Priority || again[i].Tenant != reqs[i].Tenant {
			t.Fatal("not deterministic under its seed")
		}
	}
}

func FuzzParseShares(f *testing.F) {
	for _, s := range []string{"", "a:4,b:1", "high:0.2,low:0.8", "a:", ":", "a:1e309", ",,", "-3:1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		sh, err := ParseShares(s)
		if err != nil {
			return
		}
		for _, x := range sh {
			if !(x.Share > 0) || x.Name == "" {
				t.Fatalf("ParseShares(%q) accepted %+v", s, x)
			}
		}
		_, _ = ParsePriorities(s)
	})
}
