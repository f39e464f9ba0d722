package proxy

import (
	"strings"
	"testing"
	"time"
)

func TestConfigYAML(t *testing.T) {
	y := `
listen: ":9000"
backends:
  - url: http://10.0.0.1:8000
  - name: b
    url: http://10.0.0.2:8000
policy: round-robin
health_interval: 2s
eject_after: 5
max_body_bytes: 1024
admin_token: t
`
	c, err := ParseConfig([]byte(y), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if c.Listen != ":9000" || len(c.Backends) != 2 || c.Policy != "round-robin" || c.HealthInterval != 2*time.Second ||
		c.EjectAfter != 5 || c.MaxBodyBytes != 1024 || c.AdminToken != "t" || c.ReadmitAfter != DefaultConfig().ReadmitAfter {
		t.Errorf("config %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("Validate: %v", err)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"listen: x\nbogus: 1\n", `unknown field "bogus"`},
		{"health_interval: 5\n", "duration"},
		{"health_interval: soon\n", "soon"},
		{"eject_after: many\n", "eject_after"},
	} {
		if _, err := ParseConfig([]byte(bad.yaml), DefaultConfig()); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: error %v, want one with %q", bad.yaml, err, bad.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	ok := DefaultConfig()
	ok.Backends = ParseBackends("http://a:1, http://b:2")
	if err := ok.Validate(); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		field string
		edit  func(*Config)
	}{
		{"backends", func(c *Config) { c.Backends = nil }},
		{"backends[1].url", func(c *Config) { c.Backends[1].URL = "ftp://x" }},
		{"backends[1].name", func(c *Config) { c.Backends[1].Name = "a:1" }},
		{"policy", func(c *Config) { c.Policy = "nope" }},
		{"block_tokens", func(c *Config) { c.BlockTokens = 0 }},
		{"connect_timeout", func(c *Config) { c.ConnectTimeout = -1 }},
		{"health_interval", func(c *Config) { c.HealthInterval = 0 }},
		{"eject_after", func(c *Config) { c.EjectAfter = 0 }},
		{"max_body_bytes", func(c *Config) { c.MaxBodyBytes = 0 }},
		{"max_retries", func(c *Config) { c.MaxRetries = -1 }},
	} {
		c := ok
		c.Backends = append([]Backend(nil), ok.Backends...)
		tc.edit(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.field+":") {
			t.Errorf("%s: error %v", tc.field, err)
		}
	}
	c := ok
	c.Profile = "no-such-profile"
	if _, err := New(c); err == nil || !strings.Contains(err.Error(), "profile") {
		t.Errorf("unknown profile: %v", err)
	}
}

// TestParseConfigLoRA: the config file's lora_adapters and
// lora_adapter_bytes reach the config (serve --lora-adapter-bytes's key).
func TestParseConfigLoRA(t *testing.T) {
	c, err := ParseConfig([]byte("backends:\n  - url: http://10.0.0.1:8000\nlora_adapters: [sql]\nlora_adapter_bytes: 88080384\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if len(c.LoRAAdapters) != 1 || c.LoRAAdapters[0] != "sql" || c.LoRAAdapterBytes != 84<<20 {
		t.Errorf("lora_adapters %v, lora_adapter_bytes %d", c.LoRAAdapters, c.LoRAAdapterBytes)
	}
}

func TestConfigYAMLQueueRoundTwo(t *testing.T) {
	c, err := ParseConfig([]byte("queue:\n  max_predicted_wait: 1500ms\n  lifo_after: 300ms\n  max_queued_prefill: 0s\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	a := c.Queue.Admission
	if a.MaxPredictedWait != 1500*time.Millisecond || a.LIFOAfter != 300*time.Millisecond || a.MaxQueuedPrefill != 0 {
		t.Errorf("queue: max_predicted_wait %v lifo_after %v max_queued_prefill %v", a.MaxPredictedWait, a.LIFOAfter, a.MaxQueuedPrefill)
	}
	if c, err := ParseConfig([]byte("queue:\n  lifo_after: -1s\n"), DefaultConfig()); err == nil && c.Queue.Admission.Validate() == nil {
		t.Error("negative lifo_after accepted")
	}
	d := DefaultConfig().Queue.Admission
	if c, err := ParseConfig([]byte("queue:\n  max: 10\n"), DefaultConfig()); err != nil || c.Queue.Admission.MaxPredictedWait != d.MaxPredictedWait {
		t.Errorf("max_predicted_wait not kept at its default %v: %v", d.MaxPredictedWait, err)
	}
}

func TestConfigYAMLQueueRoundFour(t *testing.T) {
	c, err := ParseConfig([]byte("queue:\n  slo_fraction: 0.25\n  engage_after: 250ms\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if a := c.Queue.Admission; a.SLOFraction != 0.25 || a.EngageAfter != 250*time.Millisecond {
		t.Errorf("queue: slo_fraction %v engage_after %v", a.SLOFraction, a.EngageAfter)
	}
	for _, bad := range []string{"slo_fraction: 1", "slo_fraction: -0.5", "engage_after: -1s"} {
		if c, err := ParseConfig([]byte("queue:\n  "+bad+"\n"), DefaultConfig()); err == nil && c.Queue.Admission.Validate() == nil {
			t.Errorf("%s accepted", bad)
		}
	}
	if d := DefaultConfig().Queue.Admission; d.SLOFraction != 0.5 || d.EngageAfter != 100*time.Millisecond {
		t.Errorf("defaults: slo_fraction %v engage_after %v", d.SLOFraction, d.EngageAfter)
	}
}
