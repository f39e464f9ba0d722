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
// proxy, and (always) a TCP proxy on its KV-event stream.
type cluster struct {
	dir       string
	engines   []*engine
	front     *front    // in front of engine 0's HTTP, or nil
	httpProxy *tcpProxy // in front of engine 0's HTTP, or nil
	kvProxy   *tcpProxy // in front of engine 0's KV-event PUB socket
	router    *router
}

// clusterOpts chooses engine 0's HTTP path and adds router flags.
type clusterOpts struct {
	front, httpProxy bool
	// routerFlags are appended to the router's command line (later flags
	// win over routerFlags' defaults).
	routerFlags []string
}

func newCluster(t *testing.T, o clusterOpts) *cluster {
	t.Helper()
	c := &cluster{dir: t.TempDir()}
	for i := range 3 {
		c.engines = append(c.engines, newEngine(t, c.dir, fmt.Sprintf("engine%d", i)))
	}
	var bs []backend
	for i, e := range c.engines {
		b := backend{URL: e.url(), KVEvents: e.kvEndpoint(), KVReplay: e.replayEndpoint()}
		if i == 0 {
			c.kvProxy = newTCPProxy(t, fmt.Sprintf("127.0.0.1:%d", e.kvPort))
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
	c.router = newRouter(t, c.dir, bs, o.routerFlags...)
	return c
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
}

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
			name:  "kv stream cut",
			fault: func(_ *testing.T, c *cluster) { c.kvProxy.cut(true) },
			heal:  func(_ *testing.T, c *cluster) { c.kvProxy.heal() },
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
		t.Skip("chaos: starts processes for ~3 minutes; not under -short")
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
	fmt.Fprintf(&b, "| %-18s | %4s | %9s | %7s | %7s | %12s | %11s | %4s | %7s | %s | %s | %8s |\n",
		"fault", "sent", "completed", "retried", "retries", "clean errors", "router conn", "lost", "unclean", "hit before→during→after", "ttft p50 ms before→during→after", "recovery")
	for _, r := range rows {
		rec := "—"
		if r.Recovery >= 0 {
			rec = r.Recovery.Round(10 * time.Millisecond).String()
		}
		fmt.Fprintf(&b, "| %-18s | %4d | %9d | %7d | %7d | %12d | %11d | %4d | %7d | %.2f→%.2f→%.2f | %.1f→%.1f→%.1f | %8s |\n",
			r.Scenario, r.Sent, r.Completed, r.Retried, r.RetriesMetric, r.Clean, r.RouterConn, r.Lost, r.Unclean,
			r.Base.hit, r.During.hit, r.After.hit, r.Base.ttftP50, r.During.ttftP50, r.After.ttftP50, rec)
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
	ct, start, wait := runLoad(ctx, c.router.url(), reqs, loadDuration)
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
	healStart := time.Now()
	sc.heal(t, c)
	healT := time.Since(start)
	healTook := time.Since(healStart)

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
	r.Notes = strings.Join(notes, " ")
	end := time.Duration(out.Records[len(out.Records)-1].SentS * float64(time.Second))
	r.Base = quality(out.Records, warmUp, faultT)
	r.During = quality(out.Records, faultT, healT)
	r.Recovery = recovery(out.Records, r.Base, healT, end, recoveryWin)
	if r.Recovery >= 0 {
		r.After = quality(out.Records, healT+r.Recovery, healT+r.Recovery+recoveryWin)
	} else {
		r.After = quality(out.Records, healT, end)
	}
	return r
}
