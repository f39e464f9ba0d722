package main

import (
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
