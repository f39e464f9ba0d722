package admission

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/policy"
)

var t0 = time.Unix(1_700_000_000, 0)

// pool returns n up replicas, each with waiting requests in its engine.
func pool(n, waiting int) []policy.Replica {
	reps := make([]policy.Replica, n)
	for i := range reps {
		reps[i] = policy.Replica{ID: i, Up: true, Waiting: waiting, Running: 1, KVUsage: 0.1}
	}
	return reps
}

// newQueue is a queue of the default config that engages at the first
// saturated arrival and keeps its predicted-wait threshold whatever the
// SLOs (EngageAfter and SLOFraction off: TestEngageAfter and
// TestSLOFraction test them), changed by mod.
func newQueue(t *testing.T, mod func(*Config)) *Queue {
	t.Helper()
	c := Default()
	c.EngageAfter, c.SLOFraction = 0, 0
	if mod != nil {
		mod(&c)
	}
	q, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	return q
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		ok   bool
	}{
		{"default", func(*Config) {}, true},
		{"max queue", func(c *Config) { c.MaxQueue = 0 }, false},
		{"timeout", func(c *Config) { c.Timeout = 0 }, false},
		{"waiting", func(c *Config) { c.MaxWaiting = -1 }, false},
		{"kv", func(c *Config) { c.MaxKVUsage = 1.5 }, false},
		{"prefill", func(c *Config) { c.MaxQueuedPrefill = -time.Second }, false},
		{"all off", func(c *Config) { c.MaxWaiting, c.MaxKVUsage, c.MaxQueuedPrefill, c.MaxPredictedWait = 0, 0, 0, 0 }, false},
		{"predicted wait", func(c *Config) { c.MaxPredictedWait = -1 }, false},
		{"lifo", func(c *Config) { c.LIFOAfter = -1 }, false},
		{"slo fraction", func(c *Config) { c.SLOFraction = 1 }, false},
		{"slo fraction NaN", func(c *Config) { c.SLOFraction = math.NaN() }, false},
		{"slo fraction off", func(c *Config) { c.SLOFraction = 0 }, true},
		{"engage after", func(c *Config) { c.EngageAfter = -1 }, false},
		{"min ttft slo", func(c *Config) { c.MinTTFTSLO = -1 }, false},
		{"min ttft slo off", func(c *Config) { c.MinTTFTSLO = 0 }, true},
		{"weight", func(c *Config) { c.Weights = map[string]float64{"a": 0} }, false},
		{"weights", func(c *Config) { c.Weights = map[string]float64{"a": 2, "b": 0.5} }, true},
	} {
		c := Default()
		tc.mod(&c)
		if err := c.Validate(); (err == nil) != tc.ok {
			t.Errorf("%s: Validate() = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

func TestJudge(t *testing.T) {
	c := Default()
	idle := policy.Replica{Up: true, Waiting: 0, KVUsage: 0.2}
	for _, tc := range []struct {
		name string
		reps []policy.Replica
		want Pool
	}{
		{"idle", []policy.Replica{idle, idle}, Pool{Up: 2}},
		{"one waiting", []policy.Replica{{Up: true, Waiting: 8}, idle}, Pool{Up: 2}},
		{"all waiting", []policy.Replica{{Up: true, Waiting: 8}, {Up: true, Waiting: 9}}, Pool{Up: 2, Saturated: true}},
		{"kv", []policy.Replica{{Up: true, KVUsage: 0.96}, {Up: true, Waiting: 8}}, Pool{Up: 2, Saturated: true}},
		{"slot kv ignored", []policy.Replica{{Up: true, KVUsage: 1, Slots: 2}}, Pool{Up: 1}},
		{"queued prefill", []policy.Replica{{Up: true, Waiting: -1, PendingPrefill: 3 * time.Second},
			{Up: true, Waiting: -1, PendingPrefill: 2 * time.Second}}, Pool{Up: 2, Saturated: true, MinQueuedPrefill: 2 * time.Second}},
		{"router's own queue", []policy.Replica{{Up: true, Waiting: -1, Prefilling: 8}}, Pool{Up: 1, Saturated: true}},
		{"down skipped", []policy.Replica{{Up: true, Waiting: 8}, {Up: false}}, Pool{Up: 1, Saturated: true}},
		{"prefill role skipped", []policy.Replica{{Up: true, Waiting: 8}, {Up: true, Role: policy.RolePrefill}}, Pool{Up: 1, Saturated: true}},
		{"none up", []policy.Replica{{Up: false}}, Pool{}},
	} {
		// Without an estimator the predicted wait is the queued prefill.
		tc.want.MinWait = tc.want.MinQueuedPrefill
		got := c.Judge(tc.reps, nil)
		got.Best = 0
		if got != tc.want {
			t.Errorf("%s: Judge = %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

func TestPassThrough(t *testing.T) {
	q := newQueue(t, nil)
	reps := pool(4, 0)
	tk := &Ticket{ID: 1, Arrival: t0}
	if v, d := q.Arrive(tk, reps, t0); v != Pass || d != nil {
		t.Fatalf("Arrive = %v, %v, want Pass", v, d)
	}
	allocs := testing.AllocsPerRun(100, func() {
		*tk = Ticket{ID: 1, Arrival: t0}
		q.Arrive(tk, reps, t0)
	})
	if allocs != 0 {
		t.Errorf("pass-through allocates %v times", allocs)
	}
	if st := q.Stats(); st.Passed != st.Arrived || q.Len() != 0 {
		t.Errorf("stats %+v, len %d", st, q.Len())
	}
}

// drain dispatches everything waiting on an idle pool.
func drain(q *Queue, now time.Time) []*Ticket {
	var out []*Ticket
	idle := pool(2, 0)
	for t := q.Next(idle, now, nil); t != nil; t = q.Next(idle, now, nil) {
		out = append(out, t)
	}
	return out
}

func TestPriorityOrder(t *testing.T) {
	q := newQueue(t, nil)
	busy := pool(2, 10)
	prios := []int{0, 5, -3, 5, 0, 10}
	for i, p := range prios {
		if v, _ := q.Arrive(&Ticket{ID: uint64(i), Priority: p, Arrival: t0}, busy, t0); v != Queued {
			t.Fatalf("request %d: %v, want Queued", i, v)
		}
	}
	if tk := q.Next(busy, t0, nil); tk != nil {
		t.Fatalf("dispatched %d while saturated", tk.ID)
	}
	// Once a request waits, a new one waits behind it even if the pool
	// has room: the queue keeps its order.
	if v, _ := q.Arrive(&Ticket{ID: 6, Priority: 0, Arrival: t0}, pool(2, 0), t0); v != Queued {
		t.Fatalf("arrival behind a queue: %v, want Queued", v)
	}
	var got []uint64
	for _, tk := range drain(q, t0) {
		got = append(got, tk.ID)
	}
	want := []uint64{5, 1, 3, 0, 4, 6, 2}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("order %v, want %v", got, want)
	}
}

func TestFairShare(t *testing.T) {
	for _, tc := range []struct {
		name    string
		weights map[string]float64
		// of the first 30 dispatched, how many are the light tenant's
		wantLight int
	}{
		{"equal", nil, 15},
		{"heavy weighs 2", map[string]float64{"heavy": 2}, 10},
		{"light weighs 0.5", map[string]float64{"light": 0.5}, 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			q := newQueue(t, func(c *Config) { c.Weights = tc.weights })
			busy := pool(1, 10)
			id := uint64(0)
			// The heavy tenant sends 4 for the light one's 1, first.
			for i := 0; i < 80; i++ {
				q.Arrive(&Ticket{ID: id, Tenant: "heavy", Arrival: t0}, busy, t0)
				id++
			}
			for i := 0; i < 20; i++ {
				q.Arrive(&Ticket{ID: id, Tenant: "light", Arrival: t0}, busy, t0)
				id++
			}
			out := drain(q, t0)
			light := 0
			for _, tk := range out[:30] {
				if tk.Tenant == "light" {
					light++
				}
			}
			if light != tc.wantLight {
				t.Errorf("light got %d of 30, want %d", light, tc.wantLight)
			}
			if len(out) != 100 {
				t.Errorf("dispatched %d, want 100", len(out))
			}
		})
	}
}

func TestTimeout(t *testing.T) {
	q := newQueue(t, func(c *Config) { c.Timeout = time.Second })
	busy := pool(1, 10)
	a := &Ticket{ID: 1, Arrival: t0}
	b := &Ticket{ID: 2, Arrival: t0.Add(500 * time.Millisecond)}
	q.Arrive(a, busy, a.Arrival)
	q.Arrive(b, busy, b.Arrival)
	if at, ok := q.NextDue(busy); !ok || !at.Equal(t0.Add(time.Second)) {
		t.Errorf("NextDue = %v %v, want %v", at, ok, t0.Add(time.Second))
	}
	var shed []*Ticket
	fn := func(t *Ticket) { shed = append(shed, t) }
	q.Expire(busy, t0.Add(999*time.Millisecond), fn)
	if len(shed) != 0 {
		t.Fatalf("shed %d before the timeout", len(shed))
	}
	q.Expire(busy, t0.Add(time.Second), fn)
	if len(shed) != 1 || shed[0] != a || a.Reason != Timeout || !b.Waiting() {
		t.Fatalf("shed %v, want request 1 by timeout", shed)
	}
	if got := q.Stats().Shed[Timeout]; got != 1 {
		t.Errorf("timeouts counted %d", got)
	}
}

func TestDeadline(t *testing.T) {
	q := newQueue(t, nil)
	busy := pool(2, 10)
	busy[0].PendingPrefill, busy[1].PendingPrefill = 3*time.Second, 1500*time.Millisecond
	// Due in 1 s, and the least queued prefill is 1.5 s: shed at once.
	late := &Ticket{ID: 1, Arrival: t0, Deadline: t0.Add(time.Second)}
	if v, _ := q.Arrive(late, busy, t0); v != Shed || late.Reason != Deadline {
		t.Fatalf("Arrive = %v (%v), want Shed by deadline", v, late.Reason)
	}
	// Due in 2 s, with 0.3 s of its own: it waits, and is shed once the
	// clock passes 2 − 0.3 − 1.5 = 0.2 s.
	ok := &Ticket{ID: 2, Arrival: t0, Deadline: t0.Add(2 * time.Second), Service: 300 * time.Millisecond}
	if v, _ := q.Arrive(ok, busy, t0); v != Queued {
		t.Fatalf("Arrive = %v, want Queued", v)
	}
	if tk := q.Next(busy, t0.Add(100*time.Millisecond), nil); tk != nil || !ok.Waiting() {
		t.Fatal("shed or dispatched too early")
	}
	var shed []*Ticket
	q.Next(busy, t0.Add(201*time.Millisecond), func(t *Ticket) { shed = append(shed, t) })
	if len(shed) != 1 || ok.Reason != Deadline {
		t.Fatalf("shed %v, want request 2 by deadline", shed)
	}
	// Below saturation a request with a deadline passes, even a late one:
	// the queue does not engage there.
	if v, _ := q.Arrive(&Ticket{ID: 3, Arrival: t0, Deadline: t0}, pool(1, 0), t0); v != Pass {
		t.Errorf("below saturation: %v, want Pass", v)
	}
}

func TestQueueFull(t *testing.T) {
	q := newQueue(t, func(c *Config) { c.MaxQueue = 3 })
	busy := pool(1, 10)
	for i := 0; i < 3; i++ {
		q.Arrive(&Ticket{ID: uint64(i), Priority: 0, Tenant: fmt.Sprint("t", i%2), Arrival: t0}, busy, t0)
	}
	same := &Ticket{ID: 10, Priority: 0, Arrival: t0}
	if v, d := q.Arrive(same, busy, t0); v != Shed || same.Reason != QueueFull || d != nil {
		t.Fatalf("same priority on a full queue: %v %v", v, d)
	}
	high := &Ticket{ID: 11, Priority: 1, Arrival: t0}
	v, d := q.Arrive(high, busy, t0)
	// The heaviest tenant (t0: requests 0 and 2) loses its newest.
	if v != Queued || d == nil || d.ID != 2 || d.Reason != QueueFull {
		t.Fatalf("higher priority on a full queue: %v, displaced %+v", v, d)
	}
	if q.Len() != 3 {
		t.Errorf("len %d, want 3", q.Len())
	}
	var got []uint64
	for _, tk := range drain(q, t0) {
		got = append(got, tk.ID)
	}
	if fmt.Sprint(got) != "[11 0 1]" {
		t.Errorf("order %v, want [11 0 1]", got)
	}
}

func TestCancelAndPoolDown(t *testing.T) {
	q := newQueue(t, nil)
	busy := pool(2, 10)
	a, b, c := &Ticket{ID: 1, Arrival: t0}, &Ticket{ID: 2, Arrival: t0}, &Ticket{ID: 3, Arrival: t0, Tenant: "x"}
	for _, tk := range []*Ticket{a, b, c} {
		q.Arrive(tk, busy, t0)
	}
	if !q.Cancel(b) || q.Cancel(b) {
		t.Fatal("Cancel: want true once, then false")
	}
	down := pool(2, 0)
	down[0].Up, down[1].Up = false, false
	var shed []*Ticket
	if tk := q.Next(down, t0, func(t *Ticket) { shed = append(shed, t) }); tk != nil {
		t.Fatal("dispatched with no replica up")
	}
	if len(shed) != 2 || a.Reason != PoolDown || c.Reason != PoolDown || q.Len() != 0 {
		t.Fatalf("shed %d, want both waiting by pool_down", len(shed))
	}
	if v, _ := q.Arrive(&Ticket{ID: 4, Arrival: t0}, down, t0); v != Shed {
		t.Errorf("arrival on a down pool: %v, want Shed", v)
	}
	st := q.Stats()
	if st.Cancelled != 1 || st.Shed[PoolDown] != 3 {
		t.Errorf("stats %+v", st)
	}
}

// TestAccounting drives the queue with random operations and checks, after
// each, that every request is counted once and that no request is
// dispatched while one of a higher priority waits.
func TestAccounting(t *testing.T) {
	for seed := uint64(1); seed <= 20; seed++ {
		rng := rand.New(rand.NewPCG(seed, 7))
		q := newQueue(t, func(c *Config) { c.MaxQueue = 16; c.Timeout = 5 * time.Second })
		now := t0
		var live []*Ticket
		ended := 0
		onShed := func(*Ticket) { ended++ }
		for step := 0; step < 2000; step++ {
			now = now.Add(time.Duration(rng.IntN(300)) * time.Millisecond)
			reps := pool(2, 10*rng.IntN(2))
			reps[0].PendingPrefill = time.Duration(rng.IntN(3000)) * time.Millisecond
			reps[1].Up = rng.IntN(20) > 0
			reps[0].Up = reps[1].Up || rng.IntN(2) > 0
			switch op := rng.IntN(4); op {
			case 0, 1:
				tk := &Ticket{ID: uint64(step), Priority: rng.IntN(3), Tenant: fmt.Sprint(rng.IntN(3)), Arrival: now}
				if rng.IntN(2) == 0 {
					tk.Deadline = now.Add(time.Duration(rng.IntN(4000)) * time.Millisecond)
				}
				v, d := q.Arrive(tk, reps, now)
				if d != nil {
					ended++
				}
				if v == Queued {
					live = append(live, tk)
				} else {
					ended++
				}
			case 2:
				for tk := q.Next(reps, now, onShed); tk != nil; tk = q.Next(reps, now, onShed) {
					ended++
					for _, o := range live {
						if o.Waiting() && o.Priority > tk.Priority {
							t.Fatalf("seed %d: dispatched priority %d while %d waits", seed, tk.Priority, o.Priority)
						}
					}
					reps[0].Waiting, reps[1].Waiting = 10, 10 // one at a time
					if rng.IntN(2) == 0 {
						reps[0].Waiting, reps[1].Waiting = 0, 0
					}
				}
				if at, ok := q.NextDue(reps); ok && !at.After(now) {
					t.Fatalf("seed %d step %d: next due %v not after now %v", seed, step, at, now)
				}
			case 3:
				if len(live) > 0 {
					if q.Cancel(live[rng.IntN(len(live))]) {
						ended++
					}
				}
			}
			st := q.Stats()
			if got := st.Passed + st.Dispatched + st.ShedTotal() + st.Cancelled + int64(q.Len()); got != st.Arrived {
				t.Fatalf("seed %d step %d: %d accounted of %d arrived (%+v, len %d)", seed, step, got, st.Arrived, st, q.Len())
			}
			if int64(ended+q.Len()) != st.Arrived {
				t.Fatalf("seed %d step %d: %d ended + %d waiting, %d arrived", seed, step, ended, q.Len(), st.Arrived)
			}
			waiting := 0
			for _, tk := range live {
				if tk.Waiting() {
					waiting++
				}
			}
			if waiting != q.Len() {
				t.Fatalf("seed %d step %d: %d tickets waiting, Len %d", seed, step, waiting, q.Len())
			}
		}
	}
}

// fakeEst predicts each replica's wait from a table.
type fakeEst struct {
	wait    []time.Duration
	service time.Duration
}

func (e *fakeEst) Wait(i int, _ *policy.Replica) time.Duration { return e.wait[i] }
func (e *fakeEst) Service(*Ticket, int) time.Duration          { return e.service }

func TestEstimatorSaturation(t *testing.T) {
	q := newQueue(t, func(c *Config) { c.MaxWaiting, c.MaxKVUsage = 0, 0 })
	reps := pool(2, 0)
	est := &fakeEst{wait: []time.Duration{3 * time.Second, time.Second}}
	q.SetEstimator(est)
	if p := q.Judge(reps); p.Saturated || p.MinWait != time.Second || p.Best != 1 {
		t.Fatalf("Judge = %+v, want not saturated, min wait 1s at replica 1", p)
	}
	if room := q.Room(reps, nil); len(room) != 1 || room[0] != 1 {
		t.Errorf("Room = %v, want [1]", room)
	}
	est.wait[1] = 2 * time.Second
	if p := q.Judge(reps); !p.Saturated {
		t.Fatalf("Judge = %+v, want saturated (both at the 2s default)", p)
	}
	// A request whose own prefill at the best replica would miss its
	// deadline is shed on arrival; the same without a Service waits.
	est.service = 500 * time.Millisecond
	tk := &Ticket{ID: 1, Arrival: t0, Deadline: t0.Add(2400 * time.Millisecond)}
	if v, _ := q.Arrive(tk, reps, t0); v != Shed || tk.Reason != Deadline {
		t.Errorf("Arrive = %v (%v), want shed for deadline", v, tk.Reason)
	}
	est.service = 0
	tk = &Ticket{ID: 2, Arrival: t0, Deadline: t0.Add(2400 * time.Millisecond)}
	if v, _ := q.Arrive(tk, reps, t0); v != Queued {
		t.Errorf("Arrive = %v, want queued", v)
	}
}

func TestAdaptiveLIFO(t *testing.T) {
	q := newQueue(t, func(c *Config) { c.LIFOAfter = time.Second })
	busy, idle := pool(2, 10), pool(2, 0)
	tks := make([]Ticket, 3)
	for i := range tks {
		tks[i] = Ticket{ID: uint64(i), Arrival: t0.Add(time.Duration(i) * 100 * time.Millisecond)}
		if v, _ := q.Arrive(&tks[i], busy, tks[i].Arrival); v != Queued {
			t.Fatalf("Arrive %d = %v", i, v)
		}
	}
	// The oldest has waited under a second: first come first served.
	if got := q.Next(idle, t0.Add(500*time.Millisecond), nil); got.ID != 0 {
		t.Errorf("Next = %d, want 0 (FIFO)", got.ID)
	}
	// Past it: the newest first.
	if got := q.Next(idle, t0.Add(1500*time.Millisecond), nil); got.ID != 2 {
		t.Errorf("Next = %d, want 2 (LIFO)", got.ID)
	}
}

func TestDecodeAware(t *testing.T) {
	prof, err := costmodel.Lookup(costmodel.Llama31_8BH100)
	if err != nil {
		t.Fatal(err)
	}
	e := &DecodeAware{Profile: func(int) costmodel.Profile { return prof }}
	idle := policy.Replica{Up: true, PendingPrefill: time.Second, Waiting: 0}
	if got := e.Wait(0, &idle); got != time.Second {
		t.Errorf("no decodes: Wait = %v, want the queued prefill 1s", got)
	}
	dec := idle
	dec.Decoding, dec.DecodeContextTokens = 64, 64*2048
	w := e.Wait(0, &dec)
	if w <= time.Second {
		t.Errorf("64 decodes: Wait = %v, want > 1s (interference)", w)
	}
	full := dec
	full.Waiting, full.Running, full.InFlight, full.DecodeTokens = 4, 64, 68, 68*200
	if got := e.Wait(0, &full); got <= w {
		t.Errorf("engine queue: Wait = %v, want > %v (admission wait)", got, w)
	}
	if allocs := testing.AllocsPerRun(100, func() { e.Wait(0, &full) }); allocs != 0 {
		t.Errorf("Wait allocates %v times", allocs)
	}
}

// backlogEst predicts one replica's wait as a fluid backlog of work.
type backlogEst struct{ backlog *time.Duration }

func (e backlogEst) Wait(int, *policy.Replica) time.Duration { return *e.backlog }
func (e backlogEst) Service(*Ticket, int) time.Duration      { return 0 }

// TestFairDeadlineShed: a heavy and a light tenant at 4:1 against a pool
// of half their demand, every request due 2 s after it arrives and the
// pool saturated exactly when its predicted wait reaches 2 s. The light
// tenant's demand (10 req/s) is under half the capacity (25 req/s), so its
// max-min fair share of what is dispatched is all of its demand, 40 %.
// A deadline shed blind to tenants gives it its share of the demand
// (20 %).
func TestFairDeadlineShed(t *testing.T) {
	const (
		step = 20 * time.Millisecond // one arrival per step: a,a,a,a,b
		cost = 40 * time.Millisecond // work each routed request adds
		slo  = 2 * time.Second
	)
	var backlog time.Duration
	q := newQueue(t, nil)
	q.SetEstimator(backlogEst{&backlog})
	reps := pool(1, 0)
	now := t0
	routed := map[string]int{}
	route := func(tk *Ticket) { routed[tk.Tenant]++; backlog += cost }
	for i := 0; i < 3000; i++ {
		now = now.Add(step)
		backlog = max(0, backlog-step)
		tenant := "heavy"
		if i%5 == 4 {
			tenant = "light"
		}
		tk := &Ticket{ID: uint64(i), Tenant: tenant, Arrival: now, Deadline: now.Add(slo)}
		if v, _ := q.Arrive(tk, reps, now); v == Pass {
			route(tk)
		}
		for tk := q.Next(reps, now, nil); tk != nil; tk = q.Next(reps, now, nil) {
			route(tk)
		}
		st := q.Stats()
		if got := st.Passed + st.Dispatched + st.ShedTotal() + st.Cancelled + int64(q.Len()); got != st.Arrived {
			t.Fatalf("step %d: %d accounted of %d arrived", i, got, st.Arrived)
		}
	}
	total := routed["heavy"] + routed["light"]
	share := float64(routed["light"]) / float64(total)
	fair := min(600, float64(total)/2) / float64(total)
	t.Logf("routed %v, light share %.1f%%, fair %.1f%%, stats %+v", routed, 100*share, 100*fair, q.Stats())
	if share < 0.9*fair {
		t.Errorf("light tenant got %.1f%% of the routed requests, want within 10%% of its fair share %.1f%%", 100*share, 100*fair)
	}
	if total < 1400 { // capacity: 60 s × 25 req/s = 1500
		t.Errorf("routed %d, want ≥ 1400 (the pool kept busy)", total)
	}
}

// TestReprieve: a light tenant's request that cannot meet its deadline
// waits while the heaviest tenant's is shed; it is shed once hopeless, and
// in its flow a fresher request that can still make it goes first.
func TestReprieve(t *testing.T) {
	backlog := 3 * time.Second
	q := newQueue(t, nil)
	q.SetEstimator(backlogEst{&backlog})
	reps := pool(1, 0)
	now := t0
	for i := 0; i < 4; i++ { // the heavy tenant's recent demand
		q.Arrive(&Ticket{ID: uint64(i), Tenant: "heavy", Arrival: now, Deadline: now.Add(2 * time.Second)}, reps, now)
	}
	if st := q.Stats(); st.Shed[Deadline] != 4 {
		t.Fatalf("heavy tenant's late requests: %+v, want 4 shed by deadline", st)
	}
	stale := &Ticket{ID: 10, Tenant: "light", Arrival: now, Deadline: now.Add(2 * time.Second)}
	if v, _ := q.Arrive(stale, reps, now); v != Queued {
		t.Fatalf("light tenant's late request: %v, want Queued (reprieved)", v)
	}
	if at, ok := q.NextDue(reps); !ok || !at.Equal(stale.Deadline) {
		t.Errorf("NextDue = %v, want its deadline %v", at, stale.Deadline)
	}
	// The pool drains; a fresh request of the light tenant can make it.
	now = now.Add(time.Second)
	backlog = 500 * time.Millisecond
	fresh := &Ticket{ID: 11, Tenant: "light", Arrival: now, Deadline: now.Add(2 * time.Second)}
	if v, _ := q.Arrive(fresh, reps, now); v != Queued {
		t.Fatalf("fresh request: %v, want Queued behind the stale one", v)
	}
	backlog = time.Second // room (below the 2 s threshold)
	if got := q.Next(reps, now, nil); got != fresh {
		t.Fatalf("dispatched %v, want the fresh request before the reprieved one", got)
	}
	var shed []*Ticket
	q.Expire(reps, now.Add(999*time.Millisecond), func(t *Ticket) { shed = append(shed, t) })
	if len(shed) != 0 {
		t.Fatal("reprieved request shed before it was hopeless")
	}
	q.Expire(reps, stale.Deadline, func(t *Ticket) { shed = append(shed, t) })
	if len(shed) != 1 || shed[0] != stale || stale.Reason != Deadline || q.Len() != 0 {
		t.Fatalf("shed %v, want the reprieved request by deadline once hopeless", shed)
	}
}

// TestEngageAfter: arrivals pass while the pool has been saturated for
// less than EngageAfter (judged at every arrival), a moment of room starts
// the count again, and once requests wait every arrival waits behind them.
func TestEngageAfter(t *testing.T) {
	q := newQueue(t, func(c *Config) { c.EngageAfter = 100 * time.Millisecond })
	busy, idle := pool(2, 10), pool(2, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	arrive := func(id uint64, reps []policy.Replica, ms int) Verdict {
		v, _ := q.Arrive(&Ticket{ID: id, Arrival: at(ms)}, reps, at(ms))
		return v
	}
	for i, tc := range []struct {
		reps []policy.Replica
		ms   int
		want Verdict
	}{
		{busy, 0, Pass},   // saturation begins
		{busy, 60, Pass},  // 60 ms of it
		{idle, 80, Pass},  // room: the count starts again
		{busy, 90, Pass},  // saturated since 90 ms
		{busy, 170, Pass}, // 80 ms
		{busy, 190, Queued},
		{idle, 200, Queued}, // behind the waiting one, though there is room
	} {
		if got := arrive(uint64(i), tc.reps, tc.ms); got != tc.want {
			t.Fatalf("arrival %d at %d ms: %v, want %v", i, tc.ms, got, tc.want)
		}
	}
	if got := drain(q, at(200)); len(got) != 2 {
		t.Fatalf("drained %d, want 2", len(got))
	}
	// Dispatches judge the pool too: an empty queue that saw room at its
	// last dispatch restarts the count.
	if got := arrive(10, busy, 300); got != Pass {
		t.Errorf("after the drain: %v, want Pass (saturation begins again)", got)
	}
	if st := q.Stats(); st.Passed+st.Dispatched+st.ShedTotal()+st.Cancelled+int64(q.Len()) != st.Arrived {
		t.Errorf("stats do not add up: %+v", st)
	}
}

// TestSLOFraction: the predicted-wait threshold falls to SLOFraction of the
// tightest TTFT SLO of the last SLOWindow, never rises above
// MaxPredictedWait, and rises back once the tight SLO is not seen for
// SLOWindow.
func TestSLOFraction(t *testing.T) {
	q := newQueue(t, func(c *Config) { c.SLOFraction = 0.5 })
	backlog := 1200 * time.Millisecond // predicted wait on the one replica
	q.SetEstimator(backlogEst{&backlog})
	reps := pool(1, 0)
	arrive := func(id uint64, slo time.Duration, now time.Time) Verdict {
		tk := &Ticket{ID: id, Arrival: now, Service: time.Millisecond}
		if slo > 0 {
			tk.Deadline = now.Add(slo)
		}
		v, _ := q.Arrive(tk, reps, now)
		return v
	}
	steps := []struct {
		name string
		slo  time.Duration
		at   time.Duration
		want time.Duration // threshold after the arrival
		v    Verdict
	}{
		{"no SLO: the configured threshold", 0, 0, 2 * time.Second, Pass},
		{"a 10 s SLO does not raise it", 10 * time.Second, time.Second, 2 * time.Second, Pass},
		{"a 2 s SLO halves it: 1.2 s waits", 2 * time.Second, 2 * time.Second, time.Second, Queued},
		{"a looser SLO within the window keeps it", 8 * time.Second, 3 * time.Second, time.Second, Queued},
		{"the tight one refreshed", 2 * time.Second, 20 * time.Second, time.Second, Queued},
		{"the window past: a looser SLO sets it", 8 * time.Second, 51 * time.Second, 2 * time.Second, Queued},
	}
	for i, s := range steps {
		if v := arrive(uint64(i), s.slo, t0.Add(s.at)); v != s.v {
			t.Errorf("%s: %v, want %v", s.name, v, s.v)
		}
		if got := q.Threshold(); got != s.want {
			t.Errorf("%s: threshold %v, want %v", s.name, got, s.want)
		}
	}
	if got := q.Config().MaxPredictedWait; got != 2*time.Second {
		t.Errorf("configured threshold changed to %v", got)
	}
	// Off: the threshold ignores SLOs.
	off := newQueue(t, nil)
	tk := &Ticket{ID: 1, Arrival: t0, Deadline: t0.Add(time.Second)}
	off.Arrive(tk, reps, t0)
	if got := off.Threshold(); got != 2*time.Second {
		t.Errorf("SLOFraction off: threshold %v, want 2s", got)
	}
}

// TestSLOFloor (issue 26, D6): one request's 2ns or 1ns SLO lowers the
// pool's predicted-wait threshold no further than SLOFraction of
// MinTTFTSLO, and without a floor it still never turns the test off (a
// threshold of 0 did).
func TestSLOFloor(t *testing.T) {
	reps := pool(1, 0)
	for _, tc := range []struct {
		floor, slo, want time.Duration
	}{
		{DefaultMinTTFTSLO, 2, DefaultMinTTFTSLO / 2},
		{DefaultMinTTFTSLO, 1, DefaultMinTTFTSLO / 2},
		{DefaultMinTTFTSLO, time.Second, 500 * time.Millisecond},
		{0, 1, 1},
		{0, 2, 1},
	} {
		q := newQueue(t, func(c *Config) { c.SLOFraction, c.MinTTFTSLO = 0.5, tc.floor })
		tk := &Ticket{ID: 1, Arrival: t0, Deadline: t0.Add(tc.slo)}
		q.Arrive(tk, reps, t0)
		if got := q.Threshold(); got != tc.want {
			t.Errorf("floor %v, SLO %v: threshold %v, want %v", tc.floor, tc.slo, got, tc.want)
		}
	}
	if Default().MinTTFTSLO != DefaultMinTTFTSLO {
		t.Error("Default has no SLO floor")
	}
}
