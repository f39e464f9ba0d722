package sharedstate

import (
	"context"
	"fmt"
	"net"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// client is what both implementations offer a router.
type client interface {
	Add(ctx context.Context, replica string, delta Load) error
	Others(ctx context.Context) (map[string]Load, error)
}

// testRedisAddr is the server the Redis tests use; they skip without one.
func testRedisAddr(t *testing.T) string {
	t.Helper()
	addr := os.Getenv("PREFIXLB_TEST_REDIS")
	if addr == "" {
		addr = "127.0.0.1:6379"
	}
	c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		t.Skipf("no Redis server at %s (set PREFIXLB_TEST_REDIS): %v", addr, err)
	}
	c.Close()
	return addr
}

// newTestRedis returns router id's client on a pool private to this test.
func newTestRedis(t *testing.T, addr, pool, id string) *Redis {
	t.Helper()
	r, err := NewRedis(RedisConfig{URL: "redis://" + addr + "/0", Pool: pool, Router: id, TTL: 5 * time.Second, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func testPool(t *testing.T) string {
	return fmt.Sprintf("test-%s-%d", t.Name(), time.Now().UnixNano())
}

// conformance checks what any implementation must do, with routers a, b
// and c on the same shared state.
func conformance(t *testing.T, a, b, c client) {
	ctx := context.Background()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	one := Load{InFlight: 1, Prefilling: 1, PendingPrefill: 1500 * time.Microsecond, PendingPrefillTokens: 100, DecodeTokens: 256}
	must(a.Add(ctx, "r0", one))
	must(a.Add(ctx, "r0", one))
	must(b.Add(ctx, "r0", one))
	must(b.Add(ctx, "r1", one))

	got, err := c.Others(ctx)
	must(err)
	if want := one.Add(one).Add(one); got["r0"] != want {
		t.Errorf("c sees r0 = %+v, want %+v", got["r0"], want)
	}
	if got["r1"] != one {
		t.Errorf("c sees r1 = %+v, want %+v", got["r1"], one)
	}
	got, err = a.Others(ctx)
	must(err)
	if got["r0"] != one {
		t.Errorf("a sees r0 = %+v, want only b's %+v", got["r0"], one)
	}
	// b's request on r1 produces its first token, then finishes.
	must(b.Add(ctx, "r1", Load{Prefilling: -1, PendingPrefill: -one.PendingPrefill, PendingPrefillTokens: -100}))
	must(b.Add(ctx, "r1", Load{InFlight: -1, DecodeTokens: -256}))
	got, err = a.Others(ctx)
	must(err)
	if got["r1"] != (Load{}) {
		t.Errorf("a sees r1 = %+v after b finished, want zero", got["r1"])
	}
}

func TestMemory(t *testing.T) {
	m := NewMemory()
	a, b, c := m.Client("a"), m.Client("b"), m.Client("c")
	conformance(t, a, b, c)
	b.Close()
	got, _ := c.Others(context.Background())
	if got["r0"].InFlight != 2 {
		t.Errorf("after b closed, c sees r0 in flight %d, want a's 2", got["r0"].InFlight)
	}
}

func TestRedis(t *testing.T) {
	addr := testRedisAddr(t)
	pool := testPool(t)
	a, b, c := newTestRedis(t, addr, pool, "a"), newTestRedis(t, addr, pool, "b"), newTestRedis(t, addr, pool, "c")
	conformance(t, a, b, c)
}

// TestRedisDeadRouterExpires: a router whose heartbeat is older than the
// TTL no longer counts, and its hash has a TTL so it disappears too.
func TestRedisDeadRouterExpires(t *testing.T) {
	addr := testRedisAddr(t)
	pool := testPool(t)
	ctx := context.Background()
	a, dead := newTestRedis(t, addr, pool, "a"), newTestRedis(t, addr, pool, "dead")
	if err := dead.Add(ctx, "r0", Load{InFlight: 7}); err != nil {
		t.Fatal(err)
	}
	raw := redis.NewClient(&redis.Options{Addr: addr})
	defer raw.Close()
	ttl, err := raw.PTTL(ctx, dead.mine).Result()
	if err != nil || ttl <= 0 || ttl > 5*time.Second {
		t.Fatalf("dead router's hash PTTL = %v, %v; want in (0, 5s]", ttl, err)
	}
	if got, _ := a.Others(ctx); got["r0"].InFlight != 7 {
		t.Fatalf("a sees r0 in flight %d, want 7 while dead is alive", got["r0"].InFlight)
	}
	// Its last heartbeat was an hour ago: it is gone for good.
	if err := raw.ZAdd(ctx, dead.set, redis.Z{Score: float64(time.Now().Add(-time.Hour).UnixMilli()), Member: "dead"}).Err(); err != nil {
		t.Fatal(err)
	}
	if got, _ := a.Others(ctx); got["r0"].InFlight != 0 {
		t.Fatalf("a sees r0 in flight %d after dead's heartbeat expired, want 0", got["r0"].InFlight)
	}
	if n, _ := raw.ZCard(ctx, dead.set).Result(); n != 0 {
		t.Errorf("routers set holds %d members, want 0 (a never wrote, dead expired)", n)
	}
}

// TestRedisRunCleansUp: a router that stops cleanly removes its figures.
func TestRedisRunCleansUp(t *testing.T) {
	addr := testRedisAddr(t)
	pool := testPool(t)
	a, b := newTestRedis(t, addr, pool, "a"), newTestRedis(t, addr, pool, "b")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.Run(ctx) }()
	if err := b.Add(context.Background(), "r0", Load{InFlight: 2}); err != nil {
		t.Fatal(err)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got, _ := a.Others(context.Background()); got["r0"].InFlight != 0 {
		t.Fatalf("a sees r0 in flight %d after b stopped, want 0", got["r0"].InFlight)
	}
}

func TestRedisConfigValidate(t *testing.T) {
	for _, c := range []RedisConfig{{}, {URL: "redis://x", TTL: -1}, {URL: "redis://x", Pool: "a{b}"}} {
		if _, err := NewRedis(c); err == nil {
			t.Errorf("NewRedis(%+v): no error", c)
		}
	}
	if _, err := NewRedis(RedisConfig{URL: "http://nope"}); err == nil {
		t.Error("NewRedis with an http URL: no error")
	}
}
