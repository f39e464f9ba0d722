package decisiontest

import (
	"fmt"
	"net/http"
	"sync"
	"time"
)

// HoldHeader names the request header that a Gate holds requests by.
const HoldHeader = "X-Replay-Id"

// Gate holds the requests to a replica that carry HoldHeader until they are
// released, so that a replay keeps a fixed set of requests in flight: when
// request k has arrived at a replica, the front door has decided it and
// committed the decision, and the requests it saw in flight are exactly
// those not yet released. Use one Gate for every replica of a cluster.
type Gate struct {
	mu      sync.Mutex
	arrived map[string]chan struct{}
	release map[string]chan struct{}
	abort   chan struct{}
	once    sync.Once
}

// NewGate returns a Gate with nothing held.
func NewGate() *Gate {
	return &Gate{arrived: map[string]chan struct{}{}, release: map[string]chan struct{}{}, abort: make(chan struct{})}
}

func (g *Gate) chans(id string) (arrived, release chan struct{}) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.arrived[id] == nil {
		g.arrived[id], g.release[id] = make(chan struct{}), make(chan struct{})
	}
	return g.arrived[id], g.release[id]
}

// Wrap returns h behind the gate.
func (g *Gate) Wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id := r.Header.Get(HoldHeader); id != "" && r.Method == http.MethodPost {
			arrived, release := g.chans(id)
			close(arrived)
			select {
			case <-release:
			case <-g.abort:
			case <-r.Context().Done():
				return
			}
		}
		h.ServeHTTP(w, r)
	})
}

// Arrived waits until request id has reached a replica, or done is closed
// (the request ended without reaching one), or a minute passes.
func (g *Gate) Arrived(id string, done <-chan struct{}) error {
	arrived, _ := g.chans(id)
	select {
	case <-arrived:
		return nil
	case <-done:
		return fmt.Errorf("request %s ended before it reached a replica", id)
	case <-time.After(time.Minute):
		return fmt.Errorf("request %s did not reach a replica in a minute", id)
	}
}

// Release lets request id go on.
func (g *Gate) Release(id string) {
	_, release := g.chans(id)
	close(release)
}

// Abort releases every request, held or to come.
func (g *Gate) Abort() { g.once.Do(func() { close(g.abort) }) }
