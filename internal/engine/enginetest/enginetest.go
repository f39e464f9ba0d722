// Package enginetest runs prefixlb's modelled replicas (internal/engine)
// on loopback for the tests of the front doors, and builds the request
// bodies those tests send. It is used by tests only.
package enginetest

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/engine"
)

// Start runs a modelled replica with ec (its Logger discarded when nil)
// on loopback until the test ends, and returns its base URL
// ("http://127.0.0.1:PORT"). The engine's Run must end cleanly.
func Start(t testing.TB, ec engine.Config) string {
	t.Helper()
	if ec.Logger == nil {
		ec.Logger = slog.New(slog.DiscardHandler)
	}
	e, err := engine.New(ec)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	srv := httptest.NewServer(e.Handler())
	t.Cleanup(func() {
		srv.Close()
		cancel()
		if err := <-done; err != nil {
			t.Errorf("engine at %s: Run: %v", srv.URL, err)
		}
	})
	return srv.URL
}

// UniquePrompt is a completions body of tokens token ids unique to request
// k (its first token is its own, so no two requests share a block).
func UniquePrompt(k, tokens, maxTokens int, stream bool) string {
	var b strings.Builder
	b.WriteString(`{"model":"prefixlb-sim","prompt":[`)
	for i := range tokens {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.Itoa(200000 + 4096*k + i))
	}
	fmt.Fprintf(&b, `],"max_tokens":%d,"stream":%v`, maxTokens, stream)
	if stream {
		b.WriteString(`,"stream_options":{"include_usage":true}`)
	}
	b.WriteString("}")
	return b.String()
}

// WallSpec is the profile spec of base as a router sees an engine running
// base at time scale scale: the engine divides every modelled time by
// scale, and the router measures wall time.
func WallSpec(base string, scale float64) string {
	if scale == 1 {
		return base
	}
	return base + ":time_scale=" + strconv.FormatFloat(1/scale, 'g', -1, 64)
}

// Profile resolves a profile spec (costmodel.Resolve) or fails t.
func Profile(t testing.TB, spec string) costmodel.Profile {
	t.Helper()
	p, err := costmodel.Resolve(spec)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// Bursts sends bursts bursts of size requests at once, numbered on from
// k+1 (send(k) sends request k), each burst after the last one's answers;
// the first error fails t. It returns the last number used.
func Bursts(t testing.TB, k, bursts, size int, send func(k int) error) int {
	t.Helper()
	for range bursts {
		var wg sync.WaitGroup
		errs := make(chan error, size)
		for range size {
			k++
			kk := k
			wg.Go(func() {
				if err := send(kk); err != nil {
					errs <- fmt.Errorf("request %d: %w", kk, err)
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Fatal(err)
		}
	}
	return k
}
