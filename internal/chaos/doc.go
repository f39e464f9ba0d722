// Package chaos holds prefixlb's fault-injection suite and soak test (issue
// 9). It has no code of its own outside its tests: the tests build the
// prefixlb binary once, start real `prefixlb engine` and `prefixlb serve`
// processes on loopback, drive open-loop load with package loadgen, and
// inject faults while the load runs — a replica killed and restarted, a
// replica that hangs, answers 500s or garbage, a slow replica behind a
// delaying TCP proxy, the link between clients and router delayed, the
// KV-event stream cut, delayed, or gapped (messages dropped by a ZeroMQ
// relay on a connection that stays up), the router restarted.
//
// TestChaosOverload sends a burst at twice the cluster's measured capacity
// at a TTFT SLO, with two priorities and two tenants, through serve with
// and without its router-side queue (issue 18; docs/overload.md).
//
// Every request must either complete or end in a clean, attributable error;
// none may be lost. docs/reliability.md has the measured fault matrix and
// the commands:
//
//	go test ./internal/chaos/ -run Chaos -v          # the fault matrix
//	go test ./internal/chaos/ -run Soak -soak=1h -v  # the soak test
//	go test ./internal/chaos/ -run TestChaosOverload -v  # the overload burst
package chaos
