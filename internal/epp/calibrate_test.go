package epp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
	"github.com/prefixlb/prefixlb/internal/engine/enginetest"
	"github.com/prefixlb/prefixlb/internal/promtest"
)

// This file checks calibration (internal/calibrate) through the ext_proc
// path: real modelled replicas (internal/engine) of two GPU generations on
// loopback, a client that plays Envoy — it asks the picker, forwards the
// request to the endpoint picked over real HTTP, and hands the response
// body to the picker as it arrives — and what the picker learnt read back
// from ReplicaViews and its /metrics.

// calScale is the engines' time scale here, as in internal/proxy's
// calibration test: a router sees each engine's profile with its times
// divided by it (enginetest.WallSpec), a decode step of llama3.1-8b-h100 takes 7 ms
// of real time, well above what the path adds to it.
const calScale = 1.25

// startCalEngine runs a modelled replica of profile spec at time scale
// scale on loopback until the test ends, and returns its "ip:port".
func startCalEngine(t *testing.T, spec string, scale float64) string {
	t.Helper()
	ec := engine.DefaultConfig()
	ec.Replica.Profile = enginetest.Profile(t, spec)
	ec.TimeScale = scale
	return strings.TrimPrefix(enginetest.Start(t, ec), "http://")
}

// calTokens is request k's prompt length: 768 to 1279 tokens.
func calTokens(k int) int { return 768 + (k*197)%512 }

// relay plays Envoy for one request in FULL_DUPLEX_STREAMED mode: it sends
// the request to the picker, forwards it to the primary endpoint picked,
// and streams the replica's response body to the picker chunk by chunk as
// it arrives, then ends the stream. The picker has recorded the request's
// end when relay returns. It returns the endpoint that served. Safe to call
// from any goroutine.
func relay(ctx context.Context, conn *grpc.ClientConn, client *http.Client, body []byte) (string, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		return "", err
	}
	send := func(r *extprocv3.ProcessingRequest) error {
		if err := st.Send(r); err != nil {
			return fmt.Errorf("send to the picker: %w", err)
		}
		return nil
	}
	h := hdrs(":method", "POST", ":path", "/v1/completions", "content-type", "application/json")
	if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: h}}}); err != nil {
		return "", err
	}
	if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: body, EndOfStream: true}}}); err != nil {
		return "", err
	}
	r, err := st.Recv()
	if err != nil {
		return "", fmt.Errorf("decision: %w", err)
	}
	dest := ""
	for _, hv := range r.GetRequestHeaders().GetResponse().GetHeaderMutation().GetSetHeaders() {
		if hv.GetHeader().GetKey() == DestinationHeader {
			dest = string(hv.GetHeader().GetRawValue())
		}
	}
	primary, _, _ := strings.Cut(dest, ",")
	if primary == "" {
		return "", fmt.Errorf("no destination in %v", r)
	}
	var forwarded []byte
	for eos := false; !eos; {
		r, err := st.Recv()
		if err != nil {
			return "", fmt.Errorf("request body: %w", err)
		}
		sr := r.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return "", fmt.Errorf("request body response is %v", r)
		}
		forwarded, eos = append(forwarded, sr.Body...), sr.EndOfStream
	}
	if !bytes.Equal(forwarded, body) {
		return "", fmt.Errorf("the picker changed the request body (%d bytes, sent %d)", len(forwarded), len(body))
	}

	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+primary+"/v1/completions", bytes.NewReader(forwarded))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	served, err := structpb.NewStruct(map[string]any{ServedKey: primary})
	if err != nil {
		return "", err
	}
	if err := send(&extprocv3.ProcessingRequest{
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{DestinationNamespace: served}},
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: hdrs(":status", strconv.Itoa(resp.StatusCode), "content-type", resp.Header.Get("Content-Type"))}}}); err != nil {
		return "", err
	}
	if _, err := st.Recv(); err != nil {
		return "", fmt.Errorf("response headers: %w", err)
	}
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		if rerr != nil && rerr != io.EOF {
			return "", fmt.Errorf("read the replica's response: %w", rerr)
		}
		eos := rerr == io.EOF
		if n == 0 && !eos {
			continue
		}
		if err := send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: append([]byte(nil), buf[:n]...), EndOfStream: eos}}}); err != nil {
			return "", err
		}
		if _, err := st.Recv(); err != nil {
			return "", fmt.Errorf("response body: %w", err)
		}
		if eos {
			break
		}
	}
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("replica %s: status %d", primary, resp.StatusCode)
	}
	if err := st.CloseSend(); err != nil {
		return "", err
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("stream end: %v, want EOF", err)
	}
	return primary, nil
}

// views returns the picker's ReplicaViews by name.
func views(p *Picker) map[string]ReplicaView {
	out := map[string]ReplicaView{}
	for _, v := range p.ReplicaViews() {
		out[v.Name] = v
	}
	return out
}

// TestCalibrationExtProc runs an H100 and an A100 replica (modelled) behind
// the picker, told llama3.1-8b-h100 for both, and checks that streamed
// responses relayed through ext_proc teach it each replica's own speed:
// ReplicaViews show observations from busy periods and token gaps, the
// A100's fitted prefill and decode step come out well above the H100's and
// nearer its true profile than the told one; /metrics exports the same
// figures; non-streamed responses are counted as skipped (no_first_token).
func TestCalibrationExtProc(t *testing.T) {
	const (
		sequential = 6
		bursts     = 2
		burstSize  = 4
		maxTokens  = 8
		nonStream  = 2
	)
	toldSpec := enginetest.WallSpec(costmodel.Llama31_8BH100, calScale)
	p, err := NewPicker(Config{Policy: "round-robin", Profile: toldSpec, BackendKind: "vllm", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	specs := map[string]string{"h100": costmodel.Llama31_8BH100, "a100": costmodel.Llama31_8BA100}
	for _, name := range []string{"h100", "a100"} {
		p.Add(Replica{Name: name, Address: startCalEngine(t, specs[name], calScale), Ready: true})
	}
	conn := startServer(t, NewServer(p, ServerConfig{}))
	client := &http.Client{}
	t.Cleanup(client.CloseIdleConnections)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	k := 0
	for range sequential {
		k++
		if _, err := relay(ctx, conn, client, []byte(enginetest.UniquePrompt(k, calTokens(k), maxTokens, true))); err != nil {
			t.Fatalf("request %d: %v", k, err)
		}
	}
	enginetest.Bursts(t, k, bursts, burstSize, func(k int) error {
		_, err := relay(ctx, conn, client, []byte(enginetest.UniquePrompt(k, calTokens(k), maxTokens, true)))
		return err
	})

	// relay returns once the picker has recorded the end: nothing to wait for.
	reps := views(p)
	told := calibrate.FitOf(enginetest.Profile(t, toldSpec))
	for name, spec := range specs {
		v, ok := reps[name]
		if !ok {
			t.Fatalf("no replica view %s: %v", name, reps)
		}
		sp, tr := v.Speed, calibrate.FitOf(enginetest.Profile(t, enginetest.WallSpec(spec, calScale)))
		t.Logf("%s: prefill/1k %.2f ms (true %.2f, told %.2f; %d samples), decode step %.3f ms (true %.3f, told %.3f; %d samples); %+v",
			name, 1e3*sp.PrefillSecondsPer1K, 1e3*tr.PrefillSecondsPer1K, 1e3*sp.PriorPrefillSecondsPer1K, sp.PrefillSamples,
			1e3*sp.DecodeStepSeconds, 1e3*tr.DecodeStepSeconds, 1e3*sp.PriorDecodeStepSeconds, sp.DecodeSamples, v.Learnt)
		if !v.Calibrated || v.Learnt == nil {
			t.Fatalf("%s: calibrated %v, calibration %v; want calibrated with its observations", name, v.Calibrated, v.Learnt)
		}
		if v.InFlight != 0 {
			t.Errorf("%s: %d in flight after every response ended", name, v.InFlight)
		}
		if v.Profile != toldSpec || sp.PriorPrefillSecondsPer1K != told.PrefillSecondsPer1K || sp.PriorDecodeStepSeconds != told.DecodeStepSeconds {
			t.Errorf("%s: profile %q (%v, %v), want the told %q (%v, %v)", name, v.Profile,
				sp.PriorPrefillSecondsPer1K, sp.PriorDecodeStepSeconds, toldSpec, told.PrefillSecondsPer1K, told.DecodeStepSeconds)
		}
		if st := v.Learnt; st.PrefillPeriods < 3 || st.DecodeITL < 3 {
			t.Errorf("%s: observations %+v; want ≥ 3 prefill busy periods and ≥ 3 decodes from token gaps", name, *st)
		}
		if name == "a100" {
			if d, dt := math.Abs(sp.PrefillSecondsPer1K-tr.PrefillSecondsPer1K), math.Abs(told.PrefillSecondsPer1K-tr.PrefillSecondsPer1K); d >= dt {
				t.Errorf("a100: fitted prefill %.2f ms is %.2f ms off the true %.2f ms, no nearer than the told profile (%.2f ms off)",
					1e3*sp.PrefillSecondsPer1K, 1e3*d, 1e3*tr.PrefillSecondsPer1K, 1e3*dt)
			}
			if d, dt := math.Abs(sp.DecodeStepSeconds-tr.DecodeStepSeconds), math.Abs(told.DecodeStepSeconds-tr.DecodeStepSeconds); d >= dt {
				t.Errorf("a100: fitted decode step %.3f ms is %.3f ms off the true %.3f ms, no nearer than the told profile (%.3f ms off)",
					1e3*sp.DecodeStepSeconds, 1e3*d, 1e3*tr.DecodeStepSeconds, 1e3*dt)
			}
		}
	}
	fast, slow := reps["h100"].Speed, reps["a100"].Speed
	if fast.PrefillSecondsPer1K*1.5 > slow.PrefillSecondsPer1K || fast.DecodeStepSeconds*1.2 > slow.DecodeStepSeconds {
		t.Errorf("fitted a100 prefill %.2f ms, decode step %.3f ms; h100 %.2f ms, %.3f ms: want the a100's over 1.5× and 1.2× the h100's (true: 3.1×, 1.5×)",
			1e3*slow.PrefillSecondsPer1K, 1e3*slow.DecodeStepSeconds, 1e3*fast.PrefillSecondsPer1K, 1e3*fast.DecodeStepSeconds)
	}

	// Non-streamed responses: no first token, nothing learnt.
	before := reps
	for range nonStream {
		k++
		if _, err := relay(ctx, conn, client, []byte(enginetest.UniquePrompt(k, calTokens(k), 4, false))); err != nil {
			t.Fatalf("request %d (not streamed): %v", k, err)
		}
	}
	reps = views(p)
	skipped := int64(0)
	for name, v := range reps {
		skipped += v.Learnt.Skipped[calibrate.SkipNoFirstToken]
		if b := before[name].Speed; v.Speed.PrefillSamples != b.PrefillSamples || v.Speed.DecodeSamples != b.DecodeSamples {
			t.Errorf("%s: samples %d, %d after non-streamed requests, want %d, %d as before", name,
				v.Speed.PrefillSamples, v.Speed.DecodeSamples, b.PrefillSamples, b.DecodeSamples)
		}
	}
	if skipped != nonStream {
		t.Errorf("%d requests skipped as %s, want the %d non-streamed ones", skipped, calibrate.SkipNoFirstToken, nonStream)
	}

	msrv := httptest.NewServer(p.MetricsHandler())
	t.Cleanup(msrv.Close)
	fams := promtest.Scrape(t, nil, msrv.URL)
	for name, r := range reps {
		promtest.CheckPricing(t, fams, name, r.Pricing)
	}
}

// TestCalibrationExtProcOff: with NoCalibrate (--calibrate=false) the
// picker prices with the profile, learns nothing from a streamed
// response, and exports the profile's figures without error or
// observation series.
func TestCalibrationExtProcOff(t *testing.T) {
	p := newTestPicker(t, Config{NoCalibrate: true, Policy: "round-robin"}, 2)
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{})))
	e.request("/v1/completions", completionBody("hello there", true), 100, nil)
	h, _, _ := e.decision()
	primary, _, _ := strings.Cut(h, ",")
	var sse []string
	for i := range 8 {
		sse = append(sse, fmt.Sprintf("data: {\"choices\":[{\"text\":\"t%d\"}]}\n\n", i))
	}
	sse = append(sse, "data: [DONE]\n\n")
	e.respond(primary, "text/event-stream", sse, nil)
	fit := calibrate.FitOf(enginetest.Profile(t, costmodel.Llama31_8BH100))
	reps := views(p)
	for name, v := range reps {
		if v.Calibrated || v.Learnt != nil || v.Speed != fit || v.Profile != costmodel.Llama31_8BH100 {
			t.Errorf("%s: calibrated %v, calibration %v, profile %q, speed %+v; want false, none, %q and its figures %+v",
				name, v.Calibrated, v.Learnt, v.Profile, v.Speed, costmodel.Llama31_8BH100, fit)
		}
	}
	msrv := httptest.NewServer(p.MetricsHandler())
	t.Cleanup(msrv.Close)
	fams := promtest.Scrape(t, nil, msrv.URL)
	for name, r := range reps {
		promtest.CheckPricing(t, fams, name, r.Pricing)
	}
	for _, name := range []string{"prefixlb_replica_calibration_error_ratio", "prefixlb_replica_calibration_profile_error_ratio",
		"prefixlb_replica_calibration_observations_total", "prefixlb_replica_calibration_skipped_total"} {
		if f := fams[name]; len(f.GetMetric()) > 0 {
			t.Errorf("/metrics has %d %s series without calibration, want none", len(f.GetMetric()), name)
		}
	}
}
