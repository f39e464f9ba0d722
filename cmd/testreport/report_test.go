package main

import (
	"bufio"
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden from the reports")

// feed plays a recorded `go test -json` stream into a Report, line by line.
func feed(t *testing.T, r *Report, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		r.Line(sc.Bytes())
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestReportGolden replays recorded streams and compares the report with
// testdata/NAME.golden (go test ./cmd/testreport -update rewrites them).
// testdata/mixed.jsonl was recorded from the module in testdata/mixed, whose
// packages pass, fail, fail in a subtest, skip (with and without a reason,
// in a parallel subtest), time out, panic, fail to build (themselves, in a
// dependency, in vet) and fail in TestMain:
//
//	cd testdata/mixed && go test -json -timeout 3s ./... > ../mixed.jsonl
//
// (its directory replaced by /src/mixed).
func TestReportGolden(t *testing.T) {
	for _, tc := range []struct {
		name                    string
		passed, failed, skipped int
	}{
		// passed: a/TestSlow, b/TestFast, k/TestTable, k/TestTable/plain.
		// failed: b/TestFail, b/TestFail/sub, c (build), d/TestHang (timeout),
		// e/TestPanic, f (vet), h (TestMain), i and j (c's build).
		// skipped: a/TestSkip, k/TestTable/redis, k/TestSkipNow.
		{name: "mixed", passed: 4, failed: 9, skipped: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			r := NewReport(&out)
			feed(t, r, filepath.Join("testdata", tc.name+".jsonl"))
			r.Finish(0)
			if p, f, s := r.Counts(); p != tc.passed || f != tc.failed || s != tc.skipped {
				t.Errorf("counts: got %d passed, %d failed, %d skipped; want %d, %d, %d", p, f, s, tc.passed, tc.failed, tc.skipped)
			}
			if got, want := r.Failed(), tc.failed > 0; got != want {
				t.Errorf("Failed() = %v, want %v", got, want)
			}
			golden := filepath.Join("testdata", tc.name+".golden")
			if *update {
				if err := os.WriteFile(golden, out.Bytes(), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatal(err)
			}
			if got := out.String(); got != string(want) {
				t.Errorf("report differs from %s (rerun with -update and review the diff):\n%s", golden, got)
			}
		})
	}
}

// TestReportLines checks the report's parts one by one on the recorded
// stream: result lines in completion order, failure output before its
// package's result line, the skipped list and the closing line.
func TestReportLines(t *testing.T) {
	var out bytes.Buffer
	r := NewReport(&out)
	feed(t, r, filepath.Join("testdata", "mixed.jsonl"))
	r.Finish(0)
	got := out.String()
	lines := strings.Split(strings.TrimSuffix(got, "\n"), "\n")
	if last := lines[len(lines)-1]; last != "4 passed, 9 failed, 3 skipped" {
		t.Errorf("closing line %q", last)
	}
	for _, want := range []string{
		"ok  \texample.com/mixed/a\t",
		"?   \texample.com/mixed/g\t[no test files]\n",
		"--- FAIL: TestFail (0.00s)\n    b_test.go:",
		"    --- FAIL: TestFail/sub (0.00s)\n        b_test.go:7: bad 1\n",
		"FAIL\texample.com/mixed/c [build failed]\n",
		"c/c.go:3:23: cannot use",
		"--- FAIL: TestHang (did not finish)\n    d_test.go:8: waiting\npanic: test timed out after 3s\n",
		"--- FAIL: TestPanic (0.00s)\npanic: assignment to entry in nil map",
		"f/f_test.go:8:42: fmt.Printf format %d has arg",
		"setup failed: no database\nFAIL\texample.com/mixed/h\t",
		"skipped tests (3):\n  example.com/mixed/a\n    TestSkip: no Redis (set PREFIXLB_TEST_REDIS)\n",
		"    TestTable/redis: no Redis / (set PREFIXLB_TEST_REDIS)\n",
		"    TestSkipNow: (no reason given)\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("report lacks %q", want)
		}
	}
	// Framing lines of -json's verbose mode never show; passing tests'
	// output neither.
	for _, bad := range []string{"=== RUN", "--- PASS", "hello", "--- SKIP"} {
		if strings.Contains(got, bad) {
			t.Errorf("report shows %q", bad)
		}
	}
	// A failing package's test output comes before its result line.
	if i, j := strings.Index(got, "bad 1"), strings.Index(got, "FAIL\texample.com/mixed/b\t"); i < 0 || j < i {
		t.Errorf("TestFail's output (at %d) not before b's result line (at %d)", i, j)
	}
}

// TestReportProgress: mid-run, the progress line names each running
// package with its age and latest running test; with none running, it says
// the run is building.
func TestReportProgress(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	r := NewReport(&bytes.Buffer{})
	r.TrimPrefix = "example.com/m/"
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	if got, want := r.Progress(at(30), 30*time.Second), "[30s] building (no test binary running); 0 packages done"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	for _, ev := range []Event{
		{Time: at(31), Action: "start", Package: "example.com/m/slow"},
		{Time: at(31), Action: "run", Package: "example.com/m/slow", Test: "TestChaos"},
		{Time: at(32), Action: "run", Package: "example.com/m/slow", Test: "TestChaos/kill"},
		{Time: at(33), Action: "start", Package: "example.com/m/fast"},
		{Time: at(33), Action: "run", Package: "example.com/m/fast", Test: "TestA"},
		{Time: at(34), Action: "pass", Package: "example.com/m/fast", Test: "TestA"},
		{Time: at(34), Action: "output", Package: "example.com/m/fast", Output: "ok  \texample.com/m/fast\t1.0s\n"},
		{Time: at(34), Action: "pass", Package: "example.com/m/fast", Elapsed: 1},
		{Time: at(40), Action: "start", Package: "example.com/m/other"},
	} {
		r.Event(ev)
	}
	want := "[1m0s] running: slow (29s, TestChaos/kill), other (20s); 1 packages done"
	if got := r.Progress(at(60), time.Minute); got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestGroupSkips: tests of one package skipped for the same reason (told
// at different lines) share a line; packages keep their order.
func TestGroupSkips(t *testing.T) {
	var out bytes.Buffer
	r := NewReport(&out)
	for _, s := range []struct{ pkg, test, msg string }{
		{"p/tok", "TestA", "    a_test.go:10: PREFIXLB_TEST_LLAMA3 is not set\n"},
		{"p/tok", "TestB", "    a_test.go:20: PREFIXLB_TEST_LLAMA3 is not set\n"},
		{"p/tok", "TestC", "    c_test.go:5: -short\n"},
		{"p/dash", "TestD", "    d_test.go:7: no Chromium\n"},
	} {
		r.Event(Event{Action: "run", Package: s.pkg, Test: s.test})
		r.Event(Event{Action: "output", Package: s.pkg, Test: s.test, Output: s.msg})
		r.Event(Event{Action: "skip", Package: s.pkg, Test: s.test})
	}
	r.Event(Event{Action: "pass", Package: "p/tok"})
	r.Event(Event{Action: "pass", Package: "p/dash"})
	r.Finish(0)
	want := "\nskipped tests (4):\n  p/tok\n    TestA, TestB: PREFIXLB_TEST_LLAMA3 is not set\n    TestC: -short\n" +
		"  p/dash\n    TestD: no Chromium\n\n0 passed, 0 failed, 4 skipped\n"
	if got := out.String(); got != want {
		t.Errorf("got:\n%s\nwant:\n%s", got, want)
	}
}

// TestReportNotJSON: lines that are not events (go test's own messages)
// pass through unchanged.
func TestReportNotJSON(t *testing.T) {
	var out bytes.Buffer
	r := NewReport(&out)
	r.Line([]byte("go: downloading example.com/x v1.0.0\n"))
	r.Line([]byte(`{"not":"an event"}`))
	if got, want := out.String(), "go: downloading example.com/x v1.0.0\n{\"not\":\"an event\"}\n"; got != want {
		t.Errorf("got %q, want %q", got, want)
	}
}

// TestReportUnfinished: a stream that stops mid-package (go test killed)
// fails the run and shows what the package had said.
func TestReportUnfinished(t *testing.T) {
	var out bytes.Buffer
	r := NewReport(&out)
	r.Event(Event{Action: "start", Package: "p"})
	r.Event(Event{Action: "run", Package: "p", Test: "TestX"})
	r.Event(Event{Action: "output", Package: "p", Test: "TestX", Output: "    x_test.go:5: working\n"})
	r.Finish(0)
	if !r.Failed() {
		t.Error("not failed")
	}
	if got := out.String(); !strings.Contains(got, "--- FAIL: TestX (did not finish)\n    x_test.go:5: working\nFAIL\tp\n") ||
		!strings.HasSuffix(got, "\n0 passed, 1 failed, 0 skipped\n") {
		t.Errorf("got:\n%s", got)
	}
}

// TestRunBuildFailure runs the real go test on testdata/broken, a module
// with a passing package and one that does not compile: the run must fail,
// show the compiler's error and count both.
func TestRunBuildFailure(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs go test")
	}
	t.Setenv("GOWORK", "off") // testdata/broken is a module of its own
	var out, errb bytes.Buffer
	code := run([]string{"-progress", "0", "--", "./..."}, filepath.Join("testdata", "broken"), &out, &errb)
	got := out.String()
	if code != 1 {
		t.Errorf("exit status %d, want 1\nstdout:\n%s\nstderr:\n%s", code, got, errb.String())
	}
	for _, want := range []string{
		`bad/bad.go:4:25: cannot use "not an int"`,
		"FAIL\texample.com/broken/bad [build failed]\n",
		"ok  \texample.com/broken/good\t",
		"\n1 passed, 1 failed, 0 skipped\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("output lacks %q:\n%s", want, got)
		}
	}
}

// TestRunArgs: runner flags go before --; a bad one is a usage error.
func TestRunArgs(t *testing.T) {
	var out, errb bytes.Buffer
	if code := run([]string{"-nonsense", "--", "./..."}, "", &out, &errb); code != 2 {
		t.Errorf("exit status %d, want 2", code)
	}
	if code := run([]string{"stray", "--", "./..."}, "", &out, &errb); code != 2 || !strings.Contains(errb.String(), `unexpected "stray"`) {
		t.Errorf("exit status %d, stderr %q", code, errb.String())
	}
}
