package epp_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/prefixlb/prefixlb/internal/decisiontest"
	"github.com/prefixlb/prefixlb/internal/epp"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// eppGolden pins the replica and branch `prefixlb epp` (internal/epp) chose
// for every request of decisiontest.Replay, per policy and cluster (the
// same runs as internal/proxy's testdata/decisions-serve.txt), and, as its
// result, every answer's destination: the primary and its fallbacks. It
// may be regenerated (`go test ./internal/epp -run
// TestEPPDecisionsUnchanged -update-golden`) only for an intended,
// documented change of decisions.
var eppGolden = filepath.Join("testdata", "decisions-epp.txt")

// TestEPPDecisionsUnchanged replays decisiontest.Replay through `prefixlb
// epp`'s ext_proc front door over loopback gRPC, the test playing Envoy
// (request headers and body, then the replica's response headers and body
// in FULL_DUPLEX_STREAMED mode) and the fake replicas, with a fixed number
// of requests in flight (decisiontest.FrontDoorRun.Window), and compares
// every decision (the destination header and x-prefixlb-route) with
// testdata/decisions-epp.txt. Issue 15's restructuring must leave them as
// they are.
func TestEPPDecisionsUnchanged(t *testing.T) {
	out := decisiontest.ReplayFrontDoor(t, eppReplay)
	decisiontest.Check(t, eppGolden,
		"The decisions of `prefixlb epp` (internal/epp) on decisiontest.Replay(96) over loopback gRPC (ext_proc), before\n"+
			"three fake replicas, with w requests in flight: TestEPPDecisionsUnchanged (internal/epp/decisions_test.go).\n"+
			"result= is the checksum of every answer's destination list (primary, then fallbacks).", out)
}

// eppReplay replays reqs through a picker configured for run r.
func eppReplay(r decisiontest.FrontDoorRun, reqs []decisiontest.Request) (decisiontest.Run, error) {
	run := decisiontest.Run{Name: r.Name()}
	engines := decisiontest.Engines(r.Cluster)
	byAddr := map[string]string{}               // replica address → name
	byName := map[string]*decisiontest.Engine{} // replica name → engine
	cfg := epp.Config{Policy: r.Policy, Seed: 1, NoCalibrate: true, BackendKind: "vllm",
		Logger: slog.New(slog.DiscardHandler)}
	switch r.Cluster {
	case "scraped":
		cfg.ScrapeInterval = time.Hour
	case "llamacpp":
		cfg.BackendKind = "llamacpp"
	case "tokenizer":
		cfg.Tokenizer = "qwen3"
	}
	p, err := epp.NewPicker(cfg)
	if err != nil {
		return run, err
	}
	for i, e := range engines {
		srv := httptest.NewServer(e)
		defer srv.Close()
		name, addr := fmt.Sprintf("r%d", i), strings.TrimPrefix(srv.URL, "http://")
		rep := epp.Replica{Name: name, Address: addr, Ready: true}
		if r.Cluster == "scraped" {
			rep.MetricsURL = srv.URL + "/metrics"
		}
		p.Add(rep)
		byAddr[addr], byName[name] = name, e
	}
	if r.Cluster == "scraped" || r.Cluster == "llamacpp" {
		// Run's first scrape (or slot count) is read at once; the next an
		// hour later. Wait for it before the replay.
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = p.Run(ctx)
		}()
		defer func() {
			cancel()
			<-done
		}()
		if err := awaitPicker(p, r.Cluster == "scraped", r.Cluster == "llamacpp"); err != nil {
			return run, err
		}
	}

	s := epp.NewServer(p, epp.ServerConfig{Explain: tenancy.ExplainAlways, Logger: slog.New(slog.DiscardHandler)})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return run, err
	}
	g := grpc.NewServer()
	s.Register(g)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = g.Serve(lis)
	}()
	defer func() {
		g.Stop()
		<-served
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return run, err
	}
	defer conn.Close()
	client := extprocv3.NewExternalProcessorClient(conn)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	var dests bytes.Buffer
	open := make([]*exchange, len(reqs))
	finish := func(j int) error {
		x := open[j]
		open[j] = nil
		return x.respond(byName[x.replica])
	}
	for k, q := range reqs {
		x, err := request(ctx, client, q)
		if err != nil {
			return run, err
		}
		name, ok := byAddr[x.primary]
		if !ok {
			return run, fmt.Errorf("request %d: destination %q is no replica", q.ID, x.dest)
		}
		x.replica = name
		branch, matched, err := decisiontest.ParseRoute(x.route)
		if err != nil {
			return run, fmt.Errorf("request %d: %v", q.ID, err)
		}
		run.Decisions = append(run.Decisions, decisiontest.Decision{ID: uint64(q.ID), Replica: name, Branch: branch, Matched: matched})
		// The destination list, by replica names (addresses change from run
		// to run).
		var names []string
		for _, a := range strings.Split(x.dest, ",") {
			names = append(names, byAddr[a])
		}
		fmt.Fprintf(&dests, "%d %s\n", q.ID, strings.Join(names, ","))
		open[k] = x
		if j := k - r.Window + 1; j >= 0 {
			if err := finish(j); err != nil {
				return run, err
			}
		}
	}
	for j := max(len(reqs)-r.Window+1, 0); j < len(reqs); j++ {
		if err := finish(j); err != nil {
			return run, err
		}
	}
	run.Result = dests.Bytes()
	return run, nil
}

// exchange is one request's ext_proc stream, between its decision and its
// response.
type exchange struct {
	q       decisiontest.Request
	stream  extprocv3.ExternalProcessor_ProcessClient
	dest    string // the destination header: primary[,fallback...]
	primary string
	route   string // x-prefixlb-route
	replica string // the primary's name
}

func hdrs(kv ...string) *corev3.HeaderMap {
	m := &corev3.HeaderMap{}
	for i := 0; i+1 < len(kv); i += 2 {
		m.Headers = append(m.Headers, &corev3.HeaderValue{Key: kv[i], RawValue: []byte(kv[i+1])})
	}
	return m
}

// request opens q's stream as Envoy does and reads the picker's decision
// and the body it streams back.
func request(ctx context.Context, client extprocv3.ExternalProcessorClient, q decisiontest.Request) (*exchange, error) {
	st, err := client.Process(ctx)
	if err != nil {
		return nil, err
	}
	x := &exchange{q: q, stream: st}
	kv := []string{":method", "POST", ":path", q.Path, "content-type", "application/json"}
	if q.Session != "" {
		kv = append(kv, epp.SessionHeader, q.Session)
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs(kv...)}}}); err != nil {
		return nil, fmt.Errorf("request %d: send headers: %v", q.ID, err)
	}
	// The body in chunks of 16 KiB, as Envoy streams it.
	const chunk = 16 << 10
	for i := 0; i < len(q.Body); i += chunk {
		end := min(i+chunk, len(q.Body))
		if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: q.Body[i:end], EndOfStream: end == len(q.Body)}}}); err != nil {
			return nil, fmt.Errorf("request %d: send body: %v", q.ID, err)
		}
	}
	resp, err := st.Recv()
	if err != nil {
		return nil, fmt.Errorf("request %d: receive the decision: %v", q.ID, err)
	}
	rh := resp.GetRequestHeaders()
	if rh == nil {
		return nil, fmt.Errorf("request %d: first answer is %T, want request headers (an immediate response?): %v", q.ID, resp.Response, resp)
	}
	for _, h := range rh.GetResponse().GetHeaderMutation().GetSetHeaders() {
		switch h.GetHeader().GetKey() {
		case epp.DestinationHeader:
			x.dest = string(h.GetHeader().GetRawValue())
		case epp.RouteHeader:
			x.route = string(h.GetHeader().GetRawValue())
		}
	}
	x.primary, _, _ = strings.Cut(x.dest, ",")
	var body []byte
	for {
		resp, err := st.Recv()
		if err != nil {
			return nil, fmt.Errorf("request %d: receive the body: %v", q.ID, err)
		}
		sr := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return nil, fmt.Errorf("request %d: got %T, want the streamed request body", q.ID, resp.Response)
		}
		body = append(body, sr.GetBody()...)
		if sr.GetEndOfStream() {
			break
		}
	}
	if !bytes.Equal(body, q.Body) {
		return nil, fmt.Errorf("request %d: the body came back changed", q.ID)
	}
	return x, nil
}

// respond plays the replica's answer (e's) through the stream, as Envoy
// hands it to the picker: the response headers with the endpoint that
// served, then the body, one SSE event a chunk; then it ends the stream.
func (x *exchange) respond(e *decisiontest.Engine) error {
	q, st := x.q, x.stream
	status, h, body := e.Complete(q.Path, q.Body)
	md, err := structpb.NewStruct(map[string]any{epp.ServedKey: x.primary})
	if err != nil {
		return err
	}
	if err := st.Send(&extprocv3.ProcessingRequest{
		MetadataContext: &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{epp.DestinationNamespace: md}},
		Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
			Headers: hdrs(":status", fmt.Sprint(status), "content-type", h.Get("Content-Type"))}}}); err != nil {
		return fmt.Errorf("request %d: send response headers: %v", q.ID, err)
	}
	if _, err := st.Recv(); err != nil {
		return fmt.Errorf("request %d: receive the response headers' answer: %v", q.ID, err)
	}
	var chunks [][]byte
	if strings.HasPrefix(h.Get("Content-Type"), "text/event-stream") {
		for ev := range bytes.SplitAfterSeq(body, []byte("\n\n")) {
			if len(ev) > 0 {
				chunks = append(chunks, ev)
			}
		}
	} else {
		chunks = [][]byte{body}
	}
	for i, c := range chunks {
		if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_ResponseBody{
			ResponseBody: &extprocv3.HttpBody{Body: c, EndOfStream: i == len(chunks)-1}}}); err != nil {
			return fmt.Errorf("request %d: send response body: %v", q.ID, err)
		}
		// The picker records the first token and, at the end of the
		// stream, the request's end before it answers.
		if _, err := st.Recv(); err != nil {
			return fmt.Errorf("request %d: receive the response body's answer: %v", q.ID, err)
		}
	}
	if err := st.CloseSend(); err != nil {
		return err
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("request %d: stream not ended after the response: %v", q.ID, err)
	}
	return nil
}

// awaitPicker polls p's replicas until every one's load has been scraped
// (with load) and its slot count read (with slots).
func awaitPicker(p *epp.Picker, load, slots bool) error {
	deadline := time.Now().Add(time.Minute)
	for {
		ready := true
		views := p.ReplicaViews()
		for _, v := range views {
			ready = ready && (!load || v.Waiting >= 0 && v.KVUsage >= 0) && (!slots || v.Slots > 0)
		}
		if ready && len(views) > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replicas not scraped or detected after a minute: %+v", views)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
