package proxy

import (
	"fmt"
	"net"
	"strconv"
	"time"
)

// PickerConfig makes serve a data plane for a Gateway API Inference
// Extension endpoint picker (gie.go; docs/gie.md). It is part of Config.
type PickerConfig struct {
	// EndpointPicker, when set, is the "HOST:PORT" of a GIE-conformant
	// endpoint picker (prefixlb epp, llm-d's router, GIE's own EPP) that
	// speaks Envoy's ext_proc v3 over plaintext gRPC: each inference
	// request is sent to it, headers and body, and goes to the endpoint
	// it names instead of the one serve's own policy would choose (YAML
	// endpoint_picker).
	EndpointPicker string
	// EndpointPickerFailOpen routes a request with serve's own policy
	// when the picker cannot answer (down, erring, past
	// EndpointPickerTimeout, or answering garbage). Off by default:
	// such a request gets 503, as GIE's InferencePool failureMode
	// defaults to FailClose (YAML endpoint_picker_fail_open).
	EndpointPickerFailOpen bool
	// EndpointPickerTimeout bounds the picking: from opening the stream
	// until the picker has named the endpoint (its own queueing
	// included), and, on the response path, the wait for its answer to
	// the response headers and for its last body chunk once the
	// replica's body has ended (YAML endpoint_picker_timeout; > 0).
	EndpointPickerTimeout time.Duration
	// ShadowPolicy, with EndpointPicker set, names a policy (any serve
	// accepts: policy.Parse, e.g. "llmd-approx:prefix_weight=3") that
	// shadows the picker (shadow.go): for each request the picker routes,
	// serve's own core is asked where that policy would send it, then the
	// request is committed to the picker's endpoint, so the policy's state
	// follows the picker's decisions. The two answers are compared
	// (prefixlb_shadow_decisions_total); where the request goes is never
	// changed. The core then runs this policy rather than Config.Policy,
	// fail-open routing included (YAML shadow_policy; "": no shadow).
	ShadowPolicy string
	// ShadowLog, with ShadowPolicy set, is a file that each shadowed
	// decision is appended to as one JSON line (shadowRecord; YAML
	// shadow_log; "": none).
	ShadowLog string
}

// defaultPickerTimeout is EndpointPickerTimeout's default: above the
// default queue timeout of prefixlb epp's router-side queue, so that a
// request it holds is not taken for a dead picker.
const defaultPickerTimeout = 60 * time.Second

// validate reports the first invalid field, by its YAML name.
func (c *PickerConfig) validate() error {
	if c.EndpointPicker == "" {
		if c.ShadowPolicy != "" {
			return fmt.Errorf("proxy: config: shadow_policy: needs endpoint_picker (the shadow is compared with the picker's decisions)")
		}
		return nil
	}
	if c.ShadowLog != "" && c.ShadowPolicy == "" {
		return fmt.Errorf("proxy: config: shadow_log: needs shadow_policy")
	}
	host, port, err := net.SplitHostPort(c.EndpointPicker)
	if err != nil {
		return fmt.Errorf("proxy: config: endpoint_picker: want HOST:PORT: %v", err)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || host == "" {
		return fmt.Errorf("proxy: config: endpoint_picker: want HOST:PORT with a port in 1..65535, got %q", c.EndpointPicker)
	}
	if c.EndpointPickerTimeout <= 0 {
		return fmt.Errorf("proxy: config: endpoint_picker_timeout: must be > 0, got %v", c.EndpointPickerTimeout)
	}
	return nil
}

// filePicker is the YAML form of PickerConfig: every field optional.
type filePicker struct {
	EndpointPicker         *string   `json:"endpoint_picker"`
	EndpointPickerFailOpen *bool     `json:"endpoint_picker_fail_open"`
	EndpointPickerTimeout  *duration `json:"endpoint_picker_timeout"`
	ShadowPolicy           *string   `json:"shadow_policy"`
	ShadowLog              *string   `json:"shadow_log"`
}

// apply sets the fields given over c.
func (f *filePicker) apply(c *PickerConfig) {
	if f.EndpointPicker != nil {
		c.EndpointPicker = *f.EndpointPicker
	}
	if f.EndpointPickerFailOpen != nil {
		c.EndpointPickerFailOpen = *f.EndpointPickerFailOpen
	}
	if f.EndpointPickerTimeout != nil {
		c.EndpointPickerTimeout = time.Duration(*f.EndpointPickerTimeout)
	}
	if f.ShadowPolicy != nil {
		c.ShadowPolicy = *f.ShadowPolicy
	}
	if f.ShadowLog != nil {
		c.ShadowLog = *f.ShadowLog
	}
}
