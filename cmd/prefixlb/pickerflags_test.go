package main

import (
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/proxy"
)

// TestPickerFlags: --endpoint-picker, its two companions and
// --shadow-policy override the config file's keys (shadow_log, not given as
// a flag, stays the file's); the default fails closed.
func TestPickerFlags(t *testing.T) {
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	if f.cfg.EndpointPickerFailOpen || f.cfg.EndpointPicker != "" {
		t.Errorf("default %+v: want no picker, fail closed", f.cfg.PickerConfig)
	}
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	pickerFlags(fs, &f.cfg.PickerConfig)
	if err := fs.Parse([]string{"--endpoint-picker=127.0.0.1:9002", "--endpoint-picker-fail-open", "--endpoint-picker-timeout=3s", "--shadow-policy=llmd-approx:prefix_weight=3"}); err != nil {
		t.Fatal(err)
	}
	file, err := proxy.ParseConfig([]byte("endpoint_picker: 10.0.0.9:9002\nendpoint_picker_fail_open: false\nendpoint_picker_timeout: 9s\nshadow_policy: e2\nshadow_log: /tmp/shadow.jsonl\n"), proxy.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.overrides(fs, &file)
	want := proxy.PickerConfig{EndpointPicker: "127.0.0.1:9002", EndpointPickerFailOpen: true, EndpointPickerTimeout: 3 * time.Second,
		ShadowPolicy: "llmd-approx:prefix_weight=3", ShadowLog: "/tmp/shadow.jsonl"}
	if file.PickerConfig != want {
		t.Errorf("after the flags: %+v, want %+v", file.PickerConfig, want)
	}
}
