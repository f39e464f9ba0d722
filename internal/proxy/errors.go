package proxy

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/prefixlb/prefixlb/internal/cluster"
	"github.com/prefixlb/prefixlb/internal/openai"

	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// Errors the proxy's operations return; the HTTP edge (writeError) maps
// them to a status.
var (
	// ErrBodyTooLarge is returned for a request body over Config.MaxBodyBytes.
	ErrBodyTooLarge = errors.New("request body too large")
	// ErrBodyTimeout is returned for a request body not read within
	// Config.BodyReadTimeout.
	ErrBodyTimeout = errors.New("request body read timeout")
	// ErrPromptTooLong is returned for a prompt over Config.MaxPromptTokens.
	ErrPromptTooLong = cluster.ErrPromptTooLong
	// ErrOverloaded is returned for a request over Config.MaxConcurrent.
	ErrOverloaded = errors.New("too many requests in flight")
	// ErrBodyMemory is returned for a request whose body would take the
	// request-body bytes held over FrontDoor.MaxInflightBodyBytes.
	ErrBodyMemory = errors.New("request bodies in memory at their bound")
	// ErrUnauthorized is returned for an admin or debug request without the
	// configured bearer token.
	ErrUnauthorized = errors.New("missing or wrong bearer token")
	// ErrUpstream is wrapped by every failure of a replica to answer.
	ErrUpstream = errors.New("replica failed")
	// errGarbage marks a replica answer that is not what the API promises.
	errGarbage = errors.New("replica answered garbage")
	// errTruncated marks a stream that ended before "data: [DONE]".
	errTruncated = errors.New("stream ended before [DONE]")
	// errIdle marks an upstream that sent nothing for Config.IdleTimeout.
	errIdle = errors.New("replica idle timeout")
)

// codeClientTimeout is the prefixlb_requests_total outcome of a request
// whose client stopped reading (FrontDoor.ClientWriteTimeout).
const codeClientTimeout = "client_timeout"

// Reasons an attempt failed, as metric labels.
const (
	reasonDial    = "dial"
	reasonConn    = "connection"
	reasonTimeout = "timeout"
	reasonStatus  = "status"
	reasonGarbage = "garbage"
)

// attemptError is a failed attempt to forward a request to one replica.
type attemptError struct {
	replica string
	reason  string
	status  int // the replica's status, for reasonStatus
	err     error
}

func (e *attemptError) Error() string {
	if e.reason == reasonStatus {
		return fmt.Sprintf("proxy: forward to %s: %v: status %d", e.replica, ErrUpstream, e.status)
	}
	return fmt.Sprintf("proxy: forward to %s: %v: %s: %v", e.replica, ErrUpstream, e.reason, e.err)
}

func (e *attemptError) Unwrap() []error { return []error{ErrUpstream, e.err} }

// statusOf chooses the HTTP status for err: the one place errors become
// statuses.
func statusOf(err error) int {
	var ae *attemptError
	switch {
	case errors.Is(err, openai.ErrBadRequest), errors.Is(err, router.ErrEmptyPrompt), errors.Is(err, router.ErrBadRequest),
		errors.Is(err, ErrPromptTooLong):
		return http.StatusBadRequest
	case errors.Is(err, ErrBodyTimeout):
		return http.StatusRequestTimeout
	case errors.Is(err, ErrOverloaded), errors.Is(err, ErrBodyMemory):
		return http.StatusTooManyRequests
	case errors.Is(err, ErrBodyTooLarge):
		return http.StatusRequestEntityTooLarge
	case errors.Is(err, ErrUnauthorized):
		return http.StatusUnauthorized
	case errors.Is(err, policy.ErrNoReplica):
		return http.StatusServiceUnavailable
	case errors.As(err, &ae) && (ae.reason == reasonTimeout):
		return http.StatusGatewayTimeout
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	case errors.Is(err, ErrUpstream):
		return http.StatusBadGateway
	}
	return http.StatusInternalServerError
}

// writeError answers err as an OpenAI-style JSON error.
func writeError(w http.ResponseWriter, err error) int {
	status := statusOf(err)
	writeErrorStatus(w, status, err)
	return status
}

// writeErrorStatus answers err with the given status.
func writeErrorStatus(w http.ResponseWriter, status int, err error) {
	h := w.Header()
	h.Set("Content-Type", "application/json")
	h.Del("Content-Length")
	if status == http.StatusUnauthorized {
		h.Set("WWW-Authenticate", `Bearer realm="prefixlb"`)
	}
	w.WriteHeader(status)
	_, _ = w.Write(openai.ErrorBody(status, err))
}
