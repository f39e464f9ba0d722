package kvevents

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the Prometheus collectors subscribers report to. One Metrics
// serves any number of subscribers (labelled by replica). A nil *Metrics is
// valid and records nothing.
type Metrics struct {
	applied  *prometheus.CounterVec // replica, type
	dropped  *prometheus.CounterVec // replica, reason
	replays  *prometheus.CounterVec // replica
	gaps     *prometheus.CounterVec // replica
	lost     *prometheus.CounterVec // replica
	restarts *prometheus.CounterVec // replica
	redials  *prometheus.CounterVec // replica
	lag      *prometheus.GaugeVec   // replica
	lastSeq  *prometheus.GaugeVec   // replica
	blocks   *prometheus.GaugeVec   // replica, medium
	state    *prometheus.GaugeVec   // replica, state
	refused  *prometheus.CounterVec // replica, reason

	// The Listener's own (its replicas' streams report above).
	listenDropped *prometheus.CounterVec // reason
	listenRefused *prometheus.CounterVec // reason
}

// NewMetrics creates the collectors; Register exposes them.
func NewMetrics() *Metrics {
	const ns, sub = "prefixlb", "kvevents"
	cv := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: ns, Subsystem: sub, Name: name, Help: help}, labels)
	}
	gv := func(name, help string, labels ...string) *prometheus.GaugeVec {
		return prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: ns, Subsystem: sub, Name: name, Help: help}, labels)
	}
	return &Metrics{
		applied:  cv("events_applied_total", "KV events applied to the index, by event type.", "replica", "type"),
		dropped:  cv("events_dropped_total", "KV events or messages not applied, by reason.", "replica", "reason"),
		replays:  cv("replays_total", "Replay requests sent to the replica's ROUTER socket.", "replica"),
		gaps:     cv("gaps_total", "Sequence gaps seen on the live stream.", "replica"),
		lost:     cv("lost_batches_total", "Batches neither received live nor replayed.", "replica"),
		restarts: cv("publisher_restarts_total", "Publisher restarts detected (seq went back).", "replica"),
		redials:  cv("redials_total", "SUB sockets closed and dialled again after an error or EOF.", "replica"),
		lag:      gv("lag_seconds", "Now minus the timestamp of the last applied batch.", "replica"),
		lastSeq:  gv("last_seq", "Sequence number of the last applied batch.", "replica"),
		blocks:   gv("index_blocks", "Engine blocks the index holds for the replica, by medium.", "replica", "medium"),
		state: gv("state", "1 for the subscriber's connection state (stopped, dialing, handshaking, connected, backoff), 0 for the others.",
			"replica", "state"),
		refused: cv("refused_total", "Connections to the replica's publisher closed by the ZMTP guard, by reason (handshake_timeout, frame_too_large, ...).",
			"replica", "reason"),
		listenDropped: cv("listener_dropped_total", "Messages the KV-event listener (engines that dial the router) applied to no replica, by reason (unknown_topic, bad_frame, panic).",
			"reason"),
		listenRefused: cv("listener_refused_total", "Engine connections to the KV-event listener closed by the ZMTP guard, by reason (handshake_timeout, frame_too_large, ...).",
			"reason"),
	}
}

// Register registers every collector with reg.
func (m *Metrics) Register(reg prometheus.Registerer) error {
	var errs []error
	for _, c := range []prometheus.Collector{m.applied, m.dropped, m.replays, m.gaps, m.lost,
		m.restarts, m.redials, m.lag, m.lastSeq, m.blocks, m.state, m.refused, m.listenDropped, m.listenRefused} {
		errs = append(errs, reg.Register(c))
	}
	return errors.Join(errs...)
}

// Forget deletes every series of replica (it left the pool).
func (m *Metrics) Forget(replica string) {
	if m == nil {
		return
	}
	l := prometheus.Labels{"replica": replica}
	for _, v := range []*prometheus.MetricVec{m.applied.MetricVec, m.dropped.MetricVec, m.replays.MetricVec,
		m.gaps.MetricVec, m.lost.MetricVec, m.restarts.MetricVec, m.redials.MetricVec,
		m.lag.MetricVec, m.lastSeq.MetricVec, m.blocks.MetricVec, m.state.MetricVec, m.refused.MetricVec} {
		v.DeletePartialMatch(l)
	}
}
