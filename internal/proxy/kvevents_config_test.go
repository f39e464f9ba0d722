package proxy

import (
	"strings"
	"testing"
)

func TestKVEventsConfig(t *testing.T) {
	tests := []struct {
		b    Backend
		want string // "" valid, else a substring of the error
	}{
		{Backend{URL: "http://a:8000", KVEvents: "tcp://a:5557"}, ""},
		{Backend{URL: "http://a:8000", KVEvents: "tcp://a:5557", KVReplay: "tcp://a:6000", KVTopic: "kv@a@m"}, ""},
		{Backend{URL: "http://a:8000", KVEvents: "a:5557"}, "backends[0].kv_events"},
		{Backend{URL: "http://a:8000", KVEvents: "tcp://*:5557"}, "not *"},
		{Backend{URL: "http://a:8000", KVEvents: "ipc:///tmp/kv"}, "kv_replay"},
		{Backend{URL: "http://a:8000", KVReplay: "tcp://a:5558"}, "need kv_events"},
		{Backend{URL: "http://a:8000", KVEvents: "tcp://a:5557", KVReplay: "udp://a:1"}, "backends[0].kv_replay"},
	}
	for _, tt := range tests {
		c := DefaultConfig()
		c.Backends = []Backend{tt.b}
		err := c.Validate()
		if (err == nil) != (tt.want == "") || (err != nil && !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("%+v: Validate() = %v, want %q", tt.b, err, tt.want)
		}
	}
	if got, err := replayEndpoint(Backend{KVEvents: "tcp://10.0.0.1:5557"}); err != nil || got != "tcp://10.0.0.1:5558" {
		t.Errorf("replayEndpoint = %q, %v; want tcp://10.0.0.1:5558", got, err)
	}
}

func TestSetKVEvents(t *testing.T) {
	bs := ParseBackends("http://a:8000,http://b:8000,http://c:8000")
	if err := SetKVEvents(bs, "tcp://a:5557,,tcp://c:5557"); err != nil {
		t.Fatal(err)
	}
	want := []string{"tcp://a:5557", "", "tcp://c:5557"}
	for i, b := range bs {
		if b.KVEvents != want[i] {
			t.Errorf("backend %d: KVEvents %q, want %q", i, b.KVEvents, want[i])
		}
	}
	if err := SetKVEvents(bs[:1], "tcp://a:5557,tcp://b:5557"); err == nil {
		t.Error("more endpoints than backends: no error")
	}
}

func TestParseConfigKVEvents(t *testing.T) {
	c, err := ParseConfig([]byte(`
backends:
  - url: http://a:8000
    kv_events: tcp://a:5557
    kv_topic: kv@a@m
speculative_ttl: 500ms
`), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if b := c.Backends[0]; b.KVEvents != "tcp://a:5557" || b.KVTopic != "kv@a@m" || c.SpeculativeTTL.String() != "500ms" {
		t.Errorf("parsed %+v, ttl %v", b, c.SpeculativeTTL)
	}
}
