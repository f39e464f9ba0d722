// Package advise is `prefixlb advise`: which router to run for a given
// traffic. It prints the traffic's prefix-sharing statistics
// (internal/analyze), the capacity at an SLO of every policy on a simulated
// cluster (sweep.SearchCapacity, the search of `prefixlb sim --slo`) in one
// table, and the recommendation: the policy with the highest capacity and
// by how much it beats the next one and round-robin, ties within the
// search's tolerance said as ties. It answers the question Orbit's users
// ask (issue 18): what capacity does my traffic get from each router?
package advise

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"github.com/prefixlb/prefixlb/internal/analyze"
	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/capacity"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/sim/sweep"
	"github.com/prefixlb/prefixlb/internal/workload"
)

// DefaultPolicies are the policies advise compares unless told otherwise:
// the cache-blind baselines (round-robin, least-load), the plain
// longest-prefix rule, the peers' cache-aware routers (llm-d's precise
// scorer, SGLang's router) and E2.
const DefaultPolicies = "round-robin,least-load,prefix,llmd-precise,sglang,e2"

// Config is one advice: the flags of `prefixlb advise`.
type Config struct {
	// Sim is the simulated cluster, the workload or trace (Sim.Workload),
	// the policies compared and the SLO (Sim.SLO, required).
	Sim sweep.Config
	// BlockSize is the KV block size in tokens for the sharing statistics.
	BlockSize int
	// JSONPath gets the Document as JSON ("": none; "-": stdout instead of
	// the text); HTMLPath a self-contained HTML report ("": none).
	JSONPath string
	HTMLPath string
}

// DefaultConfig is `prefixlb advise`'s defaults: sim's cluster
// (sweep.DefaultConfig), the DefaultPolicies, no workload chosen yet
// (give a trace or a generator's name; a generated one has 1,000
// requests), 16-token blocks for the statistics. SLO is left to the user.
func DefaultConfig() Config {
	c := Config{Sim: sweep.DefaultConfig(), BlockSize: blocks.DefaultBlockSize}
	c.Sim.Policies = DefaultPolicies
	c.Sim.Workload = workload.DefaultFlags()
	c.Sim.Workload.Spec.Name = ""
	c.Sim.Workload.Spec.Requests = 1000
	return c
}

// Validate reports the first invalid setting.
func (c Config) Validate() error {
	f := c.Sim.Workload
	switch {
	case (f.Trace == "") == (f.Spec.Name == ""):
		return errors.New("advise: give exactly one of --trace FILE or --workload NAME")
	case strings.TrimSpace(c.Sim.SLO) == "":
		return errors.New("advise: --slo is required, e.g. --slo ttft_p90=2s")
	case c.Sim.Replicas < 1:
		return fmt.Errorf("advise: --replicas %d: want ≥ 1", c.Sim.Replicas)
	case c.BlockSize < 1:
		return fmt.Errorf("advise: --block-size %d: want ≥ 1", c.BlockSize)
	case c.Sim.Rates != "":
		return errors.New("advise: the capacity search chooses the rates (--rate sets where it starts)")
	}
	if _, err := capacity.ParseSLO(c.Sim.SLO); err != nil {
		return fmt.Errorf("advise: --slo: %w", err)
	}
	return nil
}

// PolicyCapacity is one policy's line of the advice.
type PolicyCapacity struct {
	Policy string `json:"policy"`
	// CapacityRPS is the highest rate the search found meeting the SLO
	// (0: not even its lowest); AboveMax: the search's highest rate still
	// met, so the capacity is at least CapacityRPS.
	CapacityRPS float64 `json:"capacity_rps"`
	AboveMax    bool    `json:"capacity_above_max,omitempty"`
	// AtCapacity is the run at the capacity (nil when no rate met).
	AtCapacity *report.Result `json:"at_capacity,omitempty"`
}

// Recommendation is the advice's answer.
type Recommendation struct {
	// Policy has the highest capacity ("" when no policy met the SLO at
	// any rate tried); Tied are the others whose capacity is within the
	// search's tolerance of it, so the search cannot tell them apart.
	Policy string   `json:"policy"`
	Tied   []string `json:"tied,omitempty"`
	// Next is the best policy outside the tie and VsNext Policy's capacity
	// over its (0 when none, or when Next met the SLO at no rate);
	// VsRoundRobin the same against round-robin (0 when round-robin was
	// not compared, is Policy or in the tie, or met at no rate).
	Next         string  `json:"next,omitempty"`
	VsNext       float64 `json:"vs_next,omitempty"`
	VsRoundRobin float64 `json:"vs_round_robin,omitempty"`
	// Text is the recommendation in words.
	Text string `json:"text"`
}

// Document is what `prefixlb advise --json` writes.
type Document struct {
	// Traffic is the traffic's sharing statistics (as `prefixlb analyze
	// --json` writes them).
	Traffic analyze.Document `json:"traffic"`
	// SLO, Replicas, Profile and Tolerance describe the question.
	SLO       string  `json:"slo"`
	Replicas  int     `json:"replicas"`
	Profile   string  `json:"profile"`
	Tolerance float64 `json:"slo_tolerance"`
	// Policies are the capacities, highest first.
	Policies       []PolicyCapacity `json:"policies"`
	Recommendation Recommendation   `json:"recommendation"`
	// Results are every simulated run of every search, with slo,
	// slo_met, goodput_rps and capacity_rps (as `prefixlb sim --slo
	// --json`).
	Results []report.Result `json:"results"`
}

// Run analyses the traffic, searches every policy's capacity at the SLO
// and prints the statistics, the capacity table and the recommendation to
// stdout (progress to stderr unless c.Sim.Quiet), and writes the JSON and
// HTML asked for.
func Run(ctx context.Context, c Config, stdout, stderr io.Writer) error {
	if err := c.Validate(); err != nil {
		return err
	}
	traffic, err := analyze.Analyze(analyze.Config{Workload: c.Sim.Workload, BlockSize: c.BlockSize}, stderr)
	if err != nil {
		return fmt.Errorf("advise: %w", err)
	}
	slo, pcs, err := sweep.SearchCapacity(ctx, c.Sim, stderr)
	if err != nil {
		return fmt.Errorf("advise: %w", err)
	}
	tol := c.Sim.SearchConfig(1).Tolerance
	ps := make([]capacity.Policy, len(pcs))
	for i, pc := range pcs {
		ps[i] = pc.Policy
	}
	doc := Document{Traffic: traffic, SLO: slo.String(), Replicas: c.Sim.Replicas, Profile: profileName(c.Sim),
		Tolerance: tol, Recommendation: Recommend(slo, ps, tol)}
	var records []report.RequestRecord
	for _, p := range Rank(ps) {
		line := PolicyCapacity{Policy: p.Name, CapacityRPS: p.Outcome.Capacity, AboveMax: p.Outcome.AboveMax}
		if r, ok := p.AtCapacity(); ok {
			line.AtCapacity = &r
		}
		doc.Policies = append(doc.Policies, line)
	}
	for _, pc := range pcs {
		doc.Results = append(doc.Results, pc.Points...)
		records = append(records, pc.Records()...)
	}
	var text bytes.Buffer
	if err := writeText(&text, c, doc, slo, ps); err != nil {
		return err
	}
	if c.JSONPath == "-" {
		if err := writeJSON(stdout, doc); err != nil {
			return err
		}
	} else if _, err := stdout.Write(text.Bytes()); err != nil {
		return err
	}
	if c.JSONPath != "" && c.JSONPath != "-" {
		if err := writeJSONFile(c.JSONPath, doc); err != nil {
			return err
		}
	}
	if c.HTMLPath != "" {
		if err := writeHTML(c.HTMLPath, c, doc, slo, ps, records); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "wrote %s\n", c.HTMLPath)
	}
	return nil
}

func profileName(c sweep.Config) string {
	if c.ReplicaProfiles != "" {
		return c.ReplicaProfiles
	}
	return c.Profile
}

// Rank returns ps sorted by capacity, highest first; equal capacities keep
// their order.
func Rank(ps []capacity.Policy) []capacity.Policy {
	out := slices.Clone(ps)
	slices.SortStableFunc(out, func(a, b capacity.Policy) int { return cmp.Compare(b.Outcome.Capacity, a.Outcome.Capacity) })
	return out
}

// Recommend names the policy of ps with the highest capacity at slo and
// says by how much it beats the next one and round-robin. A capacity
// search brackets each policy's true capacity within [C, C·(1+tol)], so
// a policy whose C·(1+tol) reaches the best one's C cannot be told apart
// from it: it is reported as tied, and the comparison is made with the
// best policy outside the tie.
func Recommend(slo capacity.SLO, ps []capacity.Policy, tol float64) Recommendation {
	ranked := Rank(ps)
	if len(ranked) == 0 || ranked[0].Outcome.Capacity <= 0 {
		return Recommendation{Text: fmt.Sprintf("no policy met %s at any rate tried: the cluster is too small for this traffic at this objective (more replicas, or a looser objective)", slo)}
	}
	best := ranked[0]
	rec := Recommendation{Policy: best.Name}
	caps := []string{best.CapacityString()}
	rest := ranked[1:]
	for len(rest) > 0 && rest[0].Outcome.Capacity > 0 && rest[0].Outcome.Capacity*(1+tol) >= best.Outcome.Capacity {
		rec.Tied = append(rec.Tied, rest[0].Name)
		caps = append(caps, rest[0].CapacityString())
		rest = rest[1:]
	}
	var b strings.Builder
	if len(rec.Tied) == 0 {
		fmt.Fprintf(&b, "run %s: %s req/s at %s", best.Name, best.CapacityString(), slo)
	} else {
		fmt.Fprintf(&b, "run %s: a tie within %g%% (the search's tolerance) at %s, %s req/s",
			strings.Join(append([]string{best.Name}, rec.Tied...), " or "), 100*tol, slo, strings.Join(caps, " and "))
	}
	if len(rest) > 0 {
		next := rest[0]
		rec.Next = next.Name
		if next.Outcome.Capacity > 0 {
			rec.VsNext = best.Outcome.Capacity / next.Outcome.Capacity
			fmt.Fprintf(&b, ", %s %s", times(rec.VsNext, best), next.Name)
		} else {
			fmt.Fprintf(&b, "; %s met it at no rate tried", next.Name)
		}
	}
	for _, p := range rest {
		if p.Name != "round-robin" || p.Name == rec.Next {
			continue
		}
		if p.Outcome.Capacity > 0 {
			rec.VsRoundRobin = best.Outcome.Capacity / p.Outcome.Capacity
			fmt.Fprintf(&b, ", %s round-robin", times(rec.VsRoundRobin, best))
		} else {
			b.WriteString("; round-robin met it at no rate tried")
		}
	}
	if rec.Next == "round-robin" {
		rec.VsRoundRobin = rec.VsNext
	}
	if best.Outcome.AboveMax {
		b.WriteString(" (its search's highest rate still met: raise --slo-max-rate to see how far it goes)")
	}
	rec.Text = b.String()
	return rec
}

// times renders a ratio of capacities: "1.71×", "≥ 1.71×" when the best
// capacity is only a lower bound.
func times(x float64, best capacity.Policy) string {
	s := fmt.Sprintf("%.2f×", x)
	if best.Outcome.AboveMax {
		s = "≥ " + s
	}
	return s
}

// writeText prints the advice: the traffic, the capacities, the
// recommendation.
func writeText(w io.Writer, c Config, doc Document, slo capacity.SLO, ps []capacity.Policy) error {
	fmt.Fprintln(w, "traffic:")
	if err := doc.Traffic.WriteText(w); err != nil {
		return err
	}
	fmt.Fprintf(w, "\ncapacity at %s on %d × %s (each a search of simulated runs, bisection to %g%%):\n", slo, doc.Replicas, doc.Profile, 100*doc.Tolerance)
	if err := capacity.WriteTable(w, slo, Rank(ps)); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "\nrecommendation: %s\n", doc.Recommendation.Text)
	return err
}

func writeJSON(w io.Writer, doc Document) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(doc); err != nil {
		return fmt.Errorf("advise: write json: %w", err)
	}
	return nil
}

func writeJSONFile(path string, doc Document) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("advise: %w", err)
	}
	if err := writeJSON(f, doc); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("advise: %w", err)
	}
	return nil
}

// writeHTML writes the self-contained report: the recommendation, the
// capacity table, the goodput along each search and the traffic's
// statistics, then every run's results and charts (internal/report's) and
// the distributions of the runs at capacity.
func writeHTML(path string, c Config, doc Document, slo capacity.SLO, ps []capacity.Policy, records []report.RequestRecord) error {
	var capTable, sweepTable, traffic strings.Builder
	if err := capacity.WriteTable(&capTable, slo, Rank(ps)); err != nil {
		return err
	}
	if err := capacity.WriteSweep(&sweepTable, slo, ps); err != nil {
		return err
	}
	if err := doc.Traffic.WriteText(&traffic); err != nil {
		return err
	}
	sections := []report.Section{
		{Title: "Recommendation", Text: doc.Recommendation.Text},
		{Title: fmt.Sprintf("Capacity at %s on %d × %s", slo, doc.Replicas, doc.Profile), Text: capTable.String()},
		{Title: "Goodput along each search", Text: sweepTable.String()},
		{Title: "Traffic: prefix sharing", Text: traffic.String()},
	}
	note := fmt.Sprintf("prefixlb advise: %s, %d × %s, policies %s, %s (bisection to %g%%). The results below are every simulated run; the distributions those at each policy's capacity.",
		doc.Traffic.Source, doc.Replicas, doc.Profile, c.Sim.Policies, slo, 100*doc.Tolerance)
	if err := report.WriteHTMLSectionsFile(path, sections, doc.Results, records, note); err != nil {
		return fmt.Errorf("advise: %w", err)
	}
	return nil
}
