package engine

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/replica"
)

// TestTiming checks, in synctest's fake time, that a request takes exactly
// the iterations the profile prices, divided by the time scale.
func TestTiming(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cfg := testConfig(t)
		cfg.TimeScale = 4
		e, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()

		const P = 100
		body := `{"prompt":"` + words("t", P) + `","max_tokens":3}`
		begin := time.Now()
		rec := httptest.NewRecorder()
		e.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/v1/completions", strings.NewReader(body)))
		elapsed := time.Since(begin)
		if rec.Code != http.StatusOK {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}

		prof := cfg.Replica.Profile
		scaled := func(b costmodel.Batch) time.Duration {
			return time.Duration(float64(prof.Iteration(b)) / cfg.TimeScale)
		}
		prefill := scaled(costmodel.Batch{Prefill: []costmodel.Chunk{{New: P, Seq: P}}})
		want := prefill +
			scaled(costmodel.Batch{DecodeSeqs: 1, DecodeContext: P + 1}) +
			scaled(costmodel.Batch{DecodeSeqs: 1, DecodeContext: P + 2})
		if elapsed != want {
			t.Errorf("request took %v, want %v", elapsed, want)
		}
		ttft, _, e2e, _ := e.met.snapshot()
		if got := time.Duration(ttft.sum * 1e9); absDur(got-prefill) > time.Microsecond {
			t.Errorf("TTFT %v, want %v", got, prefill)
		}
		if got := time.Duration(e2e.sum * 1e9); absDur(got-want) > time.Microsecond {
			t.Errorf("e2e %v, want %v", got, want)
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
}

func absDur(d time.Duration) time.Duration {
	if d < 0 {
		return -d
	}
	return d
}

// blockedWriter is a client that stops reading: its first Write blocks until
// release is closed.
type blockedWriter struct {
	header  http.Header
	once    sync.Once
	blocked chan struct{} // closed when a Write blocks
	release chan struct{}
}

func (w *blockedWriter) Header() http.Header { return w.header }
func (w *blockedWriter) WriteHeader(int)     {}
func (w *blockedWriter) Flush()              {}
func (w *blockedWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { close(w.blocked) })
	<-w.release
	return len(b), nil
}

// TestSlowClient: a client that does not read never stalls the engine.
func TestSlowClient(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e, err := New(testConfig(t))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- e.Run(ctx) }()

		slow := &blockedWriter{header: http.Header{}, blocked: make(chan struct{}), release: make(chan struct{})}
		sctx, scancel := context.WithCancel(ctx)
		slowDone := make(chan struct{})
		go func() {
			defer close(slowDone)
			req := httptest.NewRequest("POST", "/v1/completions",
				strings.NewReader(`{"prompt":"a b c","max_tokens":5000,"stream":true}`)).WithContext(sctx)
			e.Handler().ServeHTTP(slow, req)
		}()
		<-slow.blocked

		// Another request runs to completion meanwhile, and so does the
		// slow one on the replica.
		rec := httptest.NewRecorder()
		e.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/v1/completions", strings.NewReader(`{"prompt":"x y","max_tokens":50}`)))
		if rec.Code != http.StatusOK {
			t.Fatalf("status %d: %s", rec.Code, rec.Body)
		}
		if err := e.waitStats(ctx, func(s replica.Stats) bool { return s.Finished == 2 }); err != nil {
			t.Fatal(err)
		}
		scancel()
		close(slow.release)
		<-slowDone
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	})
}
