package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sync"
	"testing"

	"github.com/prefixlb/prefixlb/internal/decisiontest"
)

// simOutputGolden pins, byte for byte (by checksum), what `prefixlb sim`
// writes for the invocations of simInvocations: its table and JSON on
// stdout and, with --out, every file. It may be regenerated (`go test
// ./cmd/prefixlb -run TestSimOutputUnchanged -update-golden`) only for an
// intended, documented change of decisions or of the output.
var simOutputGolden = filepath.Join("testdata", "decisions-sim-cli.txt")

// simInvocations are the `prefixlb sim` command lines pinned: the default
// policies, e2 and the baselines with settings, a rate sweep, local
// schedulers, mirrored caches, llama.cpp's slot caches on a shared CPU, and
// a mixed cluster whose router calibrates.
var simInvocations = []struct {
	name string
	args []string
	out  bool // add --out DIR and pin its files too
}{
	{"toolbench default policies", []string{"--workload", "toolbench", "--zipf", "1.1", "--tools", "60", "--requests", "200",
		"--replicas", "3", "--rate", "20", "--profile", "llama3.1-8b-h100"}, true},
	{"toolbench every baseline", []string{"--workload", "toolbench", "--zipf", "1.1", "--tools", "60", "--requests", "150",
		"--replicas", "3", "--rate", "30", "--profile", "llama3.1-8b-h100", "--policies",
		"random,least-load,power-of-two,session,prefix,llmd-approx,sglang,dynamo,llmd-precise:speculative=true:kv_weight=2"}, false},
	{"shared-prefix sweep e2 variants", []string{"--workload", "shared-prefix", "--groups", "8", "--system-prompt-tokens", "2000",
		"--question-tokens", "300", "--shared-output-tokens", "100", "--requests", "150", "--replicas", "2", "--rates", "2,6",
		"--policies", "e2-preble:mixing=false,e2@lpm,e2:prefill_weight=2:eviction_recompute=true@priority,sglang",
		"--kv-events=false"}, false},
	{"agent calibrated mixed cluster", []string{"--workload", "agent", "--agent-envs", "20", "--requests", "200", "--replicas", "3",
		"--rate", "30", "--replica-profiles", "llama3.1-8b-h100*2,llama3.1-8b-a100", "--router-profile", "llama3.1-8b-h100",
		"--calibrate", "--policies", "e2,llmd-precise,least-load"}, false},
	{"llamacpp slots shared cpu", []string{"--engine", "llamacpp", "--workload", "toolbench", "--tools", "40", "--zipf", "1.1",
		"--requests", "120", "--replicas", "3", "--rate", "1", "--host-cores", "2", "--policies", "round-robin,e2,llmd-precise"}, true},
}

// simCLIEnv, when set in this test binary's environment, makes
// TestSimCLIProcess run main() on the JSON list of arguments it holds.
const simCLIEnv = "PREFIXLB_DECISIONS_SIM_ARGS"

// TestSimCLIProcess is not a test: TestSimOutputUnchanged runs this test
// binary as `prefixlb` through it (a fresh process a command line, as a
// user runs it; cobra's flags keep their values within one process).
func TestSimCLIProcess(t *testing.T) {
	raw := os.Getenv(simCLIEnv)
	if raw == "" {
		t.Skip("runs main() for TestSimOutputUnchanged")
	}
	var args []string
	if err := json.Unmarshal([]byte(raw), &args); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	os.Args = append([]string{"prefixlb"}, args...)
	main()
	os.Exit(0)
}

// TestSimOutputUnchanged runs `prefixlb sim` for simInvocations and compares
// the checksum of everything each writes (stdout with --json -, and --out's
// files) with testdata/decisions-sim-cli.txt: `prefixlb sim` results stay
// byte-identical through issue 15's restructuring. Decision by decision,
// the simulator's own goldens (internal/sim, TestDecisionsUnchanged) say
// which moved.
func TestSimOutputUnchanged(t *testing.T) {
	if runtime.GOARCH != "amd64" && !decisiontest.Updating() {
		t.Skip("the golden results are amd64's (other architectures may fuse floating-point operations)")
	}
	if decisiontest.RaceEnabled {
		// The simulator is one goroutine: nothing here for the race
		// detector, which makes each command line ten times slower.
		t.Skip("byte-for-byte output of single-goroutine simulations: run without -race")
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	out := make([]decisiontest.Run, len(simInvocations))
	errs := make([]error, len(simInvocations))
	var wg sync.WaitGroup
	for i, inv := range simInvocations {
		wg.Add(1)
		go func() {
			defer wg.Done()
			args := append([]string{"sim", "-q"}, inv.args...)
			args = append(args, "--json", "-")
			dir := t.TempDir()
			if inv.out {
				args = append(args, "--out", dir)
			}
			js, err := json.Marshal(args)
			if err != nil {
				errs[i] = err
				return
			}
			cmd := exec.Command(exe, "-test.run=^TestSimCLIProcess$")
			cmd.Env = append(os.Environ(), simCLIEnv+"="+string(js))
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil {
				errs[i] = fmt.Errorf("prefixlb %v: %v\n%s", args, err, stderr.Bytes())
				return
			}
			result := stdout.Bytes()
			if inv.out {
				files, err := os.ReadDir(dir)
				if err != nil {
					errs[i] = err
					return
				}
				names := make([]string, 0, len(files))
				for _, f := range files {
					names = append(names, f.Name())
				}
				slices.Sort(names)
				for _, n := range names {
					b, err := os.ReadFile(filepath.Join(dir, n))
					if err != nil {
						errs[i] = err
						return
					}
					result = fmt.Appendf(result, "\n== %s (%d bytes)\n", n, len(b))
					result = append(result, b...)
				}
			}
			out[i] = decisiontest.Run{Name: inv.name, Result: result}
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("%s: %v", simInvocations[i].name, err)
		}
	}
	decisiontest.Check(t, simOutputGolden,
		"What `prefixlb sim` writes (stdout with --json -, and --out's files) for a fixed set of command lines:\n"+
			"TestSimOutputUnchanged (cmd/prefixlb/decisions_test.go). result= is the checksum of it all.", out)
}
