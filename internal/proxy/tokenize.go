package proxy

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"

	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// serveTokenize answers POST /tokenize and /detokenize (vLLM's and SGLang's
// endpoints, at the server's root) by passing the request to one up
// replica, so that a client of the router — a load generator learning the
// model's tokenizer, a coding agent counting its context — gets the
// replicas' own answer. The replicas serve one model, so any of them
// answers for all; they are tried in turn, starting after the last one
// asked, until one answers anything but a connection failure. The body is
// bounded by max_body_bytes and the answer by maxErrorBody (1 MiB: a
// 60k-token prompt's ids are about 400 KB).
func (p *Proxy) serveTokenize(w http.ResponseWriter, r *http.Request) {
	body, err := readBody(w, r, p.cfg.MaxBodyBytes)
	if err != nil {
		writeError(w, err)
		return
	}
	p.mu.Lock()
	var up []*backend
	for _, b := range p.backendsLocked() {
		if b.Up() {
			up = append(up, b)
		}
	}
	p.mu.Unlock()
	if len(up) == 0 {
		writeError(w, fmt.Errorf("proxy: %s: %w", r.URL.Path, policy.ErrNoReplica))
		return
	}
	start := int(p.tokenizeNext.Add(1))
	var lastErr error
	for i := range up {
		b := up[(start+i)%len(up)]
		status, header, answer, err := p.postReplica(r.Context(), b, r.URL.Path, body)
		if err != nil {
			lastErr = err
			continue
		}
		if ct := header.Get("Content-Type"); ct != "" {
			w.Header().Set("Content-Type", ct)
		}
		w.Header().Set(HeaderReplica, b.Name)
		w.WriteHeader(status)
		_, _ = w.Write(answer)
		return
	}
	writeError(w, fmt.Errorf("proxy: %s: %w: %w", r.URL.Path, ErrUpstream, lastErr))
}

// postReplica posts body as JSON to b's path, bounded by the request
// timeout, and returns its answer (at most maxErrorBody bytes).
func (p *Proxy) postReplica(ctx context.Context, b *backend, path string, body []byte) (int, http.Header, []byte, error) {
	if d := p.cfg.RequestTimeout; d > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d)
		defer cancel()
	}
	u := *b.Base
	u.Path = upstream.TrimSlash(b.Base.Path) + path
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return 0, nil, nil, fmt.Errorf("post %s to %s: %w", path, b.Name, err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := p.checks.Do(req)
	if err != nil {
		return 0, nil, nil, fmt.Errorf("post %s to %s: %w", path, b.Name, err)
	}
	defer resp.Body.Close()
	answer, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody+1))
	if err != nil {
		return 0, nil, nil, fmt.Errorf("post %s to %s: %w", path, b.Name, err)
	}
	if len(answer) > maxErrorBody {
		return 0, nil, nil, fmt.Errorf("post %s to %s: an answer over %d bytes", path, b.Name, maxErrorBody)
	}
	return resp.StatusCode, resp.Header, answer, nil
}
