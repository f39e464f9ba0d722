package chaos

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/prefixlb/prefixlb/internal/epp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// The hostile column's ext_proc case (issue 26): `prefixlb epp` with its
// default limits, a gateway's ordinary requests, and a flood of ext_proc
// streams each sending a 15 MiB body that never ends (40 × 15 MiB took
// 1.7 GiB before the limits). The ordinary requests must still be routed,
// with p99 decision time within 2× of the clean run's; the picker's RSS
// stays under 512 MiB; SIGTERM during the flood ends it within its drain
// timeout.
const (
	eppFloodStreams = 40
	eppFloodBytes   = 15 << 20
	eppFloodChunk   = 1 << 20
	eppOrdinary     = 200 // ordinary requests per phase
	eppDrain        = 2 * time.Second
)

func TestChaosHostileEPP(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos: starts processes")
	}
	dir := t.TempDir()
	var backends string
	for i := range 2 {
		e := newEngine(t, dir, fmt.Sprintf("engine%d", i))
		if backends != "" {
			backends += ","
		}
		backends += "127.0.0.1:" + strconv.Itoa(e.http)
	}
	grpcPort, metricsPort := freePort(t), freePort(t)
	p := startProc(t, dir, "epp", "epp",
		"--grpc-listen", "127.0.0.1:"+strconv.Itoa(grpcPort),
		"--health-listen", "",
		"--metrics-listen", "127.0.0.1:"+strconv.Itoa(metricsPort),
		"--backend", backends,
		"--drain-timeout", eppDrain.String(),
		"--log-level", "warn")
	metricsURL := "http://127.0.0.1:" + strconv.Itoa(metricsPort) + "/metrics"
	waitHealthy(t, p, metricsURL, 15*time.Second)

	conn, err := grpc.NewClient("127.0.0.1:"+strconv.Itoa(grpcPort),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(8<<20)))
	if err != nil {
		t.Fatalf("chaos: dial epp: %v", err)
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	// The replicas are known once the picker has scraped them.
	waitFor(t, 15*time.Second, "the picker routing", func() bool {
		_, err := eppPick(client, 0)
		return err == nil
	})

	rss := sampleRSS(p.pid(), 50*time.Millisecond)
	defer rss.stop()
	clean := eppPhase(t, client)
	cleanPeak := rss.peak.Load()

	// The flood: each stream sends its headers and 15 MiB of body in
	// 1 MiB messages, and never ends it; the picker answers 429 to those
	// past its buffered-bytes bound.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var refused, sentBytes, finished atomic.Int64
	chunk := make([]byte, eppFloodChunk)
	for i := range chunk {
		chunk[i] = 'a'
	}
	for range eppFloodStreams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := client.Process(ctx)
			if err != nil {
				return
			}
			if st.Send(eppHeaders(`POST`, "/v1/completions")) != nil {
				return
			}
			done := make(chan struct{})
			go func() { // answers: a 429 ends the stream
				defer close(done)
				for {
					r, err := st.Recv()
					if err != nil {
						return
					}
					if r.GetImmediateResponse() != nil {
						refused.Add(1)
					}
				}
			}()
			if st.Send(eppBody([]byte(`{"model":"chaos-model","prompt":"`), false)) != nil {
				return
			}
			for sent := 0; sent < eppFloodBytes; sent += eppFloodChunk {
				if st.Send(eppBody(chunk, false)) != nil {
					break
				}
				sentBytes.Add(eppFloodChunk)
			}
			finished.Add(1)
			select { // hold the stream open, its body unfinished
			case <-ctx.Done():
			case <-done:
			}
		}()
	}
	// While the flood is being sent, the attacker's gRPC client shares
	// the machine's two cores with the picker (figures logged, not judged);
	// then it holds what the picker took.
	rss.peak.Store(0)
	sending := eppPhase(t, client)
	waitFor(t, 60*time.Second, "the flood's bodies sent or refused", func() bool {
		return finished.Load() == eppFloodStreams
	})
	during := eppPhase(t, client)
	floodPeak := rss.peak.Load()
	m, err := scrape(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hostile epp clean: %d routed, decision p50/p99 %.2f/%.2f ms, RSS peak %.0f MiB", clean.served, clean.p50, clean.p99, float64(cleanPeak)/(1<<20))
	t.Logf("hostile epp while the flood is sent: %d routed, decision p50/p99 %.2f/%.2f ms", sending.served, sending.p50, sending.p99)
	t.Logf("hostile epp flood held (%d streams × %d MiB unfinished bodies, %d MiB sent, %d refused 429, limited_total %.0f): %d routed, decision p50/p99 %.2f/%.2f ms (%.2f× clean p99), RSS peak %.0f MiB",
		eppFloodStreams, eppFloodBytes>>20, sentBytes.Load()>>20, refused.Load(), m["prefixlb_epp_limited_total"], during.served, during.p50, during.p99, during.p99/clean.p99, float64(floodPeak)/(1<<20))
	if sending.served != eppOrdinary || during.served != eppOrdinary {
		t.Errorf("chaos: epp flood: %d and %d of %d ordinary requests routed: %v %v", sending.served, during.served, eppOrdinary, sending.errors, during.errors)
	}
	// Decisions take about a millisecond: on two shared cores the
	// scheduler's jitter alone moves their p99 by milliseconds, so the
	// bound is 2× or 5 ms over the clean p99, whichever is larger (as the
	// suite's recovery test judges TTFTs, window.within).
	if during.p99 > math.Max(2*clean.p99, clean.p99+5) {
		t.Errorf("chaos: epp flood: decision p99 %.2f ms over 2× (or +5 ms) the clean %.2f ms", during.p99, clean.p99)
	}
	if refused.Load() == 0 {
		t.Errorf("chaos: epp flood: no stream refused: the flood did not reach the bound")
	}
	if floodPeak > hostileRSSLimit {
		t.Errorf("chaos: epp flood: RSS peaked at %.0f MiB, over %d MiB", float64(floodPeak)/(1<<20), hostileRSSLimit>>20)
	}

	// SIGTERM with the flood's streams still open.
	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		t.Fatalf("chaos: epp had not exited 15 s after SIGTERM during the flood (drain timeout %v)", eppDrain)
	}
	took := time.Since(sent)
	t.Logf("hostile epp SIGTERM during the flood: exited in %v (drain timeout %v)", took.Round(time.Millisecond), eppDrain)
	if took > eppDrain+time.Second {
		t.Errorf("chaos: epp exit took %v after SIGTERM, over the drain timeout %v (+1 s to close)", took, eppDrain)
	}
	cancel()
	wg.Wait()
}

// eppStats are the ordinary requests of a phase.
type eppStats struct {
	served   int
	p50, p99 float64 // decision time, ms
	errors   map[string]int
}

// eppPhase routes eppOrdinary ordinary requests one after another.
func eppPhase(t *testing.T, client extprocv3.ExternalProcessorClient) eppStats {
	t.Helper()
	s := eppStats{errors: map[string]int{}}
	var ms []float64
	for i := range eppOrdinary {
		d, err := eppPick(client, i)
		if err != nil {
			s.errors[err.Error()]++
			continue
		}
		s.served++
		ms = append(ms, float64(d)/float64(time.Millisecond))

	}
	if len(ms) > 0 {
		slices.Sort(ms)
		s.p50 = ms[len(ms)/2]
		s.p99 = ms[int(math.Ceil(0.99*float64(len(ms))))-1]
	}
	return s
}

// eppPick sends one ordinary request (headers and a small body, whole)
// and waits for the picker's decision: the time to it, or an error when
// the answer is not a destination.
func eppPick(client extprocv3.ExternalProcessorClient, i int) (time.Duration, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := client.Process(ctx)
	if err != nil {
		return 0, err
	}
	start := time.Now()
	body := fmt.Sprintf(`{"model":"chaos-model","prompt":"an ordinary request number %d of the gateway","max_tokens":8}`, i)
	if err := st.Send(eppHeaders("POST", "/v1/completions")); err != nil {
		return 0, err
	}
	if err := st.Send(eppBody([]byte(body), true)); err != nil {
		return 0, err
	}
	r, err := st.Recv()
	if err != nil {
		return 0, err
	}
	took := time.Since(start)
	if ir := r.GetImmediateResponse(); ir != nil {
		return 0, fmt.Errorf("immediate response %d: %.80s", ir.GetStatus().GetCode(), ir.GetBody())
	}
	for _, h := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if h.GetHeader().GetKey() == epp.DestinationHeader {
			return took, nil
		}
	}
	return 0, fmt.Errorf("no %s in %T", epp.DestinationHeader, r.GetResponse())
}

func eppHeaders(method, path string) *extprocv3.ProcessingRequest {
	h := &corev3.HeaderMap{Headers: []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)},
		{Key: ":path", RawValue: []byte(path)},
		{Key: "content-type", RawValue: []byte("application/json")},
	}}
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: h}}}
}

func eppBody(b []byte, end bool) *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: b, EndOfStream: end}}}
}
