package proxy

import (
	"testing"
	"time"
)

// BenchmarkProxyRequest sends one streamed 4k-token request after another
// (the overhead benchmarks' fake replicas and bodies), straight to a
// replica and through the proxy: -benchmem's B/op and allocs/op of
// "proxied" less those of "direct" are what the proxy allocates per
// request, and ns/op is the sequential latency on an otherwise idle
// process.
//
//	go test -run '^$' -bench ProxyRequest -benchmem ./internal/proxy/
func BenchmarkProxyRequest(b *testing.B) {
	for _, pol := range []string{"round-robin", "e2"} {
		rig := newOHRig(b, pol)
		rig.warm(b)
		for _, target := range []string{"direct", "proxied"} {
			if target == "direct" && pol != "round-robin" {
				continue
			}
			name := target
			if target == "proxied" {
				name += "/policy=" + pol
			}
			b.Run(name, func(b *testing.B) {
				url := rig.proxied
				b.ReportAllocs()
				i := 0
				for b.Loop() {
					if target == "direct" {
						url = rig.direct[i%len(rig.direct)]
					}
					i++
					if _, err := rig.one(url, time.Now()); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
