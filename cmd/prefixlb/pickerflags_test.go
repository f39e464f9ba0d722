package main

import (
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/proxy"
)

// TestPickerFlags: --endpoint-picker and its two companions override the
// config file's endpoint_picker keys; the default fails closed.
func TestPickerFlags(t *testing.T) {
	f := &serveFlags{cfg: proxy.DefaultConfig()}
	if f.cfg.EndpointPickerFailOpen || f.cfg.EndpointPicker != "" {
		t.Errorf("default %+v: want no picker, fail closed", f.cfg.PickerConfig)
	}
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	pickerFlags(fs, &f.cfg.PickerConfig)
	if err := fs.Parse([]string{"--endpoint-picker=127.0.0.1:9002", "--endpoint-picker-fail-open", "--endpoint-picker-timeout=3s"}); err != nil {
		t.Fatal(err)
	}
	file, err := proxy.ParseConfig([]byte("endpoint_picker: 10.0.0.9:9002\nendpoint_picker_fail_open: false\nendpoint_picker_timeout: 9s\n"), proxy.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	f.overrides(fs, &file)
	want := proxy.PickerConfig{EndpointPicker: "127.0.0.1:9002", EndpointPickerFailOpen: true, EndpointPickerTimeout: 3 * time.Second}
	if file.PickerConfig != want {
		t.Errorf("after the flags: %+v, want %+v", file.PickerConfig, want)
	}
}
