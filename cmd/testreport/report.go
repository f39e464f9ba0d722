package main

import (
	"encoding/json"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Event is one line of `go test -json` (cmd/test2json's TestEvent, plus the
// build events cmd/go adds: build-output and build-fail, keyed by
// ImportPath, and FailedBuild on a package's fail event).
type Event struct {
	Time        time.Time `json:"Time"`
	Action      string    `json:"Action"`
	Package     string    `json:"Package"`
	Test        string    `json:"Test"`
	Elapsed     float64   `json:"Elapsed"`
	Output      string    `json:"Output"`
	ImportPath  string    `json:"ImportPath"`
	FailedBuild string    `json:"FailedBuild"`
}

// Report turns the event stream of `go test -json` into what `go test`
// prints without -v — each package's result line as the package completes,
// preceded, when it fails, by the output of its failing tests (or its build
// errors) — and keeps what the end of the run needs: the skipped tests with
// their reasons and the counts.
//
// Report does no I/O but writing to its writer and reads no clock: the
// caller passes the time to [Report.Progress]. It is not safe for
// concurrent use.
type Report struct {
	w io.Writer
	// TrimPrefix is cut from package paths in progress lines ("" keeps
	// them whole), to keep them short.
	TrimPrefix string

	pkgs     map[string]*pkgState
	done     int
	build    map[string]*buildState // by ImportPath
	buildSeq []string               // ImportPaths in the order of their first event
	skipped  []skip

	passed, failed, skippedN int
}

type pkgState struct {
	start   time.Time
	tests   map[string]*testState
	order   []*testState // in the order they started
	other   []string     // package-level output but the result line
	result  []string     // the result line(s): "ok  \tpkg\t1.2s"
	testErr bool         // a test failed or never finished
}

type testState struct {
	name   string
	output []string
	action string    // pass, fail, skip; "" while running
	seen   time.Time // its last run or cont event
}

type buildState struct {
	output  []string
	failed  bool
	printed bool
}

type skip struct {
	pkg, test, reason string
}

// NewReport returns a Report that writes to w.
func NewReport(w io.Writer) *Report {
	return &Report{w: w, pkgs: map[string]*pkgState{}, build: map[string]*buildState{}}
}

// Line handles one line of go test's standard output: an event, or (when
// it is not one) a line go test printed itself, written through as is.
func (r *Report) Line(line []byte) {
	var ev Event
	if len(line) == 0 || line[0] != '{' || json.Unmarshal(line, &ev) != nil || ev.Action == "" {
		r.printf("%s\n", strings.TrimRight(string(line), "\n"))
		return
	}
	r.Event(ev)
}

// Event handles one event.
func (r *Report) Event(ev Event) {
	switch ev.Action {
	case "build-output":
		b := r.buildOf(ev.ImportPath)
		b.output = append(b.output, ev.Output)
		return
	case "build-fail":
		r.buildOf(ev.ImportPath).failed = true
		return
	}
	if ev.Package == "" {
		return
	}
	p := r.pkgs[ev.Package]
	if p == nil {
		p = &pkgState{start: ev.Time, tests: map[string]*testState{}}
		r.pkgs[ev.Package] = p
	}
	if ev.Test == "" {
		r.packageEvent(ev, p)
		return
	}
	t := p.tests[ev.Test]
	if t == nil {
		t = &testState{name: ev.Test, seen: ev.Time}
		p.tests[ev.Test] = t
		p.order = append(p.order, t)
	}
	switch ev.Action {
	case "run", "cont":
		t.seen = ev.Time
	case "output":
		if !isFraming(ev.Output) {
			t.output = append(t.output, ev.Output)
		}
	case "pass":
		t.action, t.output = "pass", nil // a passing test's output is not shown
		r.passed++
	case "skip":
		t.action = "skip"
		r.skipped = append(r.skipped, skip{pkg: ev.Package, test: ev.Test, reason: skipReason(t.output)})
		t.output = nil
		r.skippedN++
	case "fail":
		t.action = "fail"
		p.testErr = true
		r.failed++
	}
}

// packageEvent handles an event of the package itself (no Test).
func (r *Report) packageEvent(ev Event, p *pkgState) {
	switch ev.Action {
	case "start":
		p.start = ev.Time
	case "output":
		if isResultLine(ev.Output) {
			p.result = append(p.result, ev.Output)
		} else {
			p.other = append(p.other, ev.Output)
		}
	case "pass", "skip":
		r.printLines(p.result)
		r.finishPackage(ev.Package)
	case "fail":
		r.packageFailed(ev, p)
		r.finishPackage(ev.Package)
	}
}

// packageFailed prints why the package failed, as go test does: the output
// of each failing test (the "--- FAIL" line first, subtests indented under
// their parents), of the tests that never finished (a timeout, a crash),
// the package's own output, its build errors; then its result line.
func (r *Report) packageFailed(ev Event, p *pkgState) {
	if ev.FailedBuild != "" {
		if b := r.build[ev.FailedBuild]; b != nil && !b.printed {
			r.printLines(b.output)
			b.printed = true
		}
	}
	for _, t := range p.order {
		switch t.action {
		case "fail":
			r.printTest(t, "")
		case "":
			// Still running when the test binary stopped: a timeout or
			// a crash. It failed with its package.
			r.printTest(t, fmt.Sprintf("--- FAIL: %s (did not finish)\n", t.name))
			p.testErr = true
			r.failed++
		}
	}
	r.printLines(p.other)
	if !p.testErr {
		r.failed++ // it failed outside any test: a build error, TestMain, a crash
	}
	if len(p.result) == 0 {
		p.result = []string{"FAIL\t" + ev.Package + "\n"}
	}
	r.printLines(p.result)
}

// printTest prints a failed test's output with its "--- FAIL" line first
// (or header, when it has none), indented by its depth as go test does.
func (r *Report) printTest(t *testState, header string) {
	indent := strings.Repeat("    ", strings.Count(t.name, "/"))
	var head string
	var rest []string
	for _, o := range t.output {
		if head == "" && strings.HasPrefix(o, "--- FAIL: ") {
			head = o
			continue
		}
		rest = append(rest, o)
	}
	if head == "" {
		head = header
		if head == "" {
			head = "--- FAIL: " + t.name + "\n"
		}
	}
	r.printf("%s%s", indent, head)
	for _, o := range rest {
		if o == "\n" {
			r.printf("\n")
			continue
		}
		r.printf("%s%s", indent, o)
	}
}

func (r *Report) finishPackage(pkg string) {
	delete(r.pkgs, pkg)
	r.done++
}

func (r *Report) buildOf(importPath string) *buildState {
	b := r.build[importPath]
	if b == nil {
		b = &buildState{}
		r.build[importPath] = b
		r.buildSeq = append(r.buildSeq, importPath)
	}
	return b
}

// Progress says what is still running after elapsed, at now: each running
// package, how long it has run and its latest test still running.
func (r *Report) Progress(now time.Time, elapsed time.Duration) string {
	names := make([]string, 0, len(r.pkgs))
	for name := range r.pkgs {
		names = append(names, name)
	}
	slices.SortFunc(names, func(a, b string) int {
		return r.pkgs[a].start.Compare(r.pkgs[b].start)
	})
	var parts []string
	for _, name := range names {
		p := r.pkgs[name]
		part := strings.TrimPrefix(name, r.TrimPrefix) + " (" + roundDuration(now.Sub(p.start))
		var latest *testState
		for _, t := range p.order {
			if t.action == "" && (latest == nil || !t.seen.Before(latest.seen)) {
				latest = t
			}
		}
		if latest != nil {
			part += ", " + latest.name
		}
		parts = append(parts, part+")")
	}
	msg := "[" + roundDuration(elapsed) + "] "
	if len(parts) == 0 {
		msg += "building (no test binary running)"
	} else {
		msg += "running: " + strings.Join(parts, ", ")
	}
	return msg + fmt.Sprintf("; %d packages done", r.done)
}

// Finish prints what the stream left unsaid — build errors no package
// reported and packages that never finished — then every skipped test with
// its reason, how long the run took (when elapsed > 0) and the closing line
// "N passed, N failed, N skipped".
func (r *Report) Finish(elapsed time.Duration) {
	for _, ip := range r.buildSeq {
		b := r.build[ip]
		if b.printed {
			continue
		}
		r.printLines(b.output)
		b.printed = true
		if b.failed {
			r.failed++
		}
	}
	var left []string
	for name := range r.pkgs {
		left = append(left, name)
	}
	slices.Sort(left)
	for _, name := range left {
		// The stream ended before the package did (go test was killed):
		// show what it had said.
		r.packageFailed(Event{Package: name}, r.pkgs[name])
		delete(r.pkgs, name)
	}
	if len(r.skipped) > 0 {
		r.printf("\nskipped tests (%d):\n", len(r.skipped))
		for _, g := range groupSkips(r.skipped) {
			if g.first {
				r.printf("  %s\n", g.pkg)
			}
			r.printf("    %s: %s\n", strings.Join(g.tests, ", "), g.reason)
		}
	}
	r.printf("\n")
	if elapsed > 0 {
		r.printf("go test took %s\n", roundDuration(elapsed))
	}
	r.printf("%d passed, %d failed, %d skipped\n", r.passed, r.failed, r.skippedN)
}

// Failed reports whether a test, a package or a build failed.
func (r *Report) Failed() bool { return r.failed > 0 }

// Counts returns the numbers of tests (and subtests) passed, failed and
// skipped so far; failed also counts each package that failed outside any
// test and each build error.
func (r *Report) Counts() (passed, failed, skipped int) {
	return r.passed, r.failed, r.skippedN
}

func (r *Report) printLines(lines []string) {
	for _, l := range lines {
		r.printf("%s", l)
	}
}

func (r *Report) printf(format string, args ...any) {
	fmt.Fprintf(r.w, format, args...)
}

// isFraming reports whether a test's output line is one of the lines
// test2json's verbose mode adds around its output ("=== RUN" and kin),
// which go test without -v does not print.
func isFraming(line string) bool {
	for _, p := range []string{"=== RUN", "=== PAUSE", "=== CONT", "=== NAME"} {
		if strings.HasPrefix(line, p) {
			return true
		}
	}
	return false
}

// isResultLine reports whether a package's output line is its result line
// as go test prints it: "ok  \tpkg\t1.2s", "FAIL\tpkg\t1.2s" (or
// "[build failed]"), "?   \tpkg\t[no test files]".
func isResultLine(line string) bool {
	return strings.HasPrefix(line, "ok  \t") || strings.HasPrefix(line, "FAIL\t") || strings.HasPrefix(line, "?   \t")
}

// skipGroup is the tests of a package skipped for the same reason.
type skipGroup struct {
	pkg, reason string
	tests       []string
	first       bool // the package's first group
}

// location is the "file_test.go:12: " that t.Skip puts before its message.
var location = regexp.MustCompile(`^[\w.-]+\.go:\d+: `)

// groupSkips groups skipped tests by package (in the order they were
// reported) and, within one, by reason, without its file:line, so that six
// tests that lack one variable take one line.
func groupSkips(skips []skip) []skipGroup {
	var groups []skipGroup
	byKey := map[[2]string]int{}
	seen := map[string]bool{}
	var pkgs []string
	for _, s := range skips {
		if !seen[s.pkg] {
			seen[s.pkg] = true
			pkgs = append(pkgs, s.pkg)
		}
	}
	for _, pkg := range pkgs {
		first := true
		for _, s := range skips {
			if s.pkg != pkg {
				continue
			}
			reason := location.ReplaceAllString(s.reason, "")
			key := [2]string{pkg, reason}
			if i, ok := byKey[key]; ok {
				groups[i].tests = append(groups[i].tests, s.test)
				continue
			}
			byKey[key] = len(groups)
			groups = append(groups, skipGroup{pkg: pkg, reason: reason, tests: []string{s.test}, first: first})
			first = false
		}
	}
	return groups
}

// skipReason is what a skipped test said before its "--- SKIP" line (the
// message of t.Skip, with its file:line), on one line.
func skipReason(output []string) string {
	var parts []string
	for _, o := range output {
		o = strings.TrimSpace(o)
		if o == "" || strings.HasPrefix(o, "--- SKIP: ") {
			continue
		}
		parts = append(parts, o)
	}
	if len(parts) == 0 {
		return "(no reason given)"
	}
	return strings.Join(parts, " / ")
}

// roundDuration formats d to the second ("2m30s"), or to the tenth of a
// second below ten seconds.
func roundDuration(d time.Duration) string {
	if d < 10*time.Second {
		return d.Round(100 * time.Millisecond).String()
	}
	return d.Round(time.Second).String()
}
