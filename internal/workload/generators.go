package workload

import (
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
)

// Random streams of a generator (see newRand): one for token ids, one for
// lengths, one for selection, so that, say, a different Zipf exponent changes
// which tools are picked but not what the tools' descriptions are.
const (
	streamTokens uint64 = iota + 1
	streamLengths
	streamSelect
)

// zipfCDF returns the cumulative weights of P(i) ∝ (i+1)^-s for i in [0, n):
// numpy's zipf(a)-1 truncated to n by rejection, as Preble draws tool
// popularity (benchmark_workload_gen.py, LoadDistribution.ZIPF).
func zipfCDF(n int, s float64) []float64 {
	cdf := make([]float64, n)
	sum := 0.0
	for i := range n {
		sum += math.Pow(float64(i+1), -s)
		cdf[i] = sum
	}
	return cdf
}

// pickCDF draws an index from cumulative weights.
func pickCDF(r *rand.Rand, cdf []float64) int {
	u := r.Float64() * cdf[len(cdf)-1]
	i := sort.Search(len(cdf), func(i int) bool { return cdf[i] > u })
	return min(i, len(cdf)-1)
}

// selection assigns each of n requests to one of k prefixes: evenly (the same
// count each, ±1, shuffled, like Preble's EVEN) when s == 0, else Zipf(s).
func selection(r *rand.Rand, n, k int, s float64) []int {
	out := make([]int, n)
	if s == 0 {
		for i := range out {
			out[i] = i % k
		}
		r.Shuffle(n, func(i, j int) { out[i], out[j] = out[j], out[i] })
		return out
	}
	cdf := zipfCDF(k, s)
	for i := range out {
		out[i] = pickCDF(r, cdf)
	}
	return out
}

// logNormalInt draws round(median·e^(σZ)) clipped to [lo, hi].
func logNormalInt(r *rand.Rand, median int, sigma float64, lo, hi int) int {
	v := int(math.Round(float64(median) * math.Exp(sigma*r.NormFloat64())))
	return min(max(v, lo), hi)
}

// concat returns a new slice holding prefix followed by n fresh tokens.
func concat(ts *tokenSource, prefix []uint32, n int) []uint32 {
	s := make([]uint32, len(prefix)+n)
	copy(s, prefix)
	ts.fill(s[len(prefix):])
	return s
}

// names formats n names once, so requests share the strings.
func names(format string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf(format, i)
	}
	return out
}

func genToolBench(s *Spec) []Request {
	p := s.ToolBench
	k := s.scaled(p.Tools)
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	descLen := make([]int, k)
	for i := range descLen {
		descLen[i] = logNormalInt(lr, p.DescMedian, 0.45, p.DescMin, p.DescMax)
	}
	groups := names("tool-%d", k)
	descs := make([][]uint32, k)
	reqs := make([]Request, s.Requests)
	for i, t := range selection(newRand(s.Seed, streamSelect), s.Requests, k, p.Zipf) {
		if descs[t] == nil {
			descs[t] = ts.tokens(descLen[t])
		}
		reqs[i] = Request{
			Tokens:       concat(ts, descs[t], uniformInt(lr, p.QueryMin, p.QueryMax)),
			OutputTokens: uniformInt(lr, p.OutputMin, p.OutputMax),
			Group:        groups[t],
		}
	}
	return reqs
}

// sessionFunc yields a session's next request and whether more follow.
type sessionFunc func() (Request, bool)

// interleave emits n requests from sessions started by start(0), start(1), ...,
// keeping `concurrent` sessions in progress and taking each next request from a
// random one of them, so sessions overlap in time while each session's steps
// stay in order.
func interleave(n, concurrent int, r *rand.Rand, start func(idx int) sessionFunc) []Request {
	out := make([]Request, 0, n)
	active := make([]sessionFunc, 0, concurrent)
	started := 0
	for len(out) < n {
		for len(active) < concurrent {
			active = append(active, start(started))
			started++
		}
		i := r.IntN(len(active))
		req, more := active[i]()
		out = append(out, req)
		if !more {
			active[i] = active[len(active)-1]
			active = active[:len(active)-1]
		}
	}
	return out
}

// growHint is the capacity to give a growing conversation's array: the
// expected final length, and at least half again what is needed now so that a
// session outgrowing its estimate reallocates geometrically.
func growHint(estimate, need int) int { return max(estimate, need+need/2) }

func genAgent(s *Spec) []Request {
	p := s.Agent
	envs := s.scaled(p.Environments)
	concurrent := p.Concurrent
	if concurrent == 0 {
		concurrent = envs
	}
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	ar := newArena()
	system := ts.tokens(p.SystemTokens)
	envPrompt := make([][]uint32, envs)
	groups := names("env-%d", envs)
	start := func(idx int) sessionFunc {
		env := idx % envs
		if envPrompt[env] == nil {
			envPrompt[env] = concat(ts, system, uniformInt(lr, p.EnvMin, p.EnvMax))
		}
		steps := uniformInt(lr, p.StepsMin, p.StepsMax)
		estimate := len(envPrompt[env]) + steps*(p.Output+p.ObsMax)
		session := fmt.Sprintf("agent-%d", idx)
		var prev []uint32
		step := 0
		return func() (Request, bool) {
			obs := uniformInt(lr, p.ObsMin, p.ObsMax)
			var t []uint32
			if step == 0 {
				t = ar.extend(envPrompt[env], obs, growHint(estimate, len(envPrompt[env])+obs))
				ts.fill(t[len(envPrompt[env]):])
			} else {
				// The previous step's output, then the environment's observation.
				n := p.Output + obs
				t = ar.extend(prev, n, growHint(estimate, len(prev)+n))
				ts.fill(t[len(prev):])
			}
			prev = t
			step++
			return Request{Tokens: t, OutputTokens: p.Output, Session: session, Group: groups[env]}, step < steps
		}
	}
	return interleave(s.Requests, concurrent, newRand(s.Seed, streamSelect), start)
}

func genProgramming(s *Spec) []Request {
	p := s.Programming
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	prefix := ts.tokens(p.PrefixTokens)
	reqs := make([]Request, s.Requests)
	for i := range reqs {
		reqs[i] = Request{
			Tokens:       concat(ts, prefix, uniformInt(lr, p.ProblemMin, p.ProblemMax)),
			OutputTokens: uniformInt(lr, p.OutputMin, p.OutputMax),
			Group:        "programming",
		}
	}
	return reqs
}

func genVideoQA(s *Spec) []Request {
	p := s.VideoQA
	v := s.scaled(p.Videos)
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	system := ts.tokens(p.SystemTokens)
	videoLen := make([]int, v)
	cdf := make([]float64, v)
	sum := 0.0
	for i := range videoLen {
		videoLen[i] = min(uniformInt(lr, p.SecondsMin, p.SecondsMax)*p.TokensPerSecond, p.MaxVideoTokens)
		// Requests per video ∝ its prompt length (Preble's videoQA
		// "proportional_to_video_length" runs).
		sum += float64(p.SystemTokens + videoLen[i] + (p.QuestionMin+p.QuestionMax)/2)
		cdf[i] = sum
	}
	prefix := make([][]uint32, v)
	groups := names("video-%d", v)
	sel := newRand(s.Seed, streamSelect)
	reqs := make([]Request, s.Requests)
	for i := range reqs {
		vid := pickCDF(sel, cdf)
		if prefix[vid] == nil {
			prefix[vid] = concat(ts, system, videoLen[vid])
		}
		reqs[i] = Request{
			Tokens:       concat(ts, prefix[vid], uniformInt(lr, p.QuestionMin, p.QuestionMax)),
			OutputTokens: uniformInt(lr, p.OutputMin, p.OutputMax),
			Group:        groups[vid],
		}
	}
	return reqs
}

// loogleHeaderTokens stands for Preble's instruction line "Please answer the
// question based on the long texts below." (~12 tokens), common to every document.
const loogleHeaderTokens = 12

func genLooGLE(s *Spec) []Request {
	p := s.LooGLE
	d := s.scaled(p.Documents)
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	header := ts.tokens(loogleHeaderTokens)
	type question struct {
		tokens []uint32
		output int
		length int
	}
	docLen := make([]int, d)
	qs := make([][]question, d)
	for i := range docLen {
		docLen[i] = uniformInt(lr, p.DocMin, p.DocMax)
		qs[i] = make([]question, uniformInt(lr, p.QuestionsMin, p.QuestionsMax))
		for j := range qs[i] {
			qs[i][j] = question{
				length: uniformInt(lr, p.QuestionMin, p.QuestionMax),
				output: uniformInt(lr, p.OutputMin, p.OutputMax),
			}
		}
	}
	docs := make([][]uint32, d)
	groups := names("doc-%d", d)
	sel := newRand(s.Seed, streamSelect)
	reqs := make([]Request, s.Requests)
	for i := range reqs {
		doc := sel.IntN(d)
		qi := sel.IntN(len(qs[doc]))
		if docs[doc] == nil {
			docs[doc] = concat(ts, header, docLen[doc])
		}
		q := &qs[doc][qi]
		if q.tokens == nil {
			q.tokens = concat(ts, docs[doc], q.length)
		}
		reqs[i] = Request{Tokens: q.tokens, OutputTokens: q.output, Group: groups[doc]}
	}
	return reqs
}

func genCodingAgent(s *Spec) []Request {
	p := s.CodingAgent
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	sel := newRand(s.Seed, streamSelect)
	ar := newArena()
	schema := ts.tokens(p.SchemaTokens)
	repoLen := make([]int, p.Repos)
	for i := range repoLen {
		repoLen[i] = uniformInt(lr, p.PrefixMin, p.PrefixMax)
	}
	repos := make([][]uint32, p.Repos)
	groups := names("repo-%d", p.Repos)
	meanTurn := (p.UserMin+p.UserMax)/2 + (p.OutputMin+p.OutputMax)/2
	start := func(idx int) sessionFunc {
		repo := sel.IntN(p.Repos)
		if repos[repo] == nil {
			repos[repo] = concat(ts, schema, repoLen[repo]-len(schema))
		}
		turns := uniformInt(lr, p.TurnsMin, p.TurnsMax)
		estimate := min(len(repos[repo])+turns*meanTurn, p.MaxContext)
		session := fmt.Sprintf("coding-%d", idx)
		var prev []uint32
		prevOut := 0
		turn := 0
		return func() (Request, bool) {
			user := uniformInt(lr, p.UserMin, p.UserMax)
			base := repos[repo]
			n := user
			if turn > 0 {
				// The previous answer (a tool call), then the tool result or the
				// user's next message.
				base, n = prev, prevOut+user
			}
			t := ar.extend(base, n, growHint(estimate, len(base)+n))
			ts.fill(t[len(base):])
			out := uniformInt(lr, p.OutputMin, p.OutputMax)
			prev, prevOut = t, out
			turn++
			more := turn < turns && len(t)+out+p.UserMax <= p.MaxContext
			return Request{Tokens: t, OutputTokens: out, Session: session, Group: groups[repo]}, more
		}
	}
	return interleave(s.Requests, p.Concurrent, sel, start)
}

func genRAG(s *Spec) []Request {
	p := s.RAG
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	sel := newRand(s.Seed, streamSelect)
	system := ts.tokens(p.SystemTokens)
	corpus := make(map[int][]uint32)
	picked := make([]int, 0, p.Chunks)
	reqs := make([]Request, s.Requests)
	for i := range reqs {
		q := uniformInt(lr, p.QuestionMin, p.QuestionMax)
		t := make([]uint32, 0, len(system)+p.Chunks*p.ChunkTokens+q)
		t = append(t, system...)
		picked = picked[:0]
		for len(picked) < min(p.Chunks, p.Corpus) {
			c := sel.IntN(p.Corpus)
			dup := false
			for _, x := range picked {
				dup = dup || x == c
			}
			if dup {
				continue
			}
			picked = append(picked, c)
			if corpus[c] == nil {
				corpus[c] = ts.tokens(p.ChunkTokens)
			}
			t = append(t, corpus[c]...)
		}
		n := len(t)
		t = t[:n+q]
		ts.fill(t[n:])
		reqs[i] = Request{Tokens: t, OutputTokens: uniformInt(lr, p.OutputMin, p.OutputMax), Group: "rag"}
	}
	return reqs
}

func genSharedPrefix(s *Spec) []Request {
	p := s.SharedPrefix
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	sel := newRand(s.Seed, streamSelect)
	system := make([][]uint32, p.Groups)
	prompts := make([][]uint32, p.Groups*p.Questions)
	groups := names("group-%d", p.Groups)
	reqs := make([]Request, s.Requests)
	for i := range reqs {
		g, u := sel.IntN(p.Groups), sel.IntN(p.Questions)
		if system[g] == nil {
			system[g] = ts.tokens(p.SystemTokens)
		}
		k := g*p.Questions + u
		if prompts[k] == nil {
			prompts[k] = concat(ts, system[g], p.QuestionTokens)
		}
		reqs[i] = Request{Tokens: prompts[k], OutputTokens: p.Output, Group: groups[g]}
	}
	return reqs
}

// genLoRA builds the `lora` workload (LoRAParams): each request picks an
// adapter by Zipf popularity, one of that adapter's system prompts evenly,
// and a fresh query. Group names the adapter and system prompt.
func genLoRA(s *Spec) []Request {
	p := s.LoRA
	ts := &tokenSource{newRand(s.Seed, streamTokens)}
	lr := newRand(s.Seed, streamLengths)
	sel := newRand(s.Seed, streamSelect)
	adapters := names("adapter-%d", p.Adapters)
	bytes := int64(p.AdapterMB * 1e6)
	system := make([][]uint32, p.Adapters*p.SystemPrompts)
	groups := make([]string, len(system))
	picks := selection(sel, s.Requests, p.Adapters, p.Zipf)
	reqs := make([]Request, s.Requests)
	for i, a := range picks {
		k := a*p.SystemPrompts + sel.IntN(p.SystemPrompts)
		if system[k] == nil {
			system[k] = ts.tokens(uniformInt(lr, p.SystemMin, p.SystemMax))
			groups[k] = fmt.Sprintf("%s/system-%d", adapters[a], k%p.SystemPrompts)
		}
		reqs[i] = Request{
			Tokens:       concat(ts, system[k], uniformInt(lr, p.QueryMin, p.QueryMax)),
			OutputTokens: uniformInt(lr, p.OutputMin, p.OutputMax),
			Group:        groups[k],
			Adapter:      adapters[a],
			AdapterBytes: bytes,
		}
	}
	return reqs
}
