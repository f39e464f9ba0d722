package proxy

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/engine"
)

// BenchmarkGIEPickerRoundTrip measures what the endpoint picker's round
// trip adds to a request (docs/gie.md): the same streamed completions,
// one at a time, through serve routing itself (e2) and through serve
// --endpoint-picker in front of prefixlb epp (e2), over the same two
// in-process engines running 10000 times faster than real time, so that
// the routers' work dominates. Each iteration sends one request each way,
// alternating which goes first, and the per-path means are reported
// (ns/op and allocs/op are of the pair):
//
//	go test -run '^$' -bench GIEPickerRoundTrip -benchtime 2000x -count 5 ./internal/proxy/
func BenchmarkGIEPickerRoundTrip(b *testing.B) {
	engines := startGIEEngines(b, 2, func(ec *engine.Config) { ec.TimeScale = 10000 })
	_, eppAddr, _ := startEPP(b, []string{engines[0].addr, engines[1].addr}, "e2", 1)
	_, native := gieProxy(b, engines, "", func(c *Config) { c.Policy = "e2" })
	_, picked := gieProxy(b, engines, eppAddr)
	const prompts = 16
	bodies := make([]string, prompts)
	for i := range bodies {
		bodies[i] = e2ePrompt(i%4, i, 512, 64, 4) // ~4 KB of JSON, 4 streamed tokens
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4}}
	defer client.CloseIdleConnections()
	send := func(url, body string) time.Duration {
		t0 := time.Now()
		resp, err := client.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			b.Fatal(err)
		}
		out, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != http.StatusOK || !strings.Contains(string(out), "[DONE]") {
			b.Fatal(fmt.Errorf("status %d, err %v: %.200s", resp.StatusCode, err, out))
		}
		return time.Since(t0)
	}
	var tNative, tPicked time.Duration
	n := 0
	b.ReportAllocs()
	for b.Loop() {
		body := bodies[n%prompts]
		if n%2 == 0 { // each goes first every other time
			tNative += send(native.URL, body)
			tPicked += send(picked.URL, body)
		} else {
			tPicked += send(picked.URL, body)
			tNative += send(native.URL, body)
		}
		n++
	}
	ms := func(d time.Duration) float64 { return d.Seconds() * 1000 / float64(n) }
	b.ReportMetric(ms(tNative), "serve-ms/req")
	b.ReportMetric(ms(tPicked), "serve-epp-ms/req")
	b.ReportMetric(ms(tPicked-tNative), "added-ms/req")
}
