package upstream

import (
	"slices"
	"strings"
	"testing"
)

// TestParseLoadLoRA: vLLM's vllm:lora_requests_info — the newest series'
// adapters and max_lora; none on a page without it.
func TestParseLoadLoRA(t *testing.T) {
	page := `# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql",waiting_lora_adapters="code"} 1.8e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.6e9
`
	l, err := ParseLoad(strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	if l.LoRA == nil || !slices.Equal(l.LoRA.Running, []string{"sql"}) || !slices.Equal(l.LoRA.Waiting, []string{"code"}) || l.LoRA.MaxLoRAs != 4 {
		t.Errorf("LoRA %+v, want the newest series", l.LoRA)
	}
	l, err = ParseLoad(strings.NewReader("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"))
	if err != nil || l.LoRA != nil {
		t.Errorf("no lora metric: %+v, %v", l.LoRA, err)
	}
}
