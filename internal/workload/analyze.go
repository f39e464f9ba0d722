package workload

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// Stats are the prefix-sharing statistics of a request stream (`prefixlb
// analyze`): how much of each prompt an unlimited prefix cache would already
// hold, how concentrated the shared prefixes are, and the session structure.
type Stats struct {
	// Requests is the number of requests analyzed.
	Requests int `json:"requests"`
	// BlockSize is the block granularity of the sharing figures, in tokens.
	BlockSize int `json:"block_size"`
	// SpanSeconds is the time from the first to the last arrival.
	SpanSeconds float64 `json:"span_s"`
	// RatePerSecond is Requests / SpanSeconds (0 when the span is 0).
	RatePerSecond float64 `json:"rate_per_s"`

	// PromptTokens and OutputTokens describe the lengths.
	PromptTokens Summary `json:"prompt_tokens"`
	OutputTokens Summary `json:"output_tokens"`

	// SharedTokenRatio is the per-request mean, over requests in arrival
	// order, of the fraction of the prompt covered by the longest prefix that
	// any earlier request also had (an unlimited cache, at block granularity:
	// whole blocks, plus the trailing partial block when an earlier prompt had
	// exactly it). This is Preble's statistic: 85–97% on its five workloads.
	SharedTokenRatio float64 `json:"shared_token_ratio"`
	// SharedTokenRatioWeighted is the same coverage summed over all prompt
	// tokens: shared tokens / prompt tokens.
	SharedTokenRatioWeighted float64 `json:"shared_token_ratio_weighted"`
	// BlockHitRatio is the fraction of blocks (a trailing partial block
	// counting as one) that continue a leading run of blocks some earlier
	// request had: Mooncake's infinite-cache prefix-hit ratio, 0.640 on its
	// FAST'25 synthetic trace at 512-token blocks.
	BlockHitRatio float64 `json:"block_hit_ratio"`
	// Blocks and UniqueBlocks count blocks (partial ones included) in all
	// prompts, and distinct ones (by chained key).
	Blocks       int `json:"blocks"`
	UniqueBlocks int `json:"unique_blocks"`

	// Prefixes is the popularity of shared prefixes.
	Prefixes Popularity `json:"prefixes"`
	// Sessions describes multi-request conversations.
	Sessions SessionStats `json:"sessions"`
}

// Summary describes a distribution of counts.
type Summary struct {
	Mean float64 `json:"mean"`
	Min  int     `json:"min"`
	P50  int     `json:"p50"`
	P90  int     `json:"p90"`
	P99  int     `json:"p99"`
	Max  int     `json:"max"`
}

// Popularity is the share of requests carried by the most popular prefixes.
type Popularity struct {
	// By is what identifies a prefix: "group" (the generator's Group field,
	// when every request has one) or "first_block" (the first full block, at
	// BlockSize; prompts shorter than a block are their own prefix).
	By string `json:"by"`
	// Distinct is the number of distinct prefixes.
	Distinct int `json:"distinct"`
	// Top1, Top10 and Top100 are the shares of requests whose prefix is among
	// the 1, 10 and 100 most popular.
	Top1   float64 `json:"top1"`
	Top10  float64 `json:"top10"`
	Top100 float64 `json:"top100"`
	// Top lists the (up to) 10 most popular prefixes.
	Top []PrefixShare `json:"top"`
}

// PrefixShare is one prefix's request count and share.
type PrefixShare struct {
	Prefix   string  `json:"prefix"`
	Requests int     `json:"requests"`
	Share    float64 `json:"share"`
}

// SessionStats is the session structure: requests sharing a Session id.
type SessionStats struct {
	// Sessions is the number of distinct non-empty session ids.
	Sessions int `json:"sessions"`
	// Requests is how many requests belong to a session.
	Requests int `json:"requests"`
	// Turns describes requests per session (zero when there are none).
	Turns Summary `json:"turns"`
}

// Analyze computes the sharing statistics of reqs at blockSize-token blocks
// (keys from internal/blocks; engines reuse KV in whole blocks). Requests are
// visited in arrival order (ties in list order); reqs is not modified.
func Analyze(reqs []Request, blockSize int) (Stats, error) {
	if blockSize < 1 {
		return Stats{}, fmt.Errorf("workload: analyze: block size %d must be >= 1", blockSize)
	}
	st := Stats{Requests: len(reqs), BlockSize: blockSize}
	if len(reqs) == 0 {
		return st, nil
	}
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].Arrival, reqs[b].Arrival) })
	first, last := reqs[order[0]].Arrival, reqs[order[len(order)-1]].Arrival
	st.SpanSeconds = (last - first).Seconds()
	if st.SpanSeconds > 0 {
		st.RatePerSecond = float64(len(reqs)) / st.SpanSeconds
	}

	seen := make(map[blocks.Key]struct{})
	var keys []blocks.Key
	var sumRatio float64
	var sharedTokens, promptTokens, hitBlocks int
	counted := 0
	for _, i := range order {
		t := reqs[i].Tokens
		keys = blocks.Keys(keys[:0], t, blockSize)
		full := len(keys)
		if rest := t[full*blockSize:]; len(rest) > 0 {
			var parent blocks.Key
			if full > 0 {
				parent = keys[full-1]
			}
			keys = append(keys, blocks.Chain(parent, full > 0, rest))
		}
		matched := 0
		for _, k := range keys {
			if _, ok := seen[k]; !ok {
				break
			}
			matched++
		}
		for _, k := range keys[matched:] {
			seen[k] = struct{}{}
		}
		shared := min(matched*blockSize, len(t))
		st.Blocks += len(keys)
		hitBlocks += matched
		sharedTokens += shared
		promptTokens += len(t)
		if len(t) > 0 {
			sumRatio += float64(shared) / float64(len(t))
			counted++
		}
	}
	st.UniqueBlocks = len(seen)
	if counted > 0 {
		st.SharedTokenRatio = sumRatio / float64(counted)
	}
	if promptTokens > 0 {
		st.SharedTokenRatioWeighted = float64(sharedTokens) / float64(promptTokens)
	}
	if st.Blocks > 0 {
		st.BlockHitRatio = float64(hitBlocks) / float64(st.Blocks)
	}

	prompt := make([]int, len(reqs))
	output := make([]int, len(reqs))
	for i, r := range reqs {
		prompt[i], output[i] = len(r.Tokens), r.OutputTokens
	}
	st.PromptTokens = summarize(prompt)
	st.OutputTokens = summarize(output)
	st.Prefixes = popularity(reqs, blockSize)
	st.Sessions = sessions(reqs)
	return st, nil
}

// summarize returns mean and nearest-rank percentiles; it sorts v.
func summarize(v []int) Summary {
	if len(v) == 0 {
		return Summary{}
	}
	slices.Sort(v)
	sum := 0.0
	for _, x := range v {
		sum += float64(x)
	}
	rank := func(p float64) int {
		i := int(math.Ceil(p*float64(len(v)))) - 1
		return v[min(max(i, 0), len(v)-1)]
	}
	return Summary{Mean: sum / float64(len(v)), Min: v[0], P50: rank(0.5), P90: rank(0.9), P99: rank(0.99), Max: v[len(v)-1]}
}

func popularity(reqs []Request, blockSize int) Popularity {
	byGroup := true
	for _, r := range reqs {
		if r.Group == "" {
			byGroup = false
			break
		}
	}
	counts := make(map[string]int)
	var keys []blocks.Key
	for _, r := range reqs {
		var p string
		if byGroup {
			p = r.Group
		} else {
			if n := min(blockSize, len(r.Tokens)); n > 0 {
				keys = blocks.Keys(keys[:0], r.Tokens[:n], n)
				p = fmt.Sprintf("%016x", uint64(keys[0]))
			}
		}
		counts[p]++
	}
	pop := Popularity{By: "first_block", Distinct: len(counts)}
	if byGroup {
		pop.By = "group"
	}
	list := make([]PrefixShare, 0, len(counts))
	for p, c := range counts {
		list = append(list, PrefixShare{Prefix: p, Requests: c, Share: float64(c) / float64(len(reqs))})
	}
	slices.SortFunc(list, func(a, b PrefixShare) int {
		if c := cmp.Compare(b.Requests, a.Requests); c != 0 {
			return c
		}
		return strings.Compare(a.Prefix, b.Prefix)
	})
	top := func(k int) float64 {
		n := 0
		for _, p := range list[:min(k, len(list))] {
			n += p.Requests
		}
		return float64(n) / float64(len(reqs))
	}
	pop.Top1, pop.Top10, pop.Top100 = top(1), top(10), top(100)
	pop.Top = list[:min(10, len(list))]
	return pop
}

func sessions(reqs []Request) SessionStats {
	turns := make(map[string]int)
	n := 0
	for _, r := range reqs {
		if r.Session != "" {
			turns[r.Session]++
			n++
		}
	}
	st := SessionStats{Sessions: len(turns), Requests: n}
	if len(turns) > 0 {
		v := make([]int, 0, len(turns))
		for _, t := range turns {
			v = append(v, t)
		}
		st.Turns = summarize(v)
	}
	return st
}

// WriteTable prints s as a readable table.
func (s *Stats) WriteTable(w io.Writer) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	pct := func(x float64) string { return fmt.Sprintf("%.1f%%", 100*x) }
	sum := func(x Summary) string {
		return fmt.Sprintf("mean %.0f  min %d  p50 %d  p90 %d  p99 %d  max %d", x.Mean, x.Min, x.P50, x.P90, x.P99, x.Max)
	}
	fmt.Fprintf(tw, "requests\t%d\n", s.Requests)
	fmt.Fprintf(tw, "span\t%.1f s (%.2f req/s)\n", s.SpanSeconds, s.RatePerSecond)
	fmt.Fprintf(tw, "prompt tokens\t%s\n", sum(s.PromptTokens))
	fmt.Fprintf(tw, "output tokens\t%s\n", sum(s.OutputTokens))
	fmt.Fprintf(tw, "block size\t%d tokens\n", s.BlockSize)
	fmt.Fprintf(tw, "shared-token ratio (per-request mean, unlimited cache)\t%s\n", pct(s.SharedTokenRatio))
	fmt.Fprintf(tw, "shared-token ratio (token-weighted)\t%s\n", pct(s.SharedTokenRatioWeighted))
	fmt.Fprintf(tw, "block hit ratio (blocks continuing a seen leading run)\t%.3f (%d of %d blocks; %d unique)\n",
		s.BlockHitRatio, int(math.Round(s.BlockHitRatio*float64(s.Blocks))), s.Blocks, s.UniqueBlocks)
	p := s.Prefixes
	fmt.Fprintf(tw, "prefixes (by %s)\t%d distinct; top 1 %s, top 10 %s, top 100 %s of requests\n",
		p.By, p.Distinct, pct(p.Top1), pct(p.Top10), pct(p.Top100))
	for i, t := range p.Top {
		if i == 5 {
			break
		}
		fmt.Fprintf(tw, "  #%d %s\t%d requests (%s)\n", i+1, t.Prefix, t.Requests, pct(t.Share))
	}
	if s.Sessions.Sessions > 0 {
		fmt.Fprintf(tw, "sessions\t%d (%d requests); turns %s\n", s.Sessions.Sessions, s.Sessions.Requests, sum(s.Sessions.Turns))
	} else {
		fmt.Fprintf(tw, "sessions\tnone\n")
	}
	return tw.Flush()
}
