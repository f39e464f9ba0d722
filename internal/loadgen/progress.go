package loadgen

import (
	"fmt"
	"io"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prefixlb/prefixlb/internal/report"
)

// recentTTFTs is how many of the latest TTFTs the progress median covers.
const recentTTFTs = 256

// stats counts a run's requests for the progress line.
type stats struct {
	total int           // requests to send
	plan  time.Duration // planned sending time (last arrival)

	mu        sync.Mutex // guards the fields below
	nSent     int
	nDone     int // finished, successfully or not
	nErr      int
	ttfts     []float64 // ring of the latest TTFTs in ms
	ttftsNext int
}

func newStats(total int, plan time.Duration) *stats {
	return &stats{total: total, plan: plan, ttfts: make([]float64, 0, recentTTFTs)}
}

// sent counts a request sent.
func (s *stats) sent() {
	s.mu.Lock()
	s.nSent++
	s.mu.Unlock()
}

// done counts a finished request.
func (s *stats) done(rec report.RequestRecord) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nDone++
	if rec.Failed() {
		s.nErr++
		return
	}
	if len(s.ttfts) < recentTTFTs {
		s.ttfts = append(s.ttfts, rec.TTFTMs)
	} else {
		s.ttfts[s.ttftsNext] = rec.TTFTMs
		s.ttftsNext = (s.ttftsNext + 1) % recentTTFTs
	}
}

// line renders the progress line at elapsed time since the start.
func (s *stats) line(elapsed time.Duration) string {
	s.mu.Lock()
	sent, done, errs := s.nSent, s.nDone, s.nErr
	recent := slices.Clone(s.ttfts)
	s.mu.Unlock()
	slices.Sort(recent)
	ttft := "-"
	if len(recent) > 0 {
		ttft = fmt.Sprintf("%.0fms", report.Percentile(recent, 50))
	}
	return fmt.Sprintf("sent %d/%d  done %d  errors %d  in-flight %d  %s/%s  ttft p50 %s",
		sent, s.total, done, errs, sent-done,
		elapsed.Truncate(100*time.Millisecond), s.plan.Truncate(100*time.Millisecond), ttft)
}

// startProgress starts the goroutine that writes progress lines for a run
// that began at start, if cfg asks for them, and returns the function that
// stops it, writes the last line and waits for it to exit. The returned
// function may be called more than once.
func startProgress(cfg Config, st *stats, start time.Time) (stop func()) {
	w := cfg.Progress
	if w == nil {
		return func() {}
	}
	tty := isTerminal(w)
	if !tty && !cfg.ProgressAlways {
		return func() {}
	}
	write := func() {
		if tty {
			// Redraw in place: carriage return, the line, clear to end.
			fmt.Fprintf(w, "\r%s\x1b[K", st.line(time.Since(start)))
		} else {
			fmt.Fprintln(w, st.line(time.Since(start)))
		}
	}
	quit := make(chan struct{})
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		t := time.NewTicker(cfg.ProgressInterval)
		defer t.Stop()
		for {
			select {
			case <-quit:
				return
			case <-t.C:
				write()
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() {
			close(quit)
			<-exited
			write()
			if tty {
				fmt.Fprintln(w)
			}
		})
	}
}

// isTerminal reports whether w is a character device such as a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
