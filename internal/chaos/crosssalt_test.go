package chaos

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// The cross-salt probe (issue 26, D5), as a phase of TestChaosHostile: a
// victim tenant keeps a secret prompt hot under its cache_salt; a prober
// tenant sends the same prompt under its own salt, and prompts of the same
// length that nobody sent, and compares what comes back. Zero bits of the
// victim's cache may reach it: no explanation header, the same header
// keys, no cached tokens reported for either. The router's own view
// (POST /debug/route with the admin token, as an operator reads it) shows
// the prober's salted request, and the unsalted one, routed as misses
// while the victim's own salt still matches.
const (
	saltPromptTokens = 1536
	saltProbes       = 10
	victimSalt       = "victim-salt"
	proberSalt       = "prober-salt"
)

// crossSalt is what the probe saw.
type crossSalt struct {
	hot, cold []saltProbe
	// matched is the router's matched_tokens for the secret prompt under
	// each salt ("" none), from /debug/route, after the probes: the
	// prober's is one it never sent.
	matched map[string]int
	err     error
}

// saltProbe is one probe's answer.
type saltProbe struct {
	status  int
	keys    []string // header keys, less Date
	route   bool     // the explanation header was present
	cached  int      // usage.prompt_tokens_details.cached_tokens
	latency time.Duration
}

// saltPromptOf is a random prompt of saltPromptTokens token ids.
func saltPromptOf(seed uint64) []uint32 {
	r := rand.New(rand.NewPCG(seed, 26))
	p := make([]uint32, saltPromptTokens)
	for i := range p {
		p[i] = 1000 + uint32(r.IntN(100000))
	}
	return p
}

func saltBody(prompt []uint32, salt string) []byte {
	m := map[string]any{"model": modelName, "prompt": prompt, "max_tokens": 1}
	if salt != "" {
		m["cache_salt"] = salt
	}
	b, _ := json.Marshal(m)
	return b
}

// sendSalted posts prompt under salt as the tenant of key.
func sendSalted(c *http.Client, url, key string, prompt []uint32, salt string) (saltProbe, error) {
	req, err := http.NewRequest(http.MethodPost, url+"/v1/completions", bytes.NewReader(saltBody(prompt, salt)))
	if err != nil {
		return saltProbe{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	start := time.Now()
	resp, err := c.Do(req)
	if err != nil {
		return saltProbe{}, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	p := saltProbe{status: resp.StatusCode, latency: time.Since(start), route: resp.Header.Get("x-prefixlb-route") != ""}
	for k := range resp.Header {
		if k != "Date" {
			p.keys = append(p.keys, k)
		}
	}
	slices.Sort(p.keys)
	var u struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK {
		return p, fmt.Errorf("status %d: %.200s", resp.StatusCode, b)
	}
	if err := json.Unmarshal(b, &u); err != nil {
		return p, fmt.Errorf("answer %.200s: %w", b, err)
	}
	p.cached = u.Usage.Details.Cached
	return p, nil
}

// routeMatched asks the router, as its operator, how many tokens of prompt
// under salt it finds cached for the tenant of key (POST /debug/route).
func routeMatched(c *http.Client, url, key string, prompt []uint32, salt string) (int, error) {
	req, err := http.NewRequest(http.MethodPost, url+"/debug/route", bytes.NewReader(saltBody(prompt, salt)))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("x-prefixlb-admin-token", hostileAdmin)
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode != http.StatusOK {
		return 0, fmt.Errorf("/debug/route: status %d: %.200s", resp.StatusCode, b)
	}
	var d struct {
		Matched *int `json:"matched_tokens"`
	}
	if err := json.Unmarshal(b, &d); err != nil || d.Matched == nil {
		return 0, fmt.Errorf("/debug/route: no matched_tokens in %.200s (%v)", b, err)
	}
	return *d.Matched, nil
}

// startCrossSalt runs the probe in the background for the phase; its stop
// waits for it to finish.
func startCrossSalt(_ *testing.T, h *hostileRig) func() {
	done := make(chan struct{})
	h.salt = &crossSalt{matched: map[string]int{}}
	go func() {
		defer close(done)
		h.salt.err = h.salt.run(h.router.url())
	}()
	return func() { <-done }
}

func (cs *crossSalt) run(url string) error {
	c := &http.Client{Timeout: 10 * time.Second}
	secret := saltPromptOf(1)
	// The victim warms its secret prompt, until the router, fed by the
	// engine's KV events, sees it cached under the victim's salt.
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := sendSalted(c, url, goodKey, secret, victimSalt); err != nil {
			return fmt.Errorf("victim: %w", err)
		}
		n, err := routeMatched(c, url, goodKey, secret, victimSalt)
		if err != nil {
			return err
		}
		if n > 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the router never saw the victim's prompt cached (matched %d)", n)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// Each pair under a salt of its own, never used before: a salt the
	// prober has sent the secret under is its own cache from then on.
	for i := range saltProbes {
		salt := fmt.Sprintf("%s-%d", proberSalt, i)
		hot, err := sendSalted(c, url, proberKey, secret, salt)
		if err != nil {
			return fmt.Errorf("probe of the secret prompt: %w", err)
		}
		cold, err := sendSalted(c, url, proberKey, saltPromptOf(uint64(100+i)), salt)
		if err != nil {
			return fmt.Errorf("probe of a cold prompt: %w", err)
		}
		cs.hot, cs.cold = append(cs.hot, hot), append(cs.cold, cold)
		time.Sleep(200 * time.Millisecond)
	}
	for _, salt := range []string{proberSalt, "", victimSalt} {
		key := proberKey
		if salt == victimSalt {
			key = goodKey
		}
		n, err := routeMatched(c, url, key, secret, salt)
		if err != nil {
			return err
		}
		cs.matched[salt] = n
	}
	return nil
}

func checkCrossSalt(t *testing.T, h *hostileRig) {
	cs := h.salt
	if cs.err != nil {
		t.Errorf("chaos: cross-salt: %v", cs.err)
		return
	}
	mean := func(ps []saltProbe) time.Duration {
		var s time.Duration
		for _, p := range ps {
			s += p.latency
		}
		return s / time.Duration(max(len(ps), 1))
	}
	h.notes["cross-salt"] = fmt.Sprintf("probes=%d+%d mean latency secret/cold %v/%v matched_tokens prober-salt=%d unsalted=%d victim-salt=%d",
		len(cs.hot), len(cs.cold), mean(cs.hot).Round(100*time.Microsecond), mean(cs.cold).Round(100*time.Microsecond),
		cs.matched[proberSalt], cs.matched[""], cs.matched[victimSalt])
	ref := cs.cold[0].keys
	for i, p := range append(slices.Clone(cs.hot), cs.cold...) {
		what := "secret"
		if i >= len(cs.hot) {
			what = "cold"
		}
		if p.route {
			t.Errorf("chaos: cross-salt: a %s probe got the explanation header", what)
		}
		if p.cached != 0 {
			t.Errorf("chaos: cross-salt: a %s probe was served %d cached tokens", what, p.cached)
		}
		if !slices.Equal(p.keys, ref) {
			t.Errorf("chaos: cross-salt: a %s probe's header keys %s differ from a cold probe's %s", what, strings.Join(p.keys, ","), strings.Join(ref, ","))
		}
	}
	if cs.matched[proberSalt] != 0 || cs.matched[""] != 0 {
		t.Errorf("chaos: cross-salt: the router matched %d tokens of the victim's prompt under the prober's salt and %d unsalted, want 0",
			cs.matched[proberSalt], cs.matched[""])
	}
	if cs.matched[victimSalt] == 0 {
		t.Errorf("chaos: cross-salt: the victim's own salt matched nothing: the probe proved nothing")
	}
}
