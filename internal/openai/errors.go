package openai

import (
	"encoding/json"
	"errors"
	"net/http"
)

// ErrorType is the OpenAI error "type" for an HTTP status.
func ErrorType(status int) string {
	switch status {
	case http.StatusBadRequest, http.StatusRequestEntityTooLarge, http.StatusMethodNotAllowed:
		return "invalid_request_error"
	case http.StatusRequestTimeout:
		return "timeout_error"
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusServiceUnavailable:
		return "service_unavailable_error"
	case http.StatusGatewayTimeout:
		return "timeout_error"
	}
	return "upstream_error"
}

// apiError is an OpenAI-style error object.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// ErrorBody renders the OpenAI error body for status and err:
// {"error": {"message", "type", "param", "code"}}, with param "model" for a
// body that lacked one (as vLLM answers).
func ErrorBody(status int, err error) []byte {
	var e struct {
		Error apiError `json:"error"`
	}
	e.Error = apiError{Message: err.Error(), Type: ErrorType(status), Code: status}
	if errors.Is(err, errNoModel) {
		p := "model"
		e.Error.Param = &p
	}
	b, _ := json.Marshal(e)
	return b
}

// ErrorEvent renders the event that ends a stream which failed after its
// first bytes reached the client (as 502), followed by "[DONE]" as vLLM
// does.
func ErrorEvent(err error) []byte {
	body := ErrorBody(http.StatusBadGateway, err)
	out := make([]byte, 0, len(body)+32)
	out = append(out, "data: "...)
	out = append(out, body...)
	out = append(out, "\n\ndata: [DONE]\n\n"...)
	return out
}
