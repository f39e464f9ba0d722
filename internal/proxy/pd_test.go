package proxy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/promtest"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// pdLeg is one request a pdReplica received.
type pdLeg struct {
	requestID string
	body      map[string]json.RawMessage
}

// pdReplica speaks vLLM's P/D protocol as a NixlConnector engine does: a
// request with kv_transfer_params.do_remote_decode is a prefill leg,
// answered (one token, JSON) with the params its decode leg needs; any
// other request is served as usual, streamed when asked.
type pdReplica struct {
	name string
	srv  *httptest.Server

	mu        sync.Mutex
	legs      []pdLeg
	status    int  // answer every completion with this status (0: serve)
	noParams  bool // answer a prefill leg without kv_transfer_params
	prefilled int  // prefill legs answered
}

func newPDReplica(t *testing.T, name string) *pdReplica {
	t.Helper()
	r := &pdReplica{name: name}
	mux := http.NewServeMux()
	mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("/v1/completions", r.complete)
	mux.HandleFunc("/v1/chat/completions", r.complete)
	r.srv = httptest.NewServer(mux)
	t.Cleanup(r.srv.Close)
	return r
}

func (r *pdReplica) backend(role string) Backend {
	return Backend{Name: r.name, URL: r.srv.URL, Kind: "vllm", Role: role}
}

func (r *pdReplica) complete(w http.ResponseWriter, req *http.Request) {
	var body map[string]json.RawMessage
	if err := json.NewDecoder(req.Body).Decode(&body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	r.legs = append(r.legs, pdLeg{requestID: req.Header.Get("X-Request-Id"), body: body})
	status, noParams := r.status, r.noParams
	r.mu.Unlock()
	if status != 0 {
		w.WriteHeader(status)
		io.WriteString(w, `{"error":{"message":"down","type":"ServiceUnavailableError","code":503}}`)
		return
	}
	var params struct {
		DoRemoteDecode bool `json:"do_remote_decode"`
	}
	_ = json.Unmarshal(body["kv_transfer_params"], &params)
	w.Header().Set("Content-Type", "application/json")
	if params.DoRemoteDecode {
		r.mu.Lock()
		r.prefilled++
		r.mu.Unlock()
		kv := fmt.Sprintf(`,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"engine-%s","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}`, r.name)
		if noParams {
			kv = ""
		}
		fmt.Fprintf(w, `{"id":"cmpl-p","object":"text_completion","model":"m","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"total_tokens":41}%s}`, kv)
		return
	}
	var stream bool
	_ = json.Unmarshal(body["stream"], &stream)
	if !stream {
		io.WriteString(w, `{"id":"cmpl-d","object":"text_completion","model":"m","choices":[{"index":0,"text":"abc","finish_reason":"length"}],"usage":{"prompt_tokens":40,"completion_tokens":3,"total_tokens":43}}`)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream")
	for i := range 3 {
		fmt.Fprintf(w, "data: {\"id\":\"cmpl-d\",\"object\":\"text_completion\",\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\"t%d\",\"finish_reason\":null}]}\n\n", i)
		w.(http.Flusher).Flush()
	}
	io.WriteString(w, "data: [DONE]\n\n")
}

func (r *pdReplica) takeLegs() []pdLeg {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.legs
	r.legs = nil
	return out
}

func (r *pdReplica) set(status int, noParams bool) {
	r.mu.Lock()
	r.status, r.noParams = status, noParams
	r.mu.Unlock()
}

// pdCluster is serve over one prefill replica and two decode replicas.
func pdCluster(t *testing.T, policy string) (*Proxy, *httptest.Server, *pdReplica, []*pdReplica) {
	t.Helper()
	pre := newPDReplica(t, "p0")
	dec := []*pdReplica{newPDReplica(t, "d0"), newPDReplica(t, "d1")}
	cfg := testConfig()
	cfg.Backends = []Backend{dec[0].backend(""), dec[1].backend("decode"), pre.backend("prefill")}
	cfg.Policy = policy
	cfg.Explain = tenancy.ExplainAlways // it reads x-prefixlb-route
	p, srv := startProxy(t, cfg)
	return p, srv, pre, dec
}

func postWith(t *testing.T, url, path, body string, header http.Header) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func raw(t *testing.T, m map[string]json.RawMessage, key string) string {
	t.Helper()
	v, ok := m[key]
	if !ok {
		return "<absent>"
	}
	return string(v)
}

// TestPDTwoLegs: a disaggregated request runs vLLM's two legs — the
// prefill leg's body as vLLM's toy proxy sends it, the decode leg with the
// prefill answer's kv_transfer_params — with one X-Request-Id, and its
// response names both replicas.
func TestPDTwoLegs(t *testing.T) {
	_, srv, pre, dec := pdCluster(t, "round-robin-pd")
	for _, tc := range []struct {
		name, path, body string
		stream           bool
		clientID         string
	}{
		{"completion streamed", "/v1/completions",
			`{"model":"m","prompt":"a shared prefix","stream":true,"stream_options":{"include_usage":true},"max_tokens":3,"min_tokens":2}`, true, ""},
		{"chat unary", "/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"hello"}],"max_completion_tokens":3,"max_tokens":3}`, false, "client-id-7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := http.Header{}
			if tc.clientID != "" {
				h.Set("X-Request-Id", tc.clientID)
			}
			resp := postWith(t, srv.URL, tc.path, tc.body, h)
			got := readAll(t, resp)
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			if p := resp.Header.Get(HeaderPrefillReplica); p != "p0" {
				t.Errorf("%s = %q, want p0", HeaderPrefillReplica, p)
			}
			dname := resp.Header.Get(HeaderReplica)
			if dname != "d0" && dname != "d1" {
				t.Errorf("%s = %q, want a decode replica", HeaderReplica, dname)
			}
			if !strings.Contains(resp.Header.Get(HeaderRoute), "prefill=r2") {
				t.Errorf("explanation %q does not name the prefill replica", resp.Header.Get(HeaderRoute))
			}
			if tc.stream && !bytes.Contains(got, []byte("data: [DONE]")) {
				t.Errorf("stream not relayed: %s", got)
			}
			pl := pre.takeLegs()
			var dl []pdLeg
			for _, d := range dec {
				dl = append(dl, d.takeLegs()...)
			}
			if len(pl) != 1 || len(dl) != 1 {
				t.Fatalf("%d prefill legs, %d decode legs; want 1 and 1", len(pl), len(dl))
			}
			pb, db := pl[0].body, dl[0].body
			if raw(t, pb, "stream") != "false" || raw(t, pb, "max_tokens") != "1" || raw(t, pb, "stream_options") != "<absent>" ||
				raw(t, pb, "min_tokens") != "<absent>" {
				t.Errorf("prefill leg body: %v", pb)
			}
			if _, ok := pb["max_completion_tokens"]; ok && raw(t, pb, "max_completion_tokens") != "1" {
				t.Errorf("prefill leg max_completion_tokens %s", raw(t, pb, "max_completion_tokens"))
			}
			var pp map[string]any
			if err := json.Unmarshal(pb["kv_transfer_params"], &pp); err != nil || pp["do_remote_decode"] != true ||
				pp["do_remote_prefill"] != false || pp["remote_engine_id"] != nil {
				t.Errorf("prefill leg kv_transfer_params %s", pb["kv_transfer_params"])
			}
			if !strings.Contains(raw(t, db, "kv_transfer_params"), `"remote_engine_id":"engine-p0"`) {
				t.Errorf("decode leg kv_transfer_params %s", raw(t, db, "kv_transfer_params"))
			}
			if tc.stream && (raw(t, db, "stream") != "true" || raw(t, db, "min_tokens") != "2" || raw(t, db, "stream_options") == "<absent>") {
				t.Errorf("decode leg body lost the client's fields: %v", db)
			}
			if pl[0].requestID == "" || pl[0].requestID != dl[0].requestID {
				t.Errorf("X-Request-Id prefill %q, decode %q", pl[0].requestID, dl[0].requestID)
			}
			if tc.clientID != "" && pl[0].requestID != tc.clientID {
				t.Errorf("X-Request-Id %q, want the client's %q", pl[0].requestID, tc.clientID)
			}
		})
	}
	m := promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
	if v, _ := promtest.Series(m, "prefixlb_pd_requests_total", "outcome", "disaggregated"); v != 2 {
		t.Errorf("prefixlb_pd_requests_total{outcome=disaggregated} = %v, want 2", v)
	}
}

// TestPDPrefillFaults: a prefill leg that fails or answers without
// kv_transfer_params leaves the decode replica to prefill; the request
// still succeeds, and the outcome is counted.
func TestPDPrefillFaults(t *testing.T) {
	_, srv, pre, dec := pdCluster(t, "round-robin-pd")
	for _, tc := range []struct {
		name     string
		status   int
		noParams bool
		outcome  string
	}{
		{"prefill 503", http.StatusServiceUnavailable, false, pdPrefillFailed},
		{"no params", 0, true, pdNoKVParams},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pre.set(tc.status, tc.noParams)
			defer pre.set(0, false)
			resp := post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":"p","max_tokens":3}`)
			got := readAll(t, resp)
			if resp.StatusCode != 200 || !strings.Contains(string(got), "abc") {
				t.Fatalf("status %d: %s", resp.StatusCode, got)
			}
			if p := resp.Header.Get(HeaderPrefillReplica); p != "" {
				t.Errorf("%s = %q after a failed prefill", HeaderPrefillReplica, p)
			}
			pre.takeLegs()
			var dl []pdLeg
			for _, d := range dec {
				dl = append(dl, d.takeLegs()...)
			}
			if len(dl) != 1 || raw(t, dl[0].body, "kv_transfer_params") != "<absent>" {
				t.Fatalf("decode legs %v: want one, as the client sent it", dl)
			}
			m := promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
			if v, _ := promtest.Series(m, "prefixlb_pd_requests_total", "outcome", tc.outcome); v != 1 {
				t.Errorf("prefixlb_pd_requests_total{outcome=%s} = %v, want 1", tc.outcome, v)
			}
		})
	}

	t.Run("prefill replica gone", func(t *testing.T) {
		pre.srv.Close()
		resp := post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":"q","max_tokens":3}`)
		if got := readAll(t, resp); resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, got)
		}
	})
}

// TestPDDecodeRetry: a decode leg that fails before its first byte is
// retried on another decode replica, with a new prefill leg.
func TestPDDecodeRetry(t *testing.T) {
	_, srv, pre, dec := pdCluster(t, "round-robin-pd")
	dec[0].set(http.StatusServiceUnavailable, false)
	dec[1].set(http.StatusServiceUnavailable, false)
	resp := post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":"r","max_tokens":3}`)
	readAll(t, resp)
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("both decode replicas down: status %d", resp.StatusCode)
	}
	if n := len(pre.takeLegs()); n != 2 {
		t.Errorf("%d prefill legs for two decode attempts, want 2", n)
	}
	dec[1].set(0, false)
	dec[0].takeLegs()
	dec[1].takeLegs()
	for range 2 { // round-robin lands on d0 once
		resp = post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":"s","max_tokens":3}`)
		got := readAll(t, resp)
		if resp.StatusCode != 200 || resp.Header.Get(HeaderReplica) != "d1" {
			t.Fatalf("status %d from %q: %s", resp.StatusCode, resp.Header.Get(HeaderReplica), got)
		}
	}
}

// TestPDLocal: e2-pd keeps a short prompt on one replica (conditional
// disaggregation: its transfer and second leg cost more than its own
// prefill); the prefill replica is not asked.
func TestPDLocal(t *testing.T) {
	_, srv, pre, _ := pdCluster(t, "e2-pd")
	resp := post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":"hi","max_tokens":3}`)
	if got := readAll(t, resp); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, got)
	}
	if n := len(pre.takeLegs()); n != 0 || resp.Header.Get(HeaderPrefillReplica) != "" {
		t.Errorf("a two-token prompt was disaggregated (%d prefill legs)", n)
	}
	m := promtest.Scrape(t, http.DefaultClient, srv.URL+"/metrics")
	if v, _ := promtest.Series(m, "prefixlb_pd_requests_total", "outcome", "local"); v != 1 {
		t.Errorf("prefixlb_pd_requests_total{outcome=local} = %v, want 1", v)
	}
}

// TestPDConfig: prefill replicas need a disaggregating policy and a
// replica that decodes.
func TestPDConfig(t *testing.T) {
	c := testConfig()
	c.Backends = []Backend{{URL: "http://127.0.0.1:1"}, {URL: "http://127.0.0.1:2", Role: "prefill"}}
	c.Policy = "e2"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "does not disaggregate") {
		t.Errorf("e2 with a prefill replica: %v", err)
	}
	c.Policy = "e2-pd"
	if err := c.Validate(); err != nil {
		t.Errorf("e2-pd: %v", err)
	}
	c.Backends[0].Role = "prefill"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "must decode") {
		t.Errorf("no decode replica: %v", err)
	}
	c.Backends[0].Role = "decoder"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "backends[0].role") {
		t.Errorf("bad role: %v", err)
	}
	b := SetPrefillBackends(nil, "http://10.0.0.1:8000, http://10.0.0.2:8000")
	if len(b) != 2 || b[1].Role != "prefill" || b[1].URL != "http://10.0.0.2:8000" {
		t.Errorf("SetPrefillBackends: %+v", b)
	}
	y, err := ParseConfig([]byte("kv_link_gbps: 100\nkv_link_latency: 2ms\nbackends:\n  - url: http://a:1\n    role: prefill\n"), DefaultConfig())
	if err != nil || y.KVLinkGbps != 100 || y.KVLinkLatency.String() != "2ms" || y.Backends[0].Role != "prefill" {
		t.Errorf("YAML: %+v %v", y, err)
	}
}

// TestPDDashboard: the dashboard shows each replica's role.
func TestPDDashboard(t *testing.T) {
	p, srv, _, _ := pdCluster(t, "round-robin-pd")
	readAll(t, post(t, srv.URL, "/v1/completions", `{"model":"m","prompt":"x","max_tokens":3}`))
	roles := map[string]string{}
	for _, r := range p.Snapshot().Replicas {
		roles[r.Name] = r.Role
	}
	if roles["p0"] != "prefill" || roles["d1"] != "decode" || roles["d0"] != "both" {
		t.Errorf("roles %v", roles)
	}
}
