// Package upstream is what prefixlb knows of the inference engines behind
// its replicas, vLLM, SGLang and llama.cpp's llama-server: which engine a
// replica runs (Detect, from its metric names, /props, /v1/models and
// Server header), and its load as its Prometheus page reports it
// (ParseLoad, FetchLoad). serve and epp share it.
package upstream

import "errors"

// ErrNoAnswer wraps the error of a check (detection, a tokenizer probe)
// that got no HTTP answer at all: worth trying again later, unlike an
// answer that said no.
var ErrNoAnswer = errors.New("no answer")
