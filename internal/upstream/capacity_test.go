package upstream

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// vllmPage is a vLLM /metrics page's cache and load series as vLLM
// 0.10 writes them (two data-parallel engines; the second's blocks are
// the same size).
const vllmPage = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",cpu_offload_gb="0",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.9",is_attention_free="False",num_cpu_blocks="None",num_gpu_blocks="27000",num_gpu_blocks_override="None",prefix_caching_hash_algo="builtin",sliding_window="None",swap_space="4",swap_space_bytes="4294967296"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="1",num_gpu_blocks="26000"} 1.0
`

func TestParseLoadCapacity(t *testing.T) {
	for _, tc := range []struct {
		name, page string
		want       Capacity
		usage      float64
	}{
		{"vllm two engines", vllmPage, Capacity{Tokens: 16 * (27000 + 26000), Source: SourceVLLMMetrics}, 0.5},
		{"vllm old usage name", "# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc 0.3\n" +
			"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"100\"} 1\n",
			Capacity{Tokens: 3200, Source: SourceVLLMMetrics}, 0.3},
		{"vllm blocks not known yet", "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"None\"} 1\n",
			Capacity{}, -1},
		{"vllm same engine twice counts once", "# TYPE vllm:cache_config_info gauge\n" +
			"vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10\",x=\"a\"} 1\n" +
			"vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"10\",x=\"b\"} 1\n",
			Capacity{Tokens: 160, Source: SourceVLLMMetrics}, -1},
		{"sglang", "# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name=\"m\"} 0.4\n" +
			"# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens{model_name=\"m\"} 471258\n",
			Capacity{Tokens: 471258, Source: SourceSGLangMetrics}, 0.4},
		{"llama.cpp says none", "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.1\n", Capacity{}, 0.1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := ParseLoad(strings.NewReader(tc.page))
			if err != nil {
				t.Fatal(err)
			}
			if l.Capacity != tc.want {
				t.Errorf("capacity %+v, want %+v", l.Capacity, tc.want)
			}
			if l.KVUsage != tc.usage {
				t.Errorf("kv usage %v, want %v", l.KVUsage, tc.usage)
			}
		})
	}
}

// sglangServerInfo is the part of SGLang's /get_server_info the capacity
// reads, among some of its other fields.
const sglangServerInfo = `{"model_path":"qwen/qwen2.5-0.5b-instruct","page_size":1,"dp_size":1,"tp_size":1,
"max_total_num_tokens":20480,"max_req_input_len":20474,"internal_states":[{"last_gen_throughput":0.0}],"version":"0.5.2"}`

func TestParseSGLangServerInfo(t *testing.T) {
	for _, tc := range []struct {
		name, body string
		want       int
		err        error
	}{
		{"one rank", sglangServerInfo, 20480, nil},
		{"pages", `{"max_total_num_tokens":1000,"page_size":64}`, 960, nil},
		{"data parallel", `{"max_total_num_tokens":1000,"page_size":1,"dp_size":4}`, 4000, nil},
		{"missing", `{"page_size":1}`, 0, ErrNoCapacity},
		{"negative", `{"max_total_num_tokens":-5}`, 0, ErrNoCapacity},
		{"not an object", `[1,2]`, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseSGLangServerInfo(strings.NewReader(tc.body))
			if got != tc.want || (tc.err != nil && !errors.Is(err, tc.err)) || (tc.want > 0) != (err == nil) {
				t.Errorf("got %d, %v; want %d, %v", got, err, tc.want, tc.err)
			}
		})
	}
}

func TestParseLlamaProps(t *testing.T) {
	// What llama-server c392e50 answered with -c 4096 -np 2 (trimmed).
	props := `{"default_generation_settings":{"id":0,"id_task":-1,"n_ctx":2048,"speculative":false,"is_processing":false,
"params":{"n_predict":-1}},"total_slots":2,"model_path":"/tmp/tiny.gguf","build_info":"b0-unknown"}`
	tokens, slotCtx, slots, err := ParseLlamaProps(strings.NewReader(props))
	if err != nil || tokens != 4096 || slotCtx != 2048 || slots != 2 {
		t.Errorf("got %d tokens, %d per slot, %d slots, %v; want 4096, 2048, 2", tokens, slotCtx, slots, err)
	}
	if _, _, _, err := ParseLlamaProps(strings.NewReader(`{"default_generation_settings":{"n_ctx":2048}}`)); !errors.Is(err, ErrNoCapacity) {
		t.Errorf("no total_slots: %v, want ErrNoCapacity", err)
	}
	if n, err := ParseLlamaSlots(strings.NewReader(`[{"id":0,"n_ctx":1024},{"id":1,"n_ctx":1024},{"id":2,"n_ctx":1024}]`)); n != 3072 || err != nil {
		t.Errorf("slots: %d, %v; want 3072", n, err)
	}
}

// TestFetchCapacity: SGLang's /get_server_info (then /server_info), and
// llama.cpp's /props (then /slots), over HTTP; a replica that does not
// answer wraps ErrNoAnswer.
func TestFetchCapacity(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /sg-new/get_server_info", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(sglangServerInfo)) })
	mux.HandleFunc("GET /sg-old/server_info", func(w http.ResponseWriter, r *http.Request) { w.Write([]byte(`{"max_total_num_tokens":777}`)) })
	mux.HandleFunc("GET /ll/props", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"default_generation_settings":{"n_ctx":512},"total_slots":4}`))
	})
	mux.HandleFunc("GET /ll-old/props", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`{"default_generation_settings":{"n_ctx":512}}`))
	})
	mux.HandleFunc("GET /ll-old/slots", func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(`[{"n_ctx":512},{"n_ctx":512}]`))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	for _, tc := range []struct {
		path string
		kind Kind
		want Capacity
	}{
		{"/sg-new", SGLang, Capacity{20480, SourceSGLangServerInfo}},
		{"/sg-old", SGLang, Capacity{777, SourceSGLangServerInfo}},
		{"/ll", LlamaCpp, Capacity{2048, SourceLlamaCppProps}},
		{"/ll-old", LlamaCpp, Capacity{1024, SourceLlamaCppSlots}},
		{"/sg-new", VLLM, Capacity{}},
	} {
		got, err := FetchCapacity(context.Background(), srv.Client(), srv.URL+tc.path, tc.kind)
		if got != tc.want || err != nil {
			t.Errorf("%s %s: %+v, %v; want %+v", tc.kind, tc.path, got, err, tc.want)
		}
	}
	if _, err := FetchCapacity(context.Background(), srv.Client(), srv.URL+"/none", SGLang); err == nil || errors.Is(err, ErrNoAnswer) {
		t.Errorf("404s: %v, want an error that is not ErrNoAnswer", err)
	}
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL
	dead.Close()
	if _, err := FetchCapacity(context.Background(), nil, url, LlamaCpp); !errors.Is(err, ErrNoAnswer) {
		t.Errorf("closed server: %v, want ErrNoAnswer", err)
	}
	// Detection of a llama.cpp replica carries its capacity, /props read once.
	d, err := Detect(context.Background(), srv.Client(), srv.URL+"/ll", "", Auto)
	if err != nil || d.Kind != LlamaCpp || d.Slots != 4 || d.Capacity != (Capacity{2048, SourceLlamaCppProps}) {
		t.Errorf("detect: %+v, %v", d, err)
	}
}

// The parsers never panic, never return a negative or absurd capacity,
// and give a capacity exactly when they return no error.
func FuzzParseLoadCapacity(f *testing.F) {
	f.Add([]byte(vllmPage))
	f.Add([]byte("# TYPE sglang:max_total_num_tokens gauge\nsglang:max_total_num_tokens 1e300\n"))
	f.Add([]byte("vllm:cache_config_info{block_size=\"99999999999999\",num_gpu_blocks=\"99999999999\"} 1\n"))
	f.Fuzz(func(t *testing.T, page []byte) {
		l, err := ParseLoad(bytes.NewReader(page))
		if err != nil {
			return
		}
		if c := l.Capacity; c.Tokens < 0 || c.Tokens > maxCapacityTokens || (c.Tokens > 0) != (c.Source != "") {
			t.Fatalf("capacity %+v", c)
		}
	})
}

func FuzzParseSGLangServerInfo(f *testing.F) {
	f.Add([]byte(sglangServerInfo))
	f.Add([]byte(`{"max_total_num_tokens":1e308,"page_size":1e-300,"dp_size":1e308}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		n, err := ParseSGLangServerInfo(bytes.NewReader(body))
		if n < 0 || n > maxCapacityTokens || (err == nil) != (n > 0) {
			t.Fatalf("%d, %v", n, err)
		}
	})
}

func FuzzParseLlamaProps(f *testing.F) {
	f.Add([]byte(`{"default_generation_settings":{"n_ctx":2048},"total_slots":2}`))
	f.Add([]byte(`[{"n_ctx":1e308},{"n_ctx":1e308}]`))
	f.Fuzz(func(t *testing.T, body []byte) {
		n, slotCtx, slots, err := ParseLlamaProps(bytes.NewReader(body))
		if n < 0 || n > maxCapacityTokens || slots < 0 || slots > maxCacheSlots || slotCtx < 0 || (err == nil) != (n > 0) {
			t.Fatalf("props: %d %d %d, %v", n, slotCtx, slots, err)
		}
		m, err := ParseLlamaSlots(bytes.NewReader(body))
		if m < 0 || m > maxCapacityTokens || (err == nil) != (m > 0) {
			t.Fatalf("slots: %d, %v", m, err)
		}
	})
}
