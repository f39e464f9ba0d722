package epp

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/promtest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// This file runs `prefixlb epp` as real processes: two of them sharing
// in-flight load through a real Redis server, in front of HTTP replicas
// that hold every request open, driven by an ext_proc client that behaves
// as Envoy does (envoy in server_test.go).

// buildPrefixlb builds the prefixlb binary into dir, without -race
// whatever this test binary was built with, so that the pickers run at
// full speed (as internal/chaos's TestMain does).
func buildPrefixlb(t *testing.T, dir string) string {
	t.Helper()
	bin := filepath.Join(dir, "prefixlb")
	cmd := exec.Command("go", "build", "-o", bin, "github.com/prefixlb/prefixlb/cmd/prefixlb")
	cmd.Env = append(os.Environ(), "GOFLAGS=-buildvcs=false")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build prefixlb: %v\n%s", err, out)
	}
	return bin
}

// holdReplica is a model server that counts the requests it holds open;
// they are answered when release is closed.
type holdReplica struct {
	srv     *httptest.Server
	arrived chan struct{} // one send per request, once counted
	release chan struct{}

	mu       sync.Mutex // guards inflight
	inflight int
}

func newHoldReplica(t *testing.T, n int) *holdReplica {
	h := &holdReplica{arrived: make(chan struct{}, n), release: make(chan struct{})}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			http.NotFound(w, r)
			return
		}
		h.mu.Lock()
		h.inflight++
		h.mu.Unlock()
		h.arrived <- struct{}{}
		select {
		case <-h.release:
		case <-r.Context().Done():
		}
		h.mu.Lock()
		h.inflight--
		h.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`)
	}))
	return h
}

// addr is the replica's "ip:port".
func (h *holdReplica) addr() string { return strings.TrimPrefix(h.srv.URL, "http://") }

func (h *holdReplica) count() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.inflight
}

// eppProc is one `prefixlb epp` process and an ext_proc connection to it.
type eppProc struct {
	cmd     *exec.Cmd
	log     string
	done    chan struct{} // closed once the process has exited
	conn    *grpc.ClientConn
	metrics string // its /metrics URL
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// startEPP starts bin epp with args plus its listen addresses and waits
// until its gRPC health says SERVING. The test's cleanup kills it.
func startEPP(t *testing.T, bin, dir, name string, args ...string) *eppProc {
	t.Helper()
	grpcAddr := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	metricsAddr := net.JoinHostPort("127.0.0.1", strconv.Itoa(freePort(t)))
	args = append([]string{"epp", "--grpc-listen", grpcAddr, "--health-listen", "", "--metrics-listen", metricsAddr,
		"--log-level", "warn"}, args...)
	f, err := os.CreateTemp(dir, name+"-*.log")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p := &eppProc{cmd: cmd, log: f.Name(), done: make(chan struct{}), metrics: "http://" + metricsAddr + "/metrics"}
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		if p.conn != nil {
			p.conn.Close()
		}
		_ = cmd.Process.Signal(syscall.SIGKILL)
		<-p.done
		if t.Failed() {
			b, _ := os.ReadFile(p.log)
			t.Logf("log of %s:\n%s", name, bytes.TrimSpace(b))
		}
	})
	// Retry the dial every 20-100 ms while the process starts (gRPC's
	// default backoff starts at 1 s).
	bo := grpc.ConnectParams{Backoff: backoff.Config{BaseDelay: 20 * time.Millisecond, Multiplier: 1.6, MaxDelay: 100 * time.Millisecond},
		MinConnectTimeout: time.Second}
	if p.conn, err = grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithConnectParams(bo)); err != nil {
		t.Fatal(err)
	}
	// Wait for SERVING on the health stream (it waits for the process to
	// listen), or for the process to die.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	go func() {
		select {
		case <-p.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	w, err := healthpb.NewHealthClient(p.conn).Watch(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	for err == nil {
		var r *healthpb.HealthCheckResponse
		if r, err = w.Recv(); err == nil && r.Status == healthpb.HealthCheckResponse_SERVING {
			return p
		}
	}
	b, _ := os.ReadFile(p.log)
	t.Fatalf("%s never served: %v; log:\n%s", name, err, bytes.TrimSpace(b))
	return nil
}

// procBurst is one burst's figures.
type procBurst struct {
	worst, final float64
	counts       []int
	perProc      []int // requests sent through each process
}

// procBurstRun starts procs pickers over replicas fresh HTTP replicas
// (sharing through Redis at redisAddr unless ""), sends n requests
// alternately through them, each forwarded to its primary endpoint as
// Envoy would and held open there, and measures the max/min in-flight
// ratio across the replicas (their own counts) after each arrival.
// Requests go in waves of wave: a wave's requests are all sent before any
// answer is read, so that they are decided at the same time (wave 1: in
// sequence, each decision awaited); the ratio is measured after each wave.
func procBurstRun(t *testing.T, bin, policy string, procs, replicas, n, wave int, redisAddr string) procBurst {
	t.Helper()
	dir := t.TempDir()
	var reps []*holdReplica
	var backends []string
	byAddr := map[string]*holdReplica{}
	for range replicas {
		h := newHoldReplica(t, n)
		reps = append(reps, h)
		backends = append(backends, h.addr())
		byAddr[h.addr()] = h
	}
	// Requests forwarded to the replicas are owned by this run: released
	// and joined before the replicas close.
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	var fwd sync.WaitGroup
	fwdErr := make(chan error, n)
	defer func() {
		for _, h := range reps {
			close(h.release)
		}
		fwd.Wait()
		client.CloseIdleConnections()
		for _, h := range reps {
			h.srv.Close()
		}
	}()

	pool := fmt.Sprintf("proc-burst-%s-%d", policy, time.Now().UnixNano())
	var ps []*eppProc
	for i := range procs {
		args := []string{"--backend", strings.Join(backends, ","), "--policy", policy,
			"--seed", strconv.Itoa(i + 1), "--scrape-interval", "0"}
		if redisAddr != "" {
			args = append(args, "--state", "redis://"+redisAddr+"/0", "--pool", pool, "--router-id", fmt.Sprint("p", i))
		}
		ps = append(ps, startEPP(t, bin, dir, fmt.Sprintf("epp-%d", i), args...))
	}

	rng := rand.New(rand.NewPCG(7, 1)) // TestBurstSpread's prompts
	out := procBurst{perProc: make([]int, procs)}
	for start := 0; start < n; start += wave {
		end := min(start+wave, n)
		// The wave's requests all go out before any answer is read.
		streams := make([]*envoy, end-start)
		bodies := make([][]byte, end-start)
		for k := start; k < end; k++ {
			bodies[k-start] = burstBody(rng, k)
			e := newEnvoy(t, ps[k%procs].conn) // the stream stays open: the pick stays in flight
			e.request("/v1/completions", bodies[k-start], 16384, nil)
			streams[k-start] = e
		}
		var arrivals []*holdReplica
		for k := start; k < end; k++ {
			body := bodies[k-start]
			h, _, echoed := streams[k-start].decision()
			if !bytes.Equal(echoed, body) {
				t.Fatalf("request %d: the body came back changed", k)
			}
			primary, _, _ := strings.Cut(h, ",")
			rep := byAddr[primary]
			if rep == nil {
				t.Fatalf("request %d: destination %q is no replica", k, h)
			}
			out.perProc[k%procs]++
			arrivals = append(arrivals, rep)
			fwd.Add(1)
			go func() { // Envoy forwards the request to the primary endpoint
				defer fwd.Done()
				resp, err := client.Post("http://"+primary+"/v1/completions", "application/json", bytes.NewReader(body))
				if err != nil {
					fwdErr <- err
					return
				}
				resp.Body.Close()
			}()
		}
		for _, rep := range arrivals {
			select {
			case <-rep.arrived:
			case err := <-fwdErr:
				t.Fatalf("forwarding to a replica: %v", err)
			}
		}
		out.counts = out.counts[:0]
		for _, r := range reps {
			out.counts = append(out.counts, r.count())
		}
		if end >= replicas {
			out.worst = max(out.worst, maxMin(out.counts))
		}
	}
	out.final = maxMin(out.counts)

	// The processes' own metrics agree with what the replicas hold.
	for i, p := range ps {
		fams := promtest.Scrape(t, nil, p.metrics)
		if v, _ := promtest.Sum(fams, "prefixlb_decisions_total", "policy", policy); int(v) != out.perProc[i] {
			t.Errorf("process %d: prefixlb_decisions_total = %v, want the %d requests sent through it", i, v, out.perProc[i])
		}
		if v, _ := promtest.Sum(fams, "prefixlb_inflight"); int(v) != out.perProc[i] {
			t.Errorf("process %d: prefixlb_inflight = %v, want %d (every pick held open)", i, v, out.perProc[i])
		}
		wantShared := 0
		if redisAddr != "" {
			wantShared = n - out.perProc[i]
		}
		// The last read of the shared state precedes this process's last
		// decision: the other's picks since may be missing.
		if v, _ := promtest.Sum(fams, "prefixlb_epp_shared_inflight"); int(v) > wantShared || int(v) < wantShared-wave {
			t.Errorf("process %d: prefixlb_epp_shared_inflight = %v, want %d to %d", i, v, wantShared-wave, wantShared)
		}
		for _, kind := range []string{errSharedRead, errSharedWrite} {
			if v, _ := promtest.Sum(fams, "prefixlb_epp_errors_total", "kind", kind); v != 0 {
				t.Errorf("process %d: %v %s errors (Redis calls over 100 ms? the machine may be overloaded)", i, v, kind)
			}
		}
	}
	return out
}

// TestBurstSpreadProcesses is TestBurstSpread with real processes: two
// `prefixlb epp` processes sharing in-flight load through a real Redis
// server spread a burst over the replicas as one process does.
//
// The burst is TestBurstSpread's (30 distinct 1-8k-token prompts, 4
// replicas, none finishing), sent alternately through the processes, each
// forwarded to its replica as Envoy would and held open there; the
// in-flight counts are the replicas' own, read after every arrival.
//
// In sequence (each decision awaited before the next request), the bound
// is: with Redis, the two processes' worst max/min ratio is at most one
// process's (+0.01 for rounding). Each picker reads the others' load from
// Redis before it decides and publishes its pick before it answers, so
// every decision sees every earlier one, exactly as one router does; the
// processes are seeded 1 and 2 as TestBurstSpread's routers are, so the
// figures are the in-process ones. Without Redis each process balances
// only its own half and the spread is worse.
//
// In pairs (one request per process at the same instant), the two
// decisions of a pair may each miss the other; that race is what Redis
// cannot remove, and the figures are reported, not bounded: the order in
// which the pickers and Redis serve two simultaneous requests is the
// scheduler's.
func TestBurstSpreadProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds prefixlb and runs epp processes: not with -short")
	}
	redisAddr := os.Getenv("PREFIXLB_TEST_REDIS")
	if redisAddr == "" {
		t.Skip("PREFIXLB_TEST_REDIS is not set: give the host:port of a Redis server (.ci/run starts one; locally: " +
			"redis-server --port 6390 --save '' --daemonize yes; PREFIXLB_TEST_REDIS=127.0.0.1:6390)")
	}
	if c, err := net.DialTimeout("tcp", redisAddr, time.Second); err != nil {
		t.Fatalf("PREFIXLB_TEST_REDIS=%s: no Redis server there: %v", redisAddr, err)
	} else {
		c.Close()
	}
	bin := buildPrefixlb(t, t.TempDir())
	const replicas, n = 4, 30
	// Each run is a subtest, so that its processes and streams end with it.
	run := func(t *testing.T, name, policy string, procs, wave int, redis string) (out procBurst) {
		t.Run(name, func(t *testing.T) { out = procBurstRun(t, bin, policy, procs, replicas, n, wave, redis) })
		return out
	}
	for _, pol := range []string{"e2", "least-load"} {
		t.Run(pol, func(t *testing.T) {
			for _, wave := range []int{1, 2} {
				how := map[int]string{1: "in sequence", 2: "in pairs"}[wave]
				one := run(t, how+"/one", pol, 1, wave, "")
				two := run(t, how+"/two", pol, 2, wave, "")
				red := run(t, how+"/two-redis", pol, 2, wave, redisAddr)
				if t.Failed() {
					return
				}
				t.Logf("%s, %d replicas, burst of %d through epp processes, %s: worst max/min in flight (final, counts)", pol, replicas, n, how)
				t.Logf("  one process:                %.2f (%.2f %v)", one.worst, one.final, one.counts)
				t.Logf("  two processes, no sharing:  %.2f (%.2f %v)", two.worst, two.final, two.counts)
				t.Logf("  two processes, Redis:       %.2f (%.2f %v)", red.worst, red.final, red.counts)
				if wave == 1 && red.worst > one.worst+0.01 {
					t.Errorf("two processes sharing through Redis: worst spread %.2f, want ≤ one process's %.2f", red.worst, one.worst)
				}
			}
		})
	}
}
