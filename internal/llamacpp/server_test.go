package llamacpp_test

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/llamacpp"
)

func TestOptionsValidate(t *testing.T) {
	good := llamacpp.Default("/bin/sh", "/bin/sh")
	tests := []struct {
		edit func(o *llamacpp.Options)
		want string
	}{
		{func(o *llamacpp.Options) { o.Binary = "" }, "binary"},
		{func(o *llamacpp.Options) { o.Model = "" }, "model"},
		{func(o *llamacpp.Options) { o.Threads = 0 }, "threads"},
		{func(o *llamacpp.Options) { o.Slots = 0 }, "slots"},
		{func(o *llamacpp.Options) { o.Context = 1 }, "context"},
		{func(o *llamacpp.Options) { o.Port = 70000 }, "port"},
		{func(o *llamacpp.Options) { o.Model = "/nonexistent.gguf" }, "nonexistent"},
	}
	if err := good.Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for _, tt := range tests {
		o := good
		tt.edit(&o)
		if err := o.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Validate: %v, want an error naming %s", err, tt.want)
		}
	}
	if _, err := llamacpp.Start(context.Background(), llamacpp.Options{}); err == nil {
		t.Error("Start with no binary: no error")
	}
}

// TestStartMetricsStop: a real llama-server starts healthy, says it has
// two slots, exposes its llamacpp:* metrics, and stops.
func TestStartMetricsStop(t *testing.T) {
	s := startServers(t, 1)[0]
	resp, err := http.Get(s.URL + "/props")
	if err != nil {
		t.Fatal(err)
	}
	var props struct {
		TotalSlots int `json:"total_slots"`
	}
	err = json.NewDecoder(resp.Body).Decode(&props)
	resp.Body.Close()
	if err != nil || props.TotalSlots != 2 {
		t.Errorf("/props total_slots %d (%v), want 2", props.TotalSlots, err)
	}
	m, err := llamacpp.Metrics(context.Background(), s.URL)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"llamacpp:prompt_seconds_total", "llamacpp:requests_processing", "llamacpp:kv_cache_usage_ratio"} {
		if _, ok := m[name]; !ok {
			t.Errorf("metrics lack %s", name)
		}
	}
	s.Stop()
	select {
	case <-s.Done():
	default:
		t.Error("Stop returned before the process exited")
	}
}
