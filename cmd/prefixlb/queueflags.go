package main

import (
	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/admission"
)

// queueFlags registers the router-side queue's thresholds and bounds on q
// (serve and epp share them; each registers its own --queue), and returns,
// per flag name, how to copy that flag's field from one configuration to
// another: serve lays the flags given over its --config file's.
func queueFlags(fs *pflag.FlagSet, q *admission.Config) map[string]func(dst, src *admission.Config) {
	fs.IntVar(&q.MaxQueue, "queue-max", q.MaxQueue, "requests the router-side queue holds at most")
	fs.DurationVar(&q.Timeout, "queue-timeout", q.Timeout, "longest wait in the router-side queue")
	fs.IntVar(&q.MaxWaiting, "queue-max-waiting", q.MaxWaiting, "a replica with this many requests waiting in its engine is saturated (0: not judged by it)")
	fs.Float64Var(&q.MaxKVUsage, "queue-max-kv-usage", q.MaxKVUsage, "a replica at this KV-cache usage is saturated (0: not judged by it)")
	fs.DurationVar(&q.MaxQueuedPrefill, "queue-max-queued-prefill", q.MaxQueuedPrefill, "a replica with this much prefill queued (e2's estimate) is saturated (0: not judged by it)")
	fs.DurationVar(&q.MaxPredictedWait, "queue-max-predicted-wait", q.MaxPredictedWait, "a replica where a new request would wait this long for its first token (queued prefill stretched by decode interference, plus the engine queue's wait) is saturated (0: not judged by it)")
	fs.DurationVar(&q.LIFOAfter, "queue-lifo-after", q.LIFOAfter, "adaptive LIFO within a tenant once its oldest request has waited this long (0: FIFO)")
	fs.Float64Var(&q.SLOFraction, "queue-slo-fraction", q.SLOFraction, "lower --queue-max-predicted-wait to this fraction of the tightest TTFT SLO of recent requests (x-prefixlb-ttft-slo or a class's), so that a request routed to an unsaturated replica keeps slack to its deadline (0: off)")
	fs.DurationVar(&q.EngageAfter, "queue-engage-after", q.EngageAfter, "requests wait in the router only once every replica has been saturated this long (a CoDel-like interval; 0: at once)")
	fs.IntVar(&q.MaxInFlight, "queue-max-inflight", q.MaxInFlight, "a replica with this many requests in flight is saturated (0: not judged by it)")
	fs.DurationVar(&q.MinTTFTSLO, "queue-min-ttft-slo", q.MinTTFTSLO, "floor of every TTFT SLO: a trusted x-prefixlb-ttft-slo is raised to it, and no SLO lowers the predicted-wait threshold below --queue-slo-fraction of it (0: no floor)")
	return map[string]func(dst, src *admission.Config){
		"queue-max":                func(d, s *admission.Config) { d.MaxQueue = s.MaxQueue },
		"queue-timeout":            func(d, s *admission.Config) { d.Timeout = s.Timeout },
		"queue-max-waiting":        func(d, s *admission.Config) { d.MaxWaiting = s.MaxWaiting },
		"queue-max-kv-usage":       func(d, s *admission.Config) { d.MaxKVUsage = s.MaxKVUsage },
		"queue-max-queued-prefill": func(d, s *admission.Config) { d.MaxQueuedPrefill = s.MaxQueuedPrefill },
		"queue-max-predicted-wait": func(d, s *admission.Config) { d.MaxPredictedWait = s.MaxPredictedWait },
		"queue-lifo-after":         func(d, s *admission.Config) { d.LIFOAfter = s.LIFOAfter },
		"queue-slo-fraction":       func(d, s *admission.Config) { d.SLOFraction = s.SLOFraction },
		"queue-engage-after":       func(d, s *admission.Config) { d.EngageAfter = s.EngageAfter },
		"queue-max-inflight":       func(d, s *admission.Config) { d.MaxInFlight = s.MaxInFlight },
		"queue-min-ttft-slo":       func(d, s *admission.Config) { d.MinTTFTSLO = s.MinTTFTSLO },
	}
}
