package sharedstate

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisConfig configures a Redis shared state. Zero fields take the
// defaults documented on each.
type RedisConfig struct {
	// URL is the server: "redis://[user:password@]host:6379/0" (go-redis's
	// ParseURL; rediss:// for TLS). Required.
	URL string
	// Pool namespaces the keys, so that routers of different pools can share
	// one server ("default").
	Pool string
	// Router identifies this router among the pool's; it must be unique
	// (default: hostname-pid, the pod name in Kubernetes).
	Router string
	// TTL is how long a router's figures outlive its last write or
	// heartbeat: a dead router's counts disappear after at most TTL
	// (default 15s; the heartbeat runs every TTL/3).
	TTL time.Duration
	// Timeout bounds each call on the request path (default 100ms): a slow
	// or absent Redis delays a decision by at most this much, after which
	// the router decides on its own counts.
	Timeout time.Duration
}

// Validate reports the first invalid field.
func (c *RedisConfig) Validate() error {
	switch {
	case c.URL == "":
		return errors.New("sharedstate: redis url is required")
	case c.TTL < 0:
		return fmt.Errorf("sharedstate: ttl must be ≥ 0, got %v", c.TTL)
	case c.Timeout < 0:
		return fmt.Errorf("sharedstate: timeout must be ≥ 0, got %v", c.Timeout)
	case strings.ContainsAny(c.Pool, "{}") || strings.ContainsAny(c.Router, "{}"):
		return errors.New("sharedstate: pool and router names must not contain braces")
	}
	return nil
}

// Redis shares load through a Redis server. Keys (P = the pool):
//
//	prefixlb:{P}:routers     sorted set: router id → last heartbeat (server ms)
//	prefixlb:{P}:load:<id>   hash: "<field>|<replica>" → integer, PEXPIRE TTL
//
// Fields: n in flight, f prefilling, t pending prefill µs, p pending
// prefill tokens, d decode tokens. Writes are HINCRBY, so a router's
// increments and decrements need no read-modify-write. The braces keep a
// pool's keys in one Redis Cluster slot, as the scripts require. Safe for
// concurrent use.
type Redis struct {
	cfg    RedisConfig
	client *redis.Client
	set    string // the routers sorted set
	mine   string // this router's hash
	prefix string // hash key prefix, + router id
}

// NewRedis returns a client for cfg; it connects lazily (Ping checks).
func NewRedis(cfg RedisConfig) (*Redis, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Pool == "" {
		cfg.Pool = "default"
	}
	if cfg.Router == "" {
		h, _ := os.Hostname()
		cfg.Router = fmt.Sprintf("%s-%d", h, os.Getpid())
	}
	if cfg.TTL == 0 {
		cfg.TTL = 15 * time.Second
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 100 * time.Millisecond
	}
	opt, err := redis.ParseURL(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("sharedstate: redis url %q: %w", cfg.URL, err)
	}
	opt.ReadTimeout, opt.WriteTimeout = cfg.Timeout, cfg.Timeout
	opt.DialTimeout = max(cfg.Timeout, time.Second)
	r := &Redis{cfg: cfg, client: redis.NewClient(opt)}
	r.prefix = "prefixlb:{" + cfg.Pool + "}:load:"
	r.set = "prefixlb:{" + cfg.Pool + "}:routers"
	r.mine = r.prefix + cfg.Router
	return r, nil
}

// Router returns this router's id.
func (r *Redis) Router() string { return r.cfg.Router }

// Ping checks that the server answers.
func (r *Redis) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, max(r.cfg.Timeout, time.Second))
	defer cancel()
	if err := r.client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("sharedstate: ping redis: %w", err)
	}
	return nil
}

// addScript applies HINCRBYs to the caller's hash (KEYS[2]), refreshes its
// TTL (ARGV[1] ms) and its heartbeat in the routers set (KEYS[1], member
// ARGV[2]) at the server's clock, so routers' clocks need not agree. The set
// itself expires when no router has written for a TTL.
var addScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 3, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return now
`)

// othersScript drops routers whose heartbeat is older than the TTL
// (ARGV[1] ms) and returns {id, HGETALL} pairs for every other router
// (ARGV[2] is the caller's id, ARGV[3] the hash key prefix).
var othersScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local out = {}
for _, id in ipairs(ids) do
  if id ~= ARGV[2] then
    table.insert(out, id)
    table.insert(out, redis.call('HGETALL', ARGV[3] .. id))
  end
end
return out
`)

// fields lists delta's non-zero fields as HINCRBY arguments for replica.
func fields(args []any, replica string, d Load) []any {
	add := func(f string, v int64) {
		if v != 0 {
			args = append(args, f+"|"+replica, v)
		}
	}
	add("n", int64(d.InFlight))
	add("f", int64(d.Prefilling))
	add("t", d.PendingPrefill.Microseconds())
	add("p", int64(d.PendingPrefillTokens))
	add("d", int64(d.DecodeTokens))
	return args
}

// Add adds delta to this router's load on replica. PendingPrefill is kept
// in whole microseconds: callers that subtract what they added get back
// exactly to zero only if they pass the same durations.
func (r *Redis) Add(ctx context.Context, replica string, delta Load) error {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	args := fields([]any{r.cfg.TTL.Milliseconds(), r.cfg.Router}, replica, delta)
	if err := addScript.Run(ctx, r.client, []string{r.set, r.mine}, args...).Err(); err != nil {
		return fmt.Errorf("sharedstate: add load on %s: %w", replica, err)
	}
	return nil
}

// Others returns the sum, per replica, of every other live router's load.
func (r *Redis) Others(ctx context.Context) (map[string]Load, error) {
	ctx, cancel := context.WithTimeout(ctx, r.cfg.Timeout)
	defer cancel()
	res, err := othersScript.Run(ctx, r.client, []string{r.set}, r.cfg.TTL.Milliseconds(), r.cfg.Router, r.prefix).Slice()
	if err != nil {
		return nil, fmt.Errorf("sharedstate: read others' load: %w", err)
	}
	out := make(map[string]Load)
	for i := 1; i < len(res); i += 2 {
		kv, _ := res[i].([]any)
		for j := 0; j+1 < len(kv); j += 2 {
			k, _ := kv[j].(string)
			vs, _ := kv[j+1].(string)
			f, replica, ok := strings.Cut(k, "|")
			if !ok {
				continue
			}
			v, err := strconv.ParseInt(vs, 10, 64)
			if err != nil {
				continue
			}
			out[replica] = addField(out[replica], f, v)
		}
	}
	return out, nil
}

// addField adds v to l's field f.
func addField(l Load, f string, v int64) Load {
	switch f {
	case "n":
		l.InFlight += int(v)
	case "f":
		l.Prefilling += int(v)
	case "t":
		l.PendingPrefill += time.Duration(v) * time.Microsecond
	case "p":
		l.PendingPrefillTokens += int(v)
	case "d":
		l.DecodeTokens += int(v)
	}
	return l
}

// Run refreshes this router's heartbeat and TTL every TTL/3 until ctx ends;
// then it deletes this router's figures, as a router that stops cleanly
// has nothing in flight. Errors are retried at the next beat.
func (r *Redis) Run(ctx context.Context) error {
	t := time.NewTicker(r.cfg.TTL / 3)
	defer t.Stop()
	_ = r.Add(ctx, "", Load{})
	for {
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_ = r.client.Del(dctx, r.mine).Err()
			_ = r.client.ZRem(dctx, r.set, r.cfg.Router).Err()
			return nil
		case <-t.C:
			_ = r.Add(ctx, "", Load{})
		}
	}
}

// Close closes the connections.
func (r *Redis) Close() error { return r.client.Close() }
