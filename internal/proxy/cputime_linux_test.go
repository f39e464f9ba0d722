package proxy

import (
	"syscall"
	"time"
	"unsafe"
)

// clockThreadCPUTime is Linux's CLOCK_THREAD_CPUTIME_ID.
const clockThreadCPUTime = 3

// threadCPU returns the CPU time the calling OS thread has used, for
// benchmarks that must be read on a busy machine: wall time there counts
// the time the thread waited for a core. The caller locks its goroutine to
// its thread (runtime.LockOSThread) between two readings. The clock counts
// to the nanosecond, the running slice included (getrusage's
// RUSAGE_THREAD lags by up to a scheduler tick).
func threadCPU() time.Duration {
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		return 0
	}
	return time.Duration(ts.Nano())
}
