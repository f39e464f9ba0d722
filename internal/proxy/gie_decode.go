package proxy

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/types/known/structpb"
)

// The names of the Gateway API Inference Extension's endpoint picker
// protocol, as the data plane uses them (kubernetes-sigs/
// gateway-api-inference-extension, docs/proposals/
// 004-endpoint-picker-protocol/README.md at commit 0fc3b125, protocol
// v1.0.0). internal/epp has the picker's side of the same names.
const (
	// gieDestination is the header, and the key in the gieNamespace
	// dynamic metadata, of the endpoints the picker chose: "ip:port", or
	// "ip:port,ip:port,..." with the primary first ("Destination
	// Endpoint").
	gieDestination = "x-gateway-destination-endpoint"
	// gieNamespace is the metadata namespace of the destination and of
	// the endpoint that served ("envoy.lb").
	gieNamespace = "envoy.lb"
	// gieServed is the key, in the gieNamespace filter metadata of the
	// response path's metadata_context, of the endpoint that served
	// ("Destination Endpoint Served").
	gieServed = "x-gateway-destination-endpoint-served"
	// gieSubsetNamespace and gieSubsetKey hold the data plane's subset
	// hint: the endpoints the picker must choose from ("Endpoint Subset").
	gieSubsetNamespace = "envoy.lb.subset_hint"
	gieSubsetKey       = "x-gateway-destination-endpoint-subset"
)

// Bounds on what a picker may answer (a hostile or broken picker meets
// these, not the proxy's memory).
const (
	// gieMaxEndpoints bounds the fallback list read from one answer; the
	// rest is ignored.
	gieMaxEndpoints = 16
	// gieMaxEndpointLen bounds one "host:port" (a DNS name is at most 253
	// bytes).
	gieMaxEndpointLen = 261
	// gieMaxMutations bounds the headers set or removed by one answer.
	gieMaxMutations = 256
)

// errPickerProtocol marks a picker answer that breaks the protocol:
// garbage mutations, a message out of order, no endpoint named.
var errPickerProtocol = errors.New("endpoint picker broke the protocol")

// parseEndpoints reads a destination value, "host:port[,host:port...]",
// into its endpoints in order, each normalized ("[v6]:port"). Entries
// that are not a host and a port in 1..65535 are skipped, as the protocol
// has the data plane use "the first valid endpoint in the list"; at most
// gieMaxEndpoints are kept. It fails when no entry is valid.
func parseEndpoints(v string) ([]string, error) {
	var out []string
	for item := range strings.SplitSeq(v, ",") {
		if len(out) == gieMaxEndpoints {
			break
		}
		item = strings.TrimSpace(item)
		if ep, ok := validEndpoint(item); ok {
			out = append(out, ep)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("%w: no valid endpoint in %q", errPickerProtocol, clip(v, 80))
	}
	return out, nil
}

// validEndpoint checks and normalizes one "host:port".
func validEndpoint(s string) (string, bool) {
	if s == "" || len(s) > gieMaxEndpointLen {
		return "", false
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil || host == "" {
		return "", false
	}
	n, err := strconv.Atoi(port)
	if err != nil || n < 1 || n > 65535 || port[0] == '0' || port[0] == '+' {
		return "", false
	}
	for i := 0; i < len(host); i++ {
		c := host[i]
		ok := c == '.' || c == '-' || c == ':' || c == '_' || c == '%' ||
			'0' <= c && c <= '9' || 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z'
		if !ok {
			return "", false
		}
	}
	return net.JoinHostPort(host, port), true
}

// clip shortens s for an error message.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// metadataDestination reads the destination from a response's dynamic
// metadata: envoy.lb's x-gateway-destination-endpoint, a string (a
// comma-separated list) or, tolerated, a list of strings. "" when absent.
func metadataDestination(md *structpb.Struct) string {
	ns := md.GetFields()[gieNamespace].GetStructValue()
	v := ns.GetFields()[gieDestination]
	switch k := v.GetKind().(type) {
	case *structpb.Value_StringValue:
		return k.StringValue
	case *structpb.Value_ListValue:
		var parts []string
		for _, e := range k.ListValue.GetValues() {
			if s := e.GetStringValue(); s != "" {
				parts = append(parts, s)
			}
			if len(parts) == gieMaxEndpoints {
				break
			}
		}
		return strings.Join(parts, ",")
	}
	return ""
}

// destination returns the endpoints the picker named: from the envoy.lb
// metadata when it has them, else from the x-gateway-destination-endpoint
// header (after the picker's mutations), and whether the two disagreed.
// The protocol says a picker MUST NOT set different values in the two and
// leaves the precedence undefined; the metadata carries the fallback list
// in the protocol's own examples, so it wins here.
func destination(h http.Header, md *structpb.Struct) (eps []string, conflict bool, err error) {
	hv := strings.Join(h.Values(gieDestination), ",")
	mv := metadataDestination(md)
	v := mv
	if v == "" {
		v = hv
	}
	if v == "" {
		return nil, false, fmt.Errorf("%w: no %s header or %s metadata", errPickerProtocol, gieDestination, gieNamespace)
	}
	eps, err = parseEndpoints(v)
	if err != nil {
		return nil, false, err
	}
	if mv != "" && hv != "" {
		if heps, herr := parseEndpoints(hv); herr != nil || !equalStrings(heps, eps) {
			conflict = true
		}
	}
	return eps, conflict, nil
}

func equalStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// inSubset keeps the endpoints of eps that are in subset (nil subset: all
// of them), in eps's order, and returns those left out.
func inSubset(eps, subset []string) (kept, out []string) {
	if subset == nil {
		return eps, nil
	}
	for _, ep := range eps {
		found := false
		for _, s := range subset {
			if s == ep {
				found = true
				break
			}
		}
		if found {
			kept = append(kept, ep)
		} else {
			out = append(out, ep)
		}
	}
	return kept, out
}

// subsetMetadata is the request's metadata_context carrying the subset
// hint (nil for no hint): filter_metadata["envoy.lb.subset_hint"]
// ["x-gateway-destination-endpoint-subset"] = [ip:port, ...].
func subsetMetadata(subset []string) *corev3.Metadata {
	if subset == nil {
		return nil
	}
	vals := make([]*structpb.Value, len(subset))
	for i, s := range subset {
		vals[i] = structpb.NewStringValue(s)
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		gieSubsetNamespace: {Fields: map[string]*structpb.Value{gieSubsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}},
	}}
}

// servedMetadata is the response path's metadata_context naming the
// endpoint that served.
func servedMetadata(ep string) *corev3.Metadata {
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		gieNamespace: {Fields: map[string]*structpb.Value{gieServed: structpb.NewStringValue(ep)}},
	}}
}

// applyHeaderMutation applies m to h as Envoy's ext_proc filter does
// (HeaderValueOption's append_action, or the deprecated append flag when
// set; remove_headers after set_headers' for the same name is Envoy's
// order too: removals first). Pseudo-headers, Host and hop-by-hop headers
// are not the picker's to change: mutations of them are ignored (Envoy's
// default HeaderMutationRules refuse the system ones). A name or value
// that is not a valid HTTP field, or more than gieMaxMutations of them,
// fail with errPickerProtocol: the request is not sent with half a
// mutation.
func applyHeaderMutation(h http.Header, m *extprocv3.HeaderMutation) error {
	if m == nil {
		return nil
	}
	if len(m.GetSetHeaders())+len(m.GetRemoveHeaders()) > gieMaxMutations {
		return fmt.Errorf("%w: %d header mutations, over %d", errPickerProtocol,
			len(m.GetSetHeaders())+len(m.GetRemoveHeaders()), gieMaxMutations)
	}
	for _, k := range m.GetRemoveHeaders() {
		if !validFieldName(k) {
			return fmt.Errorf("%w: remove header %q: not a header name", errPickerProtocol, clip(k, 40))
		}
	}
	type set struct {
		k, v   string
		action corev3.HeaderValueOption_HeaderAppendAction
	}
	sets := make([]set, 0, len(m.GetSetHeaders()))
	for _, o := range m.GetSetHeaders() {
		hv := o.GetHeader()
		k := hv.GetKey()
		if !validFieldName(k) {
			return fmt.Errorf("%w: set header %q: not a header name", errPickerProtocol, clip(k, 40))
		}
		v := hv.GetValue()
		if len(hv.GetRawValue()) > 0 {
			v = string(hv.GetRawValue())
		}
		if !validFieldValue(v) {
			return fmt.Errorf("%w: set header %s: its value is not a header value", errPickerProtocol, k)
		}
		action := o.GetAppendAction()
		if a := o.GetAppend(); a != nil {
			action = corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD
			if a.GetValue() {
				action = corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD
			}
		}
		sets = append(sets, set{k, v, action})
	}
	for _, k := range m.GetRemoveHeaders() {
		if !systemHeader(k) {
			h.Del(k)
		}
	}
	for _, s := range sets {
		if systemHeader(s.k) {
			continue
		}
		_, present := h[http.CanonicalHeaderKey(s.k)]
		switch s.action {
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if !present {
				h.Add(s.k, s.v)
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD:
			h.Set(s.k, s.v)
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if present {
				h.Set(s.k, s.v)
			}
		default: // APPEND_IF_EXISTS_OR_ADD, and unknown values
			h.Add(s.k, s.v)
		}
	}
	return nil
}

// systemHeader reports whether k is a header the picker may not change:
// a pseudo-header, Host, Content-Length (the data plane sets it from the
// body it sends) or a hop-by-hop header.
func systemHeader(k string) bool {
	if strings.HasPrefix(k, ":") {
		return true
	}
	c := http.CanonicalHeaderKey(k)
	return c == "Host" || c == "Content-Length" || isHop(c)
}

// validFieldName reports whether k is an HTTP field name (RFC 9110 §5.1:
// a token), or a pseudo-header (":" then a token).
func validFieldName(k string) bool {
	k = strings.TrimPrefix(k, ":")
	if k == "" || len(k) > 256 {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// validFieldValue reports whether v is an HTTP field value (RFC 9110
// §5.5): no control bytes but tab, at most 64 KiB.
func validFieldValue(v string) bool {
	if len(v) > 64<<10 {
		return false
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c < ' ' && c != '\t' || c == 0x7f {
			return false
		}
	}
	return true
}
