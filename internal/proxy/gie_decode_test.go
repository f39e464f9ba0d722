package proxy

import (
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

func TestParseEndpoints(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string // nil: an error
	}{
		{"10.0.0.1:8000", []string{"10.0.0.1:8000"}},
		{"10.0.0.1:8000,10.0.0.2:8000", []string{"10.0.0.1:8000", "10.0.0.2:8000"}},
		{" 10.0.0.1:8000 , ,10.0.0.2:8000 ", []string{"10.0.0.1:8000", "10.0.0.2:8000"}},
		{"[fd00::1]:8000", []string{"[fd00::1]:8000"}},
		{"vllm-0.llm.svc:8000", []string{"vllm-0.llm.svc:8000"}},
		// "The first valid endpoint in the list will be used": invalid
		// entries are skipped.
		{"10.0.0.1,10.0.0.2:8000", []string{"10.0.0.2:8000"}},
		{"10.0.0.1:0,10.0.0.1:65536,10.0.0.1:08,10.0.0.1:+8,:80,h/x:80,h@x:80,10.0.0.3:1", []string{"10.0.0.3:1"}},
		{"", nil},
		{"garbage", nil},
		{",,,", nil},
	} {
		got, err := parseEndpoints(tc.in)
		if (err != nil) != (tc.want == nil) || !slices.Equal(got, tc.want) {
			t.Errorf("parseEndpoints(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	long := strings.Repeat("10.0.0.1:8000,", 100)
	if got, _ := parseEndpoints(long); len(got) != gieMaxEndpoints {
		t.Errorf("%d endpoints kept, want %d", len(got), gieMaxEndpoints)
	}
}

func TestDestination(t *testing.T) {
	md := func(v *structpb.Value) *structpb.Struct {
		return &structpb.Struct{Fields: map[string]*structpb.Value{gieNamespace: structpb.NewStructValue(
			&structpb.Struct{Fields: map[string]*structpb.Value{gieDestination: v}})}}
	}
	list, _ := structpb.NewList([]any{"10.0.0.3:80", "10.0.0.4:80"})
	for _, tc := range []struct {
		name     string
		header   string
		md       *structpb.Struct
		want     []string
		conflict bool
	}{
		{"header", "10.0.0.1:80,10.0.0.2:80", nil, []string{"10.0.0.1:80", "10.0.0.2:80"}, false},
		{"metadata", "", md(structpb.NewStringValue("10.0.0.2:80")), []string{"10.0.0.2:80"}, false},
		{"same", "10.0.0.2:80", md(structpb.NewStringValue("10.0.0.2:80")), []string{"10.0.0.2:80"}, false},
		{"differ: metadata wins", "10.0.0.1:80", md(structpb.NewStringValue("10.0.0.2:80")), []string{"10.0.0.2:80"}, true},
		{"metadata list", "", md(structpb.NewListValue(list)), []string{"10.0.0.3:80", "10.0.0.4:80"}, false},
		{"metadata of another kind: header", "10.0.0.1:80", md(structpb.NewNumberValue(3)), []string{"10.0.0.1:80"}, false},
		{"none", "", nil, nil, false},
	} {
		h := http.Header{}
		if tc.header != "" {
			h.Set(gieDestination, tc.header)
		}
		got, conflict, err := destination(h, tc.md)
		if (err != nil) != (tc.want == nil) || !slices.Equal(got, tc.want) || conflict != tc.conflict {
			t.Errorf("%s: got %v conflict=%v err=%v; want %v conflict=%v", tc.name, got, conflict, err, tc.want, tc.conflict)
		}
	}
}

func TestInSubset(t *testing.T) {
	kept, out := inSubset([]string{"a:1", "b:1", "c:1"}, []string{"c:1", "a:1"})
	if !slices.Equal(kept, []string{"a:1", "c:1"}) || !slices.Equal(out, []string{"b:1"}) {
		t.Errorf("got %v, %v", kept, out)
	}
	if kept, _ := inSubset([]string{"a:1"}, nil); !slices.Equal(kept, []string{"a:1"}) {
		t.Errorf("no subset: got %v", kept)
	}
}

func TestApplyHeaderMutation(t *testing.T) {
	opt := func(k, v string, a corev3.HeaderValueOption_HeaderAppendAction) *corev3.HeaderValueOption {
		return &corev3.HeaderValueOption{Header: &corev3.HeaderValue{Key: k, RawValue: []byte(v)}, AppendAction: a}
	}
	h := http.Header{"A": {"1"}, "B": {"1"}, "C": {"1"}, "D": {"1"}, "Gone": {"x"}, "Host": {"h"}}
	m := &extprocv3.HeaderMutation{
		SetHeaders: []*corev3.HeaderValueOption{
			opt("a", "2", corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD),
			opt("b", "2", corev3.HeaderValueOption_ADD_IF_ABSENT),
			opt("c", "2", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
			opt("d", "2", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS),
			opt("e", "2", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS),
			opt("f", "2", corev3.HeaderValueOption_ADD_IF_ABSENT),
			{Header: &corev3.HeaderValue{Key: "g", Value: "legacy"}, Append: wrapperspb.Bool(false)},
			opt(":path", "/evil", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
			opt("host", "evil", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
			opt("content-length", "1", corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD),
		},
		RemoveHeaders: []string{"gone", "host"},
	}
	if err := applyHeaderMutation(h, m); err != nil {
		t.Fatal(err)
	}
	want := http.Header{"A": {"1", "2"}, "B": {"1"}, "C": {"2"}, "D": {"2"}, "F": {"2"}, "G": {"legacy"}, "Host": {"h"}}
	if len(h) != len(want) {
		t.Errorf("got %v, want %v", h, want)
	}
	for k, v := range want {
		if !slices.Equal(h[k], v) {
			t.Errorf("%s = %v, want %v", k, h[k], v)
		}
	}
	for _, bad := range []*extprocv3.HeaderMutation{
		{SetHeaders: []*corev3.HeaderValueOption{opt("", "v", 0)}},
		{SetHeaders: []*corev3.HeaderValueOption{opt("a b", "v", 0)}},
		{SetHeaders: []*corev3.HeaderValueOption{opt("a", "v\x00", 0)}},
		{RemoveHeaders: []string{"a\nb"}},
		{RemoveHeaders: make([]string, gieMaxMutations+1)},
	} {
		h := http.Header{"A": {"1"}}
		if err := applyHeaderMutation(h, bad); err == nil || len(h) != 1 {
			t.Errorf("%v: err %v, header %v: want an error and no change", bad, err, h)
		}
	}
}

func TestPickerConfig(t *testing.T) {
	c, err := ParseConfig([]byte("backends: [{url: 'http://10.0.0.1:8000'}]\nendpoint_picker: 127.0.0.1:9002\nendpoint_picker_fail_open: true\nendpoint_picker_timeout: 2s\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if c.EndpointPicker != "127.0.0.1:9002" || !c.EndpointPickerFailOpen || c.EndpointPickerTimeout != 2*time.Second {
		t.Errorf("got %+v", c.PickerConfig)
	}
	if err := c.Validate(); err != nil {
		t.Error(err)
	}
	for _, bad := range []PickerConfig{{EndpointPicker: "nohost", EndpointPickerTimeout: time.Second},
		{EndpointPicker: "h:0", EndpointPickerTimeout: time.Second}, {EndpointPicker: "h:80"}} {
		c.PickerConfig = bad
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "endpoint_picker") {
			t.Errorf("%+v: err %v, want one naming endpoint_picker", bad, err)
		}
	}
}

// FuzzParseEndpoints: any destination value gives valid endpoints only
// (each a host and a port in 1..65535, normalized: parsing it again gives
// itself), at most gieMaxEndpoints, or an error.
func FuzzParseEndpoints(f *testing.F) {
	for _, s := range []string{"10.0.0.1:8000", "10.0.0.1:8000,10.0.0.2:8000", "[::1]:80", "a:1,,b:2", "x", ":80", "[::1]:0", "h:65535"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		eps, err := parseEndpoints(s)
		if err != nil {
			if len(eps) != 0 {
				t.Fatalf("error with endpoints %v", eps)
			}
			return
		}
		if len(eps) == 0 || len(eps) > gieMaxEndpoints {
			t.Fatalf("%d endpoints", len(eps))
		}
		for _, ep := range eps {
			again, ok := validEndpoint(ep)
			if !ok || again != ep {
				t.Fatalf("endpoint %q not normalized (%q, %v)", ep, again, ok)
			}
		}
	})
}

// FuzzPickerAnswer decodes arbitrary bytes as a picker's answer
// (ProcessingResponse) and applies it as serve does: header mutations to
// a request's headers, the destination from the result and the metadata.
// Nothing panics; a mutation either fails whole (the headers unchanged)
// or leaves only valid fields, Host untouched; a destination is valid
// endpoints only.
func FuzzPickerAnswer(f *testing.F) {
	md, _ := structpb.NewStruct(map[string]any{gieNamespace: map[string]any{gieDestination: "10.0.0.1:80,10.0.0.2:80"}})
	for _, r := range []*extprocv3.ProcessingResponse{
		{Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			HeaderMutation: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{{Header: &corev3.HeaderValue{Key: gieDestination, RawValue: []byte("10.0.0.1:80")}}},
				RemoveHeaders: []string{"x-a"}}}}}, DynamicMetadata: md},
		{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{Body: []byte("no")}}},
	} {
		b, err := proto.Marshal(r)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		var r extprocv3.ProcessingResponse
		if proto.Unmarshal(b, &r) != nil {
			return
		}
		var m *extprocv3.HeaderMutation
		switch v := r.GetResponse().(type) {
		case *extprocv3.ProcessingResponse_RequestHeaders:
			m = v.RequestHeaders.GetResponse().GetHeaderMutation()
		case *extprocv3.ProcessingResponse_RequestBody:
			m = v.RequestBody.GetResponse().GetHeaderMutation()
		case *extprocv3.ProcessingResponse_ImmediateResponse:
			m = v.ImmediateResponse.GetHeaders()
		}
		h := http.Header{"Host": {"h"}, "X-A": {"1"}}
		if err := applyHeaderMutation(h, m); err != nil {
			if len(h) != 2 || h.Get("X-A") != "1" {
				t.Fatalf("failed mutation changed the headers: %v", h)
			}
		}
		if h.Get("Host") != "h" || len(h.Values("Host")) != 1 {
			t.Fatalf("Host changed: %v", h["Host"])
		}
		for k, vs := range h {
			if !validFieldName(k) {
				t.Fatalf("invalid name %q", k)
			}
			for _, v := range vs {
				if !validFieldValue(v) {
					t.Fatalf("invalid value %q", v)
				}
			}
		}
		eps, _, err := destination(h, r.GetDynamicMetadata())
		if err == nil {
			for _, ep := range eps {
				if again, ok := validEndpoint(ep); !ok || again != ep {
					t.Fatalf("endpoint %q", ep)
				}
			}
		}
	})
}
