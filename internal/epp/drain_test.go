package epp

import (
	"context"
	"io"
	"log/slog"
	"net"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// A stream that never finishes its request cannot hold the picker's
// shutdown past its drain timeout (GracefulStop alone waits for it).
func TestDrainServersCutsOpenStreams(t *testing.T) {
	p := newTestPicker(t, Config{}, 2)
	g := grpc.NewServer()
	NewServer(p, ServerConfig{}).Register(g)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan struct{})
	go func() { defer close(served); _ = g.Serve(ln) }()
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// Headers and half a body: the stream stays open, waiting for the rest.
	if err := st.Send(eppRequestHeaders()); err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
		RequestBody: &extprocv3.HttpBody{Body: []byte(`{"model":"m","prompt":"unfinished`)}}}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the server has the stream

	start := time.Now()
	drainServers([]*grpc.Server{g}, 300*time.Millisecond, slog.New(slog.NewTextHandler(io.Discard, nil)))
	took := time.Since(start)
	if took < 300*time.Millisecond || took > 5*time.Second {
		t.Errorf("drainServers took %v with a stream open, want the 300ms drain timeout", took)
	}
	if _, err := st.Recv(); err == nil {
		t.Error("the open stream was not ended by the drain")
	}
	<-served
}

func eppRequestHeaders() *extprocv3.ProcessingRequest {
	return &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{
		RequestHeaders: &extprocv3.HttpHeaders{Headers: hdrs(":method", "POST", ":path", "/v1/completions", "content-type", "application/json")}}}
}
