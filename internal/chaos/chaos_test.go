package chaos

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// The schedule of every scenario, from the start of its load: a warm-up,
// the baseline window, the fault, then the healed cluster until the end.
const (
	warmUp       = 2 * time.Second
	faultAt      = 6 * time.Second
	healAt       = 10 * time.Second
	loadDuration = 18 * time.Second
	loadRate     = 15.0 // requests per second
	recoveryWin  = 2 * time.Second
)

// cluster is three engines and a router. Engine 0 is reached through the
// fault points a scenario asks for: a switchable HTTP front, a delaying TCP
// proxy, (always) a TCP proxy on its KV-event stream, and behind that a
// ZeroMQ relay that can drop messages. The load may reach the router
// through a TCP proxy of its own.
type cluster struct {
	dir         string
	engines     []*engine
	front       *front    // in front of engine 0's HTTP, or nil
	httpProxy   *tcpProxy // in front of engine 0's HTTP, or nil
	kvProxy     *tcpProxy // in front of engine 0's KV-event PUB socket (or of kvRelay)
	kvRelay     *zmqRelay // between kvProxy and engine 0's PUB socket, or nil
	clientProxy *tcpProxy // between the load and the router, or nil
	router      *router
	// replica0 is engine 0's name in the router's metrics and logs.
	replica0 string

	// Set by a scenario's hooks, on the scenario's goroutine.
	notes     []string // figures for the row
	lagAtHeal float64  // the router's KV lag for engine 0 at the heal, seconds
}

// clusterOpts chooses engine 0's HTTP and KV-event paths, the load's path
// to the router, and adds router flags.
type clusterOpts struct {
	front, httpProxy bool
	kvRelay          bool // a zmqRelay behind kvProxy
	clientProxy      bool // a tcpProxy before the router, for the load
	// routerFlags are appended to the router's command line (later flags
	// win over routerFlags' defaults).
	routerFlags []string
	// pd makes engine 2 a prefill replica and engines 0 and 1 decode
	// replicas, under a disaggregating policy (docs/pd.md).
	pd bool
}

func newCluster(t *testing.T, o clusterOpts) *cluster {
	t.Helper()
	c := &cluster{dir: t.TempDir()}
	for i := range 3 {
		role := ""
		if o.pd {
			role = "decode"
			if i == 2 {
				role = "prefill"
			}
		}
		c.engines = append(c.engines, newEngineRole(t, c.dir, fmt.Sprintf("engine%d", i), role))
	}
	var bs []backend
	for i, e := range c.engines {
		b := backend{URL: e.url(), KVEvents: e.kvEndpoint(), KVReplay: e.replayEndpoint(), Role: e.role}
		if i == 0 {
			kvTarget := fmt.Sprintf("127.0.0.1:%d", e.kvPort)
			if o.kvRelay {
				c.kvRelay = newZMQRelay(t, e.kvEndpoint())
				kvTarget = c.kvRelay.addr()
			}
			c.kvProxy = newTCPProxy(t, kvTarget)
			b.KVEvents = "tcp://" + c.kvProxy.addr()
			switch {
			case o.front:
				c.front = newFront(t, e.url())
				b.URL = c.front.srv.URL
			case o.httpProxy:
				c.httpProxy = newTCPProxy(t, fmt.Sprintf("127.0.0.1:%d", e.http))
				b.URL = "http://" + c.httpProxy.addr()
			}
		}
		bs = append(bs, b)
	}
	c.replica0 = strings.TrimPrefix(bs[0].URL, "http://")
	c.router = newRouter(t, c.dir, bs, o.routerFlags...)
	if o.clientProxy {
		c.clientProxy = newTCPProxy(t, strings.TrimPrefix(c.router.url(), "http://"))
	}
	return c
}

// loadURL is where the load is sent: the router, or the proxy before it.
func (c *cluster) loadURL() string {
	if c.clientProxy != nil {
		return "http://" + c.clientProxy.addr()
	}
	return c.router.url()
}

// scenario is one fault: what to set up, inject and heal.
type scenario struct {
	name  string
	opts  clusterOpts
	fault func(t *testing.T, c *cluster)
	heal  func(t *testing.T, c *cluster)
	// routerFault: the router itself is restarted; connection errors from
	// it are expected (and counted apart).
	routerFault bool
	// probe, when set, runs just before the heal, to see that the fault
	// took effect; it may record figures with c.note.
	probe func(t *testing.T, c *cluster)
	// caughtUp, when set, says whether the router's view of the faulted
	// link is current again. runScenario polls it from the heal (every
	// 20 ms, at most viewTimeout) and reports the time it took as "view back".
	caughtUp func(c *cluster) (bool, error)
	// check, when set, asserts what is particular to the fault, on the
	// row and the router's metrics (summed over replicas) after the run.
	check func(t *testing.T, c *cluster, r row, m map[string]float64)
}

// Fault sizes of the link scenarios.
const (
	kvDelay     = 200 * time.Millisecond // one-way, on engine 0's KV-event stream
	clientDelay = 50 * time.Millisecond  // each way, between the load and the router
	kvGapEvery  = time.Second            // gap mode: one KV message let through per second
	viewTimeout = 10 * time.Second
)

func scenarios() []scenario {
	return []scenario{
		{name: "none (baseline)", fault: func(*testing.T, *cluster) {}, heal: func(*testing.T, *cluster) {}},
		{
			name:  "replica kill -9",
			fault: func(t *testing.T, c *cluster) { c.engines[1].kill9(t) },
			heal:  func(t *testing.T, c *cluster) { c.engines[1].start(t) },
		},
		{
			name:  "replica hangs",
			opts:  clusterOpts{front: true},
			fault: func(_ *testing.T, c *cluster) { c.front.setMode(modeHang) },
			heal:  func(_ *testing.T, c *cluster) { c.front.setMode(modePass) },
		},
		{
			name:  "replica 500s",
			opts:  clusterOpts{front: true},
			fault: func(_ *testing.T, c *cluster) { c.front.setMode(modeFail500) },
			heal:  func(_ *testing.T, c *cluster) { c.front.setMode(modePass) },
		},
		{
			name:  "replica garbage",
			opts:  clusterOpts{front: true},
			fault: func(_ *testing.T, c *cluster) { c.front.setMode(modeGarbage) },
			heal:  func(_ *testing.T, c *cluster) { c.front.setMode(modePass) },
		},
		{
			name:  "slow replica",
			opts:  clusterOpts{httpProxy: true},
			fault: func(_ *testing.T, c *cluster) { c.httpProxy.setDelay(50 * time.Millisecond) },
			heal:  func(_ *testing.T, c *cluster) { c.httpProxy.setDelay(0) },
		},
		{
			name:  "client link delayed",
			opts:  clusterOpts{clientProxy: true},
			fault: func(_ *testing.T, c *cluster) { c.clientProxy.setLatency(clientDelay) },
			heal:  func(_ *testing.T, c *cluster) { c.clientProxy.setLatency(0) },
			check: checkClientDelayed,
		},
		{
			name:  "kv stream cut",
			fault: func(_ *testing.T, c *cluster) { c.kvProxy.cut(true) },
			heal:  func(_ *testing.T, c *cluster) { c.kvProxy.heal() },
		},
		{
			name:     "kv stream delayed",
			fault:    func(_ *testing.T, c *cluster) { c.kvProxy.setLatency(kvDelay) },
			heal:     func(_ *testing.T, c *cluster) { c.kvProxy.setLatency(0) },
			probe:    probeKVLag,
			caughtUp: kvLagBack,
			check:    checkKVDelayed,
		},
		{
			name:     "kv stream gapped",
			opts:     clusterOpts{kvRelay: true},
			fault:    func(_ *testing.T, c *cluster) { c.kvRelay.setGap(kvGapEvery) },
			heal:     func(_ *testing.T, c *cluster) { c.kvRelay.setGap(0) },
			caughtUp: kvGapFilled,
			check:    checkKVGapped,
		},
		{
			// The prefill replica dies mid-run: every prefill leg fails and
			// the decode replicas prefill themselves until it is back.
			name:  "prefill replica kill -9",
			opts:  clusterOpts{pd: true, routerFlags: []string{"--policy", "round-robin-pd"}},
			fault: func(t *testing.T, c *cluster) { c.engines[2].kill9(t) },
			heal:  func(t *testing.T, c *cluster) { c.engines[2].start(t) },
			check: checkPrefillKilled,
		},
		{
			name:        "router restart",
			fault:       func(t *testing.T, c *cluster) { c.router.p.kill(t) },
			heal:        func(t *testing.T, c *cluster) { c.router.start(t) },
			routerFault: true,
		},
	}
}

// TestChaos runs every fault scenario under open-loop load and checks that
// no request is lost and every failure is clean; it prints the fault matrix.
func TestChaos(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos: starts processes for ~4 minutes; not under -short")
	}
	var rows []row
	for _, sc := range scenarios() {
		t.Run(strings.ReplaceAll(sc.name, " ", "_"), func(t *testing.T) {
			r := runScenario(t, sc)
			rows = append(rows, r)
			t.Logf("%s%s", r, r.errorList())
			if r.Lost != 0 {
				t.Errorf("%s: %d requests lost (no answer within the client's timeout)", sc.name, r.Lost)
			}
			if r.Unclean != 0 {
				t.Errorf("%s: %d requests failed without a clean, attributable error", sc.name, r.Unclean)
			}
			if r.Sent != r.Completed+r.Clean+r.RouterConn+r.Lost+r.Unclean {
				t.Errorf("%s: outcomes do not add up to %d sent", sc.name, r.Sent)
			}
			if r.Recovery < 0 {
				t.Errorf("%s: routing quality not back within 20%% of before the fault by the end of the run", sc.name)
			}
		})
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nfault matrix (toolbench at %g/s, 3 engines at time scale %d, policy e2; fault %v–%v of %v)\n",
		loadRate, engineTimeScale, faultAt, healAt, loadDuration)
	fmt.Fprintf(&b, "| %-19s | %4s | %9s | %7s | %7s | %12s | %11s | %4s | %7s | %s | %s | %8s | %s |\n",
		"fault", "sent", "completed", "retried", "retries", "clean errors", "router conn", "lost", "unclean", "hit before→during→after", "ttft p50 ms before→during→after", "recovery", "notes")
	for _, r := range rows {
		rec := "—"
		if r.Recovery >= 0 {
			rec = r.Recovery.Round(10 * time.Millisecond).String()
		}
		fmt.Fprintf(&b, "| %-19s | %4d | %9d | %7d | %7d | %12d | %11d | %4d | %7d | %.2f→%.2f→%.2f | %.1f→%.1f→%.1f | %8s | %s |\n",
			r.Scenario, r.Sent, r.Completed, r.Retried, r.RetriesMetric, r.Clean, r.RouterConn, r.Lost, r.Unclean,
			r.Base.hit, r.During.hit, r.After.hit, r.Base.ttftP50, r.During.ttftP50, r.After.ttftP50, rec, r.Notes)
	}
	t.Log(b.String())
}

// runScenario starts a cluster, runs the load with sc's fault injected from
// faultAt to healAt, and measures the outcome.
func runScenario(t *testing.T, sc scenario) row {
	c := newCluster(t, sc.opts)
	reqs := genWorkload(t, "toolbench", int(loadRate*loadDuration.Seconds())+20, loadRate, 1)
	ctx, cancel := context.WithTimeout(context.Background(), loadDuration+90*time.Second)
	defer cancel()
	ct, start, wait := runLoad(ctx, c.loadURL(), reqs, loadDuration)
	t.Cleanup(func() { cancel(); _, _ = wait() })

	retriesBefore := 0.0
	sleepUntil(ctx, start.Add(faultAt))
	if sc.routerFault {
		if m, err := c.router.metrics(); err == nil {
			retriesBefore = m["prefixlb_retries_total"]
		}
	}
	faultT := time.Since(start)
	sc.fault(t, c)
	sleepUntil(ctx, start.Add(healAt))
	if sc.probe != nil {
		sc.probe(t, c)
	}
	healStart := time.Now()
	sc.heal(t, c)
	healT := time.Since(start)
	healTook := time.Since(healStart)
	viewBack := time.Duration(-1)
	if sc.caughtUp != nil {
		viewBack = waitCaughtUp(t, c, sc.caughtUp, healStart)
	}

	out, err := wait()
	if err != nil {
		t.Fatalf("%s: load: %v", sc.name, err)
	}
	r := row{Scenario: sc.name, FaultFor: healT - faultT, HealTook: healTook}
	r.tally(out.Records, sc.routerFault)
	r.Retried = int(ct.retried.Load())
	m, err := c.router.metrics()
	if err != nil {
		t.Fatalf("%s: %v", sc.name, err)
	}
	r.RetriesMetric = int(retriesBefore + m["prefixlb_retries_total"])
	var notes []string
	for _, k := range []string{"gaps_total", "lost_batches_total", "publisher_restarts_total", "redials_total", "replays_total"} {
		if v := m["prefixlb_kvevents_"+k]; v > 0 {
			notes = append(notes, fmt.Sprintf("kv %s=%g", strings.TrimSuffix(k, "_total"), v))
		}
	}
	if viewBack >= 0 {
		notes = append(notes, "view back "+viewBack.Round(time.Millisecond).String())
	}
	end := time.Duration(out.Records[len(out.Records)-1].SentS * float64(time.Second))
	r.Base = quality(out.Records, warmUp, faultT)
	r.During = quality(out.Records, faultT, healT)
	r.Recovery = recovery(out.Records, r.Base, healT, end, recoveryWin)
	if r.Recovery >= 0 {
		r.After = quality(out.Records, healT+r.Recovery, healT+r.Recovery+recoveryWin)
	} else {
		r.After = quality(out.Records, healT, end)
	}
	if sc.check != nil {
		sc.check(t, c, r, m)
	}
	r.Notes = strings.Join(append(notes, c.notes...), " ")
	return r
}

// note records a figure of the scenario for its row.
func (c *cluster) note(format string, args ...any) {
	c.notes = append(c.notes, fmt.Sprintf(format, args...))
}

// waitCaughtUp polls caughtUp until it holds and returns the time since
// from; on timeout it fails the test and returns -1.
func waitCaughtUp(t *testing.T, c *cluster, caughtUp func(*cluster) (bool, error), from time.Time) time.Duration {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last error
	for time.Since(from) < viewTimeout {
		ok, err := caughtUp(c)
		if ok {
			return time.Since(from)
		}
		last = err
		<-tick.C
	}
	t.Errorf("chaos: router's view of engine 0's KV events not current %v after the heal (last error: %v)", viewTimeout, last)
	return -1
}

// checkClientDelayed: the delay reached the clients (median TTFT up by at
// least most of a round trip while it lasted).
func checkClientDelayed(t *testing.T, _ *cluster, r row, _ map[string]float64) {
	if min := r.Base.ttftP50 + 0.8*float64(2*clientDelay/time.Millisecond); r.During.ttftP50 < min {
		t.Errorf("client link delayed: median TTFT %.1f ms during the fault, want ≥ %.1f ms (the delay did not take effect)", r.During.ttftP50, min)
	}
}

// probeKVLag records the router's KV-event lag for engine 0 just before the
// heal: the delay of the last batch it applied.
func probeKVLag(t *testing.T, c *cluster) {
	m, err := c.router.replicaMetrics(c.replica0)
	if err != nil {
		t.Errorf("kv stream delayed: %v", err)
		return
	}
	c.lagAtHeal = m["prefixlb_kvevents_lag_seconds"]
	c.note("kv lag at heal %.0fms", 1000*c.lagAtHeal)
}

// kvLagBack: the router applies engine 0's batches within 50 ms of their
// timestamps again (the engines and the router share the clock).
func kvLagBack(c *cluster) (bool, error) {
	m, err := c.router.replicaMetrics(c.replica0)
	if err != nil {
		return false, err
	}
	return m["prefixlb_kvevents_lag_seconds"] < 0.05, nil
}

// checkKVDelayed: the delay took effect, and the stream was delayed whole:
// no gap (nothing reordered or dropped), no lost batch.
func checkKVDelayed(t *testing.T, c *cluster, _ row, m map[string]float64) {
	if c.lagAtHeal < 0.8*kvDelay.Seconds() {
		t.Errorf("kv stream delayed: router's KV lag for engine 0 was %.3fs at the heal, want ≥ %.3fs (the delay did not take effect)",
			c.lagAtHeal, 0.8*kvDelay.Seconds())
	}
	for _, k := range []string{"gaps_total", "lost_batches_total"} {
		if v := m["prefixlb_kvevents_"+k]; v != 0 {
			t.Errorf("kv stream delayed: prefixlb_kvevents_%s = %g, want 0 (a delay reorders and drops nothing)", k, v)
		}
	}
}

// kvGapFilled: the router has applied every batch up to the last one the
// relay dropped.
func kvGapFilled(c *cluster) (bool, error) {
	st := c.kvRelay.stats()
	m, err := c.router.replicaMetrics(c.replica0)
	if err != nil {
		return false, err
	}
	return st.LastDropped < 0 || m["prefixlb_kvevents_last_seq"] >= float64(st.LastDropped), nil
}

// checkKVGapped: the relay made gaps on the live stream, the router saw
// them, and replay filled every one (no batch lost).
// checkPrefillKilled: requests were disaggregated before the fault and
// after the heal, and the prefill legs that failed meanwhile left the
// decode replicas to prefill (counted, none lost: runScenario checks that).
func checkPrefillKilled(t *testing.T, c *cluster, _ row, _ map[string]float64) {
	for outcome, want := range map[string]string{"disaggregated": "requests prefilled on the prefill replica", "prefill_failed": "prefill legs failed while it was down"} {
		m, err := scrapeWhere(c.router.url()+"/metrics", "outcome", outcome)
		if err != nil {
			t.Fatal(err)
		}
		if v := m["prefixlb_pd_requests_total"]; v == 0 {
			t.Errorf("prefill replica kill -9: prefixlb_pd_requests_total{outcome=%q} = 0, want > 0 (%s)", outcome, want)
		}
	}
}

func checkKVGapped(t *testing.T, c *cluster, _ row, m map[string]float64) {
	st := c.kvRelay.stats()
	c.note("relay dropped %d of %d msgs in %d gaps", st.Dropped, st.Dropped+st.Sent, st.Gaps)
	if st.Err != nil {
		t.Errorf("kv stream gapped: the relay stopped: %v", st.Err)
	}
	if st.Dropped == 0 || st.Gaps == 0 {
		t.Errorf("kv stream gapped: the relay dropped %d messages in %d gaps; the fault did not take effect", st.Dropped, st.Gaps)
	}
	if g := m["prefixlb_kvevents_gaps_total"]; g < 1 {
		t.Errorf("kv stream gapped: prefixlb_kvevents_gaps_total = %g, want ≥ 1 (the relay made %d gaps)", g, st.Gaps)
	}
	if v := m["prefixlb_kvevents_lost_batches_total"]; v != 0 {
		t.Errorf("kv stream gapped: prefixlb_kvevents_lost_batches_total = %g, want 0 (replay fills a gap)", v)
	}
	if v := m["prefixlb_kvevents_redials_total"]; v != 0 {
		t.Errorf("kv stream gapped: prefixlb_kvevents_redials_total = %g, want 0 (the connection stayed up)", v)
	}
}
