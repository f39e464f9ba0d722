package proxy

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
)

// The proxy-overhead benchmarks (docs/router.md, "Proxy overhead") measure
// what the router adds to a request's latency, and how many requests per
// second it sustains, against fast fake replicas on loopback that answer
// every request at once: 8 streamed chunks, a usage chunk and [DONE], no
// modelled GPU time. Every prompt is 4096 token ids (about 25 KB of JSON),
// 3072 of them a prefix shared with other requests.
//
//	go test -run '^$' -bench 'ProxyOverhead|ProxyThroughput' -benchtime 1x ./internal/proxy/
//
// Each benchmark runs once for a fixed time whatever b.N (use -benchtime 1x);
// the -overhead.* flags (after -args) change the rate, durations and sizes.
var (
	ohRate     = flag.Float64("overhead.rate", 1000, "open-loop request rate of BenchmarkProxyOverhead (req/s)")
	ohDuration = flag.Duration("overhead.duration", 3*time.Second, "measured time per target (direct, proxied) of each benchmark")
	ohClients  = flag.Int("overhead.clients", 64, "concurrent clients of BenchmarkProxyThroughput")
	ohPrompt   = flag.Int("overhead.prompt", 4096, "prompt tokens per request")
	ohChunks   = flag.Int("overhead.chunks", 8, "streamed output chunks per response")
)

// ohReplicas is the number of fake replicas behind the proxy.
const ohReplicas = 3

// fastReplica is a loopback OpenAI-compatible server that streams a short
// vLLM-shaped completion the moment it has read the request body.
type fastReplica struct {
	srv    *httptest.Server
	events []byte // the whole SSE body
}

func newFastReplica(b *testing.B, chunks, promptTokens int) *fastReplica {
	b.Helper()
	f := &fastReplica{}
	var ev bytes.Buffer
	for i := range chunks {
		fin := "null"
		if i == chunks-1 {
			fin = `"length"`
		}
		fmt.Fprintf(&ev, `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":" tok%d","logprobs":null,"finish_reason":%s,"stop_reason":null}]}`+"\n\n", i, fin)
	}
	fmt.Fprintf(&ev, `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}}`+"\n\n",
		promptTokens, promptTokens+chunks, chunks, promptTokens*3/4)
	ev.WriteString("data: [DONE]\n\n")
	f.events = ev.Bytes()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n")
	})
	mux.HandleFunc("POST /v1/completions", f.complete)
	f.srv = httptest.NewServer(mux)
	b.Cleanup(f.srv.Close)
	return f
}

// complete reads the body and streams the answer, one flush per event as
// vLLM does.
func (f *fastReplica) complete(w http.ResponseWriter, r *http.Request) {
	if _, err := io.Copy(io.Discard, r.Body); err != nil {
		return
	}
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	fl := w.(http.Flusher)
	rest := f.events
	for len(rest) > 0 {
		i := bytes.Index(rest, []byte("\n\n")) + 2
		if _, err := w.Write(rest[:i]); err != nil {
			return
		}
		fl.Flush()
		rest = rest[i:]
	}
}

// ohBodies returns n request bodies of promptTokens token ids each: a
// prefix of 3/4 of the prompt shared by one in 16 requests, then a unique
// suffix.
func ohBodies(n, promptTokens int) [][]byte {
	rng := rand.New(rand.NewPCG(1, 2))
	const groups = 16
	shared := promptTokens * 3 / 4
	prefixes := make([][]uint32, groups)
	for g := range prefixes {
		prefixes[g] = make([]uint32, shared)
		for i := range prefixes[g] {
			prefixes[g][i] = uint32(rng.IntN(128000))
		}
	}
	out := make([][]byte, n)
	for k := range out {
		var b bytes.Buffer
		b.WriteString(`{"model":"m","prompt":[`)
		for i := range promptTokens {
			if i > 0 {
				b.WriteByte(',')
			}
			id := uint32(rng.IntN(128000))
			if i < shared {
				id = prefixes[k%groups][i]
			}
			b.WriteString(strconv.FormatUint(uint64(id), 10))
		}
		b.WriteString(`],"max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}`)
		out[k] = b.Bytes()
	}
	return out
}

// ohRig is the replicas, a proxy in front of them and a client.
type ohRig struct {
	direct  []string // the replicas' URLs
	proxied string   // the proxy's URL
	client  *http.Client
	bodies  [][]byte
	next    atomic.Uint64
}

func newOHRig(b *testing.B, policyName string) *ohRig {
	b.Helper()
	rig := &ohRig{bodies: ohBodies(256, *ohPrompt)}
	cfg := DefaultConfig()
	cfg.Policy = policyName
	cfg.Logger = slog.New(slog.DiscardHandler)
	for i := range ohReplicas {
		f := newFastReplica(b, *ohChunks, *ohPrompt)
		rig.direct = append(rig.direct, f.srv.URL)
		cfg.Backends = append(cfg.Backends, Backend{Name: fmt.Sprintf("r%d", i), URL: f.srv.URL})
	}
	p, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	loops := make(chan struct{})
	go func() { defer close(loops); _ = p.Run(ctx) }()
	srv := httptest.NewServer(p.Handler())
	rig.proxied = srv.URL
	rig.client = &http.Client{Transport: &http.Transport{
		MaxIdleConns:        4096,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     time.Minute,
		DisableCompression:  true,
	}}
	b.Cleanup(func() {
		rig.client.CloseIdleConnections()
		srv.Close()
		cancel()
		<-loops
		p.Close()
	})
	return rig
}

// one sends one request to base and returns the time from start to the
// "data: [DONE]" line.
func (rig *ohRig) one(base string, start time.Time) (time.Duration, error) {
	body := rig.bodies[rig.next.Add(1)%uint64(len(rig.bodies))]
	req, err := http.NewRequest(http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := rig.client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		return 0, fmt.Errorf("status %d: %s", resp.StatusCode, msg)
	}
	br := bufio.NewReader(resp.Body)
	for {
		line, err := br.ReadSlice('\n')
		if bytes.Equal(line, []byte("data: [DONE]\n")) {
			d := time.Since(start)
			_, _ = io.Copy(io.Discard, br)
			return d, nil
		}
		if err != nil {
			return 0, fmt.Errorf("stream ended before [DONE]: %v", err)
		}
	}
}

// ohSamples collects latencies and errors.
type ohSamples struct {
	mu   sync.Mutex // guards lat and errs
	lat  []time.Duration
	errs int
	last error
}

func (s *ohSamples) add(d time.Duration, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err != nil {
		s.errs++
		s.last = err
		return
	}
	s.lat = append(s.lat, d)
}

// pct returns the q-quantile (nearest rank) in milliseconds.
func (s *ohSamples) pct(q float64) float64 {
	if len(s.lat) == 0 {
		return 0
	}
	slices.Sort(s.lat)
	i := min(int(q*float64(len(s.lat))), len(s.lat)-1)
	return float64(s.lat[i]) / float64(time.Millisecond)
}

// openLoop sends requests at rate for d, alternating between the direct
// replicas and the proxy every 250 ms so that both see the same machine
// (the other processes on it included), and returns both sample sets.
// Latency runs from each request's scheduled send time, so a client that
// falls behind counts against the target it was sending to.
func (rig *ohRig) openLoop(rate float64, d time.Duration) (direct, proxied *ohSamples, sent int) {
	direct, proxied = &ohSamples{}, &ohSamples{}
	const window = 250 * time.Millisecond
	interval := time.Duration(float64(time.Second) / rate)
	var wg sync.WaitGroup
	start := time.Now()
	for i := 0; ; i++ {
		at := start.Add(time.Duration(i) * interval)
		el := at.Sub(start)
		if el >= 2*d {
			break
		}
		if w := time.Until(at); w > 0 {
			time.Sleep(w)
		}
		target, s := rig.proxied, proxied
		if (el/window)%2 == 0 {
			target, s = rig.direct[i%len(rig.direct)], direct
		}
		wg.Add(1)
		sent++
		go func() {
			defer wg.Done()
			lat, err := rig.one(target, at)
			s.add(lat, err)
		}()
	}
	wg.Wait()
	return direct, proxied, sent
}

// closedLoop runs clients that each send one request after another to
// target(i) for d, and returns the completed requests per second.
func (rig *ohRig) closedLoop(clients int, d time.Duration, target func(i int) string) (float64, *ohSamples) {
	s := &ohSamples{}
	var done atomic.Int64
	stop := time.Now().Add(d)
	start := time.Now()
	var wg sync.WaitGroup
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := c; time.Now().Before(stop); i += clients {
				t := time.Now()
				lat, err := rig.one(target(i), t)
				s.add(lat, err)
				if err == nil {
					done.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	return float64(done.Load()) / time.Since(start).Seconds(), s
}

// warm opens connections and fills the router's tree with the prefixes.
func (rig *ohRig) warm(b *testing.B) {
	b.Helper()
	for i := range 64 {
		for _, u := range []string{rig.direct[i%len(rig.direct)], rig.proxied} {
			if _, err := rig.one(u, time.Now()); err != nil {
				b.Fatalf("warm-up request to %s: %v", u, err)
			}
		}
	}
}

// BenchmarkProxyOverhead sends streamed 4k-token requests open-loop at
// -overhead.rate, alternately straight to the replicas and through the
// proxy, and reports the latency the proxy adds at p50 and p99 (request
// sent → "data: [DONE]" received).
func BenchmarkProxyOverhead(b *testing.B) {
	for _, pol := range []string{"e2", "round-robin"} {
		b.Run("policy="+pol, func(b *testing.B) {
			rig := newOHRig(b, pol)
			rig.warm(b)
			b.ReportAllocs()
			b.ResetTimer()
			var direct, proxied *ohSamples
			sent := 0
			for range b.N {
				direct, proxied, sent = rig.openLoop(*ohRate, *ohDuration)
			}
			b.StopTimer()
			if direct.errs+proxied.errs > 0 {
				b.Fatalf("%d direct and %d proxied requests failed, last: %v %v", direct.errs, proxied.errs, direct.last, proxied.last)
			}
			dp50, dp99 := direct.pct(0.50), direct.pct(0.99)
			pp50, pp99 := proxied.pct(0.50), proxied.pct(0.99)
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(float64(sent)/(2*ohDuration.Seconds()), "req/s")
			b.ReportMetric(dp50, "direct-p50-ms")
			b.ReportMetric(dp99, "direct-p99-ms")
			b.ReportMetric(pp50, "proxied-p50-ms")
			b.ReportMetric(pp99, "proxied-p99-ms")
			b.ReportMetric(pp50-dp50, "added-p50-ms")
			b.ReportMetric(pp99-dp99, "added-p99-ms")
		})
	}
}

// BenchmarkProxyThroughput runs -overhead.clients closed-loop clients,
// first straight to the replicas, then through the proxy (e2), and reports
// the completed requests per second of each.
func BenchmarkProxyThroughput(b *testing.B) {
	rig := newOHRig(b, "e2")
	rig.warm(b)
	b.ReportAllocs()
	b.ResetTimer()
	var direct, proxied float64
	var ds, ps *ohSamples
	for range b.N {
		direct, ds = rig.closedLoop(*ohClients, *ohDuration, func(i int) string { return rig.direct[i%len(rig.direct)] })
		proxied, ps = rig.closedLoop(*ohClients, *ohDuration, func(int) string { return rig.proxied })
	}
	b.StopTimer()
	if ds.errs+ps.errs > 0 {
		b.Fatalf("%d direct and %d proxied requests failed, last: %v %v", ds.errs, ps.errs, ds.last, ps.last)
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(direct, "direct-req/s")
	b.ReportMetric(proxied, "req/s")
	b.ReportMetric(ps.pct(0.50), "proxied-p50-ms")
	b.ReportMetric(ps.pct(0.99), "proxied-p99-ms")
}

// BenchmarkParseRequest4k measures the proxy's reading of one streamed
// completions body whose prompt is 4096 token ids: its CPU cost per request
// at the HTTP front.
func BenchmarkParseRequest4k(b *testing.B) {
	body := ohBodies(1, 4096)[0]
	k := keying.ChunkKeyer{BlockTokens: 16}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		r, err := openai.ParseRequest(openai.KindCompletion, body)
		if err != nil {
			b.Fatal(err)
		}
		if _, _, err := k.Keys(r); err != nil {
			b.Fatal(err)
		}
	}
}
