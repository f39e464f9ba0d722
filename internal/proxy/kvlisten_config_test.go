package proxy

import (
	"strings"
	"testing"
)

func TestKVEventsListenConfig(t *testing.T) {
	for _, c := range []struct {
		name, yaml, want string // want "": valid
	}{
		{"bind", "kv_events_listen: tcp://0.0.0.0:5557\nbackends: [{url: 'http://10.0.0.1:8000'}]", ""},
		{"wildcard", "kv_events_listen: 'tcp://*:5557'\nbackends: [{url: 'http://10.0.0.1:8000'}]", ""},
		{"kv_topic without kv_events", "kv_events_listen: tcp://0.0.0.0:5557\nbackends: [{url: 'http://10.0.0.1:8000', kv_topic: 'kv@a@m'}]", ""},
		{"kv_topic alone", "backends: [{url: 'http://10.0.0.1:8000', kv_topic: 'kv@a@m'}]", "or kv_events_listen"},
		{"no transport", "kv_events_listen: 0.0.0.0:5557\nbackends: [{url: 'http://10.0.0.1:8000'}]", "kv_events_listen"},
		{"inproc", "kv_events_listen: inproc://kv\nbackends: [{url: 'http://10.0.0.1:8000'}]", "cannot be dialled"},
		{"no port", "kv_events_listen: tcp://0.0.0.0\nbackends: [{url: 'http://10.0.0.1:8000'}]", "kv_events_listen"},
	} {
		cfg, err := ParseConfig([]byte(c.yaml), DefaultConfig())
		if err == nil {
			err = cfg.Validate()
		}
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s: %v", c.name, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%s: err %v, want %q", c.name, err, c.want)
		}
	}
	pools := "kv_events_listen: tcp://0.0.0.0:5557\npools: [{name: p, default: true, backends: [{url: 'http://10.0.0.1:8000'}]}]"
	cfg, err := ParseConfig([]byte(pools), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewPools(cfg.Pools, nil); err == nil || !strings.Contains(err.Error(), "kv_events_listen: not with pools") {
		t.Errorf("pools with kv_events_listen: %v", err)
	}
}
