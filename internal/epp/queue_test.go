package epp

import (
	"strings"
	"testing"
	"time"

	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/tenant"
)

// waitLen waits until the picker's router-side queue holds n requests.
func waitLen(t *testing.T, p *Picker, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for p.gate.Len() != n {
		if time.Now().After(deadline) {
			t.Fatalf("queue holds %d, want %d", p.gate.Len(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// TestExtProcQueue runs the router-side queue through ext_proc (issue 18
// item 1, docs/overload.md): a pool saturated by one request in flight
// holds the next streams until capacity frees; a request that cannot meet
// its deadline gets an immediate 429 with retry-after; the priority of the
// InferenceObjective a request names (Config.Objectives) orders dispatch,
// the later but higher-priority stream going first; and every request is
// counted (dispatched, passed or shed).
func TestExtProcQueue(t *testing.T) {
	qc := cluster.DefaultQueueConfig()
	qc.On = true
	qc.Admission.MaxInFlight = 1
	qc.Admission.EngageAfter = 0 // engage at the first saturated arrival
	qc.Admission.MinTTFTSLO = 0  // no SLO floor: the late request's 1ns deadline stands
	// The gateway strips client-set class headers: the late request's
	// SLO header is believed.
	p := newTestPicker(t, Config{Queue: &qc, Objectives: map[string]int{"premium": 5, "batch": -1},
		Tenants: tenant.Config{TrustClientHeaders: true}}, 1)
	conn := startServer(t, NewServer(p, ServerConfig{}))

	first := newEnvoy(t, conn)
	first.request("/v1/completions", completionBody("first", true), 1<<20, nil)
	if h, _, _ := first.decision(); h == "" {
		t.Fatal("first request not routed")
	}

	// Saturated (one in flight): the next two streams are held, the
	// low-priority one first.
	low := newEnvoy(t, conn)
	low.request("/v1/completions", completionBody("low", true), 1<<20, nil, ObjectiveHeader, "batch")
	waitLen(t, p, 1)
	high := newEnvoy(t, conn)
	high.request("/v1/completions", completionBody("high", true), 1<<20, nil, ObjectiveHeader, "premium")
	waitLen(t, p, 2)

	// One that cannot meet its 1 ms deadline behind a request in flight:
	// shed at once, 429 with retry-after and an error body.
	late := newEnvoy(t, conn)
	late.answered = true
	late.request("/v1/completions", completionBody("late", true), 1<<20, nil, cluster.SLOHeader, "1ns")
	r := late.recv()
	ir := r.GetImmediateResponse()
	if ir == nil || ir.GetStatus().GetCode() != typev3.StatusCode_TooManyRequests {
		t.Fatalf("late request: %v, want an immediate 429", r)
	}
	retry := ""
	for _, h := range ir.GetHeaders().GetSetHeaders() {
		if h.GetHeader().GetKey() == "retry-after" {
			retry = string(h.GetHeader().GetRawValue())
		}
	}
	if retry == "" || !strings.Contains(string(ir.GetBody()), "deadline") {
		t.Errorf("429 retry-after %q body %q, want a retry-after and the reason", retry, ir.GetBody())
	}
	if n := p.gate.Len(); n != 2 {
		t.Errorf("queue holds %d after the shed, want 2", n)
	}

	// Capacity frees: the premium stream goes first, then the batch one.
	first.respond(addr(0), "text/event-stream", []string{"data: {}\n\n", "data: [DONE]\n\n"}, nil)
	if h, _, _ := high.decision(); h == "" {
		t.Fatal("high-priority request dispatched without a destination")
	}
	if n := p.gate.Len(); n != 1 {
		t.Fatalf("queue holds %d after one finish, want 1 (the batch request)", n)
	}
	high.respond(addr(0), "text/event-stream", []string{"data: {}\n\n", "data: [DONE]\n\n"}, nil)
	if h, _, _ := low.decision(); h == "" {
		t.Fatal("low-priority request dispatched without a destination")
	}

	p.mu.Lock()
	st := p.gate.StateLocked().Stats
	p.mu.Unlock()
	if st.Arrived != 4 || st.Passed != 1 || st.Dispatched != 2 || st.ShedTotal() != 1 || st.Cancelled != 0 {
		t.Errorf("queue stats %+v, want 4 arrived: 1 passed, 2 dispatched, 1 shed", st)
	}
}
