package discovery

import (
	"context"
	"reflect"
	"testing"
	"time"
)

// TestStatic: --backend's list becomes ready replicas with their metrics
// and KV-event sockets placed by the ports, as a pod's would be; a bad
// entry is refused.
func TestStatic(t *testing.T) {
	reg := newRegistry()
	s, err := NewStatic("10.0.0.1:8000, 10.0.0.2:8001", Ports{Metrics: 9100, KVEvents: 5557, KVTopic: "kv@{ip}:{port}"}, reg)
	if err != nil {
		t.Fatal(err)
	}
	want := []Replica{
		{Name: "10.0.0.1:8000", Address: "10.0.0.1:8000", Ready: true, MetricsURL: "http://10.0.0.1:9100/metrics",
			KVEvents: "tcp://10.0.0.1:5557", KVReplay: "tcp://10.0.0.1:5558", KVTopic: "kv@10.0.0.1:8000"},
		{Name: "10.0.0.2:8001", Address: "10.0.0.2:8001", Ready: true, MetricsURL: "http://10.0.0.2:9100/metrics",
			KVEvents: "tcp://10.0.0.2:5557", KVReplay: "tcp://10.0.0.2:5558", KVTopic: "kv@10.0.0.2:8001"},
	}
	if got := s.Replicas(); !reflect.DeepEqual(got, want) {
		t.Errorf("replicas\n got %+v\nwant %+v", got, want)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	select {
	case <-s.Synced():
	case <-time.After(5 * time.Second):
		t.Fatal("not synced")
	}
	if len(reg.cur) != 2 {
		t.Errorf("registered %d replicas, want 2", len(reg.cur))
	}
	cancel()
	if err := <-done; err != nil {
		t.Error(err)
	}

	// Without scraping and KV events: the HTTP port's metrics page, or none.
	s, err = NewStatic("h:80", Ports{}, newRegistry())
	if err != nil || s.Replicas()[0].MetricsURL != "http://h:80/metrics" || s.Replicas()[0].KVEvents != "" {
		t.Errorf("default ports: %+v, %v", s.Replicas(), err)
	}
	s, err = NewStatic("h:80", Ports{Metrics: -1}, newRegistry())
	if err != nil || s.Replicas()[0].MetricsURL != "" {
		t.Errorf("metrics -1: %+v, %v", s.Replicas(), err)
	}
	for _, bad := range []string{"10.0.0.1", "h:0", "h:http", "h:70000", ""} {
		if _, err := NewStatic(bad, Ports{}, newRegistry()); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}
