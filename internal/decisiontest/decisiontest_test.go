package decisiontest

import (
	"fmt"
	"reflect"
	"strings"
	"testing"
)

func sampleRun(name string, n int) Run {
	r := Run{Name: name, Result: []byte("result " + name)}
	for i := range n {
		r.Decisions = append(r.Decisions, Decision{ID: uint64(i), Replica: fmt.Sprintf("r%d", i%3),
			Branch: []string{"explore", "exploit"}[i%2], Matched: 16 * i})
	}
	return r
}

func goldenOf(runs ...Run) (map[string]line, []string) {
	m := map[string]line{}
	var order []string
	for _, r := range runs {
		l, err := parseLine(record(r).String())
		if err != nil {
			panic(err)
		}
		m[l.name] = l
		order = append(order, l.name)
	}
	return m, order
}

func TestRecordRoundTrip(t *testing.T) {
	for _, r := range []Run{sampleRun("a b", 50), {Name: "empty"}, {Name: "cli", Result: []byte("x")}} {
		want := record(r)
		got, err := parseLine(want.String())
		if err != nil {
			t.Fatalf("%s: %v", r.Name, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%s: parsed %+v, want %+v", r.Name, got, want)
		}
		if d, ok := got.decode(); !ok || len(d) != len(r.Decisions) {
			t.Errorf("%s: decoded %d decisions (%v), want %d", r.Name, len(d), ok, len(r.Decisions))
		}
	}
}

func TestCompareNamesFirstDifference(t *testing.T) {
	a, b := sampleRun("a", 40), sampleRun("b", 40)
	golden, order := goldenOf(a, b)
	if f, _ := compare("g", golden, order, []Run{a, b}); len(f) != 0 {
		t.Fatalf("unchanged runs fail: %v", f)
	}

	moved := sampleRun("a", 40)
	moved.Decisions[7].Replica, moved.Decisions[9].Branch = "r9", "mixing"
	f, _ := compare("g", golden, order, []Run{moved, b})
	if len(f) != 1 || !strings.Contains(f[0], `run "a"`) || !strings.Contains(f[0], "first difference at decision 7 (request 7): r9/exploit, golden r1/exploit") ||
		!strings.Contains(f[0], "2 of 40 decisions moved") {
		t.Errorf("a moved decision: %v", f)
	}

	matched := sampleRun("a", 40)
	matched.Decisions[3].Matched++
	if f, _ := compare("g", golden, order, []Run{matched, b}); len(f) != 1 || !strings.Contains(f[0], "matched-token count differs") {
		t.Errorf("a moved matched count: %v", f)
	}

	res := sampleRun("b", 40)
	res.Result = []byte("other")
	if f, _ := compare("g", golden, order, []Run{a, res}); len(f) != 1 || !strings.Contains(f[0], "every decision is unchanged, but the run's result is not") {
		t.Errorf("a changed result: %v", f)
	}

	scored := sampleRun("b", 40)
	scored.Scores = []byte("1 0=0.5\n")
	if f, n := compare("g", golden, order, []Run{a, scored}); len(f) != 0 || len(n) != 1 {
		t.Errorf("changed scores: failures %v, notes %v; want one note", f, n)
	}

	f, _ = compare("g", golden, order, []Run{a, sampleRun("c", 3)})
	if len(f) != 2 || !strings.Contains(strings.Join(f, "\n"), `run "c": not in g`) || !strings.Contains(strings.Join(f, "\n"), `run "b" is in g but was not run`) {
		t.Errorf("a new and a missing run: %v", f)
	}

	prefix := sampleRun("a", 25)
	prefix.Prefix, prefix.Result = true, nil
	if f, _ := compare("g", golden, order, []Run{prefix, b}); len(f) != 0 {
		t.Errorf("an unchanged prefix: %v", f)
	}
	prefix.Decisions[20].Replica = "r7"
	if f, _ := compare("g", golden, order, []Run{prefix, b}); len(f) != 1 || !strings.Contains(f[0], "first difference at decision 20 (request 20): r7/explore, golden r2/explore") {
		t.Errorf("a moved decision in a prefix: %v", f)
	}

	short := sampleRun("a", 30)
	if f, _ := compare("g", golden, order, []Run{short, b}); len(f) != 1 || !strings.Contains(f[0], "30 decisions, golden 40") {
		t.Errorf("a shorter run: %v", f)
	}
}

func TestParseRoute(t *testing.T) {
	for _, tc := range []struct {
		in      string
		branch  string
		matched int
		bad     bool
	}{
		{"branch=exploit; matched=4096; r0=0.512(L=0.100,M=0,P=0.412,m=4096)", "exploit", 4096, false},
		{"branch=least-load; matched=0", "least-load", 0, false},
		{"matched=16; branch=cache", "cache", 16, false},
		{"", "", 0, true},
		{"branch=x", "", 0, true},
	} {
		b, m, err := ParseRoute(tc.in)
		if (err != nil) != tc.bad || b != tc.branch || m != tc.matched {
			t.Errorf("ParseRoute(%q) = %q, %d, %v", tc.in, b, m, err)
		}
	}
}

func TestReplayIsFixed(t *testing.T) {
	a, err := Replay(ReplayRequests)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Replay(ReplayRequests)
	if !reflect.DeepEqual(a, b) || len(a) != ReplayRequests {
		t.Fatalf("Replay gives %d requests, not the same twice", len(a))
	}
	shapes := map[string]int{}
	for _, r := range a {
		shapes[fmt.Sprint(r.Path, r.Stream)]++
	}
	if len(shapes) != 3 { // completions streamed; chats streamed and not
		t.Errorf("shapes %v", shapes)
	}
}
