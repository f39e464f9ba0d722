// Package decisiontest pins routing decisions in golden files, so that a
// change that was not meant to move any decision (issue 15's restructuring:
// one cluster core under `serve` and `epp`, E2's cost as named terms) is
// proven not to. The tests that use it replay a fixed workload through a
// front door (internal/sim, internal/proxy, internal/epp, `prefixlb sim`)
// and hand it every decision in order; Check compares the decisions'
// checksum, and the checksum of the run's whole result where there is one,
// with the golden file, and names the first decision that differs.
//
// A golden file is text, one line per run:
//
//	NAME<TAB>n=N<TAB>decisions=SHA<TAB>result=SHA<TAB>scores=SHA<TAB>replicas=A,B<TAB>branches=X,Y<TAB>seq=...
//
// decisions hashes every decision's request id, replica, branch and
// matched tokens, in order; result the run's whole result (e.g. the
// simulator's JSON); scores the candidates' scores where the test sees them
// (informational: a change there alone is reported, not failed); seq is the
// decision list itself, two characters a decision (the replica's index in
// replicas, the branch's index in branches), to name the first that moved.
//
// Regenerate a golden with -update-golden (`go test ./internal/sim -run
// TestDecisionsUnchanged -update-golden`) only for an intended, documented
// change of decisions: the commit that does it says which runs moved and
// why.
package decisiontest

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

var update = flag.Bool("update-golden", false,
	"rewrite the decision goldens (testdata/decisions-*.txt) from this run: only for an intended, documented change of decisions")

// Updating reports whether this test run rewrites the goldens.
func Updating() bool { return *update }

// Decision is one routing decision as a golden pins it.
type Decision struct {
	// ID identifies the request: its index in the replayed workload.
	ID uint64
	// Replica is the chosen replica's name ("" when the request got none).
	Replica string
	// Branch is the rule that decided (policy.Decision.Branch).
	Branch string
	// Matched is the prompt tokens the router predicted cached on Replica.
	Matched int
}

// Run is one replay: its decisions in order and, optionally, its whole
// result.
type Run struct {
	// Name identifies the run in the golden file (no tab, no newline).
	Name string
	// Decisions are every decision of the run, in the order made.
	Decisions []Decision
	// Result, when non-nil, is the run's whole result (JSON, output): its
	// checksum is pinned too.
	Result []byte
	// Scores, when non-nil, renders the decisions' candidate scores: its
	// checksum is recorded, and a change in it alone is logged, not failed
	// (a reordering of floating-point sums may move a score by an ulp
	// without moving a decision).
	Scores []byte
	// Prefix says the run replayed only the first len(Decisions) requests
	// of its workload (a quick run, under the race detector): its
	// decisions are compared, replica and branch, with the first ones of
	// the golden's decision list, and nothing is recorded from it.
	Prefix bool
}

// seqDigits encode an index (replica, branch) in one character.
const seqDigits = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"

// line is one run's golden record.
type line struct {
	name               string
	n                  int
	decisions, result  string
	scores             string
	replicas, branches []string
	seq                string // "-" when not encodable
}

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:16])
}

// DecisionBytes is the canonical rendering of ds that the decisions
// checksum hashes.
func DecisionBytes(ds []Decision) []byte {
	var b bytes.Buffer
	for _, d := range ds {
		fmt.Fprintf(&b, "%d %s %s %d\n", d.ID, d.Replica, d.Branch, d.Matched)
	}
	return b.Bytes()
}

func record(r Run) line {
	l := line{name: r.Name, n: len(r.Decisions), decisions: digest(DecisionBytes(r.Decisions)), result: "-", scores: "-"}
	if r.Result != nil {
		l.result = digest(r.Result)
	}
	if r.Scores != nil {
		l.scores = digest(r.Scores)
	}
	ri, bi := map[string]int{}, map[string]int{}
	var seq strings.Builder
	for _, d := range r.Decisions {
		if _, ok := ri[d.Replica]; !ok {
			ri[d.Replica] = len(l.replicas)
			l.replicas = append(l.replicas, d.Replica)
		}
		if _, ok := bi[d.Branch]; !ok {
			bi[d.Branch] = len(l.branches)
			l.branches = append(l.branches, d.Branch)
		}
	}
	encodable := len(l.replicas) <= len(seqDigits) && len(l.branches) <= len(seqDigits)
	for _, s := range append(append([]string(nil), l.replicas...), l.branches...) {
		if strings.ContainsAny(s, ",\t\n") {
			encodable = false
		}
	}
	if !encodable {
		l.seq = "-"
		return l
	}
	for _, d := range r.Decisions {
		seq.WriteByte(seqDigits[ri[d.Replica]])
		seq.WriteByte(seqDigits[bi[d.Branch]])
	}
	l.seq = seq.String()
	return l
}

func (l line) String() string {
	return fmt.Sprintf("%s\tn=%d\tdecisions=%s\tresult=%s\tscores=%s\treplicas=%s\tbranches=%s\tseq=%s",
		l.name, l.n, l.decisions, l.result, l.scores, strings.Join(l.replicas, ","), strings.Join(l.branches, ","), l.seq)
}

func parseLine(s string) (line, error) {
	f := strings.Split(s, "\t")
	if len(f) != 8 {
		return line{}, fmt.Errorf("%d tab-separated fields, want 8", len(f))
	}
	l := line{name: f[0]}
	get := func(i int, key string) (string, error) {
		v, ok := strings.CutPrefix(f[i], key+"=")
		if !ok {
			return "", fmt.Errorf("field %d is %q, want %s=...", i+1, f[i], key)
		}
		return v, nil
	}
	var err error
	var n, reps, brs string
	if n, err = get(1, "n"); err != nil {
		return l, err
	}
	if l.n, err = strconv.Atoi(n); err != nil {
		return l, fmt.Errorf("n: %w", err)
	}
	if l.decisions, err = get(2, "decisions"); err != nil {
		return l, err
	}
	if l.result, err = get(3, "result"); err != nil {
		return l, err
	}
	if l.scores, err = get(4, "scores"); err != nil {
		return l, err
	}
	if reps, err = get(5, "replicas"); err != nil {
		return l, err
	}
	if brs, err = get(6, "branches"); err != nil {
		return l, err
	}
	if l.seq, err = get(7, "seq"); err != nil {
		return l, err
	}
	if l.n > 0 {
		l.replicas, l.branches = strings.Split(reps, ","), strings.Split(brs, ",")
	}
	return l, nil
}

// decoded is a golden's decision at one position: replica and branch.
type decoded struct{ replica, branch string }

func (l line) decode() ([]decoded, bool) {
	if l.seq == "-" || len(l.seq) != 2*l.n {
		return nil, false
	}
	out := make([]decoded, l.n)
	for i := range out {
		r := strings.IndexByte(seqDigits, l.seq[2*i])
		b := strings.IndexByte(seqDigits, l.seq[2*i+1])
		if r < 0 || r >= len(l.replicas) || b < 0 || b >= len(l.branches) {
			return nil, false
		}
		out[i] = decoded{l.replicas[r], l.branches[b]}
	}
	return out, true
}

// Check compares runs with the golden file at path (relative to the test's
// package directory); with -update-golden it rewrites the file instead,
// headed by header (one or more lines, each written as a comment). Every
// run that differs is reported, naming the first decision that moved.
func Check(t testing.TB, path, header string, runs []Run) {
	t.Helper()
	seen := map[string]bool{}
	for _, r := range runs {
		if r.Name == "" || strings.ContainsAny(r.Name, "\t\n") {
			t.Fatalf("decisiontest: bad run name %q", r.Name)
		}
		if seen[r.Name] {
			t.Fatalf("decisiontest: run %q twice", r.Name)
		}
		seen[r.Name] = true
	}
	if *update {
		for _, r := range runs {
			if r.Prefix {
				t.Fatalf("decisiontest: run %q is a prefix of its replay: record the goldens without the race detector", r.Name)
			}
		}
		write(t, path, header, runs)
		return
	}
	golden, order, err := read(path)
	if err != nil {
		t.Fatalf("decisiontest: %v (record the goldens with -update-golden)", err)
	}
	failures, notes := compare(path, golden, order, runs)
	for _, n := range notes {
		t.Log(n)
	}
	for _, f := range failures {
		t.Error(f)
	}
	if len(failures) > 0 {
		t.Logf("%d of %d runs differ from %s. Regenerate it (-update-golden) only for an intended, documented change of decisions.",
			len(failures), len(order), path)
	}
}

// compare checks runs against the golden records (by name, in file order
// order) read from path: one failure per run that differs, and notes.
func compare(path string, golden map[string]line, order []string, runs []Run) (failures, notes []string) {
	seen := map[string]bool{}
	for _, r := range runs {
		seen[r.Name] = true
		got := record(r)
		want, ok := golden[r.Name]
		switch {
		case ok && r.Prefix:
			if msg := comparePrefix(r, want); msg != "" {
				failures = append(failures, fmt.Sprintf("run %q (its first %d decisions): %s", r.Name, len(r.Decisions), msg))
			}
		case !ok:
			failures = append(failures, fmt.Sprintf("run %q: not in %s (a new run? add it with -update-golden, in a change of its own)", r.Name, path))
			continue
		case got.decisions != want.decisions:
			failures = append(failures, fmt.Sprintf("run %q: decisions changed: %s", r.Name, explain(r, got, want)))
		case got.result != want.result:
			failures = append(failures, fmt.Sprintf("run %q: every decision is unchanged, but the run's result is not: checksum %s, golden %s", r.Name, got.result, want.result))
		case got.scores != want.scores:
			notes = append(notes, fmt.Sprintf("note: run %q: the candidates' scores moved (checksum %s, golden %s) though no decision did", r.Name, got.scores, want.scores))
		}
	}
	for _, name := range order {
		if !seen[name] {
			failures = append(failures, fmt.Sprintf("run %q is in %s but was not run", name, path))
		}
	}
	return failures, notes
}

// comparePrefix compares run r, a prefix of its replay, with the first
// decisions of want; "" when they agree.
func comparePrefix(r Run, want line) string {
	wd, ok := want.decode()
	if !ok {
		return "the golden keeps no decision list to compare a prefix with"
	}
	if len(r.Decisions) > len(wd) {
		return fmt.Sprintf("%d decisions, more than the golden's %d", len(r.Decisions), len(wd))
	}
	for i, d := range r.Decisions {
		if d.Replica != wd[i].replica || d.Branch != wd[i].branch {
			return fmt.Sprintf("decisions changed: first difference at decision %d (request %d): %s/%s, golden %s/%s",
				i, d.ID, d.Replica, d.Branch, wd[i].replica, wd[i].branch)
		}
	}
	return ""
}

// explain names the first decision of run r (recorded as got) that differs
// from the golden want.
func explain(r Run, got, want line) string {
	sum := fmt.Sprintf("checksum %s, golden %s", got.decisions, want.decisions)
	if got.n != want.n {
		sum += fmt.Sprintf("; %d decisions, golden %d", got.n, want.n)
	}
	wd, ok := want.decode()
	if !ok {
		return sum + " (the golden keeps no decision list)"
	}
	first, moved := -1, 0
	for i := 0; i < min(len(wd), len(r.Decisions)); i++ {
		d := r.Decisions[i]
		if d.Replica != wd[i].replica || d.Branch != wd[i].branch {
			if first < 0 {
				first = i
			}
			moved++
		}
	}
	if first < 0 {
		if len(wd) != len(r.Decisions) {
			first = min(len(wd), len(r.Decisions))
			return fmt.Sprintf("%s; the first %d decisions agree, then one list ends", sum, first)
		}
		return sum + "; every decision's replica and branch agree with the golden: a request id or a matched-token count differs"
	}
	d := r.Decisions[first]
	return fmt.Sprintf("%s; first difference at decision %d (request %d): %s/%s, golden %s/%s (matched %d now); %d of %d decisions moved",
		sum, first, d.ID, d.Replica, d.Branch, wd[first].replica, wd[first].branch, d.Matched, moved, min(len(wd), len(r.Decisions)))
}

func read(path string) (map[string]line, []string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	out := map[string]line{}
	var order []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for n := 1; sc.Scan(); n++ {
		s := sc.Text()
		if s == "" || strings.HasPrefix(s, "#") {
			continue
		}
		l, err := parseLine(s)
		if err != nil {
			return nil, nil, fmt.Errorf("%s:%d: %v", path, n, err)
		}
		if _, dup := out[l.name]; dup {
			return nil, nil, fmt.Errorf("%s:%d: run %q twice", path, n, l.name)
		}
		out[l.name] = l
		order = append(order, l.name)
	}
	return out, order, sc.Err()
}

func write(t testing.TB, path, header string, runs []Run) {
	t.Helper()
	var b bytes.Buffer
	for _, h := range strings.Split(strings.TrimRight(header, "\n"), "\n") {
		b.WriteString(strings.TrimRight("# "+h, " ") + "\n")
	}
	fmt.Fprintf(&b, "#\n# Recorded from %s. Do not regenerate (-update-golden) except for an intended,\n", commit())
	b.WriteString("# documented change of decisions: the commit that does it names the runs that moved and why.\n")
	b.WriteString("# Fields: name, decisions, sha256/128 of the decisions (id replica branch matched), of the\n")
	b.WriteString("# whole result and of the candidates' scores, then each decision as replica and branch indices.\n")
	for _, r := range runs {
		b.WriteString(record(r).String() + "\n")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("wrote %s (%d runs)", path, len(runs))
}

// commit describes the source tree the goldens come from (best effort).
func commit() string {
	out, err := exec.Command("git", "rev-parse", "--short", "HEAD").Output()
	if err != nil {
		return "a tree outside git"
	}
	s := "commit " + strings.TrimSpace(string(out))
	if exec.Command("git", "diff", "--quiet", "HEAD", "--").Run() != nil {
		s += " with uncommitted changes"
	}
	return s
}
