package proxy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"time"

	"github.com/prefixlb/prefixlb/internal/policy"
)

// Prefill/decode disaggregation over vLLM's wire protocol. A decision of a
// disaggregating policy (e2-pd, llmd-pd, dynamo-pd, round-robin-pd) names a
// prefill replica beside the replica that decodes. serve then runs two legs,
// as vLLM's own P/D proxy does (vllm-project/vllm
// tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, commit
// 030ea52effcb05071543c8c42b8f0145e94cee43):
//
//  1. The prefill leg: the client's body with "kv_transfer_params":
//     {"do_remote_decode": true, "do_remote_prefill": false,
//     "remote_engine_id": null, "remote_block_ids": null, "remote_host":
//     null, "remote_port": null}, "stream": false, "max_tokens": 1 (and
//     "max_completion_tokens": 1 when present), without "stream_options",
//     "min_tokens" and "min_completion_tokens", to the prefill replica,
//     with an X-Request-Id that the decode leg repeats. Its answer's
//     "kv_transfer_params" (NixlConnector.request_finished: the prefill
//     engine's id, block ids, host and port) says where the KV waits.
//  2. The decode leg: the client's body with those kv_transfer_params, to
//     the decode replica, streamed (or not) to the client as any request.
//
// A prefill leg that fails (no connection, an error status, a timeout, an
// answer that is not JSON) does not fail the request: it is counted and
// the decode replica prefills the prompt itself (the decode leg without
// kv_transfer_params). A prefill answer without kv_transfer_params goes the
// same way (vLLM then recomputes the prompt on the decode side) and is
// counted. A decode leg that fails before its first byte is retried like
// any request: the router decides again, with a new prefill leg if it
// disaggregates again.

// HeaderPrefillReplica names the replica that ran a disaggregated
// request's prefill leg (beside HeaderReplica, the decode replica).
const HeaderPrefillReplica = "x-prefixlb-prefill-replica"

// HeaderRequestID is the request id both legs of a disaggregated request
// carry (vLLM's X-Request-Id): the client's, else one of the proxy's.
const HeaderRequestID = "X-Request-Id"

var canonPrefillReplica = "X-Prefixlb-Prefill-Replica"

// Outcomes of prefixlb_pd_requests_total.
const (
	pdDisaggregated = "disaggregated" // both legs ran, KV moved
	pdLocal         = "local"         // the policy kept the request on one replica
	pdPrefillFailed = "prefill_failed"
	pdNoKVParams    = "no_kv_params" // the prefill answer carried no kv_transfer_params
)

var pdOutcomes = []string{pdDisaggregated, pdLocal, pdPrefillFailed, pdNoKVParams}

// prefillParams is the kv_transfer_params of a prefill leg.
var prefillParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// pdBodies are the bodies of the two legs, derived from the client's.
type pdBodies struct {
	fields map[string]json.RawMessage // the client's body's members
}

// parsePD reads the client's body (a JSON object: ParseRequest accepted
// it) for the legs.
func parsePD(body []byte) (*pdBodies, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, fmt.Errorf("proxy: disaggregate: %w", err)
	}
	if m == nil {
		return nil, errors.New("proxy: disaggregate: the body is not a JSON object")
	}
	return &pdBodies{fields: m}, nil
}

// prefill is the prefill leg's body.
func (b *pdBodies) prefill() ([]byte, error) {
	m := make(map[string]json.RawMessage, len(b.fields)+1)
	for k, v := range b.fields {
		switch k {
		case "stream_options", "min_tokens", "min_completion_tokens":
			continue
		}
		m[k] = v
	}
	m["kv_transfer_params"] = prefillParams
	m["stream"] = json.RawMessage("false")
	m["max_tokens"] = json.RawMessage("1")
	if _, ok := b.fields["max_completion_tokens"]; ok {
		m["max_completion_tokens"] = json.RawMessage("1")
	}
	return json.Marshal(m)
}

// decode is the decode leg's body: the client's, with params when the
// prefill leg gave them (nil: the client's body as it came).
func (b *pdBodies) decode(orig []byte, params json.RawMessage) ([]byte, error) {
	if params == nil {
		return orig, nil
	}
	m := make(map[string]json.RawMessage, len(b.fields)+1)
	for k, v := range b.fields {
		m[k] = v
	}
	m["kv_transfer_params"] = params
	return json.Marshal(m)
}

// prefillAnswer is what serve reads of a prefill leg's answer.
type prefillAnswer struct {
	KVTransferParams json.RawMessage `json:"kv_transfer_params"`
}

// prefillLeg runs the prefill leg of request id (decision d) on pb and
// returns the decode leg's body, and whether the KV was prefilled there
// (false: the decode replica prefills itself). It reports the prefill's end
// to the core either way.
func (x *exchange) prefillLeg(ctx context.Context, id uint64, d *policy.Decision, pb *backend) ([]byte, bool) {
	p := x.p
	start := time.Now()
	defer func() {
		p.mu.Lock()
		err := p.rt.PrefillDone(id, time.Now())
		p.mu.Unlock()
		if err != nil {
			p.log.Warn("router prefill done", "id", id, "err", err)
		}
	}()
	fail := func(outcome string, err error) ([]byte, bool) {
		p.m.pd.WithLabelValues(outcome).Inc()
		p.log.Warn("prefill leg failed: the decode replica prefills", "prefill_replica", pb.Name, "outcome", outcome, "err", err)
		return x.orig, false
	}
	if x.pd == nil {
		var err error
		if x.pd, err = parsePD(x.orig); err != nil {
			return fail(pdPrefillFailed, err)
		}
	}
	body, err := x.pd.prefill()
	if err != nil {
		return fail(pdPrefillFailed, err)
	}
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pb.m.inflight.Inc()
	defer pb.m.inflight.Dec()
	out, err := x.outRequestWith(pctx, pb, body)
	if err != nil {
		return fail(pdPrefillFailed, err)
	}
	resp, err := p.fwd.RoundTrip(out)
	if err != nil {
		if res := x.transportFailure(pb, err); res.dead {
			p.checked(pb, false, true)
		}
		return fail(pdPrefillFailed, err)
	}
	defer resp.Body.Close()
	buf, err := io.ReadAll(io.LimitReader(resp.Body, p.cfg.MaxResponseBytes))
	if err != nil {
		return fail(pdPrefillFailed, fmt.Errorf("read the answer: %w", err))
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fail(pdPrefillFailed, fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(buf[:min(len(buf), 256)])))
	}
	var a prefillAnswer
	if err := json.Unmarshal(buf, &a); err != nil {
		return fail(pdPrefillFailed, fmt.Errorf("%w: the answer is not JSON: %v", errGarbage, err))
	}
	p.m.pdPrefill.Observe(time.Since(start).Seconds())
	if len(a.KVTransferParams) == 0 || string(a.KVTransferParams) == "null" {
		p.m.pd.WithLabelValues(pdNoKVParams).Inc()
		p.log.Warn("prefill answer without kv_transfer_params: the decode replica recomputes the prompt", "prefill_replica", pb.Name)
		return x.orig, false
	}
	dec, err := x.pd.decode(x.orig, a.KVTransferParams)
	if err != nil {
		return fail(pdPrefillFailed, err)
	}
	p.m.pd.WithLabelValues(pdDisaggregated).Inc()
	return dec, true
}

// requestID is the X-Request-Id both legs carry: the client's, else
// prefixlb-<n>.
func (x *exchange) requestID() string {
	if x.rid == "" {
		if x.rid = x.r.Header.Get(HeaderRequestID); x.rid == "" {
			x.rid = "prefixlb-" + strconv.FormatUint(x.p.nextID.Add(1), 10)
		}
	}
	return x.rid
}
