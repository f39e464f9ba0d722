package engine

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/replica"
)

// routes builds the HTTP API:
//
//	POST /v1/completions        OpenAI completions, streamed or not
//	POST /v1/chat/completions   OpenAI chat completions, streamed or not
//	GET  /v1/models             the one model served
//	GET  /health                200 while Run runs, else 503
//	POST /tokenize              vLLM's tokenizer endpoint
//	GET  /metrics               Prometheus text, vLLM's metric names
//	POST /reset_prefix_cache    empty the prefix cache (409 while busy)
func (e *Engine) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/completions", e.handleCompletions)
	mux.HandleFunc("POST /v1/chat/completions", e.handleChat)
	mux.HandleFunc("GET /v1/models", e.handleModels)
	mux.HandleFunc("GET /health", e.handleHealth)
	mux.HandleFunc("POST /tokenize", e.handleTokenize)
	mux.HandleFunc("GET /metrics", e.handleMetrics)
	mux.HandleFunc("POST /reset_prefix_cache", e.handleReset)
	return mux
}

// apiError is the OpenAI error object as vLLM sends it.
type apiError struct {
	Message string `json:"message"`
	Type    string `json:"type"`
	Param   any    `json:"param"`
	Code    int    `json:"code"`
}

// errorType is vLLM's error type for a status.
func errorType(status int) string {
	switch status {
	case http.StatusBadRequest:
		return "BadRequestError"
	case http.StatusNotFound:
		return "NotFoundError"
	case http.StatusConflict:
		return "ConflictError"
	case http.StatusRequestEntityTooLarge:
		return "RequestEntityTooLargeError"
	case http.StatusServiceUnavailable:
		return "ServiceUnavailableError"
	}
	return "InternalServerError"
}

// writeError answers with an OpenAI error body.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, struct {
		Error apiError `json:"error"`
	}{apiError{Message: msg, Type: errorType(status), Code: status}})
}

// statusOf chooses the HTTP status of an error.
func statusOf(err error) int {
	var mbe *http.MaxBytesError
	switch {
	case errors.As(err, &mbe):
		return http.StatusRequestEntityTooLarge
	case isBadRequest(err):
		return http.StatusBadRequest
	case errors.Is(err, errModelNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrStopped):
		return http.StatusServiceUnavailable
	case errors.Is(err, ErrBusy):
		return http.StatusConflict
	}
	return http.StatusInternalServerError
}

var errModelNotFound = errors.New("model not found")

func writeJSON(w http.ResponseWriter, status int, v any) {
	b, err := json.Marshal(v)
	if err != nil {
		http.Error(w, "engine: encode response: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(status)
	_, _ = w.Write(append(b, '\n'))
}

// readBody reads a request body of at most MaxBodyBytes.
func (e *Engine) readBody(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, e.cfg.MaxBodyBytes))
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, fmt.Errorf("request body over %d bytes: %w", mbe.Limit, err)
		}
		return nil, fmt.Errorf("read request body: %w", err)
	}
	return body, nil
}

func (e *Engine) handleCompletions(w http.ResponseWriter, r *http.Request) {
	body, err := e.readBody(w, r)
	if err == nil {
		var g genRequest
		if g, err = decodeCompletion(body); err == nil {
			tokens := g.ids
			if !g.isIDs {
				tokens = e.cfg.Tokenizer.Encode(g.text)
			}
			e.generate(w, r, &g, tokens)
			return
		}
	}
	writeError(w, statusOf(err), err.Error())
}

func (e *Engine) handleChat(w http.ResponseWriter, r *http.Request) {
	body, err := e.readBody(w, r)
	if err == nil {
		var g genRequest
		if g, err = decodeChat(body); err == nil {
			var tokens []uint32
			if tokens, err = e.chatTokens(&g); err == nil {
				e.generate(w, r, &g, tokens)
				return
			}
		}
	}
	writeError(w, statusOf(err), err.Error())
}

// chatTokens renders and tokenizes a decoded chat: with ChatEncoder when
// set, else RenderChat and Tokenizer.
func (e *Engine) chatTokens(g *genRequest) ([]uint32, error) {
	if e.cfg.ChatEncoder == nil {
		return e.cfg.Tokenizer.Encode(e.cfg.RenderChat(g.messages)), nil
	}
	ids, err := e.cfg.ChatEncoder.EncodeChat(g.tmpl.messages, g.tmpl.opts)
	if err != nil {
		return nil, badRequest("apply chat template: %v", err)
	}
	return ids, nil
}

// check applies the engine's limits to a decoded request of prompt tokens;
// it fills in the default output length.
func (e *Engine) check(g *genRequest, prompt int) error {
	if e.cfg.StrictModel && g.model != "" && g.model != e.cfg.Model && e.adapterOf(g.model) == "" {
		return fmt.Errorf("%w: the model `%s` does not exist", errModelNotFound, g.model)
	}
	if g.maxTokens == 0 {
		g.maxTokens = e.cfg.DefaultMaxTokens
	}
	where := "prompt"
	if g.chat {
		where = "messages"
	}
	if prompt == 0 {
		return badRequest("the %s is empty (0 tokens)", where)
	}
	if total := prompt + g.maxTokens; total > e.cfg.MaxModelLen {
		return badRequest("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the %s, %d in the completion). Please reduce the length of the %s or completion.",
			e.cfg.MaxModelLen, total, prompt, where, g.maxTokens, where)
	}
	// Replica.Submit's rule: the longest sequence ever held, plus a block
	// of headroom for recomputation, must fit the KV cache.
	B := e.cfg.Replica.BlockSize
	if need := (prompt+g.maxTokens-1+B-1)/B + 1; need > e.totalBlocks {
		return badRequest("the request needs %d KV blocks of %d tokens (%d prompt + %d output tokens); the replica holds %d",
			need, B, prompt, g.maxTokens, e.totalBlocks)
	}
	return nil
}

// checkRole applies the engine's P/D role to a request (pd.go): a prefill
// engine serves only prefill legs, one output token with
// kv_transfer_params.do_remote_decode, as the replica model's prefill role
// takes only one-token requests. It reports whether the request is a
// decode leg whose KV the engine pulls (replica.Request.RemoteKV).
func (e *Engine) checkRole(g *genRequest) (pull bool, err error) {
	if e.cfg.Replica.Role == replica.RolePrefill {
		switch {
		case g.kv.remotePrefill:
			return false, badRequest("this engine has role prefill: it does not take decode legs (kv_transfer_params.do_remote_prefill true); send them to a decode engine")
		case !g.kv.remoteDecode:
			return false, badRequest("this engine has role prefill: it serves only prefill legs, with kv_transfer_params {\"do_remote_decode\": true} and max_tokens 1")
		case g.maxTokens != 1:
			return false, badRequest("this engine has role prefill: a prefill leg has max_tokens 1, got %d", g.maxTokens)
		}
	}
	if !g.kv.remotePrefill {
		return false, nil
	}
	if !g.kv.usablePull() || e.kvBytesPerToken <= 0 {
		// vLLM computes the prompt itself when the params name no blocks
		// to pull; an engine whose profile has no KV size cannot price
		// the pull and does the same.
		e.met.pullRecomputed()
		return false, nil
	}
	return true, nil
}

// generate submits a request and answers it, streamed or not.
func (e *Engine) generate(w http.ResponseWriter, r *http.Request, g *genRequest, tokens []uint32) {
	if err := e.check(g, len(tokens)); err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	pull, err := e.checkRole(g)
	if err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	now := e.cfg.Clock.Now()
	id := e.ids.Add(1)
	adapter := e.adapterOf(g.model)
	var adapterBytes int64
	if adapter != "" {
		adapterBytes = e.cfg.LoRAAdapterBytes
	}
	s := newStream(replica.Request{
		ID:           id,
		Keys:         blocks.SeededKeys(nil, blocks.ChainSeed(adapter, g.salt), tokens, e.cfg.Replica.BlockSize),
		PromptTokens: len(tokens),
		OutputTokens: g.maxTokens,
		RemoteKV:     pull,
		Adapter:      adapter,
		AdapterBytes: adapterBytes,
		Salt:         g.salt,
	}, now)
	s.tokens = tokens
	if err := e.enqueue(op{kind: opSubmit, st: s}); err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	finished := false
	defer func() {
		if !finished {
			// The client went away or the write failed: free the replica.
			_ = e.enqueue(op{kind: opCancel, id: id})
		}
	}()
	prefix := "cmpl-"
	if g.chat {
		prefix = "chatcmpl-"
	}
	rs := &response{
		id:      prefix + strconv.FormatUint(id, 10),
		created: now.Unix(),
		model:   e.cfg.Model,
		g:       g,
		prompt:  len(tokens),
		hash:    promptHash(tokens),
	}
	if g.kv.remoteDecode && !g.stream {
		// NixlConnectorScheduler.request_finished: the params the decode
		// leg needs. A streamed prefill leg has no place for them, as in
		// vLLM, whose streamed chunks carry none.
		local, _ := r.Context().Value(http.LocalAddrContextKey).(net.Addr)
		rs.kv = e.prefillParams(s.req.Keys, rs.id, local)
	}
	if g.stream {
		err = rs.stream(r.Context(), w, s)
	} else {
		err = rs.whole(r.Context(), w, s)
	}
	finished = err == nil
	if err != nil && r.Context().Err() == nil && !errors.Is(err, ErrStopped) {
		e.cfg.Logger.Debug("engine: request failed", "id", rs.id, "err", err)
	}
}

// response writes one request's answer.
type response struct {
	id      string
	created int64
	model   string
	g       *genRequest
	prompt  int    // prompt tokens
	hash    uint64 // promptHash of the prompt
	kv      *kvTransferOut
}

// usage is the OpenAI usage object with vLLM's cached_tokens.
type usage struct {
	PromptTokens        int           `json:"prompt_tokens"`
	TotalTokens         int           `json:"total_tokens"`
	CompletionTokens    int           `json:"completion_tokens"`
	PromptTokensDetails promptDetails `json:"prompt_tokens_details"`
}

// promptDetails is usage.prompt_tokens_details.
type promptDetails struct {
	CachedTokens int `json:"cached_tokens"`
}

func (rs *response) usage(p progress) *usage {
	return &usage{
		PromptTokens:        rs.prompt,
		CompletionTokens:    p.generated,
		TotalTokens:         rs.prompt + p.generated,
		PromptTokensDetails: promptDetails{CachedTokens: p.hit},
	}
}

// chunk is a streamed chunk or a whole response, of either endpoint.
type chunk struct {
	ID      string   `json:"id"`
	Object  string   `json:"object"`
	Created int64    `json:"created"`
	Model   string   `json:"model"`
	Choices []choice `json:"choices"`
	Usage   *usage   `json:"usage,omitempty"`
	// KVTransferParams answers a prefill leg (pd.go); absent otherwise.
	KVTransferParams *kvTransferOut `json:"kv_transfer_params,omitempty"`
}

// choice is one choice: Text for completions, Delta (streamed) or Message
// (whole) for chat.
type choice struct {
	Index        int      `json:"index"`
	Text         *string  `json:"text,omitempty"`
	Delta        *message `json:"delta,omitempty"`
	Message      *message `json:"message,omitempty"`
	Logprobs     any      `json:"logprobs"`
	FinishReason *string  `json:"finish_reason"`
	StopReason   any      `json:"stop_reason"`
}

// message is a chat message or delta.
type message struct {
	Role    string  `json:"role,omitempty"`
	Content *string `json:"content,omitempty"`
}

// finishLength is the finish reason of every request: the model always
// produces max_tokens tokens.
var finishLength = "length"

// await calls emit for each output token k (from 1) as the request produces
// it, in order, and returns when it has finished, failed, or ctx is done.
func await(ctx context.Context, s *stream, emit func(k int, p progress) error) (progress, error) {
	sent := 0
	for {
		p := s.progress()
		for sent < p.generated {
			sent++
			if err := emit(sent, p); err != nil {
				return p, err
			}
		}
		switch {
		case p.err != nil:
			return p, p.err
		case p.finished:
			return p, nil
		}
		select {
		case <-s.notify:
		case <-ctx.Done():
			return p, ctx.Err()
		}
	}
}

// whole answers with one JSON response once the request has finished.
func (rs *response) whole(ctx context.Context, w http.ResponseWriter, s *stream) error {
	var text strings.Builder
	p, err := await(ctx, s, func(k int, _ progress) error {
		text.WriteString(outputToken(rs.hash, k))
		return nil
	})
	if err != nil {
		if ctx.Err() == nil {
			writeError(w, statusOf(err), err.Error())
		}
		return err
	}
	out := text.String()
	c := chunk{ID: rs.id, Object: "text_completion", Created: rs.created, Model: rs.model, Usage: rs.usage(p), KVTransferParams: rs.kv}
	ch := choice{FinishReason: &finishLength}
	if rs.g.chat {
		c.Object = "chat.completion"
		ch.Message = &message{Role: "assistant", Content: &out}
	} else {
		ch.Text = &out
	}
	c.Choices = []choice{ch}
	writeJSON(w, http.StatusOK, c)
	return nil
}

// stream answers with Server-Sent Events as vLLM does: one chunk per token
// (chat first sends the assistant role), the last with finish_reason, then a
// usage chunk when stream_options.include_usage, then [DONE]. Every chunk is
// flushed.
func (rs *response) stream(ctx context.Context, w http.ResponseWriter, s *stream) error {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	if err := rc.Flush(); err != nil {
		return fmt.Errorf("engine: stream %s: %w", rs.id, err)
	}
	var buf bytes.Buffer
	send := func(v any) error {
		buf.Reset()
		buf.WriteString("data: ")
		if err := json.NewEncoder(&buf).Encode(v); err != nil { // adds "\n"
			return fmt.Errorf("engine: stream %s: encode: %w", rs.id, err)
		}
		buf.WriteByte('\n')
		if _, err := w.Write(buf.Bytes()); err != nil {
			return fmt.Errorf("engine: stream %s: %w", rs.id, err)
		}
		if err := rc.Flush(); err != nil {
			return fmt.Errorf("engine: stream %s: %w", rs.id, err)
		}
		return nil
	}
	object := "text_completion"
	if rs.g.chat {
		object = "chat.completion.chunk"
	}
	p, err := await(ctx, s, func(k int, p progress) error {
		c := chunk{ID: rs.id, Object: object, Created: rs.created, Model: rs.model}
		if rs.g.chat && k == 1 {
			empty := ""
			c.Choices = []choice{{Delta: &message{Role: "assistant", Content: &empty}}}
			if err := send(c); err != nil {
				return err
			}
		}
		text := outputToken(rs.hash, k)
		ch := choice{}
		if rs.g.chat {
			ch.Delta = &message{Content: &text}
		} else {
			ch.Text = &text
		}
		if k == rs.g.maxTokens {
			ch.FinishReason = &finishLength
		}
		c.Choices = []choice{ch}
		if rs.g.continuousUsage {
			p.generated = k
			c.Usage = rs.usage(p)
		}
		return send(c)
	})
	if err != nil {
		if p.err != nil && errors.Is(err, p.err) {
			// vLLM reports an error inside a stream as a data event.
			_ = send(struct {
				Error apiError `json:"error"`
			}{apiError{Message: err.Error(), Type: errorType(statusOf(err)), Code: statusOf(err)}})
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
			_ = rc.Flush()
		}
		return err
	}
	if rs.g.includeUsage {
		c := chunk{ID: rs.id, Object: object, Created: rs.created, Model: rs.model, Choices: []choice{}, Usage: rs.usage(p)}
		if err := send(c); err != nil {
			return err
		}
	}
	if _, err := io.WriteString(w, "data: [DONE]\n\n"); err != nil {
		return fmt.Errorf("engine: stream %s: %w", rs.id, err)
	}
	if err := rc.Flush(); err != nil {
		return fmt.Errorf("engine: stream %s: %w", rs.id, err)
	}
	return nil
}

// modelCard is one entry of /v1/models, in vLLM's shape.
type modelCard struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	Root        string `json:"root"`
	Parent      any    `json:"parent"`
	MaxModelLen int    `json:"max_model_len"`
}

// handleModels lists the base model, then each LoRA module with the base
// model as its parent (as vLLM lists an adapter; its root is the adapter's
// path there, its name here).
func (e *Engine) handleModels(w http.ResponseWriter, _ *http.Request) {
	data := []modelCard{{ID: e.cfg.Model, Object: "model", Created: e.created.Unix(), OwnedBy: "prefixlb",
		Root: e.cfg.Model, MaxModelLen: e.cfg.MaxModelLen}}
	for _, m := range e.cfg.LoRAModules {
		if m != e.cfg.Model {
			data = append(data, modelCard{ID: m, Object: "model", Created: e.created.Unix(), OwnedBy: "prefixlb",
				Root: m, Parent: e.cfg.Model, MaxModelLen: e.cfg.MaxModelLen})
		}
	}
	writeJSON(w, http.StatusOK, struct {
		Object string      `json:"object"`
		Data   []modelCard `json:"data"`
	}{"list", data})
}

// adapterOf is the LoRA adapter a request for model runs with ("": the
// base model).
func (e *Engine) adapterOf(model string) string {
	for _, m := range e.cfg.LoRAModules {
		if m == model && m != e.cfg.Model {
			return m
		}
	}
	return ""
}

func (e *Engine) handleHealth(w http.ResponseWriter, _ *http.Request) {
	if !e.running() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

func (e *Engine) handleTokenize(w http.ResponseWriter, r *http.Request) {
	body, err := e.readBody(w, r)
	if err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	g, err := decodeTokenize(body)
	if err != nil {
		writeError(w, statusOf(err), err.Error())
		return
	}
	var tokens []uint32
	if g.chat {
		if tokens, err = e.chatTokens(&g); err != nil {
			writeError(w, statusOf(err), err.Error())
			return
		}
	} else {
		tokens = e.cfg.Tokenizer.Encode(g.text)
	}
	if tokens == nil {
		tokens = []uint32{}
	}
	writeJSON(w, http.StatusOK, struct {
		Count       int      `json:"count"`
		MaxModelLen int      `json:"max_model_len"`
		Tokens      []uint32 `json:"tokens"`
		TokenStrs   any      `json:"token_strs"`
	}{len(tokens), e.cfg.MaxModelLen, tokens, nil})
}

func (e *Engine) handleReset(w http.ResponseWriter, r *http.Request) {
	if err := e.resetPrefixCache(r.Context()); err != nil {
		writeError(w, statusOf(err), fmt.Sprintf("reset prefix cache: %v", err))
		return
	}
	w.WriteHeader(http.StatusOK)
}
