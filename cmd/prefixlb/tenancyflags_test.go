package main

import (
	"testing"

	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// TestTenancyFlags: --explain takes never|trusted|always (true/false for
// a boolean's habits), bare means always, and the default is trusted;
// --tenant-isolation and --tenant-salt-secret override the config.
func TestTenancyFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want tenancy.Explain
	}{
		{nil, tenancy.ExplainTrusted},
		{[]string{"--explain"}, tenancy.ExplainAlways},
		{[]string{"--explain=never"}, tenancy.ExplainNever},
		{[]string{"--explain=false"}, tenancy.ExplainNever},
		{[]string{"--explain=trusted"}, tenancy.ExplainTrusted},
	} {
		cfg := proxy.DefaultConfig()
		fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
		tenancyFlags(fs, &cfg)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if cfg.Explain != tc.want {
			t.Errorf("%v: explain %q, want %q", tc.args, cfg.Explain, tc.want)
		}
	}
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	cfg := proxy.DefaultConfig()
	tenancyFlags(fs, &cfg)
	if err := fs.Parse([]string{"--explain=sometimes"}); err == nil {
		t.Error("--explain=sometimes: no error")
	}
	// Flags override the file.
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	fs = pflag.NewFlagSet("serve", pflag.ContinueOnError)
	tenancyFlags(fs, &f.cfg)
	if err := fs.Parse([]string{"--explain=always", "--tenant-isolation", "--tenant-salt-secret=k"}); err != nil {
		t.Fatal(err)
	}
	file, err := proxy.ParseConfig([]byte("explain: never\ntenant_isolation: false\n"), proxy.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.overrides(fs, &file)
	if file.Explain != tenancy.ExplainAlways || !file.TenantIsolation || file.TenantSaltSecret != "k" {
		t.Errorf("after the flags: explain %q, isolation %v, secret %q", file.Explain, file.TenantIsolation, file.TenantSaltSecret)
	}
}

// TestEPPTenancyFlags: epp's --explain mirrors serve's (default trusted,
// bare means always, a bad value refused) and --tenant-isolation is off
// by default.
func TestEPPTenancyFlags(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
		iso  string
	}{
		{nil, "trusted", "false"},
		{[]string{"--explain"}, "always", "false"},
		{[]string{"--explain=never", "--tenant-isolation"}, "never", "true"},
	} {
		fs := newEPPCmd().Flags()
		if err := fs.Parse(tc.args); err != nil {
			t.Fatalf("%v: %v", tc.args, err)
		}
		if got := fs.Lookup("explain").Value.String(); got != tc.want {
			t.Errorf("%v: explain %q, want %q", tc.args, got, tc.want)
		}
		if got := fs.Lookup("tenant-isolation").Value.String(); got != tc.iso {
			t.Errorf("%v: tenant-isolation %q, want %q", tc.args, got, tc.iso)
		}
	}
	if err := newEPPCmd().Flags().Parse([]string{"--explain=sometimes"}); err == nil {
		t.Error("--explain=sometimes: no error")
	}
}
