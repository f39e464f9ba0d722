// Package llamacpp runs llama.cpp's OpenAI-compatible `llama-server` as a
// child process: for `prefixlb demo --engine llamacpp`, the real-engine
// benchmark (`prefixlb bench-engines`) and the tests that hold prefixlb
// against a real engine. It starts nothing on its own: Start launches one
// server and waits until it answers /health.
package llamacpp

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Options configures one llama-server process. Default gives the settings
// the real-engine tests use (one thread, two slots).
type Options struct {
	// Binary is the path of llama-server.
	Binary string
	// Model is the GGUF model file.
	Model string
	// Threads is -t, the CPU threads of the server (1).
	Threads int
	// Slots is -np, the parallel slots: one cached prompt each (2).
	Slots int
	// Context is -c, the KV context in tokens, split evenly between the
	// slots (16384).
	Context int
	// Host and Port are where it listens (127.0.0.1; Port 0: a free port).
	Host string
	Port int
	// Extra are further command-line arguments.
	Extra []string
	// Log receives the server's output (nil: discarded).
	Log io.Writer
	// StartTimeout bounds the wait for /health (60 s).
	StartTimeout time.Duration
}

// Default returns Options for binary and model with the defaults filled in.
func Default(binary, model string) Options {
	return Options{Binary: binary, Model: model, Threads: 1, Slots: 2, Context: 16384, Host: "127.0.0.1", StartTimeout: time.Minute}
}

// Validate reports the first invalid field.
func (o *Options) Validate() error {
	switch {
	case o.Binary == "":
		return errors.New("llamacpp: no llama-server binary given")
	case o.Model == "":
		return errors.New("llamacpp: no model (GGUF) given")
	case o.Threads < 1:
		return fmt.Errorf("llamacpp: threads must be ≥ 1, got %d", o.Threads)
	case o.Slots < 1:
		return fmt.Errorf("llamacpp: slots must be ≥ 1, got %d", o.Slots)
	case o.Context < o.Slots:
		return fmt.Errorf("llamacpp: context must be ≥ slots, got %d", o.Context)
	case o.Port < 0 || o.Port > 65535:
		return fmt.Errorf("llamacpp: port %d out of range", o.Port)
	}
	for _, f := range []string{o.Binary, o.Model} {
		if _, err := os.Stat(f); err != nil {
			return fmt.Errorf("llamacpp: %w", err)
		}
	}
	return nil
}

// Server is one running llama-server.
type Server struct {
	// URL is its base URL (http://host:port).
	URL string
	// Port is the port it listens on.
	Port int
	opts Options
	cmd  *exec.Cmd
	done chan struct{}
	err  error // the process's exit, once done is closed
	once sync.Once
}

// Start launches a llama-server with o and waits until its /health answers
// 200 (the model is loaded), ctx ends, or StartTimeout passes. The process
// is killed when ctx ends.
func Start(ctx context.Context, o Options) (*Server, error) {
	if o.Host == "" {
		o.Host = "127.0.0.1"
	}
	if o.StartTimeout <= 0 {
		o.StartTimeout = time.Minute
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	port := o.Port
	if port == 0 {
		p, err := freePort(o.Host)
		if err != nil {
			return nil, err
		}
		port = p
	}
	args := []string{"-m", o.Model, "--host", o.Host, "--port", strconv.Itoa(port),
		"-t", strconv.Itoa(o.Threads), "-np", strconv.Itoa(o.Slots), "-c", strconv.Itoa(o.Context),
		"--metrics", "--slots"}
	args = append(args, o.Extra...)
	cmd := exec.CommandContext(ctx, o.Binary, args...)
	cmd.Stdout, cmd.Stderr = o.Log, o.Log
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("llamacpp: start %s: %w", o.Binary, err)
	}
	s := &Server{URL: fmt.Sprintf("http://%s", net.JoinHostPort(o.Host, strconv.Itoa(port))), Port: port, opts: o, cmd: cmd, done: make(chan struct{})}
	go func() {
		s.err = cmd.Wait()
		close(s.done)
	}()
	if err := s.waitHealthy(ctx, o.StartTimeout); err != nil {
		s.Kill()
		return nil, err
	}
	return s, nil
}

// waitHealthy polls /health until it answers 200.
func (s *Server) waitHealthy(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	c := &http.Client{Timeout: 2 * time.Second}
	for {
		select {
		case <-s.done:
			return fmt.Errorf("llamacpp: %s exited before it was healthy: %v", s.opts.Binary, s.err)
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		resp, err := c.Get(s.URL + "/health")
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("llamacpp: %s not healthy after %v (last: %v)", s.URL, timeout, err)
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-s.done:
		case <-ctx.Done():
		}
	}
}

// Done is closed when the process has exited.
func (s *Server) Done() <-chan struct{} { return s.done }

// Kill ends the process at once (SIGKILL) and waits for it: a replica that
// dies mid-stream.
func (s *Server) Kill() {
	s.once.Do(func() { _ = s.cmd.Process.Kill() })
	<-s.done
}

// Stop asks the process to end (SIGTERM), kills it after 5 s, and waits.
func (s *Server) Stop() {
	s.once.Do(func() {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.done:
		case <-time.After(5 * time.Second):
			_ = s.cmd.Process.Kill()
		}
	})
	<-s.done
}

// Metrics reads the server's /metrics: every llamacpp:* sample by name
// (llamacpp:prompt_seconds_total, llamacpp:prompt_tokens_total, ...).
func Metrics(ctx context.Context, baseURL string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, baseURL+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("llamacpp: metrics of %s: %w", baseURL, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return nil, fmt.Errorf("llamacpp: metrics of %s: %w", baseURL, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("llamacpp: metrics of %s: status %d", baseURL, resp.StatusCode)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("llamacpp: metrics of %s: %w", baseURL, err)
	}
	out := make(map[string]float64, len(fams))
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch {
			case m.Counter != nil:
				out[name] += m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[name] += m.GetGauge().GetValue()
			case m.Untyped != nil:
				out[name] += m.GetUntyped().GetValue()
			}
		}
	}
	return out, nil
}

// freePort asks the kernel for a free TCP port on host.
func freePort(host string) (int, error) {
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("llamacpp: find a free port: %w", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}
