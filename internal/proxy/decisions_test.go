package proxy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/decisiontest"
	"github.com/prefixlb/prefixlb/internal/proxy"
	"github.com/prefixlb/prefixlb/internal/tenancy"
)

// serveGolden pins the replica and branch `prefixlb serve` (internal/proxy)
// chose for every request of decisiontest.Replay, per policy and cluster.
// It may be regenerated (`go test ./internal/proxy -run
// TestServeDecisionsUnchanged -update-golden`) only for an intended,
// documented change of decisions.
var serveGolden = filepath.Join("testdata", "decisions-serve.txt")

// TestServeDecisionsUnchanged replays decisiontest.Replay through `prefixlb
// serve`'s HTTP front door against fake replicas that answer at once, with
// a fixed number of requests in flight (decisiontest.FrontDoorRun.Window),
// and compares the replica, branch and matched tokens of every decision
// (the x-prefixlb-replica and x-prefixlb-route headers) with
// testdata/decisions-serve.txt. Issue 15's restructuring must leave them as
// they are.
func TestServeDecisionsUnchanged(t *testing.T) {
	out := decisiontest.ReplayFrontDoor(t, func(r decisiontest.FrontDoorRun, reqs []decisiontest.Request) (decisiontest.Run, error) {
		ds, err := serveReplay(r, reqs)
		return decisiontest.Run{Decisions: ds}, err
	})
	decisiontest.Check(t, serveGolden,
		"The decisions of `prefixlb serve` (internal/proxy) on decisiontest.Replay(96) over loopback HTTP, to three\n"+
			"fake replicas, with w requests in flight: TestServeDecisionsUnchanged (internal/proxy/decisions_test.go).", out)
}

// answer is a replayed request's outcome.
type answer struct {
	d   decisiontest.Decision
	err error
}

func serveReplay(r decisiontest.FrontDoorRun, reqs []decisiontest.Request) (ds []decisiontest.Decision, err error) {
	gate := decisiontest.NewGate()
	var srvs []*httptest.Server
	for _, e := range decisiontest.Engines(r.Cluster) {
		srvs = append(srvs, httptest.NewServer(gate.Wrap(e)))
	}
	defer func() {
		gate.Abort()
		for _, s := range srvs {
			s.Close()
		}
	}()
	cfg := proxy.DefaultConfig()
	for i, s := range srvs {
		cfg.Backends = append(cfg.Backends, proxy.Backend{Name: fmt.Sprintf("r%d", i), URL: s.URL})
	}
	cfg.Policy = r.Policy
	cfg.Explain = tenancy.ExplainAlways // the decisions are read from x-prefixlb-route
	cfg.Calibrate = false
	cfg.Seed = 1
	cfg.BackendKind = "vllm"
	cfg.HealthInterval = time.Hour
	cfg.ScrapeInterval = 0
	cfg.Logger = slog.New(slog.DiscardHandler)
	switch r.Cluster {
	case "scraped":
		cfg.ScrapeInterval = time.Hour
	case "llamacpp":
		cfg.BackendKind = "llamacpp"
	case "tokenizer":
		cfg.Tokenizer = "qwen3"
	}
	p, err := proxy.New(cfg)
	if err != nil {
		return nil, err
	}
	defer p.Close()
	srv := httptest.NewServer(p.Handler())
	defer srv.Close()
	defer gate.Abort() // before the servers close: they wait for held requests
	if r.Cluster == "scraped" || r.Cluster == "llamacpp" {
		// Run's first scrape (or slot count) is read at once; the next an
		// hour later. Wait for it before the replay.
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = p.Run(ctx)
		}()
		defer func() {
			cancel()
			<-done
		}()
		if err := awaitFeeds(srv.URL+"/debug/replicas", r.Cluster == "scraped", r.Cluster == "llamacpp"); err != nil {
			return nil, err
		}
	}
	client := srv.Client()
	answers := make([]chan answer, len(reqs))
	collect := func(k int) error {
		gate.Release(strconv.Itoa(k))
		a := <-answers[k]
		ds = append(ds, a.d)
		return a.err
	}
	for k, q := range reqs {
		answers[k] = make(chan answer, 1)
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			answers[k] <- send(client, srv.URL, q)
		}()
		if err := gate.Arrived(strconv.Itoa(k), ended); err != nil {
			if a := <-answers[k]; a.err != nil {
				err = a.err
			}
			return nil, err
		}
		if j := k - r.Window + 1; j >= 0 {
			if err := collect(j); err != nil {
				return nil, err
			}
		}
	}
	for j := max(len(reqs)-r.Window+1, 0); j < len(reqs); j++ {
		if err := collect(j); err != nil {
			return nil, err
		}
	}
	return ds, nil
}

// send sends q to the front door at base and reads its decision from the
// response headers. Reading the whole response waits for the proxy's
// handler to return, after it has reported the request's end to the
// router.
func send(client *http.Client, base string, q decisiontest.Request) answer {
	req, err := http.NewRequest(http.MethodPost, base+q.Path, bytes.NewReader(q.Body))
	if err != nil {
		return answer{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set(decisiontest.HoldHeader, strconv.Itoa(q.ID))
	if q.Session != "" {
		req.Header.Set("x-session-id", q.Session)
	}
	resp, err := client.Do(req)
	if err != nil {
		return answer{err: fmt.Errorf("request %d: %v", q.ID, err)}
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return answer{err: fmt.Errorf("request %d: read: %v", q.ID, err)}
	}
	if resp.StatusCode != http.StatusOK {
		return answer{err: fmt.Errorf("request %d: status %d: %s", q.ID, resp.StatusCode, b)}
	}
	branch, matched, err := decisiontest.ParseRoute(resp.Header.Get("x-prefixlb-route"))
	if err != nil {
		return answer{err: fmt.Errorf("request %d: %v", q.ID, err)}
	}
	return answer{d: decisiontest.Decision{ID: uint64(q.ID), Replica: resp.Header.Get("x-prefixlb-replica"),
		Branch: branch, Matched: matched}}
}

// awaitFeeds polls url (GET /debug/replicas) until every replica's load has
// been scraped (with load) and its slot count read (with slots).
func awaitFeeds(url string, load, slots bool) error {
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := http.Get(url)
		if err != nil {
			return err
		}
		var st struct {
			Replicas []struct {
				Name    string  `json:"name"`
				Waiting int     `json:"waiting"`
				KVUsage float64 `json:"kv_usage"`
				Slots   int     `json:"slots"`
			} `json:"replicas"`
		}
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if err != nil {
			return fmt.Errorf("GET /debug/replicas: %v", err)
		}
		ready := len(st.Replicas) > 0
		for _, r := range st.Replicas {
			ready = ready && (!load || r.Waiting >= 0 && r.KVUsage >= 0) && (!slots || r.Slots > 0)
		}
		if ready {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("replicas not scraped or detected after a minute: %+v", st.Replicas)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
