package chaos

import (
	"bytes"
	"cmp"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// proc is one child process of the test. Its owner is the test that started
// it: t.Cleanup kills it, and Pdeathsig kills it if the test binary dies
// (a -timeout panic included).
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{} // closed when the process has exited
}

// startProc starts binary with args, its output in a log file under dir.
func startProc(t testing.TB, dir, name string, args ...string) *proc {
	t.Helper()
	f, err := os.CreateTemp(dir, name+"-*.log")
	if err != nil {
		t.Fatalf("chaos: log file for %s: %v", name, err)
	}
	cmd := exec.Command(binary, args...)
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("chaos: start %s: %v", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: f.Name(), done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill(t)
		if t.Failed() {
			t.Logf("chaos: log of %s (%s):\n%s", name, p.log, tail(p.log, 3000))
		}
	})
	return p
}

// pid returns the process id.
func (p *proc) pid() int { return p.cmd.Process.Pid }

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill sends SIGKILL and waits for the process to end.
func (p *proc) kill(t testing.TB) {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Errorf("chaos: %s (pid %d) did not exit 10s after SIGKILL", p.name, p.pid())
	}
}

// tail returns the last n bytes of file path.
func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(bytes.TrimSpace(b))
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	// Below Linux's ephemeral range (32768–60999 by default): a port the
	// kernel handed out for ":0" can be handed out again, as the source
	// port of any outgoing connection, between this check and the
	// process's bind ("address already in use", seen in CI). Ports here are
	// never chosen by the kernel, so once free they stay free for the
	// process that binds them.
	for range 1000 {
		port := int(portLow + nextPort.Add(1)%(portHigh-portLow))
		ln, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			continue
		}
		ln.Close()
		return port
	}
	t.Fatalf("chaos: no free port in [%d, %d)", portLow, portHigh)
	return 0
}

// The ports freePort hands out: each once per test binary (a counter from
// a start that differs between runs), below the ephemeral range.
const portLow, portHigh = 20000, 32000

var nextPort = func() *atomic.Int64 {
	var n atomic.Int64
	n.Store(int64(os.Getpid()) * 37 % (portHigh - portLow))
	return &n
}()

// waitHealthy polls url until it answers 200, p exits, or timeout passes.
func waitHealthy(t testing.TB, p *proc, url string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	client := &http.Client{Timeout: time.Second}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	var last error
	for time.Now().Before(deadline) {
		if p != nil && p.exited() {
			t.Fatalf("chaos: %s exited before it was healthy; log:\n%s", p.name, tail(p.log, 3000))
		}
		resp, err := client.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
			err = fmt.Errorf("status %d", resp.StatusCode)
		}
		last = err
		<-tick.C
	}
	name := "?"
	if p != nil {
		name = p.name
	}
	t.Fatalf("chaos: %s not healthy at %s after %v: %v", name, url, timeout, last)
}

// engine is one `prefixlb engine` process on fixed loopback ports, so that
// it can be killed and restarted in place.
type engine struct {
	name                 string
	dir                  string
	http, kvPort, replay int
	timeScale            float64
	role                 string // --role ("": both)
	profile              string // --profile ("": llama3.1-8b-h100)
	p                    *proc
}

// engineTimeScale runs the modelled GPU this many times faster than real.
const engineTimeScale = 4

// newEngine starts an engine on fresh ports and waits until it is healthy.
func newEngine(t testing.TB, dir, name string) *engine { return newEngineRole(t, dir, name, "") }

// newEngineRole is newEngine with a role in a disaggregated cluster ("":
// both).
func newEngineRole(t testing.TB, dir, name, role string) *engine {
	e := &engine{name: name, dir: dir, http: freePort(t), kvPort: freePort(t), replay: freePort(t), timeScale: engineTimeScale, role: role}
	e.start(t)
	return e
}

// url is the engine's HTTP base URL.
func (e *engine) url() string { return "http://127.0.0.1:" + strconv.Itoa(e.http) }

// kvEndpoint is the engine's KV-event PUB socket.
func (e *engine) kvEndpoint() string { return "tcp://127.0.0.1:" + strconv.Itoa(e.kvPort) }

// replayEndpoint is the engine's KV-event replay socket.
func (e *engine) replayEndpoint() string { return "tcp://127.0.0.1:" + strconv.Itoa(e.replay) }

// start starts the process (again) on the engine's ports.
func (e *engine) start(t testing.TB) {
	t.Helper()
	// Every socket binds loopback only (--kv-bind: bind without '*').
	args := []string{"--listen", "127.0.0.1:" + strconv.Itoa(e.http),
		"--profile", cmp.Or(e.profile, "llama3.1-8b-h100"),
		"--time-scale", strconv.FormatFloat(e.timeScale, 'f', -1, 64),
		"--kv-events", e.kvEndpoint(), "--kv-bind",
		"--kv-replay", e.replayEndpoint(),
		"--model", modelName,
		"--shutdown-timeout", "1s"}
	if e.role != "" {
		args = append(args, "--role", e.role)
	}
	e.p = startProc(t, e.dir, e.name, append([]string{"engine"}, args...)...)
	waitHealthy(t, e.p, e.url()+"/health", 15*time.Second)
}

// kill9 kills the engine with SIGKILL.
func (e *engine) kill9(t testing.TB) { e.p.kill(t) }

// modelName is the model every engine serves.
const modelName = "chaos-model"

// procStats are a process's resources read from /proc.
type procStats struct {
	RSSBytes int64
	FDs      int
}

// readProcStats reads pid's resident memory and open file descriptors.
func readProcStats(pid int) (procStats, error) {
	var s procStats
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "status"))
	if err != nil {
		return s, err
	}
	for _, line := range bytes.Split(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("VmRSS:")); ok {
			var kb int64
			if _, err := fmt.Sscan(string(v), &kb); err == nil {
				s.RSSBytes = kb << 10
			}
		}
	}
	fds, err := os.ReadDir(filepath.Join("/proc", strconv.Itoa(pid), "fd"))
	if err != nil {
		return s, err
	}
	s.FDs = len(fds)
	return s, nil
}
