package proxy

import (
	"fmt"
	"strings"
	"time"
)

// FrontDoor is the part of Config that bounds what a hostile client or a
// failing replica can take from the proxy: request-body memory, a client that
// stops reading, the /v1 paths forwarded, and a replica that fails requests
// while its health check passes (docs/security.md). Config embeds
// it; DefaultFrontDoor gives the defaults.
type FrontDoor struct {
	// MaxInflightBodyBytes bounds the request-body bytes held in memory at
	// once, over every request in flight (YAML max_inflight_body_bytes; 0:
	// no bound; else ≥ MaxBodyBytes, so that any accepted body can fit). A
	// body is counted by the buffer that holds it, reserved as the buffer
	// grows with the bytes that arrive (never from the declared
	// Content-Length alone), and released when its request ends: retries
	// send it again, so it is held until then. A request whose body cannot
	// reserve gets 429 with Retry-After.
	MaxInflightBodyBytes int64
	// ClientWriteTimeout bounds how long one write to a client may make no
	// progress (YAML client_write_timeout; 0: none): the write deadline of
	// the client's connection is pushed this far ahead before each write (of
	// at most clientWriteChunk bytes) and flush, so a client that stops
	// reading (a zero TCP window) fails the write; its replica request is
	// then cancelled, the router told it failed, and its max_concurrent
	// slot freed (outcome client_timeout).
	ClientWriteTimeout time.Duration
	// AllowedPaths are the /v1 requests the proxy serves, each "METHOD
	// /v1/path" (exact), "METHOD /v1/prefix/*" (every path below), METHOD
	// "*" for any method, or the single entry "*" for every /v1 request
	// (YAML allowed_paths, flag --allow-path; DefaultAllowedPaths). Other
	// /v1 requests get 404 before their body is read: a replica's
	// administrative endpoints (vLLM's /v1/load_lora_adapter) are not
	// reachable through the router.
	AllowedPaths []string
	// BreakerFailures of a replica's last BreakerWindow requests failing
	// (5xx, connection errors, timeouts, garbage; not 4xx nor what the
	// client ended) eject it from routing even while its health check
	// passes, as Envoy's outlier detection does (YAML breaker_failures,
	// breaker_window; BreakerFailures 0: off). It stays out for
	// BreakerEjectionTime times the number of its recent ejections (capped
	// at breakerMaxEjectionFactor times), and comes back at the first
	// health check after that if its last ReadmitAfter checks passed. At
	// most half of the replicas whose health checks pass are out by the
	// breaker at once: never the last one.
	BreakerFailures, BreakerWindow int
	BreakerEjectionTime            time.Duration
}

// Defaults of FrontDoor.
const (
	// DefaultMaxInflightBodyBytes is 128 MiB: 8 bodies of the largest size
	// (max_body_bytes, 16 MiB); 5,000 4k-token prompts (~25 KB); 2,048
	// bodies declared and never sent (64.5 KiB each, trustedBodyBytes). The
	// Go heap grows to about twice what is live before it collects: with
	// 256 MiB, 40 clients sending 15 MiB bodies took serve to 579 MiB RSS
	// (TestChaosHostile, big-bodies), over the 512 MiB the whole process
	// should stay under (issue 26).
	DefaultMaxInflightBodyBytes = 128 << 20
	// DefaultClientWriteTimeout is how long a client may take no byte:
	// longer than any TCP retransmission backoff on a live path, short
	// enough that a stalled client frees its slot and replica within a
	// minute.
	DefaultClientWriteTimeout = 30 * time.Second
	// DefaultBreakerFailures, DefaultBreakerWindow and
	// DefaultBreakerEjectionTime: 5 failures in the last 10 requests, 30 s
	// out (Envoy's consecutive_5xx is 5 and its base_ejection_time 30 s).
	DefaultBreakerFailures     = 5
	DefaultBreakerWindow       = 10
	DefaultBreakerEjectionTime = 30 * time.Second
	// maxBreakerWindow bounds breaker_window (one bit of memory a request).
	maxBreakerWindow = 1024
)

// DefaultAllowedPaths are the /v1 requests served by default: generation
// (completions, chat), the model list and vLLM's stateless pooling
// endpoints (embeddings, score, rerank). Left out: vLLM's runtime LoRA
// management (/v1/load_lora_adapter, /v1/unload_lora_adapter, mounted with
// VLLM_ALLOW_RUNTIME_LORA_UPDATING), the stateful Responses API
// (/v1/responses, whose stored answers live on one replica), audio uploads
// and anything else a replica may mount under /v1 (vllm-project/vllm
// vllm/entrypoints/openai/api_server.py build_app, commit 0001948bc769).
// vLLM's other administrative routes (/reset_prefix_cache, /sleep,
// /collective_rpc, ...) are not under /v1 and never forwarded.
func DefaultAllowedPaths() []string {
	return []string{
		"POST /v1/completions",
		"POST /v1/chat/completions",
		"GET /v1/models",
		"POST /v1/embeddings",
		"POST /v1/score",
		"POST /v1/rerank",
	}
}

// DefaultFrontDoor returns FrontDoor's defaults.
func DefaultFrontDoor() FrontDoor {
	return FrontDoor{
		MaxInflightBodyBytes: DefaultMaxInflightBodyBytes,
		ClientWriteTimeout:   DefaultClientWriteTimeout,
		AllowedPaths:         DefaultAllowedPaths(),
		BreakerFailures:      DefaultBreakerFailures,
		BreakerWindow:        DefaultBreakerWindow,
		BreakerEjectionTime:  DefaultBreakerEjectionTime,
	}
}

// validate reports the first invalid field, by its YAML name; maxBody is
// Config.MaxBodyBytes.
func (f *FrontDoor) validate(maxBody int64) error {
	switch {
	case f.MaxInflightBodyBytes < 0:
		return fmt.Errorf("max_inflight_body_bytes: must be ≥ 0 (0: no bound), got %d", f.MaxInflightBodyBytes)
	case f.MaxInflightBodyBytes > 0 && f.MaxInflightBodyBytes < maxBody:
		return fmt.Errorf("max_inflight_body_bytes: %d is under max_body_bytes (%d): a body of the largest size could never be read; raise it or set 0 (no bound)",
			f.MaxInflightBodyBytes, maxBody)
	case f.ClientWriteTimeout < 0:
		return fmt.Errorf("client_write_timeout: must be ≥ 0 (0: none), got %v", f.ClientWriteTimeout)
	case f.BreakerFailures < 0:
		return fmt.Errorf("breaker_failures: must be ≥ 0 (0: no circuit breaker), got %d", f.BreakerFailures)
	case f.BreakerFailures > 0 && (f.BreakerWindow < f.BreakerFailures || f.BreakerWindow > maxBreakerWindow):
		return fmt.Errorf("breaker_window: must be in [breaker_failures, %d] = [%d, %d], got %d (breaker_failures: 0 turns the breaker off)",
			maxBreakerWindow, f.BreakerFailures, maxBreakerWindow, f.BreakerWindow)
	case f.BreakerFailures > 0 && f.BreakerEjectionTime <= 0:
		return fmt.Errorf("breaker_ejection_time: must be > 0 with the breaker on, got %v (breaker_failures: 0 turns it off)", f.BreakerEjectionTime)
	}
	if len(f.AllowedPaths) == 0 {
		return fmt.Errorf("allowed_paths: empty: no /v1 request would be served (\"*\" serves every one)")
	}
	for i, s := range f.AllowedPaths {
		if strings.TrimSpace(s) == allowAll {
			continue
		}
		if _, err := parseAllowRule(s); err != nil {
			return fmt.Errorf("allowed_paths[%d]: %w", i, err)
		}
	}
	return nil
}

// fileFrontDoor is the YAML form of FrontDoor, embedded in fileConfig:
// every field optional.
type fileFrontDoor struct {
	MaxInflightBodyBytes *int64    `json:"max_inflight_body_bytes"`
	ClientWriteTimeout   *duration `json:"client_write_timeout"`
	AllowedPaths         *[]string `json:"allowed_paths"`
	BreakerFailures      *int      `json:"breaker_failures"`
	BreakerWindow        *int      `json:"breaker_window"`
	BreakerEjectionTime  *duration `json:"breaker_ejection_time"`
}

// apply sets the fields given over fd.
func (f *fileFrontDoor) apply(fd *FrontDoor) {
	if f.MaxInflightBodyBytes != nil {
		fd.MaxInflightBodyBytes = *f.MaxInflightBodyBytes
	}
	if f.ClientWriteTimeout != nil {
		fd.ClientWriteTimeout = time.Duration(*f.ClientWriteTimeout)
	}
	if f.AllowedPaths != nil {
		fd.AllowedPaths = append([]string(nil), *f.AllowedPaths...)
	}
	if f.BreakerFailures != nil {
		fd.BreakerFailures = *f.BreakerFailures
	}
	if f.BreakerWindow != nil {
		fd.BreakerWindow = *f.BreakerWindow
	}
	if f.BreakerEjectionTime != nil {
		fd.BreakerEjectionTime = time.Duration(*f.BreakerEjectionTime)
	}
}
