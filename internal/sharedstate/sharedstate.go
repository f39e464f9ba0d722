// Package sharedstate shares in-flight load between several router
// processes that front the same replicas (several `prefixlb epp` pods behind
// one gateway), so that they do not all pick the same replica at the same
// instant. Each router publishes what it has routed and not yet seen finish,
// per replica, and reads what the others publish; the router core adds the
// others' figures to its own (router.Router.SetExternalLoad).
//
// Redis holds the shared figures; Memory does the same for routers in one
// process (tests, demos). Entries carry a TTL that every write and a
// heartbeat refresh, so a router that dies takes its counts with it after
// TTL instead of leaving them behind forever.
//
// The cache view needs no sharing: every router subscribes to every
// replica's KV events and so builds the same tree.
package sharedstate

import (
	"context"
	"sync"

	"github.com/prefixlb/prefixlb/internal/router"
)

// Load is one router's (or the sum of several routers') in-flight work on
// one replica.
type Load = router.ExternalLoad

// Memory is a shared state for routers in one process. Each router gets its
// own Client. It is safe for concurrent use.
type Memory struct {
	mu      sync.Mutex                 // guards routers
	routers map[string]map[string]Load // router → replica → load
}

// NewMemory returns an empty in-process shared state.
func NewMemory() *Memory { return &Memory{routers: make(map[string]map[string]Load)} }

// Client returns the handle router id publishes through.
func (m *Memory) Client(id string) *MemoryClient { return &MemoryClient{m: m, id: id} }

// MemoryClient is one router's handle on a Memory.
type MemoryClient struct {
	m  *Memory
	id string
}

// Add adds delta to this router's load on replica.
func (c *MemoryClient) Add(_ context.Context, replica string, delta Load) error {
	c.m.mu.Lock()
	defer c.m.mu.Unlock()
	mine := c.m.routers[c.id]
	if mine == nil {
		mine = make(map[string]Load)
		c.m.routers[c.id] = mine
	}
	mine[replica] = mine[replica].Add(delta)
	return nil
}

// Others returns the sum, per replica, of every other router's load.
func (c *MemoryClient) Others(context.Context) (map[string]Load, error) {
	c.m.mu.Lock()
	defer c.m.mu.Unlock()
	out := make(map[string]Load)
	for id, reps := range c.m.routers {
		if id == c.id {
			continue
		}
		for r, l := range reps {
			out[r] = out[r].Add(l)
		}
	}
	return out, nil
}

// Run does nothing until ctx ends (a Memory entry never expires).
func (c *MemoryClient) Run(ctx context.Context) error {
	<-ctx.Done()
	return nil
}

// Close forgets this router's load, as a router that stops cleanly should.
func (c *MemoryClient) Close() error {
	c.m.mu.Lock()
	delete(c.m.routers, c.id)
	c.m.mu.Unlock()
	return nil
}
