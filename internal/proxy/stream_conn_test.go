package proxy

import (
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// doneReplica streams two chunks and [DONE], each flushed, then waits
// after before its handler returns (and the chunked encoding's last chunk
// goes out), counting the connections it accepts.
func doneReplica(t *testing.T, after time.Duration) (*httptest.Server, *atomic.Int64) {
	t.Helper()
	var conns atomic.Int64
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		for _, ev := range []string{
			`data: {"choices":[{"index":0,"text":"a"}]}`,
			`data: {"choices":[{"index":0,"text":"b"}]}`,
			`data: [DONE]`,
		} {
			_, _ = io.WriteString(w, ev+"\n\n")
			w.(http.Flusher).Flush()
		}
		select {
		case <-time.After(after):
		case <-r.Context().Done():
		}
	}))
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

// TestStreamKeepsUpstreamConnection checks that a stream whose replica
// ends its response a moment after [DONE] leaves the connection to the
// replica open for the next request: the proxy reads the response to its
// end before closing it (drainAfterDone).
func TestStreamKeepsUpstreamConnection(t *testing.T) {
	rep, conns := doneReplica(t, 2*time.Millisecond)
	cfg := testConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: rep.URL}}
	_, srv := startProxy(t, cfg)
	const n = 10
	for range n {
		resp := post(t, srv.URL, "/v1/completions", streamBody)
		if body := string(readAll(t, resp)); !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Fatalf("stream %q", body)
		}
	}
	if got := conns.Load(); got != 1 {
		t.Errorf("%d streams opened %d connections to the replica, want 1", n, got)
	}
}

// TestStreamEndsWhenReplicaLingers checks that a replica that keeps its
// response open after [DONE] holds the client's response for at most
// drainWait.
func TestStreamEndsWhenReplicaLingers(t *testing.T) {
	rep, _ := doneReplica(t, 10*time.Second)
	cfg := testConfig()
	cfg.Backends = []Backend{{Name: "r0", URL: rep.URL}}
	_, srv := startProxy(t, cfg)
	start := time.Now()
	resp := post(t, srv.URL, "/v1/completions", streamBody)
	if body := string(readAll(t, resp)); !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("stream %q", body)
	}
	if took := time.Since(start); took > drainWait+2*time.Second {
		t.Errorf("the response ended after %v", took)
	}
}
