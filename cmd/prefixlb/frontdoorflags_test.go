package main

import (
	"slices"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/spf13/pflag"
)

// TestFrontDoorFlagsOverConfig: the front door's flags given replace the
// --config file's values (--allow-path, repeated, replaces the whole list),
// and a flag not given keeps the file's value.
func TestFrontDoorFlagsOverConfig(t *testing.T) {
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	frontDoorFlags(fs, &f.cfg.FrontDoor)
	if err := fs.Parse([]string{"--allow-path", "POST /v1/completions", "--allow-path", "GET /v1/models",
		"--client-write-timeout", "5s", "--breaker-failures", "0"}); err != nil {
		t.Fatal(err)
	}
	c, err := proxy.ParseConfig([]byte("allowed_paths: ['*']\nbreaker_window: 20\nbreaker_failures: 7\nmax_inflight_body_bytes: 33554432\n"), proxy.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.overrides(fs, &c)
	if want := []string{"POST /v1/completions", "GET /v1/models"}; !slices.Equal(c.AllowedPaths, want) {
		t.Errorf("allowed paths %q, want %q", c.AllowedPaths, want)
	}
	if c.ClientWriteTimeout != 5*time.Second || c.BreakerFailures != 0 {
		t.Errorf("flags given: client_write_timeout %v breaker_failures %d, want 5s 0", c.ClientWriteTimeout, c.BreakerFailures)
	}
	if c.BreakerWindow != 20 || c.MaxInflightBodyBytes != 32<<20 || c.BreakerEjectionTime != proxy.DefaultBreakerEjectionTime {
		t.Errorf("file's values: breaker_window %d max_inflight_body_bytes %d breaker_ejection_time %v", c.BreakerWindow, c.MaxInflightBodyBytes, c.BreakerEjectionTime)
	}
	if err := c.Validate(); err == nil {
		t.Errorf("config without backends validated")
	}
	serve := newServeCmd().Flags()
	fs.VisitAll(func(fl *pflag.Flag) {
		if serve.Lookup(fl.Name) == nil {
			t.Errorf("--%s not registered by serve", fl.Name)
		}
	})
}
