package chaos

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// binary is the prefixlb binary TestMain builds for the suite's processes.
var binary string

var (
	soakDuration = flag.Duration("soak", 0, "run TestSoak for this long (0: skip it)")
	soakOut      = flag.String("soak-out", "", "directory for the soak test's CSV and summary (default: a new temporary directory, kept)")
)

// TestMain builds prefixlb once, without -race and whatever the test binary
// was built with, so that the engines and the router run at full speed.
func TestMain(m *testing.M) {
	flag.Parse()
	code := func() int {
		if !wantProcesses() {
			return m.Run()
		}
		dir, err := os.MkdirTemp("", "prefixlb-chaos-")
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos:", err)
			return 1
		}
		defer os.RemoveAll(dir)
		binary = filepath.Join(dir, "prefixlb")
		cmd := exec.Command("go", "build", "-o", binary, "github.com/prefixlb/prefixlb/cmd/prefixlb")
		cmd.Env = append(os.Environ(), "GOFLAGS=-buildvcs=false") // never -race
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "chaos: build prefixlb:", err)
			return 1
		}
		return m.Run()
	}()
	os.Exit(code)
}

// wantProcesses reports whether a test that needs the binary will run:
// not under -short unless the soak test was asked for.
func wantProcesses() bool {
	return !testing.Short() || *soakDuration > 0
}
