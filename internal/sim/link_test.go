package sim

import (
	"testing"
	"time"
)

// TestLinksShare: two transfers leaving one replica share its link and take
// twice as long as one alone; a transfer into another replica from another
// source is not slowed; when one ends the other speeds up.
func TestLinksShare(t *testing.T) {
	l := newLinks(4, 1e9, time.Millisecond) // 1 GB/s
	l.start(0, 0, 2, 1e6, epoch)            // 1 MB: 1 ms alone
	at, _, ok := l.next()
	if !ok || at.Sub(epoch) != time.Millisecond {
		t.Fatalf("one transfer ends at %v, want 1ms", at.Sub(epoch))
	}
	l.start(1, 0, 3, 3e6, epoch) // same source: both at 0.5 GB/s
	l.start(2, 1, 3, 1e6, epoch) // into 3 as well: 3 has 2 incoming
	at, _, _ = l.next()
	if at.Sub(epoch) != 2*time.Millisecond {
		t.Fatalf("shared: first end at %v, want 2ms (1 MB at half the link)", at.Sub(epoch))
	}
	done := l.finish(at, nil)
	if len(done) != 2 || done[0].req != 0 || done[1].req != 2 {
		t.Fatalf("done at 2ms: %v, want requests 0 and 2", done)
	}
	// Request 1 moved 1 MB of 3 at half speed; the last 2 MB go at full.
	at, _, _ = l.next()
	if got := at.Sub(epoch); got != 4*time.Millisecond {
		t.Fatalf("the last transfer ends at %v, want 4ms", got)
	}
	if done := l.finish(at, nil); len(done) != 1 || done[0].req != 1 {
		t.Fatalf("done at 4ms: %v", done)
	}
	if _, _, ok := l.next(); ok {
		t.Error("transfers left")
	}
}
