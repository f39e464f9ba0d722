package epp

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
)

// Limits bound what the gateway's ext_proc streams can make the picker
// hold, whatever its clients send through it: streams open at once,
// request-body bytes buffered across them, a stream that stops sending
// mid-request, and what gRPC itself accepts. Every field's zero value
// means its default (DefaultLimits).
type Limits struct {
	// MaxStreams bounds the ext_proc streams open at once (one per HTTP
	// request the gateway is processing, from its headers to the end of
	// its response). A stream over it is answered 429 at once, with
	// Retry-After, and closed (prefixlb_epp_limited_total{limit="streams"}).
	// Default 1024.
	MaxStreams int
	// MaxBufferedBytes bounds the request-body bytes buffered by all
	// streams together (a body is held until it is whole, then routed
	// and released): a body whose growth would take the total over it is
	// answered 429 with Retry-After (limit="buffered_bytes"). The last
	// eighth is kept for bodies of at most smallBody bytes that arrive
	// whole (their last message), which are routed and released at once:
	// while a flood of bodies still arriving fills the rest, ordinary
	// requests route. Buffers
	// grow with what arrives, doubling up to the body limit, and count
	// by their capacity. Default 128 MiB: the Go heap grows to about twice
	// what is live before it collects, so 128 MiB of bodies held kept the
	// picker under 512 MiB RSS in TestChaosHostileEPP (256 MiB: 641 MiB).
	MaxBufferedBytes int64
	// StreamIdleTimeout bounds the wait for the next message while the
	// request is being received (from the stream's start to the routing
	// decision): a stream silent that long ends with DEADLINE_EXCEEDED
	// and frees what it held (limit="idle"). The response path is not
	// bounded: a long generation, or one queued in the engine, is
	// legitimate (the gateway's route timeout bounds it). Default 60 s.
	StreamIdleTimeout time.Duration
	// MaxRecvMsgBytes is gRPC's bound on one ext_proc message (a chunk of
	// a body, in FULL_DUPLEX_STREAMED mode): larger ones end their stream
	// with RESOURCE_EXHAUSTED before they are read. gRPC reads a message
	// as its frames arrive, not sized from its declared length (grpc-go
	// 1.85 internal/transport/transport.go Stream.read). Default 4 MiB,
	// gRPC's own default, set on purpose.
	MaxRecvMsgBytes int
	// MaxHeaderListBytes bounds one stream's gRPC metadata (Envoy's is a
	// few hundred bytes: the HTTP request's headers travel in the
	// messages). Default 64 KiB (gRPC's is 16 MiB).
	MaxHeaderListBytes int
	// KeepaliveMinTime is the shortest interval between a client's
	// keepalive pings the server tolerates; one that pings faster gets
	// GOAWAY (ENHANCE_YOUR_CALM). Default 10 s: gRPC's 5 min would cut
	// off an Envoy whose cluster pings every 30 s, and no gateway needs
	// faster. Pings are allowed with no stream open.
	KeepaliveMinTime time.Duration
	// KeepaliveTime is how long a connection may be idle before the
	// server pings it, and KeepaliveTimeout how long it then waits for
	// the answer before closing it: a gateway that vanished without a
	// FIN frees its streams. Defaults 1 min and 20 s (gRPC's: 2 h and
	// 20 s).
	KeepaliveTime, KeepaliveTimeout time.Duration
}

// smallBody is the body size up to which a body completed by the message
// being read may use the last eighth of MaxBufferedBytes.
const smallBody = 1 << 20

// DefaultLimits returns the default limits.
func DefaultLimits() Limits {
	return Limits{
		MaxStreams:         1024,
		MaxBufferedBytes:   128 << 20,
		StreamIdleTimeout:  60 * time.Second,
		MaxRecvMsgBytes:    4 << 20,
		MaxHeaderListBytes: 64 << 10,
		KeepaliveMinTime:   10 * time.Second,
		KeepaliveTime:      time.Minute,
		KeepaliveTimeout:   20 * time.Second,
	}
}

// withDefaults returns l with its zero fields set to their defaults.
func (l Limits) withDefaults() Limits {
	d := DefaultLimits()
	if l.MaxStreams == 0 {
		l.MaxStreams = d.MaxStreams
	}
	if l.MaxBufferedBytes == 0 {
		l.MaxBufferedBytes = d.MaxBufferedBytes
	}
	if l.StreamIdleTimeout == 0 {
		l.StreamIdleTimeout = d.StreamIdleTimeout
	}
	if l.MaxRecvMsgBytes == 0 {
		l.MaxRecvMsgBytes = d.MaxRecvMsgBytes
	}
	if l.MaxHeaderListBytes == 0 {
		l.MaxHeaderListBytes = d.MaxHeaderListBytes
	}
	if l.KeepaliveMinTime == 0 {
		l.KeepaliveMinTime = d.KeepaliveMinTime
	}
	if l.KeepaliveTime == 0 {
		l.KeepaliveTime = d.KeepaliveTime
	}
	if l.KeepaliveTimeout == 0 {
		l.KeepaliveTimeout = d.KeepaliveTimeout
	}
	return l
}

// Validate reports the first limit that is out of range (zero fields are
// taken as their defaults).
func (l Limits) Validate() error {
	l = l.withDefaults()
	switch {
	case l.MaxStreams < 1 || l.MaxStreams > 1<<20:
		return fmt.Errorf("epp: --max-streams must be in [1, 1048576], got %d", l.MaxStreams)
	case l.MaxBufferedBytes < 2*defaultMaxBodyBytes:
		return fmt.Errorf("epp: --max-buffered-bytes must be at least %d (twice the %d-byte body limit, so that the largest body fits beside the small bodies' reserve), got %d",
			2*defaultMaxBodyBytes, defaultMaxBodyBytes, l.MaxBufferedBytes)
	case l.StreamIdleTimeout < 0:
		return fmt.Errorf("epp: --stream-idle-timeout must be > 0, got %v", l.StreamIdleTimeout)
	case l.MaxRecvMsgBytes < 64<<10:
		return fmt.Errorf("epp: limits: max_recv_msg_bytes must be at least 64 KiB, got %d", l.MaxRecvMsgBytes)
	case l.MaxHeaderListBytes < 8<<10:
		return fmt.Errorf("epp: limits: max_header_list_bytes must be at least 8 KiB, got %d", l.MaxHeaderListBytes)
	case l.KeepaliveMinTime < 0 || l.KeepaliveTime < 0 || l.KeepaliveTimeout < 0:
		return errors.New("epp: limits: keepalive durations must be > 0")
	}
	return nil
}

// ServerOptions are the gRPC server options that apply l, for every gRPC
// server of the picker. gRPC's own per-connection stream bound is twice
// MaxStreams: up to it, a stream over MaxStreams gets the picker's 429;
// a connection that opens more at once has them refused by HTTP/2
// (REFUSED_STREAM) before they cost a goroutine.
func (l Limits) ServerOptions() []grpc.ServerOption {
	l = l.withDefaults()
	return []grpc.ServerOption{
		grpc.MaxRecvMsgSize(l.MaxRecvMsgBytes),
		grpc.MaxConcurrentStreams(uint32(2 * l.MaxStreams)),
		grpc.MaxHeaderListSize(uint32(l.MaxHeaderListBytes)),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: l.KeepaliveMinTime, PermitWithoutStream: true}),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: l.KeepaliveTime, Timeout: l.KeepaliveTimeout}),
	}
}

// Limits of prefixlb_epp_limited_total.
const (
	limitStreams  = "streams"        // over MaxStreams: 429
	limitBuffered = "buffered_bytes" // over MaxBufferedBytes: 429
	limitBody     = "body_bytes"     // over MaxBodyBytes: 413
	limitIdle     = "idle"           // silent for StreamIdleTimeout: stream ended
)

// limitMetrics count what the limits refused, and what they hold.
type limitMetrics struct {
	limited  *prometheus.CounterVec
	buffered prometheus.Gauge
}

// newLimitMetrics registers the limits' metrics on reg (or finds those
// an earlier server of the same picker registered).
func newLimitMetrics(reg prometheus.Registerer) *limitMetrics {
	m := &limitMetrics{
		limited: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "prefixlb_epp_limited_total",
			Help: "ext_proc streams a limit stopped, by limit: streams (over --max-streams: 429), buffered_bytes (over --max-buffered-bytes: 429), body_bytes (a body over 16 MiB: 413), idle (silent for --stream-idle-timeout mid-request: stream ended).",
		}, []string{"limit"}),
		buffered: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "prefixlb_epp_buffered_bytes",
			Help: "Request-body bytes the picker holds for streams whose body is not whole yet (buffer capacity; bounded by --max-buffered-bytes).",
		}),
	}
	if err := reg.Register(m.limited); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			panic(err) // a name clash on the picker's own registry: a programming error
		}
		m.limited = are.ExistingCollector.(*prometheus.CounterVec)
	}
	if err := reg.Register(m.buffered); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			panic(err)
		}
		m.buffered = are.ExistingCollector.(prometheus.Gauge)
	}
	for _, l := range []string{limitStreams, limitBuffered, limitBody, limitIdle} {
		m.limited.WithLabelValues(l)
	}
	return m
}

// byteBudget is a bound on bytes held across streams. Safe for concurrent
// use.
type byteBudget struct {
	max, open int64 // open: what bodies not completing now may take together
	used      atomic.Int64
	peak      atomic.Int64 // the most used has been (tests)
	gauge     prometheus.Gauge
}

func newByteBudget(max int64, gauge prometheus.Gauge) *byteBudget {
	return &byteBudget{max: max, open: max - max/8, gauge: gauge}
}

// take reserves n bytes for a buffer that will then hold size bytes of
// capacity, whose body the bytes being added complete (whole); false if
// that would pass the bound.
func (b *byteBudget) take(n, size int64, whole bool) bool {
	limit := b.open
	if whole && size <= smallBody {
		limit = b.max
	}
	for {
		u := b.used.Load()
		if u+n > limit {
			return false
		}
		if b.used.CompareAndSwap(u, u+n) {
			for p := b.peak.Load(); u+n > p && !b.peak.CompareAndSwap(p, u+n); p = b.peak.Load() {
			}
			b.gauge.Add(float64(n))
			return true
		}
	}
}

// give returns n bytes.
func (b *byteBudget) give(n int64) {
	if n != 0 {
		b.used.Add(-n)
		b.gauge.Sub(float64(n))
	}
}

// streamSlots counts the streams open against MaxStreams. Safe for
// concurrent use.
type streamSlots struct {
	max  int64
	open atomic.Int64
}

// acquire takes a slot; false when all are taken.
func (s *streamSlots) acquire() bool {
	if s.open.Add(1) > s.max {
		s.open.Add(-1)
		return false
	}
	return true
}

func (s *streamSlots) release() { s.open.Add(-1) }
