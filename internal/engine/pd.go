package engine

// Prefill/decode disaggregation over vLLM's wire protocol (docs/pd.md,
// "prefixlb engine"). The two legs of a disaggregated request are ordinary
// completion or chat requests that carry kv_transfer_params, as vLLM's
// NixlConnector and its toy proxy exchange them (vllm-project/vllm:
// tests/v1/kv_connector/nixl_integration/toy_proxy_server.py @
// 030ea52effcb05071543c8c42b8f0145e94cee43, send_request_to_service and
// _handle_completions; vllm/distributed/kv_transfer/kv_connector/v1/
// nixl_connector.py, NixlConnectorScheduler.request_finished, read @
// 002a1057e9ae674d7bdc9c4be95bc29d65d2e808, NIXL_CONNECTOR_VERSION 2):
//
//   - the prefill leg's body has {"do_remote_decode": true, ...}, stream
//     false and max_tokens 1; the engine serves it and answers, at the top
//     level of its JSON response, the params the decode leg needs
//     (do_remote_prefill true, the prompt's blocks, this engine's id, host
//     and port, tp_size);
//   - the decode leg's body carries those params unchanged; the engine
//     admits it with its blocks reserved, pulls the blocks it does not
//     cache over its modelled link (kvLink) and decodes.

import (
	"bytes"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"strconv"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
)

// kvTransfer is a request's decoded kv_transfer_params.
type kvTransfer struct {
	set           bool   // the body had a kv_transfer_params object
	remoteDecode  bool   // do_remote_decode: a prefill leg
	remotePrefill bool   // do_remote_prefill: a decode leg
	engineID      string // remote_engine_id ("" when null or absent)
	blockIDs      []uint64
	host          string
	port          int
}

// usablePull reports whether a decode leg's params let the engine pull the
// prompt's KV: do_remote_prefill with a remote_engine_id and at least one
// remote block. Otherwise the decode leg is served as a plain request, whose
// prompt the engine computes itself, as vLLM's NixlConnector schedules a
// request with no remote blocks (a prompt shorter than one block) normally.
func (k *kvTransfer) usablePull() bool {
	return k.remotePrefill && k.engineID != "" && len(k.blockIDs) > 0
}

// rawKVTransfer is kv_transfer_params as it comes: every field may be null.
// Fields the engine does not read (remote_request_id of NixlConnector
// version 2, for one) are ignored, as vLLM's connectors ignore theirs.
type rawKVTransfer struct {
	DoRemoteDecode  json.RawMessage `json:"do_remote_decode"`
	DoRemotePrefill json.RawMessage `json:"do_remote_prefill"`
	RemoteEngineID  json.RawMessage `json:"remote_engine_id"`
	RemoteBlockIDs  json.RawMessage `json:"remote_block_ids"`
	RemoteHost      json.RawMessage `json:"remote_host"`
	RemotePort      json.RawMessage `json:"remote_port"`
	TPSize          json.RawMessage `json:"tp_size"`
}

// isNull reports whether a raw field is absent or JSON null.
func isNull(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) == 0 || string(raw) == "null"
}

// decodeKVTransfer decodes kv_transfer_params. Absent or null gives the zero
// kvTransfer; anything malformed is a bad request naming the field.
func decodeKVTransfer(raw json.RawMessage) (kvTransfer, error) {
	var k kvTransfer
	if isNull(raw) {
		return k, nil
	}
	if bytes.TrimSpace(raw)[0] != '{' {
		return k, badRequest("kv_transfer_params must be an object or null, got %s", jsonValueKind(raw))
	}
	var r rawKVTransfer
	if err := json.Unmarshal(raw, &r); err != nil {
		return k, badRequest("kv_transfer_params: %v", err)
	}
	k.set = true
	var err error
	if k.remoteDecode, err = kvBool("do_remote_decode", r.DoRemoteDecode); err != nil {
		return k, err
	}
	if k.remotePrefill, err = kvBool("do_remote_prefill", r.DoRemotePrefill); err != nil {
		return k, err
	}
	if k.remoteDecode && k.remotePrefill {
		return k, badRequest("kv_transfer_params: do_remote_decode and do_remote_prefill are both true: a request is a prefill leg or a decode leg, not both")
	}
	if k.engineID, err = kvString("remote_engine_id", r.RemoteEngineID); err != nil {
		return k, err
	}
	if k.host, err = kvString("remote_host", r.RemoteHost); err != nil {
		return k, err
	}
	if k.port, err = kvInt("remote_port", r.RemotePort, 0, 65535); err != nil {
		return k, err
	}
	if _, err = kvInt("tp_size", r.TPSize, 1, math.MaxInt32); err != nil {
		return k, err
	}
	if k.blockIDs, err = kvBlockIDs(r.RemoteBlockIDs); err != nil {
		return k, err
	}
	return k, nil
}

func kvBool(field string, raw json.RawMessage) (bool, error) {
	if isNull(raw) {
		return false, nil
	}
	var b bool
	if err := json.Unmarshal(raw, &b); err != nil {
		return false, badRequest("kv_transfer_params.%s: expected a boolean or null, got %s", field, jsonValueKind(raw))
	}
	return b, nil
}

func kvString(field string, raw json.RawMessage) (string, error) {
	if isNull(raw) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return "", badRequest("kv_transfer_params.%s: expected a string or null, got %s", field, jsonValueKind(raw))
	}
	return s, nil
}

func kvInt(field string, raw json.RawMessage, lo, hi int64) (int, error) {
	if isNull(raw) {
		return 0, nil
	}
	var n int64
	if err := json.Unmarshal(raw, &n); err != nil {
		return 0, badRequest("kv_transfer_params.%s: expected an integer or null, got %s", field, jsonValueKind(raw))
	}
	if n < lo || n > hi {
		return 0, badRequest("kv_transfer_params.%s: %d is out of range [%d, %d]", field, n, lo, hi)
	}
	return int(n), nil
}

// kvBlockIDs decodes remote_block_ids: a list of non-negative integers, or
// a list of such lists (one per KV-cache group, as vLLM's hybrid allocator
// sends them; the first group is taken), or null.
func kvBlockIDs(raw json.RawMessage) ([]uint64, error) {
	if isNull(raw) {
		return nil, nil
	}
	const want = "a list of non-negative integers (or of such lists) or null"
	var items []json.RawMessage
	if err := json.Unmarshal(raw, &items); err != nil {
		return nil, badRequest("kv_transfer_params.remote_block_ids: expected %s, got %s", want, jsonValueKind(raw))
	}
	if len(items) > 0 && bytes.TrimSpace(items[0])[0] == '[' {
		for i, it := range items {
			if bytes.TrimSpace(it)[0] != '[' {
				return nil, badRequest("kv_transfer_params.remote_block_ids[%d]: expected a list like the first, got %s", i, jsonValueKind(it))
			}
		}
		var group []json.RawMessage
		if err := json.Unmarshal(items[0], &group); err != nil {
			return nil, badRequest("kv_transfer_params.remote_block_ids[0]: expected a list of non-negative integers, got %s", jsonValueKind(items[0]))
		}
		items = group
	}
	ids := make([]uint64, len(items))
	for i, it := range items {
		if err := json.Unmarshal(it, &ids[i]); err != nil {
			return nil, badRequest("kv_transfer_params.remote_block_ids: element %d is %s, want a non-negative integer", i, jsonValueKind(it))
		}
	}
	return ids, nil
}

// jsonValueKind names the kind of a JSON value for an error message.
func jsonValueKind(raw json.RawMessage) string {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return "nothing"
	}
	switch raw[0] {
	case '{':
		return "an object"
	case '[':
		return "a list"
	case '"':
		return "a string"
	case 't', 'f':
		return "a boolean"
	case 'n':
		return "null"
	}
	if len(raw) > 32 {
		raw = raw[:32]
	}
	return "the number " + string(raw)
}

// kvTransferOut is the kv_transfer_params a prefill leg answers: the fields
// NixlConnectorScheduler.request_finished returns for a request that
// finished with do_remote_decode, at the top level of the response (vLLM's
// CompletionResponse and ChatCompletionResponse kv_transfer_params).
// remote_block_ids are the prompt's full blocks: vLLM sends its physical
// block ids, meaningful to its own NIXL agent only; the engine has none and
// sends the blocks' hashes as its KV events name them (BlockStored's
// block_hashes). remote_request_id is NixlConnector version 2's.
type kvTransferOut struct {
	DoRemotePrefill bool     `json:"do_remote_prefill"`
	DoRemoteDecode  bool     `json:"do_remote_decode"`
	RemoteBlockIDs  []uint64 `json:"remote_block_ids"`
	RemoteEngineID  string   `json:"remote_engine_id"`
	RemoteRequestID string   `json:"remote_request_id"`
	RemoteHost      string   `json:"remote_host"`
	RemotePort      int      `json:"remote_port"`
	TPSize          int      `json:"tp_size"`
}

// prefillParams is a prefill leg's answer for a prompt whose chain is keys
// (its full blocks), served on the connection whose local address is local.
func (e *Engine) prefillParams(keys []blocks.Key, requestID string, local net.Addr) *kvTransferOut {
	out := &kvTransferOut{
		DoRemotePrefill: true,
		RemoteBlockIDs:  make([]uint64, len(keys)),
		RemoteEngineID:  e.cfg.EngineID,
		RemoteRequestID: requestID,
		TPSize:          1, // one modelled GPU
	}
	for i, k := range keys {
		out.RemoteBlockIDs[i] = uint64(k)
	}
	addr := e.cfg.KVAdvertise
	if addr == "" && local != nil {
		addr = local.String()
	}
	if addr != "" {
		out.RemoteHost, out.RemotePort, _ = splitHostPort(addr)
	}
	return out
}

// splitHostPort splits "host:port" into a host and a port number.
func splitHostPort(addr string) (string, int, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 0 || n > 65535 {
		return "", 0, fmt.Errorf("port %q of %q is not a number in [0, 65535]", port, addr)
	}
	return host, n, nil
}

// newEngineID returns a random RFC 4122 version-4 UUID, the form vLLM gives
// an engine_id it is not told.
func newEngineID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24)
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// kvLink models the link that pulled KV enters this engine over: bw bytes
// per second shared by every pull in flight by processor sharing (each of n
// pulls moves at bw/n, recomputed whenever one starts, ends or is
// cancelled, as RDMA or TCP flows into one NIC share it), each pull paying
// lat once after its last byte. Alone, a pull of b bytes takes
// lat + b·8/(gbps·1e9), as `prefixlb sim`'s link (internal/sim/link.go)
// prices the ingress side of a transfer; the prefill engine's egress is not
// modelled here, as each engine knows only its own link.
//
// All times are modelled time. It reads no clock and is not safe for
// concurrent use: Run's goroutine owns it.
type kvLink struct {
	bw      float64 // bytes per second
	lat     time.Duration
	last    time.Time // the moving pulls' left is as of last
	moving  []*pull   // bytes still to move
	landing []*pull   // last byte moved; arrive at done
}

// pull is one decode leg's KV on its way in.
type pull struct {
	id     uint64 // replica request ID
	blocks int
	bytes  float64
	left   float64 // bytes still to move
	start  time.Time
	done   time.Time // arrival, once landing
}

func newKVLink(gbps float64, lat time.Duration) *kvLink {
	return &kvLink{bw: gbps * 1e9 / 8, lat: max(lat, 0)}
}

// advance moves the link on to now, piece by piece: whenever a pull moves
// its last byte the others speed up.
func (l *kvLink) advance(now time.Time) {
	for len(l.moving) > 0 && now.After(l.last) {
		rate := l.bw / float64(len(l.moving))
		first := l.moving[0]
		for _, p := range l.moving[1:] {
			if p.left < first.left {
				first = p
			}
		}
		finish := l.last.Add(time.Duration(math.Ceil(first.left / rate * 1e9)))
		step := now
		if finish.Before(now) {
			step = finish
		}
		moved := rate * step.Sub(l.last).Seconds()
		eps := max(1, rate*2e-9) // a byte, or two nanoseconds' worth
		kept := l.moving[:0]
		for _, p := range l.moving {
			p.left -= moved
			if p == first && !step.Before(finish) || p.left <= eps {
				p.left = 0
				p.done = step.Add(l.lat)
				l.landing = append(l.landing, p)
				continue
			}
			kept = append(kept, p)
		}
		clear(l.moving[len(kept):])
		l.moving = kept
		l.last = step
	}
	if now.After(l.last) {
		l.last = now
	}
}

// start begins pulling bytes for request id at now.
func (l *kvLink) start(id uint64, nBlocks int, bytes float64, now time.Time) {
	l.advance(now)
	p := &pull{id: id, blocks: nBlocks, bytes: bytes, left: bytes, start: now}
	if bytes <= 0 {
		p.done = now.Add(l.lat)
		l.landing = append(l.landing, p)
		return
	}
	l.moving = append(l.moving, p)
}

// cancel drops request id's pull, if any, at now.
func (l *kvLink) cancel(id uint64, now time.Time) {
	l.advance(now)
	drop := func(ps []*pull) []*pull {
		for i, p := range ps {
			if p.id == id {
				copy(ps[i:], ps[i+1:])
				ps[len(ps)-1] = nil
				return ps[:len(ps)-1]
			}
		}
		return ps
	}
	l.moving = drop(l.moving)
	l.landing = drop(l.landing)
}

// next returns when the next pull arrives at the current rates; ok is false
// when none is in flight.
func (l *kvLink) next() (at time.Time, ok bool) {
	for _, p := range l.landing {
		if !ok || p.done.Before(at) {
			at, ok = p.done, true
		}
	}
	if len(l.moving) > 0 {
		rate := l.bw / float64(len(l.moving))
		least := l.moving[0].left
		for _, p := range l.moving[1:] {
			least = min(least, p.left)
		}
		t := l.last.Add(time.Duration(math.Ceil(least/rate*1e9)) + l.lat)
		if !ok || t.Before(at) {
			at, ok = t, true
		}
	}
	return at, ok
}

// arrived moves the link on to now and appends to out the pulls that have
// arrived by then, in arrival order, removing them.
func (l *kvLink) arrived(now time.Time, out []*pull) []*pull {
	l.advance(now)
	kept := l.landing[:0]
	n := len(out)
	for _, p := range l.landing {
		if p.done.After(now) {
			kept = append(kept, p)
			continue
		}
		out = append(out, p)
	}
	clear(l.landing[len(kept):])
	l.landing = kept
	got := out[n:]
	for i := 1; i < len(got); i++ { // insertion sort: a handful at most
		for j := i; j > 0 && got[j].done.Before(got[j-1].done); j-- {
			got[j], got[j-1] = got[j-1], got[j]
		}
	}
	return out
}

// inFlight is the number of pulls not yet arrived.
func (l *kvLink) inFlight() int { return len(l.moving) + len(l.landing) }
