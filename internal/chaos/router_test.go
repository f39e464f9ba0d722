package chaos

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// backend is one replica as the router sees it: its HTTP URL and KV-event
// sockets (possibly a fault proxy's in front of the engine's).
type backend struct {
	URL, KVEvents, KVReplay string
	// Role is the replica's role in a disaggregated cluster ("": both).
	Role string
}

// router is one `prefixlb serve` process on a fixed loopback port, so that
// it can be killed and restarted in place.
type router struct {
	dir  string
	port int
	args []string
	p    *proc
}

// routerFlags are the router's settings in the suite: short health checks
// and timeouts so that faults are found and healed within seconds.
var routerFlags = []string{
	"--policy", "e2",
	"--profile", "llama3.1-8b-h100",
	"--health-interval", "200ms",
	"--health-timeout", "500ms",
	"--eject-after", "2",
	"--readmit-after", "2",
	"--scrape-interval", "500ms",
	"--connect-timeout", "1s",
	"--response-header-timeout", "2s",
	"--idle-timeout", "3s",
	"--request-timeout", "20s",
	"--max-retries", "2",
	"--drain-timeout", "2s",
	"--log-level", "warn",
}

// newRouter writes a config naming backends and starts the router.
func newRouter(t testing.TB, dir string, backends []backend, extra ...string) *router {
	t.Helper()
	return newRouterYAML(t, dir, backends, "", extra...)
}

// newRouterYAML is newRouter with more of the config file: yaml is
// appended after the backends (top-level keys such as tenants).
func newRouterYAML(t testing.TB, dir string, backends []backend, yaml string, extra ...string) *router {
	t.Helper()
	var cfg strings.Builder
	cfg.WriteString("backends:\n")
	for _, b := range backends {
		fmt.Fprintf(&cfg, "- url: %q\n", b.URL)
		if b.KVEvents != "" {
			fmt.Fprintf(&cfg, "  kv_events: %q\n  kv_replay: %q\n", b.KVEvents, b.KVReplay)
		}
		if b.Role != "" {
			fmt.Fprintf(&cfg, "  role: %q\n", b.Role)
		}
	}
	cfg.WriteString(yaml)
	path := filepath.Join(dir, "router.yaml")
	if err := os.WriteFile(path, []byte(cfg.String()), 0o600); err != nil {
		t.Fatalf("chaos: write router config: %v", err)
	}
	r := &router{dir: dir, port: freePort(t)}
	r.args = append([]string{"serve", "--listen", "127.0.0.1:" + strconv.Itoa(r.port), "--config", path}, routerFlags...)
	r.args = append(r.args, extra...)
	r.start(t)
	return r
}

// url is the router's base URL.
func (r *router) url() string { return "http://127.0.0.1:" + strconv.Itoa(r.port) }

// start starts the router process (again) and waits until it is healthy.
func (r *router) start(t testing.TB) {
	t.Helper()
	r.p = startProc(t, r.dir, "router", r.args...)
	waitHealthy(t, r.p, r.url()+"/health", 15*time.Second)
}

// metrics scrapes the router's /metrics.
func (r *router) metrics() (map[string]float64, error) {
	return scrape(r.url() + "/metrics")
}

// replicaMetrics scrapes the router's /metrics, keeping only the series
// labelled replica=name.
func (r *router) replicaMetrics(name string) (map[string]float64, error) {
	return scrapeWhere(r.url()+"/metrics", "replica", name)
}

// scrape reads a Prometheus text page and sums every family's series.
func scrape(url string) (map[string]float64, error) {
	return scrapeWhere(url, "", "")
}

// scrapeWhere reads a Prometheus text page and sums every family's series
// that have label=value (label "": every series).
func scrapeWhere(url, label, value string) (map[string]float64, error) {
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return nil, fmt.Errorf("chaos: scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("chaos: scrape %s: status %d", url, resp.StatusCode)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("chaos: scrape %s: %w", url, err)
	}
	out := make(map[string]float64, len(fams))
	for name, f := range fams {
		sum := 0.0
		for _, m := range f.GetMetric() {
			if label != "" && !hasLabel(m.GetLabel(), label, value) {
				continue
			}
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Untyped != nil:
				sum += m.GetUntyped().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
		out[name] = sum
	}
	return out, nil
}

// hasLabel reports whether a series has label name=value.
func hasLabel[L interface {
	GetName() string
	GetValue() string
}](ls []L, name, value string) bool {
	for _, l := range ls {
		if l.GetName() == name {
			return l.GetValue() == value
		}
	}
	return false
}
