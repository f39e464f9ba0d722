// Command testreport runs `go test -json` and prints what `go test` prints
// without -v — each package's result line as the package completes ("ok  ",
// "FAIL", "?   ") and the output of failing tests and build errors — plus:
//
//   - a progress line every 30 s naming the packages still running, how long
//     each has run and its latest test, so a long run is never silent;
//   - at the end, every skipped test with its reason (the message it gave
//     t.Skip: which service or variable it lacked);
//   - a closing line "N passed, N failed, N skipped", counting tests and
//     subtests; failed also counts each package that failed outside any
//     test (a build error, a crash in TestMain).
//
// It exits 1 when anything failed, else with go test's own status.
//
// Usage:
//
//	go run ./cmd/testreport [-progress 30s] -- [go test flags] [packages]
//	go run ./cmd/testreport -- -race ./...
//
// Everything after -- goes to go test (everything, when there is no --).
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

func main() {
	os.Exit(run(os.Args[1:], "", os.Stdout, os.Stderr))
}

// run runs go test with args in dir ("" for the current directory),
// reports on stdout, and returns the exit status.
func run(args []string, dir string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("testreport", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: testreport [-progress 30s] -- [go test flags] [packages]")
		fs.PrintDefaults()
	}
	every := fs.Duration("progress", 30*time.Second, "print the packages still running this often (0: never)")
	goArgs := args
	if i := slices.Index(args, "--"); i >= 0 {
		if err := fs.Parse(args[:i]); err != nil {
			return 2
		}
		if fs.NArg() > 0 {
			fmt.Fprintf(stderr, "testreport: unexpected %q before --\n", fs.Arg(0))
			return 2
		}
		goArgs = args[i+1:]
	}

	rep := NewReport(stdout)
	rep.TrimPrefix = modulePrefix(dir)
	cmd := exec.Command("go", append([]string{"test", "-json"}, goArgs...)...)
	cmd.Dir = dir
	cmd.Stderr = stderr // go test's own errors are plain text
	out, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintf(stderr, "testreport: %v\n", err)
		return 2
	}
	start := time.Now()
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(stderr, "testreport: start go test: %v\n", err)
		return 2
	}
	// Forward an interrupt that reached only this process; go test then
	// stops its test binaries and the report still ends with the counts.
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt)
	defer signal.Stop(sig)

	lines := make(chan []byte, 64)
	go func() { // owned by run: ends at go test's EOF, which Wait follows
		defer close(lines)
		br := bufio.NewReaderSize(out, 64<<10)
		for {
			line, err := br.ReadBytes('\n')
			if len(line) > 0 {
				lines <- line
			}
			if err != nil {
				return
			}
		}
	}()
	var tick <-chan time.Time
	if *every > 0 {
		t := time.NewTicker(*every)
		defer t.Stop()
		tick = t.C
	}
loop:
	for {
		select {
		case line, ok := <-lines:
			if !ok {
				break loop
			}
			rep.Line(line)
		case now := <-tick:
			fmt.Fprintln(stdout, rep.Progress(now, now.Sub(start)))
		case s := <-sig:
			_ = cmd.Process.Signal(s)
		}
	}
	werr := cmd.Wait()
	rep.Finish(time.Since(start))
	if rep.Failed() {
		return 1
	}
	if werr != nil {
		// go test failed without reporting a failure on stdout: a bad
		// flag or pattern, said on stderr.
		fmt.Fprintf(stderr, "testreport: go test: %v\n", werr)
		var ee *exec.ExitError
		if errors.As(werr, &ee) && ee.ExitCode() > 0 {
			return ee.ExitCode()
		}
		return 1
	}
	return 0
}

// modulePrefix returns "PATH/" for the module whose go.mod is in dir, or ""
// when there is none there.
func modulePrefix(dir string) string {
	b, err := os.ReadFile(filepath.Join(dir, "go.mod"))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) == 2 && f[0] == "module" {
			return strings.Trim(f[1], `"`) + "/"
		}
	}
	return ""
}
