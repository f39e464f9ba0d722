package proxy

import (
	"errors"
	"net"
	"net/http"
	"os"
	"time"
)

// clientWriteChunk bounds the bytes one write to the client carries under
// one deadline: a large write (a non-streamed answer's head) to a slow
// client fails only when the client took no clientWriteChunk bytes in
// ClientWriteTimeout (about 2 KiB/s at the defaults), not when the whole
// write outlasts it.
const clientWriteChunk = 64 << 10

// clientWriter is the ResponseWriter of an inference request when
// FrontDoor.ClientWriteTimeout is set: before each write (of at most
// clientWriteChunk bytes) and flush it pushes the connection's write
// deadline d ahead, through http.ResponseController, so a client that
// stops reading (a zero TCP window) fails the write within d instead of
// holding its goroutine, max_concurrent slot and replica request forever.
// net/http then cancels the request's context, which ends the replica
// request. It keeps the first write error. Not safe for concurrent use: one
// handler goroutine writes.
type clientWriter struct {
	http.ResponseWriter
	rc *http.ResponseController // of the ResponseWriter
	d  time.Duration
	// armed is when the deadline was last pushed (zero: never).
	armed time.Time
	// err is the first write or flush error.
	err error
}

var _ http.ResponseWriter = (*clientWriter)(nil)

// newClientWriter wraps w with write deadlines d ahead.
func newClientWriter(w http.ResponseWriter, d time.Duration) *clientWriter {
	return &clientWriter{ResponseWriter: w, rc: http.NewResponseController(w), d: d}
}

// arm pushes the write deadline d ahead. Pushing it updates a runtime
// timer; within d/16 of the last push it is still at least 15/16 of d
// ahead, and is left as it is (force pushes it anyway).
func (cw *clientWriter) arm(force bool) {
	now := time.Now()
	if !force && !cw.armed.IsZero() && now.Sub(cw.armed) < cw.d/16 {
		return
	}
	// A writer without deadlines (http.ErrNotSupported: a test recorder)
	// is written without one.
	if cw.rc.SetWriteDeadline(now.Add(cw.d)) == nil {
		cw.armed = now
	}
}

// Write writes b in pieces of at most clientWriteChunk bytes, each under a
// deadline pushed d ahead.
func (cw *clientWriter) Write(b []byte) (int, error) {
	if cw.err != nil {
		return 0, cw.err
	}
	n := 0
	for len(b) > 0 {
		piece := b[:min(len(b), clientWriteChunk)]
		cw.arm(false)
		m, err := cw.ResponseWriter.Write(piece)
		n += m
		if err != nil {
			cw.err = err
			return n, err
		}
		b = b[len(piece):]
	}
	return n, nil
}

// FlushError flushes under a deadline pushed d ahead; it is what
// http.ResponseController.Flush calls.
func (cw *clientWriter) FlushError() error {
	if cw.err != nil {
		return cw.err
	}
	cw.arm(false)
	err := cw.rc.Flush()
	if err != nil && !errors.Is(err, http.ErrNotSupported) {
		cw.err = err
	}
	return err
}

// Flush is FlushError for http.Flusher.
func (cw *clientWriter) Flush() { _ = cw.FlushError() }

// Unwrap is the ResponseWriter under cw, for http.ResponseController.
func (cw *clientWriter) Unwrap() http.ResponseWriter { return cw.ResponseWriter }

// finish pushes the deadline d ahead a last time when the handler ends:
// net/http writes what is still buffered, and the end of a chunked body,
// after the handler returns, and that write is bounded too. The deadline
// stays on the connection; the next request on it starts without one
// (clearWriteDeadline, and Serve's idle hook).
func (cw *clientWriter) finish() {
	if cw.err == nil {
		cw.arm(true)
	}
}

// timedOut reports whether a write failed on its deadline: the client
// stopped reading.
func (cw *clientWriter) timedOut() bool {
	if cw.err == nil {
		return false
	}
	if errors.Is(cw.err, os.ErrDeadlineExceeded) {
		return true
	}
	var ne net.Error
	return errors.As(cw.err, &ne) && ne.Timeout()
}

// clearWriteDeadline wraps h so that each request starts with no write
// deadline on its connection: a clientWriter leaves one behind (finish), and
// a keep-alive connection's next request may be one whose writes are not
// bounded (GET /metrics, a profile). net/http resets the write deadline per
// request only with http.Server.WriteTimeout, which the proxy leaves unset
// (it would bound streams).
func clearWriteDeadline(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).SetWriteDeadline(time.Time{})
		h.ServeHTTP(w, r)
	})
}
