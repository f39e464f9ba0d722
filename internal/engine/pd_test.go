package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/kvevents"
	"github.com/prefixlb/prefixlb/internal/replica"
)

// prefillLegParams is what vLLM's toy proxy puts into the prefill leg
// (toy_proxy_server.py, send_request_to_service).
func prefillLegParams() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

// pdResponse is a response with its kv_transfer_params.
type pdResponse struct {
	testResponse
	KV *struct {
		DoRemotePrefill bool     `json:"do_remote_prefill"`
		DoRemoteDecode  bool     `json:"do_remote_decode"`
		RemoteBlockIDs  []uint64 `json:"remote_block_ids"`
		RemoteEngineID  string   `json:"remote_engine_id"`
		RemoteHost      string   `json:"remote_host"`
		RemotePort      int      `json:"remote_port"`
		TPSize          int      `json:"tp_size"`
	} `json:"kv_transfer_params"`
}

func pdPost(t *testing.T, url string, body map[string]any) (pdResponse, map[string]json.RawMessage) {
	t.Helper()
	status, out := post(t, url, body)
	if status != http.StatusOK {
		t.Fatalf("status %d: %s", status, out)
	}
	var r pdResponse
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("decode %s: %v", out, err)
	}
	if err := json.Unmarshal(out, &raw); err != nil {
		t.Fatal(err)
	}
	return r, raw
}

// kvRecorder is a KVPublisher that keeps every batch.
type kvRecorder struct {
	mu     sync.Mutex
	events []kvevents.Event
}

func (k *kvRecorder) Publish(evs []kvevents.Event, _ float64) (uint64, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.events = append(k.events, slices.Clone(evs)...)
	return uint64(len(k.events)), nil
}

// stored returns the block hashes of every BlockStored so far, and clears.
func (k *kvRecorder) stored(t *testing.T, blockSize int) []uint64 {
	t.Helper()
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []uint64
	for _, ev := range k.events {
		if bs, ok := ev.(kvevents.BlockStored); ok {
			if len(bs.TokenIDs) != len(bs.BlockHashes)*blockSize {
				t.Errorf("BlockStored of %d blocks with %d token ids", len(bs.BlockHashes), len(bs.TokenIDs))
			}
			out = append(out, bs.BlockHashes...)
		}
	}
	k.events = nil
	return out
}

// pullMetric scrapes one of the engine's series labelled by model only.
func pullMetric(t *testing.T, srvURL, name string) float64 {
	t.Helper()
	series := name + `{model_name="` + DefaultModel + `"}`
	v := metricValue(t, scrape(t, srvURL), series)
	if v < 0 {
		t.Fatalf("no %s in /metrics", series)
	}
	return v
}

// TestPrefillLeg: a prefill engine serves the toy proxy's prefill leg, of
// completions and chat, with the params NixlConnector's request_finished
// gives: the prompt's full blocks, the engine's id, host and port.
func TestPrefillLeg(t *testing.T) {
	e, srv := start(t, func(c *Config) {
		c.Replica.Role = replica.RolePrefill
		c.EngineID = "prefill-0"
	})
	u, _ := url.Parse(srv.URL)
	host, port, _ := net.SplitHostPort(u.Host)
	prompt := words("p", 50) // 3 full blocks of 16 and 2 tokens
	r, raw := pdPost(t, srv.URL+"/v1/completions", map[string]any{
		"prompt": prompt, "max_tokens": 1, "stream": false, "kv_transfer_params": prefillLegParams()})
	if r.KV == nil {
		t.Fatalf("no kv_transfer_params: %v", raw)
	}
	want := blocks.Keys(nil, WordTokenizer{}.Encode(prompt), 16)
	if len(r.KV.RemoteBlockIDs) != 3 {
		t.Errorf("remote_block_ids %v, want 3 (the full blocks)", r.KV.RemoteBlockIDs)
	}
	for i, k := range want {
		if i < len(r.KV.RemoteBlockIDs) && r.KV.RemoteBlockIDs[i] != uint64(k) {
			t.Errorf("remote_block_ids[%d] = %d, want %d (the block's hash)", i, r.KV.RemoteBlockIDs[i], k)
		}
	}
	if !r.KV.DoRemotePrefill || r.KV.DoRemoteDecode || r.KV.RemoteEngineID != "prefill-0" ||
		r.KV.RemoteHost != host || strconv.Itoa(r.KV.RemotePort) != port || r.KV.TPSize != 1 {
		t.Errorf("kv_transfer_params %s, want do_remote_prefill, engine prefill-0 at %s:%s, tp_size 1", raw["kv_transfer_params"], host, port)
	}
	if r.Usage == nil || r.Usage.CompletionTokens != 1 || r.Usage.PromptTokens != 50 {
		t.Errorf("usage %s", raw["usage"])
	}
	// Chat, with max_completion_tokens as the proxy sets it.
	r, raw = pdPost(t, srv.URL+"/v1/chat/completions", map[string]any{
		"messages": []map[string]any{{"role": "user", "content": prompt}}, "max_tokens": 1,
		"max_completion_tokens": 1, "kv_transfer_params": prefillLegParams()})
	if r.KV == nil || len(r.KV.RemoteBlockIDs) == 0 || r.Object != "chat.completion" {
		t.Errorf("chat prefill leg: %v", raw)
	}
	// A plain response carries no kv_transfer_params.
	_, raw = pdPost(t, srv.URL+"/v1/completions", map[string]any{
		"prompt": "a b", "max_tokens": 1, "kv_transfer_params": prefillLegParams()})
	var kv *struct {
		RemoteBlockIDs []uint64 `json:"remote_block_ids"`
	}
	if err := json.Unmarshal(raw["kv_transfer_params"], &kv); err != nil || kv == nil || len(kv.RemoteBlockIDs) != 0 {
		t.Errorf("a prompt shorter than a block: kv_transfer_params %s, want no blocks", raw["kv_transfer_params"])
	}
	if e.Stats().Finished != 3 {
		t.Errorf("stats %+v", e.Stats())
	}
}

// TestPrefillRoleRefuses: a prefill engine answers 400 to anything but a
// one-token prefill leg, with an OpenAI error body.
func TestPrefillRoleRefuses(t *testing.T) {
	_, srv := start(t, func(c *Config) { c.Replica.Role = replica.RolePrefill })
	decodeLeg := map[string]any{"do_remote_prefill": true, "remote_engine_id": "x", "remote_block_ids": []int{1}}
	for _, tt := range []struct {
		name string
		body map[string]any
		want string
	}{
		{"plain", map[string]any{"prompt": "a b c", "max_tokens": 1}, "serves only prefill legs"},
		{"two tokens", map[string]any{"prompt": "a b c", "max_tokens": 2, "kv_transfer_params": prefillLegParams()}, "max_tokens 1"},
		{"default max_tokens", map[string]any{"prompt": "a b c", "kv_transfer_params": prefillLegParams()}, "max_tokens 1"},
		{"decode leg", map[string]any{"prompt": "a b c", "max_tokens": 1, "kv_transfer_params": decodeLeg}, "decode legs"},
	} {
		status, out := post(t, srv.URL+"/v1/completions", tt.body)
		var body struct {
			Error apiError `json:"error"`
		}
		if err := json.Unmarshal(out, &body); err != nil || status != 400 || body.Error.Code != 400 ||
			!strings.Contains(body.Error.Message, tt.want) {
			t.Errorf("%s: %d %s, want 400 saying %q", tt.name, status, out, tt.want)
		}
	}
}

// TestDecodeLegPull runs the protocol end to end over loopback: a prefill
// engine's answer goes unchanged into a decode engine's request, which pulls
// the blocks it lacks and publishes them as KV events; the same prompt again
// pulls only the last block (recomputed), and a decode leg without usable
// params is served without a pull.
func TestDecodeLegPull(t *testing.T) {
	_, psrv := start(t, func(c *Config) { c.Replica.Role = replica.RolePrefill; c.EngineID = "P" })
	rec := &kvRecorder{}
	_, dsrv := start(t, func(c *Config) { c.Replica.Role = replica.RoleDecode; c.KVPublisher = rec })

	prompt := words("d", 64) // 4 full blocks
	keys := blocks.Keys(nil, WordTokenizer{}.Encode(prompt), 16)
	leg := func() {
		t.Helper()
		p, raw := pdPost(t, psrv.URL+"/v1/completions", map[string]any{
			"prompt": prompt, "max_tokens": 1, "stream": false, "kv_transfer_params": prefillLegParams()})
		if p.KV == nil {
			t.Fatalf("prefill leg without params: %v", raw)
		}
		d, draw := pdPost(t, dsrv.URL+"/v1/completions", map[string]any{
			"prompt": prompt, "max_tokens": 3, "kv_transfer_params": raw["kv_transfer_params"]})
		if d.Usage == nil || d.Usage.CompletionTokens != 3 || d.KV != nil {
			t.Fatalf("decode leg: %v", draw)
		}
	}
	leg()
	bpt := float64(costmodel.KVBytesOf(testConfig(t).Replica.Profile))
	if got := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_blocks_total"); got != 4 {
		t.Errorf("first leg pulled %v blocks, want 4 (the decode engine caches none)", got)
	}
	if got, want := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_bytes_total"), 4*16*bpt; got != want {
		t.Errorf("pulled %v bytes, want %v", got, want)
	}
	if got := rec.stored(t, 16); !slices.Equal(got, blockHashes(keys)) {
		t.Errorf("decode engine's BlockStored hashes %v, want the prompt's blocks %v", got, blockHashes(keys))
	}
	leg()
	if got := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_blocks_total"); got != 5 {
		t.Errorf("second leg pulled %v blocks, want 1 (its last block; the rest is cached)", got-4)
	}
	if got := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_total"); got != 2 {
		t.Errorf("pulls %v, want 2", got)
	}
	if got := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_seconds_count"); got != 2 {
		t.Errorf("pull seconds count %v, want 2", got)
	}
	// Params naming no engine: served as a plain request, no pull.
	r, raw := pdPost(t, dsrv.URL+"/v1/completions", map[string]any{
		"prompt": words("x", 40), "max_tokens": 2,
		"kv_transfer_params": map[string]any{"do_remote_prefill": true, "remote_block_ids": []int{1, 2}}})
	if r.Usage == nil || r.Usage.CompletionTokens != 2 {
		t.Errorf("decode leg without remote_engine_id: %v", raw)
	}
	if got := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_recomputed_total"); got != 1 {
		t.Errorf("recomputed %v, want 1", got)
	}
	if got := pullMetric(t, dsrv.URL, "prefixlb_engine_kv_pull_total"); got != 2 {
		t.Errorf("pulls %v after a recomputed leg, want still 2", got)
	}
}

func blockHashes(keys []blocks.Key) []uint64 {
	out := make([]uint64, len(keys))
	for i, k := range keys {
		out[i] = uint64(k)
	}
	return out
}

// decodeLegBody is a decode leg as the proxy sends it to D.
func decodeLegBody(prompt string, maxTokens int) string {
	return fmt.Sprintf(`{"prompt":%q,"max_tokens":%d,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3,4],"remote_engine_id":"P","remote_host":"10.0.0.1","remote_port":8100,"tp_size":1}}`,
		prompt, maxTokens)
}

// TestPullTiming checks, in synctest's fake time at time scale 1, that a
// decode leg waits exactly the modelled pull (latency + bytes at the link's
// rate) before its one-token recompute and its decodes, and that two pulls
// at once share the link: each takes the latency plus twice the bytes' time.
func TestPullTiming(t *testing.T) {
	cfg := testConfig(t)
	cfg.TimeScale = 1
	cfg.Replica.Role = replica.RoleDecode
	prof := cfg.Replica.Profile
	blockBytes := 16 * costmodel.KVBytesOf(prof)
	bw := DefaultKVLinkGbps * 1e9 / 8
	lat := DefaultKVLinkLatency
	seconds := func(s float64) time.Duration { return time.Duration(s * 1e9) }
	const P = 64 // 4 blocks

	run := func(t *testing.T, prompts ...string) (*Engine, []time.Duration) {
		e, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()
		took := make([]time.Duration, len(prompts))
		var wg sync.WaitGroup
		for i, p := range prompts {
			wg.Go(func() {
				begin := time.Now()
				rec := httptest.NewRecorder()
				e.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/v1/completions", strings.NewReader(decodeLegBody(p, 3))))
				took[i] = time.Since(begin)
				if rec.Code != http.StatusOK {
					t.Errorf("status %d: %s", rec.Code, rec.Body)
				}
			})
		}
		wg.Wait()
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		return e, took
	}
	near := func(got, want time.Duration) bool { return absDur(got-want) <= 5*time.Nanosecond }

	synctest.Test(t, func(t *testing.T) {
		e, took := run(t, words("a", P))
		pull := lat + seconds(4*blockBytes/bw)
		compute := prof.Iteration(costmodel.Batch{Prefill: []costmodel.Chunk{{New: 1, Seq: P}}}) +
			prof.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: P + 1}) +
			prof.Iteration(costmodel.Batch{DecodeSeqs: 1, DecodeContext: P + 2})
		if !near(took[0], pull+compute) {
			t.Errorf("decode leg took %v, want pull %v + compute %v = %v", took[0], pull, compute, pull+compute)
		}
		ps := e.met.pullSnapshot()
		if ps.n != 1 || ps.blocks != 4 || !near(seconds(ps.seconds.sum), pull) {
			t.Errorf("pull metrics: %d pulls, %d blocks, %v s; want 1, 4, %v", ps.n, ps.blocks, ps.seconds.sum, pull)
		}
	})
	synctest.Test(t, func(t *testing.T) {
		e, took := run(t, words("a", P), words("b", P))
		shared := lat + seconds(2*4*blockBytes/bw)
		ps := e.met.pullSnapshot()
		if ps.n != 2 || !near(seconds(ps.seconds.sum), 2*shared) {
			t.Errorf("two pulls at once: %d pulls, %v s in all; want 2 of %v each (the link shared)", ps.n, ps.seconds.sum, shared)
		}
		alone := lat + seconds(4*blockBytes/bw)
		for i, d := range took {
			if d <= alone {
				t.Errorf("leg %d took %v, no longer than one pull alone (%v)", i, d, alone)
			}
		}
	})
}

// TestPullCancelled: a decode leg whose client goes away during its pull
// leaves the link; the other pull then moves alone.
func TestPullCancelled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig(t)
		cfg.TimeScale = 1
		cfg.Replica.Role = replica.RoleDecode
		e, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()
		const gone = 100 * time.Microsecond
		var wg sync.WaitGroup
		for i, tag := range []string{"gone", "stays"} {
			wg.Go(func() {
				rctx := t.Context()
				if i == 0 {
					c, stop := context.WithTimeout(rctx, gone)
					defer stop()
					rctx = c
				}
				req := httptest.NewRequest("POST", "/v1/completions", strings.NewReader(decodeLegBody(words(tag, 64), 3)))
				e.Handler().ServeHTTP(httptest.NewRecorder(), req.WithContext(rctx))
			})
		}
		wg.Wait()
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		// Both share the link for 100 µs, then "stays" moves alone: it
		// takes 50 µs longer than alone.
		b := 4 * 16 * costmodel.KVBytesOf(cfg.Replica.Profile)
		want := DefaultKVLinkLatency + gone/2 + time.Duration(b/(DefaultKVLinkGbps*1e9/8)*1e9)
		ps := e.met.pullSnapshot()
		if got := time.Duration(ps.seconds.sum * 1e9); ps.n != 1 || absDur(got-want) > 5*time.Nanosecond {
			t.Errorf("%d pulls, %v; want 1 (the cancelled one never lands) of %v", ps.n, got, want)
		}
		if st := e.Stats(); st.Cancelled != 1 || st.Finished != 1 {
			t.Errorf("stats %+v", st)
		}
	})
}

// TestKVLink checks the link model by hand: 1000 bytes/s, 10 ms latency.
func TestKVLink(t *testing.T) {
	t0 := time.Unix(1000, 0)
	ms := func(n float64) time.Time { return t0.Add(time.Duration(n * 1e6)) }
	arrivals := func(l *kvLink, now time.Time) (ids []uint64, at []time.Time) {
		for _, p := range l.arrived(now, nil) {
			ids, at = append(ids, p.id), append(at, p.done)
		}
		return ids, at
	}
	t.Run("alone", func(t *testing.T) {
		l := newKVLink(8e-6, 10*time.Millisecond) // 1000 B/s
		l.start(1, 1, 100, t0)
		if at, ok := l.next(); !ok || !at.Equal(ms(110)) {
			t.Errorf("next %v %v, want 110ms", at.Sub(t0), ok)
		}
		if ids, _ := arrivals(l, ms(109)); len(ids) != 0 {
			t.Errorf("arrived early: %v", ids)
		}
		if ids, _ := arrivals(l, ms(110)); !slices.Equal(ids, []uint64{1}) || l.inFlight() != 0 {
			t.Errorf("arrived %v, in flight %d", ids, l.inFlight())
		}
	})
	t.Run("shared", func(t *testing.T) {
		l := newKVLink(8e-6, 10*time.Millisecond)
		l.start(1, 1, 100, t0)
		l.start(2, 1, 300, ms(50)) // 1 has 50 left: both at 500 B/s until 1 ends at 150
		ids, at := arrivals(l, ms(1000))
		// 2 has 250 left at 150 and moves alone from there: 400.
		if !slices.Equal(ids, []uint64{1, 2}) || !at[0].Equal(ms(160)) || !at[1].Equal(ms(410)) {
			t.Errorf("arrivals %v at %v, want 1 at 160ms, 2 at 410ms", ids, at)
		}
	})
	t.Run("cancel", func(t *testing.T) {
		l := newKVLink(8e-6, 0)
		l.start(1, 1, 100, t0)
		l.start(2, 1, 100, t0)
		l.cancel(1, ms(100)) // 2 has 50 left, alone from 100
		if at, ok := l.next(); !ok || !at.Equal(ms(150)) {
			t.Errorf("next %v, want 150ms", at.Sub(t0))
		}
	})
}

// TestDecodeRoleNeedsKVSize: a decode engine refuses to start on a profile
// that gives no KV bytes per token, naming the profile.
func TestDecodeRoleNeedsKVSize(t *testing.T) {
	cfg := testConfig(t)
	prof, err := costmodel.Lookup(costmodel.Mistral7BA6000)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Replica.Profile = prof
	cfg.Replica.Role = replica.RoleDecode
	_, err = New(cfg)
	if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), costmodel.Mistral7BA6000) {
		t.Errorf("New: %v, want an invalid-config error naming the profile", err)
	}
	cfg.Replica.Role = replica.RoleBoth // a both engine recomputes instead
	if _, err := New(cfg); err != nil {
		t.Errorf("role both: %v", err)
	}
	cfg = testConfig(t)
	cfg.KVLinkGbps = -1
	if _, err := New(cfg); !errors.Is(err, ErrInvalidConfig) {
		t.Errorf("negative KVLinkGbps: %v", err)
	}
}

// TestDecodeKVTransfer: kv_transfer_params decoded, and refused with a
// message naming the field.
func TestDecodeKVTransfer(t *testing.T) {
	for _, tt := range []struct {
		params string
		want   kvTransfer // when wantErr is ""
		err    string
	}{
		{`null`, kvTransfer{}, ""},
		{`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`,
			kvTransfer{set: true, remoteDecode: true}, ""},
		{`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":9,"tp_size":1}`,
			kvTransfer{set: true, remotePrefill: true, engineID: "e", blockIDs: []uint64{1, 2, 3}, host: "h", port: 9}, ""},
		{`{"do_remote_prefill":true,"remote_engine_id":"e","remote_block_ids":[[7,8],[9,10]]}`,
			kvTransfer{set: true, remotePrefill: true, engineID: "e", blockIDs: []uint64{7, 8}}, ""},
		{`{"remote_block_ids":[18446744073709551615]}`, kvTransfer{set: true, blockIDs: []uint64{1<<64 - 1}}, ""},
		{`[]`, kvTransfer{}, "kv_transfer_params must be an object or null, got a list"},
		{`"x"`, kvTransfer{}, "must be an object or null, got a string"},
		{`{"do_remote_decode":"yes"}`, kvTransfer{}, "kv_transfer_params.do_remote_decode: expected a boolean or null, got a string"},
		{`{"do_remote_decode":true,"do_remote_prefill":true}`, kvTransfer{}, "both true"},
		{`{"remote_engine_id":5}`, kvTransfer{}, "kv_transfer_params.remote_engine_id: expected a string or null, got the number 5"},
		{`{"remote_port":70000}`, kvTransfer{}, "kv_transfer_params.remote_port: 70000 is out of range"},
		{`{"remote_port":1.5}`, kvTransfer{}, "kv_transfer_params.remote_port: expected an integer"},
		{`{"tp_size":0}`, kvTransfer{}, "kv_transfer_params.tp_size: 0 is out of range"},
		{`{"remote_block_ids":[1,-2]}`, kvTransfer{}, "remote_block_ids: element 1 is the number -2"},
		{`{"remote_block_ids":{"a":1}}`, kvTransfer{}, "remote_block_ids: expected a list"},
		{`{"remote_block_ids":[[1],2]}`, kvTransfer{}, "remote_block_ids[1]: expected a list like the first"},
		{`{"remote_block_ids":[[1,"a"]]}`, kvTransfer{}, "element 1 is a string"},
	} {
		body := `{"prompt":"a","kv_transfer_params":` + tt.params + `}`
		g, err := decodeCompletion([]byte(body))
		switch {
		case tt.err == "" && err != nil:
			t.Errorf("%s: %v", tt.params, err)
		case tt.err == "":
			if got := g.kv; got.set != tt.want.set || got.remoteDecode != tt.want.remoteDecode ||
				got.remotePrefill != tt.want.remotePrefill || got.engineID != tt.want.engineID ||
				!slices.Equal(got.blockIDs, tt.want.blockIDs) || got.host != tt.want.host || got.port != tt.want.port {
				t.Errorf("%s: got %+v, want %+v", tt.params, got, tt.want)
			}
		case err == nil || !isBadRequest(err) || !strings.Contains(err.Error(), tt.err):
			t.Errorf("%s: error %v, want a bad request containing %q", tt.params, err, tt.err)
		}
	}
}

// FuzzKVTransferParams: any kv_transfer_params decodes or is a bad request
// (400), never a panic; a decoded decode leg is consistent.
func FuzzKVTransferParams(f *testing.F) {
	for _, s := range []string{
		`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`,
		`{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"e","remote_host":"h","remote_port":1,"tp_size":1}`,
		`{"remote_block_ids":[[1],[2]]}`,
		`{"remote_block_ids":[[]]}`,
		`[`, `7`, `{"tp_size":1e99}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, params []byte) {
		k, err := decodeKVTransfer(params)
		if err != nil {
			if !isBadRequest(err) {
				t.Fatalf("error %v is not a request error", err)
			}
			return
		}
		if k.remoteDecode && k.remotePrefill {
			t.Fatal("both legs at once")
		}
		if k.usablePull() && (k.engineID == "" || len(k.blockIDs) == 0) {
			t.Fatal("usable pull without engine or blocks")
		}
		if k.port < 0 || k.port > 65535 {
			t.Fatalf("port %d", k.port)
		}
	})
}
