package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/proxy"
)

// TestQueueFlagsOverConfig: serve lays the queue flags given over its
// --config file's queue settings, and only those: a flag not given keeps
// the file's value.
func TestQueueFlagsOverConfig(t *testing.T) {
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	f.queueCopy = queueFlags(fs, &f.cfg.Queue.Admission)
	if err := fs.Parse([]string{"--queue-max-predicted-wait", "1500ms", "--queue-slo-fraction", "0.25", "--queue-max", "7"}); err != nil {
		t.Fatal(err)
	}
	c, err := proxy.ParseConfig([]byte("queue:\n  max_predicted_wait: 3s\n  engage_after: 50ms\n  max: 99\n  max_waiting: 3\n"), proxy.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.overrides(fs, &c)
	a := c.Queue.Admission
	if a.MaxPredictedWait != 1500*time.Millisecond || a.SLOFraction != 0.25 || a.MaxQueue != 7 {
		t.Errorf("flags given: max_predicted_wait %v slo_fraction %v max %d, want 1.5s 0.25 7", a.MaxPredictedWait, a.SLOFraction, a.MaxQueue)
	}
	if a.EngageAfter != 50*time.Millisecond || a.MaxWaiting != 3 {
		t.Errorf("file's values: engage_after %v max_waiting %d, want 50ms 3", a.EngageAfter, a.MaxWaiting)
	}
	// Every registered queue flag has its copy, and serve and epp both
	// register them.
	fs.VisitAll(func(fl *pflag.Flag) {
		if _, ok := f.queueCopy[fl.Name]; !ok {
			t.Errorf("flag --%s has no copy", fl.Name)
		}
	})
	for _, cmd := range []*pflag.FlagSet{newServeCmd().Flags(), newEPPCmd().Flags()} {
		for name := range f.queueCopy {
			if cmd.Lookup(name) == nil {
				t.Errorf("--%s not registered", name)
			}
		}
	}
}

// TestTenantFlags: serve's --trusted-proxies lays over the file's
// trusted_proxies; epp reads --tenants and --trust-client-headers.
func TestTenantFlags(t *testing.T) {
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	cmd := newServeCmd()
	fs := cmd.Flags()
	f.cfg.Tenants.TrustedProxies = nil
	fs2 := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	fs2.StringSliceVar(&f.cfg.Tenants.TrustedProxies, "trusted-proxies", nil, "")
	if err := fs2.Parse([]string{"--trusted-proxies", "10.0.0.0/8,192.168.0.1"}); err != nil {
		t.Fatal(err)
	}
	c, err := proxy.ParseConfig([]byte("trusted_proxies: [172.16.0.0/12]\n"), proxy.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.overrides(fs2, &c)
	if got := strings.Join(c.Tenants.TrustedProxies, ","); got != "10.0.0.0/8,192.168.0.1" {
		t.Errorf("trusted proxies %q", got)
	}
	for _, name := range []string{"trusted-proxies", "queue-min-ttft-slo"} {
		if fs.Lookup(name) == nil {
			t.Errorf("serve lacks --%s", name)
		}
	}
	ecmd := newEPPCmd().Flags()
	for _, name := range []string{"tenants", "trust-client-headers", "queue-min-ttft-slo"} {
		if ecmd.Lookup(name) == nil {
			t.Errorf("epp lacks --%s", name)
		}
	}
	file := filepath.Join(t.TempDir(), "tenants.yaml")
	if err := os.WriteFile(file, []byte("tenants: [{name: a, tokens_per_minute: 10}]\nrequire_tenant: true\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tc, err := eppTenants(file, true)
	if err != nil || len(tc.Tenants) != 1 || !tc.RequireTenant || !tc.TrustClientHeaders {
		t.Errorf("eppTenants = %+v, %v", tc, err)
	}
	if err := os.WriteFile(file, []byte("trusted_proxies: [10.0.0.0/8]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := eppTenants(file, false); err == nil {
		t.Error("epp accepted trusted_proxies")
	}
}
