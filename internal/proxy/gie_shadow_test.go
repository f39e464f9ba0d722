package proxy

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// shadowRun sends groups×perGroup requests one at a time through serve
// --endpoint-picker (prefixlb epp running pickerPolicy over two engines)
// with --shadow-policy shadowPolicy and a shadow log. Each group's first
// request is cold (no replica holds its prefix), the rest share it. It
// returns the proxy and the log's records.
func shadowRun(t *testing.T, pickerPolicy, shadowPolicy string, groups, perGroup int) (*Proxy, []shadowRecord) {
	t.Helper()
	engines := startGIEEngines(t, 2)
	pk, addr, plog := startEPP(t, []string{engines[0].addr, engines[1].addr}, pickerPolicy, 0)
	logPath := filepath.Join(t.TempDir(), "shadow.jsonl")
	p, srv := gieProxy(t, engines, addr, func(c *Config) {
		c.ShadowPolicy = shadowPolicy
		c.ShadowLog = logPath
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = p.Run(ctx); close(done) }()
	for k := range perGroup {
		for g := range groups {
			rid := fmt.Sprintf("g%d-k%d", g, k)
			res := gieSend(t, srv.URL, rid, e2ePrompt(g, k, 256, 16, 8))
			if res.err != nil || res.status != http.StatusOK || !res.done {
				t.Fatalf("%s: status %d err %v body %s", rid, res.status, res.err, res.body)
			}
			// The shadow never moves a request: it went where the picker said.
			e := engineOf(engines, rid)
			if dest := plog.get(rid); e == nil || strings.Split(dest, ",")[0] != e.addr {
				t.Fatalf("%s: picker named %q, served by %v", rid, dest, e)
			}
		}
	}
	cancel()
	<-done // the log is flushed and closed
	// The shadow's flights all ended, as the picker's did.
	p.mu.Lock()
	inflight := p.rt.InFlight()
	p.mu.Unlock()
	if inflight != 0 {
		t.Errorf("the shadow's core has %d flights after every response ended", inflight)
	}
	for _, r := range pk.Replicas() {
		if r.InFlight != 0 {
			t.Errorf("picker has %d in flight on %s", r.InFlight, r.Name)
		}
	}
	f, err := os.Open(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var recs []shadowRecord
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var r shadowRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatalf("shadow log line %q: %v", sc.Text(), err)
		}
		recs = append(recs, r)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	n := groups * perGroup
	agree := counter(t, p.m.Reg, "prefixlb_shadow_decisions_total", "agree", "true")
	disagree := counter(t, p.m.Reg, "prefixlb_shadow_decisions_total", "agree", "false")
	if agree+disagree != float64(n) {
		t.Errorf("prefixlb_shadow_decisions_total sums to %v (agree %v), want one per request: %d", agree+disagree, agree, n)
	}
	if errs := counter(t, p.m.Reg, "prefixlb_shadow_errors_total"); errs != 0 {
		t.Errorf("prefixlb_shadow_errors_total = %v, want 0", errs)
	}
	if len(recs) != n {
		t.Fatalf("shadow log has %d records, want %d", len(recs), n)
	}
	logged := 0
	for _, r := range recs {
		if r.RequestID == "" || r.Picked == "" || r.Shadow == "" || r.Error != "" || len(r.Replicas) != 2 {
			t.Errorf("shadow log record %+v: want a request id, both replicas, two replicas' terms and no error", r)
		}
		if r.Agree != (r.Picked == r.Shadow) {
			t.Errorf("record %s: agree=%v but picked %s, shadow %s", r.RequestID, r.Agree, r.Picked, r.Shadow)
		}
		if r.Agree {
			logged++
		}
	}
	if float64(logged) != agree {
		t.Errorf("the log agrees on %d requests, the counter on %v", logged, agree)
	}
	t.Logf("%s shadowing %s: agreed on %v of %d requests", shadowPolicy, pickerPolicy, agree, n)
	return p, recs
}

// TestShadowAgreesWithSamePolicy: prefixlb epp runs llmd-approx, and so
// does serve's shadow. Teacher forcing keeps the shadow's prefix index
// equal to the picker's, so every warm request agrees; a cold request is a
// tie on every score (no prefix anywhere, no load known), which each side
// breaks at random with its own seed (epp 0, serve 1): those are the only
// disagreements allowed.
func TestShadowAgreesWithSamePolicy(t *testing.T) {
	const groups, perGroup = 6, 5
	_, recs := shadowRun(t, "llmd-approx", "llmd-approx", groups, perGroup)
	agree := 0
	for i, r := range recs {
		if r.Agree {
			agree++
			continue
		}
		cold := i < groups // the first round: each group's first request
		s0, s1 := r.Replicas[0].Score, r.Replicas[1].Score
		tie := s0 != nil && s1 != nil && math.Abs(*s0-*s1) < 1e-12
		if !cold || !tie {
			t.Errorf("record %s disagrees (picked %s, shadow %s) but is not a cold tie: %+v", r.RequestID, r.Picked, r.Shadow, r.Replicas)
		}
		for _, rp := range r.Replicas {
			if rp.MatchedTokens == nil || *rp.MatchedTokens != 0 {
				t.Errorf("cold record %s: %s matched %v tokens, want 0", r.RequestID, rp.Name, rp.MatchedTokens)
			}
		}
	}
	// Warm requests: the group's replica holds its 256-token prefix in the
	// shadow's index, as in the picker's.
	for i := groups; i < len(recs); i++ {
		r := recs[i]
		for _, rp := range r.Replicas {
			if rp.Name == r.Picked && (rp.MatchedTokens == nil || *rp.MatchedTokens < 256) {
				t.Errorf("warm record %s: the picked replica %s matched %v tokens in the shadow, want ≥ 256", r.RequestID, rp.Name, rp.MatchedTokens)
			}
		}
	}
	if min := groups * (perGroup - 1); agree < min {
		t.Errorf("agreed on %d of %d, want at least the %d warm requests", agree, len(recs), min)
	}
}

// TestShadowDisagreesWithOtherPolicy: round-robin shadowing llmd-approx
// alternates while the picker keeps each group on its replica, so about
// half of the warm requests disagree. The groups are odd in number, so
// that a group's turn alternates between the replicas from one round to
// the next.
func TestShadowDisagreesWithOtherPolicy(t *testing.T) {
	const groups, perGroup = 5, 6
	p, _ := shadowRun(t, "llmd-approx", "round-robin", groups, perGroup)
	disagree := counter(t, p.m.Reg, "prefixlb_shadow_decisions_total", "policy", "round-robin", "agree", "false")
	if disagree < groups*perGroup/4 {
		t.Errorf("round-robin disagreed with llmd-approx on %v of %d requests, want at least a quarter", disagree, groups*perGroup)
	}
}

// TestShadowConfig: the shadow needs a picker, a policy serve knows, and
// its log needs the shadow.
func TestShadowConfig(t *testing.T) {
	for _, tt := range []struct {
		name    string
		set     func(*Config)
		wantErr string
	}{
		{"no picker", func(c *Config) { c.ShadowPolicy = "llmd-approx" }, "shadow_policy: needs endpoint_picker"},
		{"unknown policy", func(c *Config) { c.EndpointPicker = "127.0.0.1:9002"; c.ShadowPolicy = "nope" }, "shadow_policy"},
		{"log alone", func(c *Config) { c.EndpointPicker = "127.0.0.1:9002"; c.ShadowLog = "x.jsonl" }, "shadow_log: needs shadow_policy"},
		{"ok", func(c *Config) {
			c.EndpointPicker = "127.0.0.1:9002"
			c.ShadowPolicy = "llmd-approx:prefix_weight=3:kv_weight=2:queue_weight=2"
		}, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := DefaultConfig()
			c.Backends = []Backend{{URL: "http://127.0.0.1:8001"}}
			tt.set(&c)
			err := c.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Validate: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("Validate: %v, want an error with %q", err, tt.wantErr)
			}
		})
	}
	// YAML fills the same fields.
	c, err := ParseConfig([]byte("endpoint_picker: 127.0.0.1:9002\nshadow_policy: llmd-precise\nshadow_log: /tmp/s.jsonl\n"), DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	if c.ShadowPolicy != "llmd-precise" || c.ShadowLog != "/tmp/s.jsonl" {
		t.Errorf("YAML: shadow_policy %q, shadow_log %q", c.ShadowPolicy, c.ShadowLog)
	}
}
