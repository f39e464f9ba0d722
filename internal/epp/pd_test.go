package epp

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"testing"
)

// pdPicker is a picker over r0 (a prefill pod) and r1, r2 (decode pods).
func pdPicker(t *testing.T, policy string) *Picker {
	t.Helper()
	p, err := NewPicker(Config{Policy: policy, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	for i, role := range []string{"prefill", "decode", ""} {
		p.Add(Replica{Name: fmt.Sprintf("r%d", i), Address: addr(i), Role: role, Ready: true})
	}
	return p
}

// pickHeaders sends one request through the server and returns the
// headers its first answer sets and removes.
func pickHeaders(t *testing.T, p *Picker, body string) (set map[string]string, removed []string) {
	t.Helper()
	e := newEnvoy(t, startServer(t, NewServer(p, ServerConfig{Logger: slog.New(slog.DiscardHandler)})))
	e.request("/v1/completions", []byte(body), 1<<20, nil, PrefillerHeader, "10.9.9.9:1")
	r := e.recv()
	hm := r.GetRequestHeaders().GetResponse().GetHeaderMutation()
	set = map[string]string{}
	for _, h := range hm.GetSetHeaders() {
		set[h.GetHeader().GetKey()] = string(h.GetHeader().GetRawValue())
	}
	return set, hm.GetRemoveHeaders()
}

// TestPickerPD: with a disaggregating policy the picker answers a decode
// pod as the destination (and decode pods only as fallbacks) and names the
// prefill pod in llm-d's x-prefiller-host-port; with another policy the
// prefill pod is never picked and a client's x-prefiller-host-port is
// removed.
func TestPickerPD(t *testing.T) {
	body := `{"model":"m","prompt":"` + strings.Repeat("a long shared prefix ", 50) + `","max_tokens":4}`
	t.Run("round-robin-pd", func(t *testing.T) {
		p := pdPicker(t, "round-robin-pd")
		for range 4 {
			set, removed := pickHeaders(t, p, body)
			dest := strings.Split(set[DestinationHeader], ",")
			if slices.Contains(dest, addr(0)) || len(dest) != 2 {
				t.Errorf("destination %v: want the two decode pods, never the prefill pod %s", dest, addr(0))
			}
			if set[PrefillerHeader] != addr(0) || slices.Contains(removed, PrefillerHeader) {
				t.Errorf("%s = %q (removed %v), want %s", PrefillerHeader, set[PrefillerHeader], removed, addr(0))
			}
		}
	})
	t.Run("e2", func(t *testing.T) {
		p := pdPicker(t, "e2")
		for range 4 {
			set, removed := pickHeaders(t, p, body)
			if d := set[DestinationHeader]; strings.Contains(d, addr(0)) {
				t.Errorf("destination %q includes the prefill pod", d)
			}
			if _, ok := set[PrefillerHeader]; ok || !slices.Contains(removed, PrefillerHeader) {
				t.Errorf("a request that is not disaggregated keeps %s (set %v, removed %v)", PrefillerHeader, set, removed)
			}
		}
	})
}
