// Package loadgen is the client of `prefixlb bench`: an open-loop load
// generator for any OpenAI-compatible endpoint (vLLM, SGLang, prefixlb serve,
// prefixlb engine). It sends each workload request at its arrival time,
// whether or not earlier ones have finished, streams the response and
// measures TTFT, inter-token latency, TPOT, end-to-end latency and the prefix
// cache hit the server reports (usage.prompt_tokens_details.cached_tokens, or
// llama.cpp's usage.prompt_tokens − timings.prompt_n), and hands the records
// to package report.
package loadgen

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// Mode selects how a workload request's tokens are sent.
type Mode string

const (
	// ModeCompletions posts to /v1/completions with the prompt as a list of
	// token ids: requests that share token prefixes share them exactly on
	// the server, with no tokenizer involved. vLLM and SGLang accept it.
	ModeCompletions Mode = "completions"
	// ModeText posts to /v1/completions with the prompt as text: a
	// dataset request's own Text, else the token ids rendered by
	// Config.Text (bench: one whole-word token of the target's tokenizer
	// per id, internal/tokenize/prompttext), else as words "t<id>" joined
	// by spaces.
	ModeText Mode = "text"
	// ModeChat posts to /v1/chat/completions with a dataset request's own
	// Messages, else one user message holding the text of ModeText.
	ModeChat Mode = "chat"
)

// Config configures a run. Start from [DefaultConfig]; the zero value of
// each field is documented where it differs from the default.
type Config struct {
	// Target is the server's base URL, e.g. "http://127.0.0.1:8000"; a
	// trailing "/v1" is accepted. Required.
	Target string
	// Mode selects the endpoint and prompt form (default ModeCompletions).
	Mode Mode
	// Model is sent as "model". Empty: the first id listed by GET
	// /v1/models, or "default" if that fails. A request for a LoRA adapter
	// (workload.Request.Adapter: the lora workload) is sent with the
	// adapter's name as its model instead, as vLLM serves an adapter under
	// its own name; `prefixlb serve --lora-adapters` then routes it by
	// adapter.
	Model string
	// Policy labels the results (report.Result.Policy); default "bench".
	Policy string
	// Rate labels the results with the offered load in requests per second.
	Rate float64
	// Workload labels the results with the workload's name.
	Workload string
	// MaxInFlight caps the requests outstanding at once (default 4096). A
	// request due while the cap is reached waits for a free slot and is
	// counted in report.Result.Delayed.
	MaxInFlight int
	// RequestTimeout bounds each request, from sending to the end of its
	// stream (default 10 minutes; 0: no bound beyond the run's context).
	RequestTimeout time.Duration
	// MaxDuration stops sending requests whose arrival is at or after it;
	// requests in flight then still finish. 0: send every request.
	MaxDuration time.Duration
	// Client sends the requests. Nil: a client of its own with a connection
	// pool sized for MaxInFlight and compression off (so chunks are not
	// buffered), whose idle connections are closed when Run returns.
	Client *http.Client
	// Header is added to every request (e.g. Authorization).
	Header http.Header
	// Text renders a prompt's token ids as the text ModeText and ModeChat
	// send; it is called from the request goroutines, so it must be safe
	// for concurrent use (a *prompttext.Renderer's Render is). Nil: each
	// id as the word "t<id>", words joined by spaces, which a real
	// tokenizer splits into several tokens each.
	Text func(ids []uint32) string
	// MaxLine is the longest SSE line accepted (default DefaultMaxLine).
	MaxLine int
	// Progress receives a progress line about twice a second: requests
	// sent, completed, failed and in flight, elapsed and total time, and the
	// median TTFT of recent requests. Nil: none. It is written only when
	// Progress is a terminal (the line is redrawn in place) or when
	// ProgressAlways is set (one line per update).
	Progress io.Writer
	// ProgressAlways writes progress even when Progress is not a terminal.
	ProgressAlways bool
	// ProgressInterval is the time between progress lines (default 500ms).
	ProgressInterval time.Duration
}

// DefaultConfig returns a Config with every default filled in but Target.
func DefaultConfig() Config {
	return Config{
		Mode:             ModeCompletions,
		Policy:           "bench",
		MaxInFlight:      4096,
		RequestTimeout:   10 * time.Minute,
		MaxLine:          DefaultMaxLine,
		ProgressInterval: 500 * time.Millisecond,
	}
}

// Validate reports the first invalid field of c.
func (c Config) Validate() error {
	switch {
	case c.Target == "":
		return errors.New("loadgen: Target is required")
	case !strings.HasPrefix(c.Target, "http://") && !strings.HasPrefix(c.Target, "https://"):
		return fmt.Errorf("loadgen: Target %q: want an http:// or https:// URL", c.Target)
	case c.Mode != ModeCompletions && c.Mode != ModeText && c.Mode != ModeChat:
		return fmt.Errorf("loadgen: Mode %q: want %q, %q or %q", c.Mode, ModeCompletions, ModeText, ModeChat)
	case c.MaxInFlight < 1:
		return fmt.Errorf("loadgen: MaxInFlight %d: want ≥ 1", c.MaxInFlight)
	case c.RequestTimeout < 0:
		return fmt.Errorf("loadgen: RequestTimeout %v: want ≥ 0", c.RequestTimeout)
	case c.MaxDuration < 0:
		return fmt.Errorf("loadgen: MaxDuration %v: want ≥ 0", c.MaxDuration)
	case c.Rate < 0:
		return fmt.Errorf("loadgen: Rate %v: want ≥ 0", c.Rate)
	case c.ProgressInterval < 0:
		return fmt.Errorf("loadgen: ProgressInterval %v: want ≥ 0", c.ProgressInterval)
	}
	return nil
}

// withDefaults fills zero fields that have a default.
func (c Config) withDefaults() Config {
	d := DefaultConfig()
	c.Mode = cmp.Or(c.Mode, d.Mode)
	c.Policy = cmp.Or(c.Policy, d.Policy)
	c.MaxInFlight = cmp.Or(c.MaxInFlight, d.MaxInFlight)
	c.MaxLine = cmp.Or(c.MaxLine, d.MaxLine)
	c.ProgressInterval = cmp.Or(c.ProgressInterval, d.ProgressInterval)
	c.Target = baseURL(c.Target)
	return c
}

// baseURL strips trailing slashes and a trailing "/v1" from target.
func baseURL(target string) string {
	t := strings.TrimRight(target, "/")
	return strings.TrimSuffix(t, "/v1")
}

// Output is the outcome of a run.
type Output struct {
	// Records holds one record per request sent, in sending order.
	Records []report.RequestRecord
	// Result summarises Records (report.Build over the run's elapsed time),
	// with ITL, Delayed, SendLag, Workload and Target filled in.
	Result report.Result
	// Timings holds, index for index with Records, the timings llama.cpp's
	// llama-server reported for each request (prefill time prompt_ms,
	// prompt tokens computed, decode time per token); nil where the
	// server sent none (vLLM, SGLang).
	Timings []*Timings
	// Model is the model name the requests carried (those for a LoRA
	// adapter carried the adapter's).
	Model string
	// Elapsed is the time from the start of the run to the end of the last
	// request.
	Elapsed time.Duration
}

// Run sends reqs to cfg.Target open-loop: request i leaves at its Arrival
// after the start of the run (reqs need not be sorted), regardless of how
// many earlier ones are still streaming, up to cfg.MaxInFlight; but the
// next turn of a conversation (workload.Request.AwaitPrevious) leaves no
// earlier than the end of its session's previous request, closed-loop
// within the conversation as a chat client is. Its send lag counts from
// the later of the two. It returns when every request sent has finished.
//
// Each request runs in a goroutine that Run owns and waits for. When ctx is
// done, Run stops sending, cancels the requests in flight (they are recorded
// as failed) and returns promptly with the records so far and an error
// wrapping ctx.Err().
func Run(ctx context.Context, cfg Config, reqs []workload.Request) (Output, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return Output{}, err
	}
	client := cfg.Client
	if client == nil {
		client = newClient(cfg.MaxInFlight)
		defer client.CloseIdleConnections()
	}
	model := cfg.Model
	if model == "" {
		model = discoverModel(ctx, client, cfg.Target, cfg.Header)
	}
	url := cfg.Target + cfg.Mode.path()

	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].Arrival, reqs[b].Arrival) })
	if cfg.MaxDuration > 0 {
		n, _ := slices.BinarySearchFunc(order, cfg.MaxDuration, func(i int, d time.Duration) int {
			return cmp.Compare(reqs[i].Arrival, d)
		})
		order = order[:n]
	}

	st := newStats(len(order), lastArrival(reqs, order, cfg.MaxDuration))
	records := make([]report.RequestRecord, len(order))
	timings := make([]*Timings, len(order))
	usagePrompt := make([]int, len(order)) // usage.prompt_tokens; 0: none
	sentReq := make([]int, len(order))     // sentReq[k]: the index in reqs of the k-th request sent
	prev, finished := previousTurns(reqs, order)

	start := time.Now()
	stopProgress := startProgress(cfg, st, start)
	defer stopProgress()

	var (
		wg      sync.WaitGroup // the request goroutines and the turns waiting for an answer
		mu      sync.Mutex     // guards sent, delayed and sendLag, which the waiting turns update too
		sent    int
		delayed int
		sendLag report.Samples
	)
	sem := make(chan struct{}, cfg.MaxInFlight)
	// dispatch sends request i, due at due, once a slot is free; false
	// when ctx ended first. It returns once the request is on its way.
	dispatch := func(i int, due time.Duration) bool {
		r := reqs[i]
		select {
		case sem <- struct{}{}:
		default:
			mu.Lock()
			delayed++
			mu.Unlock()
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				return false
			}
		}
		if ctx.Err() != nil {
			<-sem
			return false
		}
		sentAt := time.Since(start)
		mu.Lock()
		sendLag.Add(float64(sentAt-due) / float64(time.Millisecond))
		k := sent
		sent++
		sentReq[k] = i
		mu.Unlock()
		st.sent()
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			rctx, cancel := ctx, context.CancelFunc(func() {})
			if cfg.RequestTimeout > 0 {
				rctx, cancel = context.WithTimeout(ctx, cfg.RequestTimeout)
			}
			// The body is built here, not in the sending loop, so that long
			// prompts do not delay the requests due after this one.
			var o outcome
			if payload, err := body(cfg.Mode, model, r, cfg.Text); err != nil {
				o.err = err // only an invalid Mode, which Validate rejects
			} else {
				o = do(rctx, client, url, cfg.Header, payload, cfg.MaxLine)
			}
			cancel()
			rec := record(cfg, r, start, sentAt, o)
			records[k], timings[k], usagePrompt[k] = rec, o.timings, o.promptTokens
			st.done(rec)
			if ch := finished[i]; ch != nil {
				close(ch)
			}
		}()
		return true
	}

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
send:
	for _, i := range order {
		r := reqs[i]
		if d := time.Until(start.Add(r.Arrival)); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				break send
			case <-timer.C:
			}
		}
		if p := prev[i]; p >= 0 {
			select {
			case <-finished[p]:
			default:
				// The next turn of a conversation whose answer has not
				// arrived: it leaves when the answer does.
				wg.Add(1)
				go func() {
					defer wg.Done()
					select {
					case <-finished[p]:
						dispatch(i, max(r.Arrival, time.Since(start)))
					case <-ctx.Done():
					}
				}()
				continue
			}
		}
		if !dispatch(i, r.Arrival) {
			break send
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	stopProgress()

	mu.Lock() // every sender has returned; for the race detector's sake
	defer mu.Unlock()
	records, timings = records[:sent], timings[:sent]
	res := report.Build(cfg.Policy, cfg.Rate, records, elapsed)
	res.Workload, res.Target, res.Delayed = cfg.Workload, cfg.Target, delayed
	res.PromptTokensMean, res.WorkloadPromptTokensMean = promptMeans(reqs, sentReq[:sent], records, usagePrompt[:sent])
	res.ErrorClasses = report.ErrorClasses(records)
	if sendLag.Len() > 0 {
		s := sendLag.Summary()
		res.SendLag = &s
	}
	out := Output{Records: records, Timings: timings, Result: res, Model: model, Elapsed: elapsed}
	if err := ctx.Err(); err != nil {
		return out, fmt.Errorf("loadgen: run interrupted after %d of %d requests: %w", sent, len(order), err)
	}
	return out, nil
}

// previousTurns returns, for each request of reqs, the index of the
// request it awaits (workload.Request.AwaitPrevious: the last one before
// it in reqs with the same Session), or -1; and a channel for each awaited
// request that is to be sent (in order), which closes when its answer
// has arrived (nil for the others). An awaited request that is not to be
// sent (after MaxDuration) is awaited by no one: its turn is sent at its
// arrival.
func previousTurns(reqs []workload.Request, order []int) (prev []int, finished []chan struct{}) {
	prev = make([]int, len(reqs))
	finished = make([]chan struct{}, len(reqs))
	toSend := make([]bool, len(reqs))
	for _, i := range order {
		toSend[i] = true
	}
	last := map[string]int{}
	for i, r := range reqs {
		prev[i] = -1
		p, ok := last[r.Session]
		if r.Session != "" {
			last[r.Session] = i
		}
		if !r.AwaitPrevious || !ok || !toSend[p] {
			continue
		}
		prev[i] = p
		if finished[p] == nil {
			finished[p] = make(chan struct{})
		}
	}
	return prev, finished
}

// promptMeans returns the mean usage.prompt_tokens over the successful
// requests that reported it, and the mean workload length of the same
// requests; with no usage at all, 0 and the mean workload length of the
// successful requests. records[k] is the record of reqs[order[k]].
func promptMeans(reqs []workload.Request, order []int, records []report.RequestRecord, usagePrompt []int) (engine, work float64) {
	var nUsage, sumUsage, sumWorkUsage, nOK, sumWork int
	for k, rec := range records {
		if rec.Failed() {
			continue
		}
		n := len(reqs[order[k]].Tokens)
		nOK++
		sumWork += n
		if usagePrompt[k] > 0 {
			nUsage++
			sumUsage += usagePrompt[k]
			sumWorkUsage += n
		}
	}
	switch {
	case nUsage > 0:
		return float64(sumUsage) / float64(nUsage), float64(sumWorkUsage) / float64(nUsage)
	case nOK > 0:
		return 0, float64(sumWork) / float64(nOK)
	}
	return 0, 0
}

// record turns the outcome of request r into its report record.
func record(cfg Config, r workload.Request, start time.Time, sentAt time.Duration, o outcome) report.RequestRecord {
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	rec := report.RequestRecord{
		ID:             r.ID,
		Policy:         cfg.Policy,
		Rate:           cfg.Rate,
		Replica:        o.replica,
		PrefillReplica: o.prefill,
		Session:        r.Session,
		Group:          r.Group,
		ArrivalS:       r.Arrival.Seconds(),
		SentS:          sentAt.Seconds(),
		PromptTokens:   o.promptTokens,
		CachedTokens:   o.cachedTokens,
		OutputTokens:   o.outputTokens,
	}
	if rec.PromptTokens == 0 {
		// No usage from the server: the workload's length (exact in
		// ModeCompletions, the server's tokenizer decides in the others).
		rec.PromptTokens = len(r.Tokens)
	}
	if o.err != nil {
		rec.Error = o.err.Error()
		rec.LatencyMs = ms(o.latency)
		return rec
	}
	rec.TTFTMs, rec.LatencyMs, rec.ITLMs = ms(o.ttft), ms(o.latency), o.itl
	rec.TPOTMs = report.TPOT(rec.TTFTMs, rec.LatencyMs, rec.OutputTokens)
	return rec
}

// lastArrival returns the arrival of the last request to be sent (the run's
// planned sending time), bounded by maxDuration when it is set.
func lastArrival(reqs []workload.Request, order []int, maxDuration time.Duration) time.Duration {
	if len(order) == 0 {
		return 0
	}
	last := reqs[order[len(order)-1]].Arrival
	if maxDuration > 0 {
		last = min(last, maxDuration)
	}
	return last
}

// newClient returns an HTTP client whose pool keeps up to maxInFlight
// connections to one host alive and that does not ask for compression, so
// SSE chunks reach the parser as they are sent.
func newClient(maxInFlight int) *http.Client {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConns = 0
	t.MaxIdleConnsPerHost = maxInFlight
	t.DisableCompression = true
	return &http.Client{Transport: t}
}

// discoverTimeout bounds the GET /v1/models request.
const discoverTimeout = 10 * time.Second

// discoverModel returns the first model id that GET {base}/v1/models lists,
// or "default" when there is none or the request fails.
func discoverModel(ctx context.Context, client *http.Client, base string, header http.Header) string {
	id, err := DiscoverModel(ctx, client, base, header)
	if err != nil || id == "" {
		return "default"
	}
	return id
}

// DiscoverModel returns the first model id listed by GET {base}/v1/models
// (the OpenAI list format, {"data":[{"id":..}]}), or "" if it lists none.
// A nil client means http.DefaultClient; header is added to the request.
func DiscoverModel(ctx context.Context, client *http.Client, base string, header http.Header) (string, error) {
	if client == nil {
		client = http.DefaultClient
	}
	ctx, cancel := context.WithTimeout(ctx, discoverTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, baseURL(base)+"/v1/models", nil)
	if err != nil {
		return "", fmt.Errorf("loadgen: list models: %w", err)
	}
	for k, vs := range header {
		req.Header[k] = vs
	}
	resp, err := client.Do(req)
	if err != nil {
		return "", fmt.Errorf("loadgen: list models: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("loadgen: list models: %w", statusError(resp))
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 16<<20)).Decode(&list); err != nil {
		return "", fmt.Errorf("loadgen: list models: %w", err)
	}
	if len(list.Data) == 0 {
		return "", nil
	}
	return list.Data[0].ID, nil
}
