package report

import (
	"bytes"
	"strings"
	"testing"
)

func TestErrorClass(t *testing.T) {
	tests := []struct{ msg, want string }{
		{"http 400: the request needs 1258 KV blocks of 16 tokens (20090 prompt + 20 output tokens); the replica holds 1250",
			"http 400: the request needs N KV blocks of N tokens (N prompt + N output tokens); the replica holds N"},
		{"http 503 Service Unavailable", "http 503 Service Unavailable"},
		{"http 429: retry after 1.5s", "http 429: retry after Ns"},
		{"http 400: 1,250 blocks", "http 400: N blocks"},
		{`Post "http://127.0.0.1:8000/v1/completions": dial tcp 127.0.0.1:8000: connect: connection refused`,
			`Post "http://N:N/vN/completions": dial tcp N:N: connect: connection refused`},
		{"stream ended before [DONE] after 12 content chunks", "stream ended before [DONE] after N content chunks"},
		{"http 4000 odd", "http N odd"},
		{"", ""},
	}
	for _, tt := range tests {
		if got := ErrorClass(tt.msg); got != tt.want {
			t.Errorf("ErrorClass(%q) = %q, want %q", tt.msg, got, tt.want)
		}
	}
	long := "http 500: " + string(make([]byte, 400))
	if got := ErrorClass(long); len(got) > maxClassLen {
		t.Errorf("ErrorClass of a %d-byte message is %d bytes, want ≤ %d", len(long), len(got), maxClassLen)
	}
}

func TestErrorClasses(t *testing.T) {
	recs := []RequestRecord{
		{Error: "http 400: needs 1258 blocks"},
		{},
		{Error: "http 400: needs 1300 blocks"},
		{Error: "http 503: overloaded"},
		{Error: "http 400: needs 99 blocks"},
	}
	got := SortedErrorClasses(ErrorClasses(recs))
	want := []ErrorClassEntry{
		{"http 400: needs N blocks", ErrorClassCount{3, "http 400: needs 1258 blocks"}},
		{"http 503: overloaded", ErrorClassCount{1, "http 503: overloaded"}},
	}
	if len(got) != len(want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("class %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	if ErrorClasses([]RequestRecord{{}}) != nil {
		t.Error("ErrorClasses of successes is not nil")
	}
}

// TestWriteTablePromptTokens: the prompt columns appear when a result
// carries the workload's mean, with "-" for a server that reported none.
func TestWriteTablePromptTokens(t *testing.T) {
	var buf bytes.Buffer
	rs := []Result{
		{Policy: "bench", PromptTokensMean: 3212.4, WorkloadPromptTokensMean: 3200},
		{Policy: "nousage", WorkloadPromptTokensMean: 150},
	}
	if err := WriteTable(&buf, rs); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimRight(buf.String(), "\n"), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "prompt_tok") || !strings.Contains(lines[0], "workload_tok") {
		t.Fatalf("table lacks the prompt columns:\n%s", buf.String())
	}
	if f := strings.Fields(lines[1]); f[len(f)-2] != "3212" || f[len(f)-1] != "3200" {
		t.Errorf("row 1 = %q, want … 3212 3200", lines[1])
	}
	if f := strings.Fields(lines[2]); f[len(f)-2] != "-" || f[len(f)-1] != "150" {
		t.Errorf("row 2 = %q, want … - 150", lines[2])
	}
	buf.Reset()
	if err := WriteTable(&buf, []Result{{Policy: "sim"}}); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(buf.String(), "prompt_tok") {
		t.Errorf("prompt columns without prompt means:\n%s", buf.String())
	}
}
