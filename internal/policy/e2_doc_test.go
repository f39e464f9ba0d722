package policy

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"strconv"
	"strings"
	"testing"
)

// funcDoc returns the doc comment of the function name in file.
func funcDoc(t *testing.T, file, name string) string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range f.Decls {
		if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv == nil && fd.Name.Name == name && fd.Doc != nil {
			return fd.Doc.Text()
		}
	}
	t.Fatalf("%s: no doc comment on func %s", file, name)
	return ""
}

// checkE2Doc compares the cost a doc comment states with cfg's and the
// term list's, and returns what differs: the table whose header is
// "term weight" must list every term (E2Term) in order with the weight cfg
// gives it (termWeights), and the lines "L = ...", "M = ..." and "P = ...",
// if the doc has them, the terms of each part in order.
func checkE2Doc(doc string, cfg E2Config) []string {
	var errs []string
	w := cfg.termWeights()
	lines := strings.Split(doc, "\n")
	table := -1
	for i, l := range lines {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "term" && f[1] == "weight" {
			table = i + 1
			break
		}
	}
	if table < 0 {
		return []string{`no table with the header "term weight"`}
	}
	var rows [][]string
	for _, l := range lines[table:] {
		f := strings.Fields(l)
		if len(f) == 0 {
			break
		}
		rows = append(rows, f)
	}
	if len(rows) != int(NumE2Terms) {
		errs = append(errs, fmt.Sprintf("the table has %d rows, want one per term (%d)", len(rows), NumE2Terms))
	}
	for i, f := range rows {
		if i >= int(NumE2Terms) {
			break
		}
		term := E2Term(i)
		if f[0] != term.String() {
			errs = append(errs, fmt.Sprintf("row %d is %q, want term %q", i+1, f[0], term))
			continue
		}
		if len(f) < 2 {
			errs = append(errs, fmt.Sprintf("%s: no weight", term))
			continue
		}
		got, err := strconv.ParseFloat(f[1], 64)
		if err != nil || got != w[term] {
			errs = append(errs, fmt.Sprintf("%s weighs %q in the doc, %v in the code", term, f[1], w[term]))
		}
	}
	parts := map[string][]string{}
	for t := range NumE2Terms {
		p := "L"
		switch t {
		case E2Eviction, E2AdapterEviction, E2AdapterCascade:
			p = "M"
		case E2Prefill, E2AdapterLoad:
			p = "P"
		}
		parts[p] = append(parts[p], t.String())
	}
	for _, l := range lines {
		part, sum, ok := strings.Cut(strings.TrimSpace(l), " = ")
		if !ok || parts[part] == nil {
			continue
		}
		if want := strings.Join(parts[part], " + "); sum != want {
			errs = append(errs, fmt.Sprintf("%s = %s, want %s = %s", part, sum, part, want))
		}
	}
	return errs
}

// TestE2ConfigDocs holds the doc comments of DefaultE2Config and
// PrebleE2Config to the code: their tables give every term of the cost in
// order with the weight the config gives it, and DefaultE2Config's formula
// names every term.
func TestE2ConfigDocs(t *testing.T) {
	for _, tt := range []struct {
		name    string
		cfg     E2Config
		formula bool
	}{
		{"DefaultE2Config", DefaultE2Config(), true},
		{"PrebleE2Config", PrebleE2Config(), false},
	} {
		doc := funcDoc(t, "e2.go", tt.name)
		if tt.formula && !strings.Contains(doc, "L = ") {
			t.Errorf("%s's doc comment has no formula (L = ...)", tt.name)
		}
		for _, e := range checkE2Doc(doc, tt.cfg) {
			t.Errorf("%s's doc comment: %s", tt.name, e)
		}
	}
}

// TestE2ConfigDocsCheck: checkE2Doc finds a weight, a row and a formula that
// differ from the code.
func TestE2ConfigDocsCheck(t *testing.T) {
	doc := funcDoc(t, "e2.go", "DefaultE2Config")
	cfg := DefaultE2Config()
	cfg.PendingWeight = 2
	if errs := checkE2Doc(doc, cfg); len(errs) != 1 || !strings.Contains(errs[0], "pending weighs") {
		t.Errorf("pending_weight=2: %q, want one error on pending", errs)
	}
	cfg = DefaultE2Config()
	cfg.IncludePrefill = false
	if errs := checkE2Doc(doc, cfg); len(errs) != 1 || !strings.Contains(errs[0], "prefill weighs") {
		t.Errorf("include_prefill=false: %q, want one error on prefill", errs)
	}
	noRow := strings.Replace(doc, "\tslot_wait ", "\t", 1)
	if errs := checkE2Doc(noRow, DefaultE2Config()); len(errs) == 0 {
		t.Error("a doc without slot_wait's row passed")
	}
	swapped := strings.Replace(doc, "self_decode + prefill_slowdown", "prefill_slowdown + self_decode", 1)
	if errs := checkE2Doc(swapped, DefaultE2Config()); len(errs) != 1 || !strings.HasPrefix(errs[0], "L = ") {
		t.Errorf("terms of L out of order: %q, want one error on L", errs)
	}
}

// TestE2TermWeightsFollowConfig: each term's weight is the E2Config field of
// its name with "_weight", or for prefill_slowdown and slot_wait the flag of
// that name, as DefaultE2Config's doc says; no other field moves it.
func TestE2TermWeightsFollowConfig(t *testing.T) {
	base := DefaultE2Config()
	raw, err := json.Marshal(base)
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]any
	if err := json.Unmarshal(raw, &fields); err != nil {
		t.Fatal(err)
	}
	w0 := base.termWeights()
	for term := range NumE2Terms {
		key := term.String() + "_weight"
		f := map[string]any{}
		for k, v := range fields {
			f[k] = v
		}
		switch old := f[key].(type) {
		case float64:
			f[key] = old + 0.25
		default:
			key = term.String()
			b, ok := f[key].(bool)
			if !ok {
				t.Errorf("%v: E2Config has neither %s_weight nor a flag %s", term, term, term)
				continue
			}
			f[key] = !b
		}
		raw, _ := json.Marshal(f)
		var cfg E2Config
		if err := json.Unmarshal(raw, &cfg); err != nil {
			t.Fatal(err)
		}
		w := cfg.termWeights()
		for u := range NumE2Terms {
			if (w[u] != w0[u]) != (u == term) {
				t.Errorf("changing %s moves %v's weight %v → %v", key, u, w0[u], w[u])
			}
		}
	}
}
