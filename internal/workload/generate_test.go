package workload

import (
	"math"
	"slices"
	"testing"
)

// lcp is the length of the longest common prefix of a and b.
func lcp(a, b []uint32) int {
	n := min(len(a), len(b))
	for i := range n {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

func gen(t *testing.T, s Spec) []Request {
	t.Helper()
	reqs, err := Generate(s)
	if err != nil {
		t.Fatalf("Generate(%s): %v", s.Name, err)
	}
	if len(reqs) != s.Requests {
		t.Fatalf("Generate(%s): %d requests, want %d", s.Name, len(reqs), s.Requests)
	}
	for i, r := range reqs {
		if r.ID != i || len(r.Tokens) == 0 || r.OutputTokens < 1 || r.Arrival != 0 {
			t.Fatalf("Generate(%s): request %d = {ID %d, %d tokens, %d out, at %v}", s.Name, i, r.ID, len(r.Tokens), r.OutputTokens, r.Arrival)
		}
		for _, tok := range r.Tokens {
			if tok < VocabLow || tok >= VocabHigh {
				t.Fatalf("Generate(%s): token %d outside the vocabulary", s.Name, tok)
			}
		}
	}
	return reqs
}

func analyze(t *testing.T, reqs []Request, bs int) Stats {
	t.Helper()
	st, err := Analyze(reqs, bs)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestNamesAndUnknown(t *testing.T) {
	want := []string{"agent", "coding-agent", "loogle", "lora", "programming", "rag", "shared-prefix", "toolbench", "videoqa"}
	if got := Names(); !slices.Equal(got, want) {
		t.Fatalf("Names() = %v, want %v", got, want)
	}
	_, err := Generate(DefaultSpec("nope"))
	if err == nil || !errorsIs(err, ErrUnknownWorkload) {
		t.Fatalf("Generate(nope) error = %v, want ErrUnknownWorkload", err)
	}
	for _, n := range want {
		if !containsStr(err.Error(), n) {
			t.Errorf("error %q does not list %q", err, n)
		}
	}
}

func TestValidate(t *testing.T) {
	tests := []struct {
		name string
		edit func(*Spec)
		want string
	}{
		{"requests", func(s *Spec) { s.Requests = 0 }, "requests 0 must be >= 1"},
		{"zipf", func(s *Spec) { s.ToolBench.Zipf = -1 }, "toolbench zipf -1 must be >= 0"},
		{"desc", func(s *Spec) { s.ToolBench.DescMax = 10 }, "toolbench description max 10 must be >= min 600"},
		{"replicas", func(s *Spec) { s.Replicas = 0 }, "replicas 0 must be >= 1"},
	}
	for _, tt := range tests {
		s := DefaultSpec("toolbench")
		tt.edit(&s)
		err := s.Validate()
		if err == nil || !containsStr(err.Error(), tt.want) {
			t.Errorf("%s: Validate() = %v, want %q", tt.name, err, tt.want)
		}
	}
	for _, n := range Names() {
		s := DefaultSpec(n)
		if err := s.Validate(); err != nil {
			t.Errorf("DefaultSpec(%s).Validate() = %v", n, err)
		}
	}
}

func TestDeterministic(t *testing.T) {
	for _, n := range Names() {
		s := DefaultSpec(n)
		s.Requests = 300
		a, b := gen(t, s), gen(t, s)
		for i := range a {
			if !slices.Equal(a[i].Tokens, b[i].Tokens) || a[i].OutputTokens != b[i].OutputTokens || a[i].Session != b[i].Session || a[i].Group != b[i].Group {
				t.Fatalf("%s: request %d differs between two runs with seed %d", n, i, s.Seed)
			}
		}
		s.Seed = 2
		c := gen(t, s)
		same := 0
		for i := range a {
			if slices.Equal(a[i].Tokens, c[i].Tokens) {
				same++
			}
		}
		if same == len(a) {
			t.Errorf("%s: seeds 1 and 2 gave the same workload", n)
		}
	}
}

func TestSharedPrefixStructure(t *testing.T) {
	s := DefaultSpec("shared-prefix")
	s.Requests = 3000
	p := s.SharedPrefix
	reqs := gen(t, s)
	distinct := make(map[*uint32][]uint32)
	byGroup := make(map[string][][]uint32)
	for _, r := range reqs {
		if len(r.Tokens) != p.SystemTokens+p.QuestionTokens || r.OutputTokens != p.Output {
			t.Fatalf("request %d: %d tokens, %d out; want %d, %d", r.ID, len(r.Tokens), r.OutputTokens, p.SystemTokens+p.QuestionTokens, p.Output)
		}
		if _, ok := distinct[&r.Tokens[0]]; !ok {
			distinct[&r.Tokens[0]] = r.Tokens
			byGroup[r.Group] = append(byGroup[r.Group], r.Tokens)
		}
	}
	// With 3000 draws over 750 prompts all appear (P(miss any) ≈ 750·e^-4 is not
	// negligible, so count distinct contents rather than insisting on 750).
	contents := make(map[string]bool)
	for _, tok := range distinct {
		contents[string(u32bytes(tok))] = true
	}
	if len(contents) != len(distinct) || len(distinct) > p.Groups*p.Questions {
		t.Fatalf("%d distinct arrays, %d distinct prompts; want equal and <= %d", len(distinct), len(contents), p.Groups*p.Questions)
	}
	if len(byGroup) != p.Groups {
		t.Fatalf("%d groups seen, want %d", len(byGroup), p.Groups)
	}
	for g, prompts := range byGroup {
		if len(prompts) > p.Questions {
			t.Fatalf("group %s has %d prompts, want <= %d", g, len(prompts), p.Questions)
		}
		for i := 1; i < len(prompts); i++ {
			if l := lcp(prompts[0], prompts[i]); l < p.SystemTokens || l >= p.SystemTokens+16 {
				t.Fatalf("group %s: prompts share %d tokens, want the %d-token system prompt", g, l, p.SystemTokens)
			}
		}
	}
	// Exactly G·U distinct prompts once every combination has been drawn.
	s.Requests = 20000
	s.SharedPrefix = SharedPrefixParams{Groups: 10, SystemTokens: 100, Questions: 5, QuestionTokens: 20, Output: 7}
	small := gen(t, s)
	seen := make(map[string]bool)
	for _, r := range small {
		seen[string(u32bytes(r.Tokens))] = true
	}
	if len(seen) != 50 {
		t.Fatalf("%d distinct prompts, want G·U = 50", len(seen))
	}
	// Each prompt is 120 tokens; all but the first use of each prompt is fully
	// shared, and the first use of a group's later questions shares the system
	// prompt's 6 full blocks (96 of 120 tokens).
	st := analyze(t, small, 16)
	want := (float64(len(small)-50) + 40*96.0/120) / float64(len(small))
	if math.Abs(st.SharedTokenRatio-want) > 1e-9 {
		t.Fatalf("shared-token ratio %v, want %v", st.SharedTokenRatio, want)
	}
}

func u32bytes(t []uint32) []byte {
	b := make([]byte, 4*len(t))
	for i, v := range t {
		b[4*i], b[4*i+1], b[4*i+2], b[4*i+3] = byte(v), byte(v>>8), byte(v>>16), byte(v>>24)
	}
	return b
}

func TestToolBenchSelection(t *testing.T) {
	s := DefaultSpec("toolbench")
	s.Requests = 20000
	s.ToolBench.Zipf = 1.1
	reqs := gen(t, s)
	st := analyze(t, reqs, 16)
	h := 0.0
	for i := 1; i <= 200; i++ {
		h += math.Pow(float64(i), -1.1)
	}
	if want := 1 / h; math.Abs(st.Prefixes.Top1-want) > 0.01 {
		t.Errorf("Zipf(1.1) over 200 tools: top tool share %.4f, want %.4f", st.Prefixes.Top1, want)
	}
	if st.Prefixes.By != "group" || st.Prefixes.Top[0].Prefix != "tool-0" {
		t.Errorf("top prefix = %+v, want group tool-0", st.Prefixes.Top[0])
	}
	// Every request of a tool starts with the tool's description, and different
	// tools share nothing.
	desc := make(map[string][]uint32)
	for _, r := range reqs {
		if d, ok := desc[r.Group]; ok {
			if l := lcp(d, r.Tokens); l < len(r.Tokens)-s.ToolBench.QueryMax || l > len(r.Tokens)-s.ToolBench.QueryMin {
				t.Fatalf("%s: requests share %d of %d tokens", r.Group, l, len(r.Tokens))
			}
		} else {
			desc[r.Group] = r.Tokens
		}
	}
	if l := lcp(desc["tool-0"], desc["tool-1"]); l > 1 {
		t.Fatalf("tools 0 and 1 share %d tokens", l)
	}

	// Replicas scales K: 4 replicas, 400 tools; even selection gives each the
	// same count.
	s.ToolBench.Zipf = 0
	s.Replicas = 4
	s.Requests = 4000
	counts := make(map[string]int)
	for _, r := range gen(t, s) {
		counts[r.Group]++
	}
	if len(counts) != 400 {
		t.Fatalf("%d tools with 4 replicas, want 400", len(counts))
	}
	for g, c := range counts {
		if c != 10 {
			t.Fatalf("even selection: %s has %d requests, want 10", g, c)
		}
	}
}

func TestProgrammingPrefix(t *testing.T) {
	s := DefaultSpec("programming")
	s.Requests = 500
	reqs := gen(t, s)
	p := s.Programming
	for _, r := range reqs[1:] {
		if l := lcp(reqs[0].Tokens, r.Tokens); l < p.PrefixTokens || l > p.PrefixTokens+1 {
			t.Fatalf("request %d shares %d tokens with request 0, want %d", r.ID, l, p.PrefixTokens)
		}
		if r.OutputTokens > 512 {
			t.Fatalf("output %d > 512", r.OutputTokens)
		}
	}
	// The shared tokens are the 2,400-token prefix (150 full blocks of 16).
	st := analyze(t, reqs, 16)
	want := 0.0
	for _, r := range reqs[1:] {
		want += 2400 / float64(len(r.Tokens))
	}
	want /= float64(len(reqs))
	if math.Abs(st.SharedTokenRatio-want) > 1e-9 {
		t.Fatalf("shared-token ratio %v, want %v", st.SharedTokenRatio, want)
	}
}

func TestAgentSessions(t *testing.T) {
	s := DefaultSpec("agent")
	s.Requests = 3000
	reqs := gen(t, s)
	p := s.Agent
	last := make(map[string]Request)
	steps := make(map[string]int)
	envs := make(map[string]bool)
	for _, r := range reqs {
		if r.Session == "" || r.OutputTokens != p.Output {
			t.Fatalf("request %d: session %q, output %d", r.ID, r.Session, r.OutputTokens)
		}
		envs[r.Group] = true
		if prev, ok := last[r.Session]; ok {
			grow := len(r.Tokens) - len(prev.Tokens)
			if !slices.Equal(r.Tokens[:len(prev.Tokens)], prev.Tokens) || grow < p.Output+p.ObsMin || grow > p.Output+p.ObsMax {
				t.Fatalf("session %s: step does not extend the previous one by output+observation (grew %d)", r.Session, grow)
			}
		}
		last[r.Session] = r
		steps[r.Session]++
	}
	if len(envs) != 200 {
		t.Errorf("%d environments, want 200", len(envs))
	}
	for sess, n := range steps {
		if n > p.StepsMax {
			t.Fatalf("session %s has %d steps > %d", sess, n, p.StepsMax)
		}
	}
	st := analyze(t, reqs, 16)
	if st.Sessions.Sessions != len(steps) || st.Sessions.Requests != len(reqs) {
		t.Errorf("sessions %+v, want %d sessions", st.Sessions, len(steps))
	}
}

func TestVideoQA(t *testing.T) {
	s := DefaultSpec("videoqa")
	s.Requests = 30000
	reqs := gen(t, s)
	p := s.VideoQA
	count := make(map[string]int)
	length := make(map[string]int)
	for _, r := range reqs {
		video := len(r.Tokens) - p.SystemTokens
		if video > p.MaxVideoTokens+p.QuestionMax || video < p.SecondsMin*p.TokensPerSecond+p.QuestionMin {
			t.Fatalf("request %d: %d video+question tokens", r.ID, video)
		}
		count[r.Group]++
		length[r.Group] = len(r.Tokens)
	}
	if len(count) != 150 {
		t.Fatalf("%d videos, want 150", len(count))
	}
	// Requests per video ∝ prompt length: the per-token rate is the same for
	// short and long videos.
	var shortReq, shortTok, longReq, longTok float64
	for g, c := range count {
		if length[g] > 4500 {
			longReq, longTok = longReq+float64(c), longTok+float64(length[g])
		} else {
			shortReq, shortTok = shortReq+float64(c), shortTok+float64(length[g])
		}
	}
	if ratio := (longReq / longTok) / (shortReq / shortTok); ratio < 0.85 || ratio > 1.15 {
		t.Errorf("requests per token, long vs short videos: %.3f, want ≈ 1", ratio)
	}
}

func TestLooGLE(t *testing.T) {
	s := DefaultSpec("loogle")
	s.Requests = 2000
	reqs := gen(t, s)
	p := s.LooGLE
	docs := make(map[string]bool)
	prompts := make(map[*uint32]bool)
	for _, r := range reqs {
		docs[r.Group] = true
		prompts[&r.Tokens[0]] = true
		doc := len(r.Tokens) - loogleHeaderTokens
		if doc < p.DocMin+p.QuestionMin || doc > p.DocMax+p.QuestionMax || r.OutputTokens > 45 {
			t.Fatalf("request %d: %d tokens, %d out", r.ID, len(r.Tokens), r.OutputTokens)
		}
	}
	if len(docs) != 24 || len(prompts) > 24*p.QuestionsMax {
		t.Fatalf("%d documents, %d distinct prompts", len(docs), len(prompts))
	}
}

func TestCodingAgent(t *testing.T) {
	s := DefaultSpec("coding-agent")
	s.Requests = 400
	reqs := gen(t, s)
	p := s.CodingAgent
	repo := make(map[string][]uint32)
	first := make(map[string]int)
	interleaved := false
	prevSession := ""
	for _, r := range reqs {
		if len(r.Tokens) < p.PrefixMin || len(r.Tokens) > p.MaxContext {
			t.Fatalf("request %d: %d tokens", r.ID, len(r.Tokens))
		}
		if _, ok := first[r.Session]; !ok {
			first[r.Session] = r.ID
			if rp, ok := repo[r.Group]; ok {
				if l := lcp(rp, r.Tokens); l < p.PrefixMin {
					t.Fatalf("%s: sessions share only %d tokens", r.Group, l)
				}
			} else {
				repo[r.Group] = r.Tokens
			}
		} else if prevSession != r.Session {
			interleaved = true
		}
		prevSession = r.Session
	}
	if !interleaved {
		t.Error("sessions never overlap")
	}
	if len(repo) != p.Repos {
		t.Errorf("%d repositories, want %d", len(repo), p.Repos)
	}
}

// TestSharingStatistics checks each workload's shared-token ratio: Preble's
// five workloads share most of their prompt tokens (the paper reports 85–97%),
// rag little.
func TestSharingStatistics(t *testing.T) {
	tests := []struct {
		name   string
		lo, hi float64
	}{
		// 200 tools over 2,000 requests: each tool's first request is cold.
		{"toolbench", 0.8, 0.99},
		{"agent", 0.85, 0.99},
		{"programming", 0.8, 0.97},
		{"videoqa", 0.85, 0.999},
		{"loogle", 0.9, 0.9999},
		{"coding-agent", 0.9, 0.9999},
		{"shared-prefix", 0.85, 1},
		{"rag", 0, 0.2},
	}
	for _, tt := range tests {
		s := DefaultSpec(tt.name)
		s.Requests = 2000
		if tt.name == "coding-agent" || tt.name == "loogle" {
			s.Requests = 500 // long prompts: keep the test fast
		}
		st := analyze(t, gen(t, s), 16)
		t.Logf("%-13s shared %.3f (weighted %.3f), prompt mean %.0f, top1 %.3f top10 %.3f, sessions %d",
			tt.name, st.SharedTokenRatio, st.SharedTokenRatioWeighted, st.PromptTokens.Mean, st.Prefixes.Top1, st.Prefixes.Top10, st.Sessions.Sessions)
		if st.SharedTokenRatio < tt.lo || st.SharedTokenRatio > tt.hi {
			t.Errorf("%s: shared-token ratio %.3f, want in [%.2f, %.2f]", tt.name, st.SharedTokenRatio, tt.lo, tt.hi)
		}
	}
}

func TestOutputOverride(t *testing.T) {
	s := DefaultSpec("rag")
	s.Requests = 50
	s.OutputTokens = 3
	for _, r := range gen(t, s) {
		if r.OutputTokens != 3 {
			t.Fatalf("output %d, want 3", r.OutputTokens)
		}
	}
}

func BenchmarkGenerate10k(b *testing.B) {
	for _, n := range Names() {
		b.Run(n, func(b *testing.B) {
			b.ReportAllocs()
			s := DefaultSpec(n)
			s.Requests = 10000
			for b.Loop() {
				if _, err := Generate(s); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
