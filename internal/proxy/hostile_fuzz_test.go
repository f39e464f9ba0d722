package proxy

import (
	"bufio"
	"bytes"
	"context"
	"github.com/prefixlb/prefixlb/internal/cluster"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"testing"

	"github.com/prefixlb/prefixlb/internal/upstream"
)

// FuzzParseConfig feeds the YAML config reader arbitrary documents: it must
// not panic; a document it rejects leaves the base untouched; one it accepts
// is idempotent (applying it again over its own result changes nothing, since
// every field it names replaces the base's), and Validate does not panic on
// the result.
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		"",
		"null",
		"listen: 127.0.0.1:9000\npolicy: e2-preble:mixing=false\nblock_tokens: 32\n",
		"backends:\n  - name: a\n    url: http://10.0.0.1:8000\n    kv_events: tcp://10.0.0.1:5557\n  - url: http://10.0.0.2:8000\n",
		"connect_timeout: 1s\nidle_timeout: 1m30s\nrequest_timeout: 0s\nmax_body_bytes: 1024\nmax_retries: 0\n",
		"max_prompt_tokens: 4096\nmax_header_bytes: 8192\nmax_concurrent: 2\nbody_read_timeout: 5s\nclient_idle_timeout: 10s\n",
		"connect_timeout: 5\n",
		"unknown_field: 1\n",
		"seed: -1\n",
		"a: &a [x, x, x]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n",
		"backends: {name: a}\n",
		"- just\n- a list\n",
		"admin_token: \"s3cret\"\ntokenizer: none\n",
		"max_body_bytes: 1e400\n",
		"backend_kind: llamacpp\nbackends:\n  - url: http://10.0.0.1:8080\n    kind: vllm\n  - url: http://10.0.0.2:8080\n    kind: bogus\n",
	} {
		f.Add([]byte(s))
	}
	base := DefaultConfig()
	base.Backends = []Backend{{Name: "base", URL: "http://127.0.0.1:1"}}
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig(data, base)
		if err != nil {
			if !reflect.DeepEqual(c, base) {
				t.Fatalf("rejected document changed the base: %+v", c)
			}
			if !strings.HasPrefix(err.Error(), "proxy: parse config: ") {
				t.Fatalf("error %q does not name the operation", err)
			}
			return
		}
		again, err := ParseConfig(data, c)
		if err != nil {
			t.Fatalf("accepted once, rejected over its own result: %v", err)
		}
		if !reflect.DeepEqual(again, c) {
			t.Fatalf("not idempotent:\n%+v\n%+v", c, again)
		}
		_ = c.Validate()
	})
}

// FuzzOutRequest parses arbitrary bytes as a client's HTTP request (request
// line, headers, body) and builds the request the proxy sends to a replica:
// whatever the request line's URI, its Host, or headers such as
// x-gateway-destination-endpoint say, the outgoing request goes to the
// configured backend's scheme and host, under its base path, with no
// hop-by-hop header left, and it serialises to a request that reads back the
// same way.
func FuzzOutRequest(f *testing.F) {
	for _, s := range []string{
		"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Length: 2\r\n\r\n{}",
		"GET http://evil.example/v1/models HTTP/1.1\r\nHost: evil.example\r\n\r\n",
		"GET /v1/models HTTP/1.1\r\nHost: evil.example:80\r\nx-gateway-destination-endpoint: 10.9.9.9:80\r\nx-prefixlb-replica: evil\r\n\r\n",
		"GET /v1/..%2F..%2Fadmin?x=1 HTTP/1.1\r\nHost: r\r\n\r\n",
		"GET //evil.example/v1/x HTTP/1.1\r\nHost: r\r\n\r\n",
		"POST /v1/x HTTP/1.1\r\nHost: r\r\nConnection: close, X-Keep\r\nX-Keep: 1\r\nUpgrade: h2c\r\nTe: trailers\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
		"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n",
		"OPTIONS * HTTP/1.1\r\nHost: r\r\n\r\n",
		"GET /v1/models HTTP/1.0\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n",
	} {
		f.Add([]byte(s), true)
		f.Add([]byte(s), false)
	}
	f.Fuzz(func(t *testing.T, raw []byte, withBase bool) {
		in, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(raw)))
		if err != nil {
			return
		}
		in.RemoteAddr = "192.0.2.7:4242"
		bu := &url.URL{Scheme: "http", Host: "127.0.0.1:9"}
		if withBase {
			bu.Path = "/base"
		}
		b := newBackend(&cluster.Member{Replica: cluster.Replica{Name: "r0"}, Base: bu}, nil)
		var body bytes.Buffer
		_, _ = body.ReadFrom(in.Body)
		x := &exchange{r: in, body: body.Bytes()}
		out, err := x.outRequest(context.Background(), b)
		if err != nil {
			return
		}
		// The URL as it was built before outRequest made it a struct:
		// formatted, then parsed again.
		ref := *bu
		ref.Path = strings.TrimSuffix(bu.Path, "/") + in.URL.Path
		ref.RawPath = ""
		ref.RawQuery = in.URL.RawQuery
		if old, err := http.NewRequest(in.Method, ref.String(), nil); err == nil {
			if old.URL.RequestURI() != out.URL.RequestURI() || old.Host != out.Host || old.URL.String() != out.URL.String() {
				t.Fatalf("request %q: URL %q (Host %q), built from its string %q (Host %q)", raw, out.URL, out.Host, old.URL, old.Host)
			}
		}
		if out.URL.Scheme != "http" || out.URL.Host != bu.Host || out.Host != bu.Host {
			t.Fatalf("request %q goes to %s (Host %q), not the backend %s", raw, out.URL, out.Host, bu.Host)
		}
		if !strings.HasPrefix(out.URL.Path, bu.Path) {
			t.Fatalf("path %q is not under the backend's base %q", out.URL.Path, bu.Path)
		}
		for _, h := range hopHeaders {
			if _, ok := out.Header[http.CanonicalHeaderKey(h)]; ok {
				t.Fatalf("hop-by-hop header %s forwarded", h)
			}
		}
		var wire bytes.Buffer
		if err := out.Write(&wire); err != nil {
			return // the transport refuses it too: nothing is sent
		}
		back, err := http.ReadRequest(bufio.NewReader(&wire))
		if err != nil {
			return
		}
		if back.Host != bu.Host {
			t.Fatalf("serialised request %q names host %q", wire.Bytes(), back.Host)
		}
		if back.URL.Host != "" && back.URL.Host != bu.Host {
			t.Fatalf("serialised request %q names host %q in its URI", wire.Bytes(), back.URL.Host)
		}
	})
}

// FuzzParseLoad feeds the scrape of a replica's /metrics (Prometheus text
// from the replica) arbitrary bytes: it must not panic, and what it returns
// is either unknown (-1) or a sane load: non-negative counts, KV usage in
// [0,1].
func FuzzParseLoad(f *testing.F) {
	for _, s := range []string{
		"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"m\"} 2\nvllm:num_requests_waiting{model_name=\"m\"} 1\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n",
		"sglang:num_running_reqs 3\nsglang:num_queue_reqs 4\nsglang:token_usage 0.5\n",
		"vllm:num_requests_running 1e300\nvllm:num_requests_waiting 9.3e18\nvllm:kv_cache_usage_perc 7\n",
		"vllm:num_requests_running NaN\nvllm:num_requests_waiting -Inf\n",
		"# TYPE vllm:num_requests_running counter\nvllm:num_requests_running 5\n",
		"vllm:num_requests_running{a=\"\\\"} 1\n",
		// llama.cpp's page (internal/upstream/upstreamtest/llamacpp/metrics.txt, abridged).
		"# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.0375366\n# TYPE llamacpp:kv_cache_tokens gauge\nllamacpp:kv_cache_tokens 615\n# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 0\n",
		"llamacpp:kv_cache_tokens 1e300\nllamacpp:requests_deferred -3\nvllm:num_requests_running 1\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		l, err := upstream.ParseLoad(bytes.NewReader(data))
		if err != nil {
			if l != upstream.UnknownLoad {
				t.Fatalf("failed parse returned %+v", l)
			}
			return
		}
		if l.Running < -1 || l.Waiting < -1 || l.KVTokens < -1 || (l.KVUsage != -1 && (l.KVUsage < 0 || l.KVUsage > 1)) {
			t.Fatalf("load %+v from %q", l, data)
		}
	})
}
