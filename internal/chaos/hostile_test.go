package chaos

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// The hostile column (issue 26): one cluster, one router with its default
// limits, a tenant's steady load, and attacks on the router one after
// another, each for a phase of the load. For every attack the tenant's
// requests must all be served, with p99 TTFT within 2× of the clean
// phase's; the router's resident memory stays under 512 MiB throughout;
// and SIGTERM during attacks ends the router within its drain timeout.
const (
	hostilePhase    = 8 * time.Second
	hostileWarmUp   = 6 * time.Second
	hostileRSSLimit = 512 << 20
	// hostileDrain is the router's --drain-timeout (routerFlags).
	hostileDrain = 2 * time.Second
	// API keys of the tenants (the config holds their SHA-256 digests).
	goodKey   = "sk-chaos-good-tenant"
	noisyKey  = "sk-chaos-noisy-tenant"
	proberKey = "sk-chaos-prober-tenant"
	// hostileAdmin is the router's admin token: the test reads /debug
	// with it, as an operator would.
	hostileAdmin = "chaos-admin-token"
	// noisyRate is the noisy tenant's request rate, 4× its quota.
	noisyRate = 15.0
)

// hostileAttack is one phase: start returns what stops it.
type hostileAttack struct {
	name  string
	start func(t *testing.T, h *hostileRig) (stop func())
	// replicaFault: a replica misbehaves, not a client (its p99 is logged,
	// not judged).
	replicaFault bool
	// inPlace, when set, waits until the attack holds what it takes (the
	// tenant's requests are judged from then on).
	inPlace func(t *testing.T, h *hostileRig)
	// check asserts what the attack must leave, after its phase.
	check func(t *testing.T, h *hostileRig)
}

// hostileRig is the cluster under attack.
type hostileRig struct {
	t          *testing.T
	engines    []*engine
	fronts     []*front // each engine's HTTP (fronts[0] switches to 500s)
	front0     *front   // engine 0's HTTP
	pub0, rep0 *kvFront // engine 0's KV-event PUB and replay ROUTER
	router     *router
	bigBodies  *bigBodies // the big-bodies attack, while it runs
	// cutBefore, cutDuring: requests ended by client_write_timeout before
	// and during the zero-window phase.
	cutBefore, cutDuring float64
	salt                 *crossSalt // the cross-salt probe's answers
	cleanThresh          float64    // the queue's predicted-wait threshold before any attack
	notes                map[string]string
}

func sha(s string) string {
	d := sha256.Sum256([]byte(s))
	return hex.EncodeToString(d[:])
}

func TestChaosHostile(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos: starts processes for ~90 s")
	}
	dir := t.TempDir()
	h := &hostileRig{t: t, notes: map[string]string{}}
	for i := range 3 {
		h.engines = append(h.engines, newEngine(t, dir, fmt.Sprintf("engine%d", i)))
	}
	var bs []backend
	for i, e := range h.engines {
		f := newFront(t, e.url())
		h.fronts = append(h.fronts, f)
		b := backend{URL: f.srv.URL, KVEvents: e.kvEndpoint(), KVReplay: e.replayEndpoint()}
		if i == 0 {
			h.front0 = f
			h.pub0 = newKVFront(t, fmt.Sprintf("127.0.0.1:%d", e.kvPort))
			h.rep0 = newKVFront(t, fmt.Sprintf("127.0.0.1:%d", e.replay))
			b.KVEvents, b.KVReplay = h.pub0.endpoint(), h.rep0.endpoint()
		}
		bs = append(bs, b)
	}

	// The noisy tenant's quota is a quarter of what it sends, in the
	// router's reckoning (prompt tokens + max_tokens), with two seconds'
	// burst so that the phase sees the quota and not the burst.
	noisyReqs := genWorkload(t, "toolbench", int(noisyRate*hostilePhase.Seconds()), noisyRate, 7)
	var demand float64
	for _, r := range noisyReqs {
		demand += float64(len(r.Tokens) + r.OutputTokens)
	}
	perMinute := demand / float64(len(noisyReqs)) * noisyRate * 60
	quota := int64(perMinute / 4)
	yaml := fmt.Sprintf("admin_token: %q\ntenants:\n- name: good\n  api_key_sha256: [%q]\n- name: noisy\n  api_key_sha256: [%q]\n  tokens_per_minute: %d\n  burst_tokens: %d\n- name: prober\n  api_key_sha256: [%q]\n",
		hostileAdmin, sha(goodKey), sha(noisyKey), quota, quota/30, sha(proberKey))
	// Defaults everywhere but the client write timeout, which is shortened
	// from 30 s so that the zero-window clients are cut within their phase.
	h.router = newRouterYAML(t, dir, bs, yaml, "--client-write-timeout", "3s")
	rss := sampleRSS(h.router.p.pid(), 100*time.Millisecond)
	defer rss.stop()

	attacks := hostileAttacks()
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	n := int(loadRate * (hostileWarmUp + time.Duration(1+len(attacks))*hostilePhase).Seconds())
	reqs := genWorkload(t, "toolbench", n, loadRate, 1)
	total := hostileWarmUp + time.Duration(1+len(attacks))*hostilePhase
	wait := runTenantLoad(ctx, h.router.url(), goodKey, reqs, total)
	start := time.Now()

	sleepUntil(ctx, start.Add(hostileWarmUp+hostilePhase/2))
	h.cleanThresh = queueThreshold(t, h.router)
	type phase struct {
		name             string
		from, judged, to time.Duration // judged: from the attack in place
		peakRSS          int64
		replicaFault     bool
	}
	phases := []phase{{name: "clean", from: hostileWarmUp, judged: hostileWarmUp, to: hostileWarmUp + hostilePhase}}
	sleepUntil(ctx, start.Add(hostileWarmUp+hostilePhase))
	for i, a := range attacks {
		from := hostileWarmUp + time.Duration(i+1)*hostilePhase
		rss.peak.Store(0)
		stop := a.start(t, h)
		judged := from
		if a.inPlace != nil {
			a.inPlace(t, h)
			judged = max(from, time.Since(start))
		}
		sleepUntil(ctx, start.Add(from+hostilePhase))
		stop()
		phases = append(phases, phase{name: a.name, from: from, judged: judged, to: from + hostilePhase, peakRSS: rss.peak.Load(), replicaFault: a.replicaFault})
		if h.router.p.exited() {
			t.Fatalf("chaos: the router exited during %q", a.name)
		}
		if a.check != nil {
			a.check(t, h)
		}
	}
	out, err := wait()
	if err != nil {
		t.Fatalf("chaos: load: %v", err)
	}

	// Each phase: the tenant's requests sent in it, all served, p99 TTFT.
	clean := tenantWindow(out.Records, phases[0].from, phases[0].to)
	t.Logf("hostile %-14s sent=%d served=%d ttft p50/p99 %.1f/%.1f ms", "clean", clean.sent, clean.served, clean.p50, clean.p99)
	if clean.served != clean.sent || clean.sent < 60 {
		t.Fatalf("chaos: clean phase: %d of %d served (errors %v)", clean.served, clean.sent, clean.errors)
	}
	for _, p := range phases[1:] {
		if p.judged > p.from {
			// While the attacker pushed its bytes through loopback it
			// shared the machine's two cores with the router: logged,
			// not judged.
			w := tenantWindow(out.Records, p.from, p.judged)
			t.Logf("hostile %-14s while the attack was set up (%v): sent=%d served=%d ttft p50/p99 %.1f/%.1f ms",
				p.name, (p.judged - p.from).Round(10*time.Millisecond), w.sent, w.served, w.p50, w.p99)
			if w.served != w.sent {
				t.Errorf("chaos: %s: the tenant had %d of %d requests served while it was set up: %v", p.name, w.served, w.sent, w.errors)
			}
		}
		w := tenantWindow(out.Records, p.judged, p.to)
		t.Logf("hostile %-14s sent=%d served=%d ttft p50/p99 %.1f/%.1f ms (%.2f× clean p99) router RSS peak %.0f MiB %s",
			p.name, w.sent, w.served, w.p50, w.p99, w.p99/clean.p99, float64(p.peakRSS)/(1<<20), h.notes[p.name])
		if w.served != w.sent {
			t.Errorf("chaos: %s: the tenant had %d of %d requests served: %v", p.name, w.served, w.sent, w.errors)
		}
		// 2× the clean p99, or 5 ms over it for TTFTs of a few ms (the
		// suite's rule, window.within). A replica fault is not an attack
		// on the router: the prefixes cached on the failing replica are
		// prefilled again elsewhere, as when it is killed (TestChaos), and
		// that costs TTFT however the router does: logged, not judged.
		if p.replicaFault {
			continue
		}
		if w.p99 > math.Max(2*clean.p99, clean.p99+5) {
			t.Errorf("chaos: %s: the tenant's p99 TTFT %.1f ms is over 2× (or +5 ms) the clean phase's %.1f ms", p.name, w.p99, clean.p99)
		}
	}

	// The KV stream of engine 0 is back once the attacks on it ended.
	waitFor(t, 15*time.Second, "engine 0's KV stream connected again", func() bool {
		m, err := scrapeWhere(h.router.url()+"/metrics", "state", "connected")
		return err == nil && m["prefixlb_kvevents_state"] == 3
	})

	// SIGTERM while slow bodies, clients that never read and a silent KV
	// peer all hold the router: it ends within its drain timeout.
	h.pub0.setMode(kvSilent)
	slow := startSlowBodies(strings.TrimPrefix(h.router.url(), "http://"), 50, 16<<20-1)
	defer slow.stop()
	zw := startZeroWindow(strings.TrimPrefix(h.router.url(), "http://"), 10, longStreamBody())
	defer zw.stop()
	waitFor(t, 10*time.Second, "the attackers' connections open", func() bool {
		return slow.opened.Load() >= 50 && zw.opened.Load() >= 10 && h.pub0.mutes.Load() > 0
	})
	time.Sleep(500 * time.Millisecond) // the zero-window streams reach their replicas
	sent := time.Now()
	if err := h.router.p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatalf("chaos: SIGTERM: %v", err)
	}
	select {
	case <-h.router.p.done:
	case <-time.After(4 * hostileDrain):
		t.Fatalf("chaos: the router had not exited %v after SIGTERM (drain timeout %v)", 4*hostileDrain, hostileDrain)
	}
	took := time.Since(sent)
	t.Logf("hostile SIGTERM under attack (50 slow bodies, 10 zero-window streams, a silent KV peer): exited in %v (drain timeout %v)", took.Round(time.Millisecond), hostileDrain)
	// The drain timeout bounds the wait for requests; the process then
	// closes its listeners and feeds, which may take a moment more.
	if took > hostileDrain+time.Second {
		t.Errorf("chaos: exit took %v after SIGTERM, over the drain timeout %v (+1 s to close)", took, hostileDrain)
	}
	rss.stop()
	peak := rss.peak.Load() // since the last phase
	for _, p := range phases {
		peak = max(peak, p.peakRSS)
	}
	t.Logf("hostile router RSS peak over the run %.0f MiB (%d samples)", float64(peak)/(1<<20), rss.samples.Load())
	for _, p := range phases {
		if p.peakRSS > hostileRSSLimit {
			t.Errorf("chaos: %s: router RSS peaked at %.0f MiB, over %d MiB", p.name, float64(p.peakRSS)/(1<<20), hostileRSSLimit>>20)
		}
	}
}

// hostileAttacks are the phases after the clean one, in order. The breaker
// phase is last: its replica stays ejected for the breaker's ejection time.
func hostileAttacks() []hostileAttack {
	return []hostileAttack{
		{
			name: "kv-bomb",
			start: func(_ *testing.T, h *hostileRig) func() {
				h.pub0.setMode(kvBomb)
				h.rep0.setMode(kvBomb)
				return func() { h.pub0.setMode(kvPass); h.rep0.setMode(kvPass) }
			},
			check: func(t *testing.T, h *hostileRig) {
				m := mustScrape(t, h.router)
				h.notes["kv-bomb"] = fmt.Sprintf("bombs=%d refused=%.0f", h.pub0.bombs.Load(), m["prefixlb_kvevents_refused_total"])
				if h.pub0.bombs.Load() == 0 || m["prefixlb_kvevents_refused_total"] == 0 {
					t.Errorf("chaos: kv-bomb: %d bombs sent, %.0f connections refused: the attack did not happen", h.pub0.bombs.Load(), m["prefixlb_kvevents_refused_total"])
				}
			},
		},
		{
			name: "kv-silent",
			start: func(_ *testing.T, h *hostileRig) func() {
				h.pub0.setMode(kvSilent)
				return func() { h.pub0.setMode(kvPass) }
			},
			check: func(t *testing.T, h *hostileRig) {
				m, err := scrapeWhere(h.router.url()+"/metrics", "reason", "handshake_timeout")
				if err != nil {
					t.Fatal(err)
				}
				h.notes["kv-silent"] = fmt.Sprintf("mute_conns=%d handshake_timeouts=%.0f", h.pub0.mutes.Load(), m["prefixlb_kvevents_refused_total"])
				if m["prefixlb_kvevents_refused_total"] == 0 {
					t.Errorf("chaos: kv-silent: no handshake timed out (%d silent connections)", h.pub0.mutes.Load())
				}
			},
		},
		{
			name: "slow-bodies",
			start: func(_ *testing.T, h *hostileRig) func() {
				// 200 requests each declaring a body of 16 MiB - 1 (the
				// default max_body_bytes is 16 MiB) and sending a byte a
				// second: 3.2 GiB declared.
				s := startSlowBodies(strings.TrimPrefix(h.router.url(), "http://"), 200, 16<<20-1)
				return func() {
					s.stop()
					h.notes["slow-bodies"] = fmt.Sprintf("conns=%d refused=%d", s.opened.Load(), s.refused.Load())
				}
			},
		},
		{
			name: "big-bodies",
			inPlace: func(t *testing.T, h *hostileRig) {
				waitFor(t, hostilePhase/2, "the big bodies sent or refused", func() bool { return h.bigBodies.done.Load() == 40 })
				// The bytes the attacker wrote are still crossing loopback
				// into the router's held bodies after its writes return:
				// in place once the router's body bytes stop growing (by
				// more than the tenant's own small bodies come and go).
				waitFor(t, hostilePhase/2, "the router's held body bytes settled", func() bool {
					a := mustScrape(t, h.router)["prefixlb_inflight_body_bytes"]
					time.Sleep(300 * time.Millisecond)
					b := mustScrape(t, h.router)["prefixlb_inflight_body_bytes"]
					return math.Abs(a-b) < 1<<20
				})
			},
			start: func(_ *testing.T, h *hostileRig) func() {
				// 40 requests each declaring 16 MiB - 1 and sending 15 MiB
				// as fast as loopback takes it, then stalling: 600 MiB.
				b := startBigBodies(strings.TrimPrefix(h.router.url(), "http://"), 40, 16<<20-1, 15<<20)
				h.bigBodies = b
				return func() {
					m := mustScrape(h.t, h.router)
					b.stop()
					h.notes["big-bodies"] = fmt.Sprintf("conns=%d sent_whole=%d refused_body_memory=%.0f", b.opened.Load(), b.sentAll.Load(), m["prefixlb_refused_total"])
				}
			},
		},
		{
			name: "zero-window",
			// The replicas stream 24 MiB to each client as fast as the
			// router takes it (fatHeader), so that the sockets between them
			// fill: judged once the fronts have stopped writing.
			inPlace: func(t *testing.T, h *hostileRig) {
				waitFor(t, hostilePhase/2, "the zero-window streams blocked", func() bool {
					n, b := fatStreams(h)
					time.Sleep(300 * time.Millisecond)
					n2, b2 := fatStreams(h)
					return n2 == 20 && n == n2 && b == b2
				})
			},
			start: func(_ *testing.T, h *hostileRig) func() {
				h.cutBefore = clientTimeouts(h)
				z := startZeroWindow(strings.TrimPrefix(h.router.url(), "http://"), 20, longStreamBody())
				return func() {
					n, b := fatStreams(h)
					h.notes["zero-window"] = fmt.Sprintf("conns=%d fat_streams=%d bytes_taken_by_router=%.1f MiB", z.opened.Load(), n, float64(b)/(1<<20))
					h.cutDuring = clientTimeouts(h) - h.cutBefore
					z.stop()
				}
			},
			check: func(t *testing.T, h *hostileRig) {
				h.notes["zero-window"] += fmt.Sprintf(" cut_by_write_timeout=%.0f", h.cutDuring)
				// Every one of them blocked a write and was cut by the
				// client write timeout (3 s here) within the phase, while
				// its client still held the connection.
				if h.cutDuring < 20 {
					t.Errorf("chaos: zero-window: %.0f of 20 streams cut by client_write_timeout within the phase (%s)", h.cutDuring, h.notes["zero-window"])
				}
			},
		},
		{
			name:  "cross-salt",
			start: startCrossSalt,
			check: checkCrossSalt,
		},
		{
			name:  "spoofed-headers",
			start: startSpoofers,
			check: func(t *testing.T, h *hostileRig) {
				if got := queueThreshold(t, h.router); got != h.cleanThresh {
					t.Errorf("chaos: spoofed-headers: the queue's predicted-wait threshold is %v, was %v before", got, h.cleanThresh)
				}
				m := mustScrape(t, h.router)
				if m["prefixlb_untrusted_headers_total"] == 0 {
					t.Errorf("chaos: spoofed-headers: no untrusted header counted")
				}
			},
		},
		{
			name: "quota-flood",
			start: func(t *testing.T, h *hostileRig) func() {
				ctx, cancel := context.WithCancel(context.Background())
				reqs := genWorkload(t, "toolbench", int(noisyRate*hostilePhase.Seconds()), noisyRate, 7)
				wait := runTenantLoad(ctx, h.router.url(), noisyKey, reqs, hostilePhase)
				return func() {
					out, _ := wait()
					cancel()
					var ok, limited int
					for _, r := range out.Records {
						switch {
						case r.Error == "":
							ok++
						case strings.HasPrefix(r.Error, "http 429"):
							limited++
						}
					}
					h.notes["quota-flood"] = fmt.Sprintf("noisy: sent=%d served=%d 429=%d", len(out.Records), ok, limited)
					if limited == 0 {
						t.Errorf("chaos: quota-flood: the tenant at 4× its quota got no 429 (%s)", h.notes["quota-flood"])
					}
				}
			},
		},
		{
			name:         "always-500",
			replicaFault: true,
			start: func(_ *testing.T, h *hostileRig) func() {
				h.front0.setMode(modeFail500)
				return func() { h.front0.setMode(modePass) }
			},
			check: func(t *testing.T, h *hostileRig) {
				m, err := scrapeWhere(h.router.url()+"/metrics", "reason", "breaker")
				if err != nil {
					t.Fatal(err)
				}
				h.notes["always-500"] = fmt.Sprintf("500s_answered=%d breaker_ejections=%.0f", h.front0.n.Load(), m["prefixlb_replica_ejections_total"])
				if m["prefixlb_replica_ejections_total"] == 0 {
					t.Errorf("chaos: always-500: the breaker never ejected the replica (%d 500s answered)", h.front0.n.Load())
				}
			},
		},
	}
}

// startSpoofers sends, at 20 requests a second, small requests whose class
// headers claim a 1 ns TTFT SLO, priority 1000 and a new tenant name each:
// the router ignores them from an untrusted peer.
func startSpoofers(t *testing.T, h *hostileRig) func() {
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var sent, served atomic.Int64
	c := &http.Client{Timeout: 10 * time.Second}
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; sleepCtx(ctx, 200*time.Millisecond); i++ {
				body := fmt.Sprintf(`{"model":%q,"prompt":[%d,%d,%d],"max_tokens":1}`, modelName, 100+g, i, 7)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, h.router.url()+"/v1/completions", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("x-prefixlb-ttft-slo", "1ns")
				req.Header.Set("x-prefixlb-priority", "1000")
				req.Header.Set("x-prefixlb-tenant", fmt.Sprintf("spoof-%d-%d", g, i))
				sent.Add(1)
				resp, err := c.Do(req)
				if err != nil {
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode == http.StatusOK {
					served.Add(1)
				}
			}
		}()
	}
	before := seriesCount(t, h.router)
	return func() {
		cancel()
		wg.Wait()
		after := seriesCount(t, h.router)
		h.notes["spoofed-headers"] = fmt.Sprintf("spoofed=%d served=%d metric_series %d→%d", sent.Load(), served.Load(), before, after)
		// Each spoofed tenant name would add its queue series; the labels
		// are bounded, so the page grows by a handful of series at most
		// (new outcome codes, the untrusted-header counters).
		if after-before > 40 {
			t.Errorf("chaos: spoofed-headers: %d tenant names grew the metrics by %d series", sent.Load(), after-before)
		}
	}
}

// fatStreams sums the fronts' fat streams and the bytes the router took of
// them.
func fatStreams(h *hostileRig) (n, bytes int64) {
	for _, f := range h.fronts {
		n += f.fat.Load()
		bytes += f.fatBytes.Load()
	}
	return n, bytes
}

// clientTimeouts reads how many requests the router ended because their
// client took nothing for client_write_timeout.
func clientTimeouts(h *hostileRig) float64 {
	m, err := scrapeWhere(h.router.url()+"/metrics", "code", "client_timeout")
	if err != nil {
		h.t.Fatal(err)
	}
	return m["prefixlb_requests_total"]
}

// longStreamBody is a streamed completion of 2,000 tokens: what a client
// that never reads asks for.
func longStreamBody() string {
	return fmt.Sprintf(`{"model":%q,"prompt":[1,2,3,4,5,6,7,8],"max_tokens":2000,"stream":true}`, modelName)
}

// tenantStats are a tenant's requests sent in one window.
type tenantStats struct {
	sent, served int
	p50, p99     float64
	errors       map[string]int
}

// tenantWindow is the tenant's requests sent in [from, to).
func tenantWindow(recs []report.RequestRecord, from, to time.Duration) tenantStats {
	s := tenantStats{errors: map[string]int{}}
	var ttft []float64
	for _, r := range recs {
		at := time.Duration(r.SentS * float64(time.Second))
		if at < from || at >= to {
			continue
		}
		s.sent++
		if r.Error != "" {
			e := r.Error
			if len(e) > 100 {
				e = e[:100]
			}
			s.errors[e]++
			continue
		}
		s.served++
		ttft = append(ttft, r.TTFTMs)
	}
	if len(ttft) > 0 {
		slices.Sort(ttft)
		s.p50 = ttft[len(ttft)/2]
		s.p99 = ttft[int(math.Ceil(0.99*float64(len(ttft))))-1]
	}
	return s
}

// runTenantLoad runs reqs against target with key as the API key.
func runTenantLoad(ctx context.Context, target, key string, reqs []workload.Request, d time.Duration) func() (loadgen.Output, error) {
	hdr := http.Header{}
	hdr.Set("Authorization", "Bearer "+key)
	_, _, wait := runLoadHeader(ctx, target, reqs, d, hdr)
	return wait
}

// queueThreshold reads the queue's predicted-wait threshold in force.
func queueThreshold(t *testing.T, r *router) float64 {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, r.url()+"/debug/queue", nil)
	req.Header.Set("x-prefixlb-admin-token", hostileAdmin)
	resp, err := http.DefaultClient.Do(req)
	if err == nil && resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		err = fmt.Errorf("status %d", resp.StatusCode)
	}
	if err != nil {
		t.Fatalf("chaos: /debug/queue: %v", err)
	}
	defer resp.Body.Close()
	var st struct {
		Threshold *float64 `json:"predicted_wait_threshold"`
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err := json.Unmarshal(b, &st); err != nil || st.Threshold == nil {
		t.Fatalf("chaos: /debug/queue: no predicted_wait_threshold in %.200s (%v)", b, err)
	}
	return *st.Threshold
}

// seriesCount counts the series on the router's /metrics page.
func seriesCount(t *testing.T, r *router) int {
	t.Helper()
	resp, err := http.Get(r.url() + "/metrics")
	if err != nil {
		t.Fatalf("chaos: metrics: %v", err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	n := 0
	for line := range bytes.SplitSeq(b, []byte("\n")) {
		if len(line) > 0 && line[0] != '#' {
			n++
		}
	}
	return n
}

func mustScrape(t *testing.T, r *router) map[string]float64 {
	t.Helper()
	m, err := r.metrics()
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// waitFor polls cond every 100 ms until it holds or timeout passes.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("chaos: waited %v for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
