//go:build !linux

package proxy

import "time"

// threadCPU is unknown outside Linux: benchmarks report 0.
func threadCPU() time.Duration { return 0 }
