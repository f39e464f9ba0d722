package main

import (
	"fmt"
	"testing"

	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/sim/sweep"
)

// TestAdviseFlagsMatchSim: advise simulates the cluster sim simulates, so
// every flag it shares with sim has sim's default, but for those it sets
// on purpose (its policy set, a smaller default request count, no default
// workload, --json's meaning). This also holds sweep.DefaultConfig to
// sim's flag defaults for the fields advise exposes.
func TestAdviseFlagsMatchSim(t *testing.T) {
	sim := newSimCmd().Flags()
	differ := map[string]bool{"policies": true, "requests": true, "workload": true, "json": true}
	shared := 0
	adviseCmd().Flags().VisitAll(func(f *pflag.Flag) {
		s := sim.Lookup(f.Name)
		if s == nil || differ[f.Name] {
			return
		}
		shared++
		if s.DefValue != f.DefValue || s.Value.Type() != f.Value.Type() {
			t.Errorf("--%s: advise's default %s %q, sim's %s %q", f.Name, f.Value.Type(), f.DefValue, s.Value.Type(), s.DefValue)
		}
	})
	if shared < 40 {
		t.Errorf("only %d flags shared with sim: the workload flags are missing", shared)
	}
	d := sweep.DefaultConfig()
	for name, v := range map[string]string{
		"replicas": fmt.Sprint(d.Replicas), "profile": d.Profile, "local": d.Local,
		"kv-events": fmt.Sprint(d.KVEvents), "event-lag": d.EventLag.String(), "router-seed": fmt.Sprint(d.RouterSeed),
		"engine": d.Engine, "slots": fmt.Sprint(d.Slots), "kv-link-gbps": fmt.Sprint(d.KVLinkGbps),
		"kv-link-latency": d.KVLinkLatency.String(), "slo-tolerance": fmt.Sprint(d.SLOTolerance),
	} {
		if f := sim.Lookup(name); f == nil || f.DefValue != v {
			t.Errorf("sweep.DefaultConfig's --%s is %q, sim's flag %v", name, v, f)
		}
	}
}
