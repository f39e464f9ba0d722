// Package cluster is the routing core that both of prefixlb's front doors,
// serve (internal/proxy, an HTTP reverse proxy) and epp (internal/epp, the
// Gateway API Inference Extension's endpoint picker), run over: the router
// and the one lock that serialises it, the settings resolved once (cost
// profile, policy, prompt keyer), admission of a prompt, the KV-event sink
// that feeds the engines' cache events to the router, and the timer that
// keeps the router's speculative entries honest. The front doors own
// transport and membership; what a decision depends on lives here, so that
// the same request routes the same way through either.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prefixlb/prefixlb/internal/blocks"
	"github.com/prefixlb/prefixlb/internal/calibrate"
	"github.com/prefixlb/prefixlb/internal/costmodel"
	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/openai"
	"github.com/prefixlb/prefixlb/internal/policy"
	"github.com/prefixlb/prefixlb/internal/router"
)

// Settings are what a routing core is built from: the same for serve and
// epp (each reads them from its own flags and YAML).
type Settings struct {
	// BlockTokens is the tokens per router key (the engines' block size).
	BlockTokens int
	// Profile names the replicas' cost profile (costmodel.Resolve: a name,
	// NAME:key=value,..., or a YAML file).
	Profile string
	// Policy names the routing policy with its options (policy.Parse).
	Policy string
	// Tokenizer, when Keyer is nil, is the replicas' tokenizer
	// (keying.LoadTokenizer); "" or "auto" the bundled Qwen3 once a
	// replica confirms it (keying.NewAutoTokenizerKeyer); "none" keys by
	// text chunks.
	Tokenizer string
	// Keyer keys prompts (nil: from Tokenizer). A *keying.TokenizerKeyer
	// must make keys of BlockTokens tokens.
	Keyer keying.Keyer
	// Seed seeds the policy's random choices.
	Seed uint64
	// SpeculativeTTL is how long a decision's blocks count as cached on
	// its replica before a KV event confirms them (router.Config).
	SpeculativeTTL time.Duration
	// TreeMaxBlocks bounds the router's global prefix tree (0: unbounded).
	TreeMaxBlocks int
	// DefaultOutputTokens is the output assumed for a request that does
	// not say (0: the router's default).
	DefaultOutputTokens int
	// Calibrate, when set, learns each replica's speed (internal/calibrate).
	Calibrate *calibrate.Config
	// MaxPromptTokens bounds a prompt's length in tokens (0: no bound).
	MaxPromptTokens int
	// KVLink is the network between prefill and decode replicas that
	// disaggregating policies price a KV transfer on (router.Config).
	KVLink policy.KVLink
	// IgnoreTiers drops the KV events of slower cache tiers (CPU, disk)
	// instead of pricing their blocks at their load time (Sink).
	IgnoreTiers bool
	// Adapters are the model names that are LoRA adapters (vLLM's
	// --lora-modules names): a request for one is keyed from the
	// adapter's seed (blocks.AdapterSeed), as vLLM hashes the adapter into
	// its blocks and its KV events name it (lora_name).
	Adapters []string
	// AdapterBytes is the size of an adapter's weights (engine's and the
	// workload's --lora-adapter-bytes), which with the profile's
	// costmodel.AdapterLoad prices loading one on a replica
	// (policy.Replica.AdapterBytes); 0 prices the fixed cost alone.
	AdapterBytes int64
}

// ErrPromptTooLong is returned by Key for a prompt over
// Settings.MaxPromptTokens.
var ErrPromptTooLong = errors.New("prompt too long")

// PolicyOptions are the policy options for blocks of blockTokens tokens:
// the defaults, with the approximate-cache capacity kept in tokens.
func PolicyOptions(blockTokens int) policy.Options {
	o := policy.DefaultOptions()
	o.ApproxCapacityBlocks = o.ApproxCapacityBlocks * o.BlockTokens / blockTokens
	o.BlockTokens = blockTokens
	return o
}

// Core is a router behind its lock, with what was resolved to build it.
// Mu serialises Router and whatever replica state the front door keeps
// beside it; the other fields are set once by New.
type Core struct {
	// Mu guards Router (and the front door's state that goes with it).
	Mu sync.Mutex
	// Router is the routing core (internal/router): not safe for
	// concurrent use, hence Mu.
	Router *router.Router
	// Profile is the replicas' default cost profile.
	Profile costmodel.Profile
	// Policy is the policy's name (a metrics label).
	Policy string
	// Keyer keys prompts; safe for concurrent use.
	Keyer keying.Keyer

	maxPrompt    int
	adapters     map[string]bool
	adapterBytes int64
	ignoreTiers  bool
}

// New resolves s (profile, policy, keyer) and builds the router. Errors
// name the setting at fault.
func New(s Settings) (*Core, error) {
	prof, err := costmodel.Resolve(s.Profile)
	if err != nil {
		return nil, fmt.Errorf("profile: %w", err)
	}
	pol, err := policy.Parse(s.Policy, PolicyOptions(s.BlockTokens))
	if err != nil {
		return nil, fmt.Errorf("policy: %w", err)
	}
	keyer := s.Keyer
	switch {
	case keyer != nil, s.Tokenizer == keying.TokenizerNone:
	case s.Tokenizer == "" || s.Tokenizer == keying.TokenizerAuto:
		keyer = keying.NewAutoTokenizerKeyer(s.BlockTokens)
	default:
		tok, err := keying.LoadTokenizer(s.Tokenizer)
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %w", err)
		}
		tk := keying.NewTokenizerKeyer(tok, s.BlockTokens)
		tk.SetSpec(s.Tokenizer)
		keyer = tk
	}
	if keyer == nil {
		keyer = keying.ChunkKeyer{BlockTokens: s.BlockTokens}
	}
	if tk, ok := keyer.(*keying.TokenizerKeyer); ok && tk.BlockTokens() != s.BlockTokens {
		return nil, fmt.Errorf("keyer: tokenizer keys of %d tokens, block_tokens is %d", tk.BlockTokens(), s.BlockTokens)
	}
	rt, err := router.New(router.Config{BlockTokens: s.BlockTokens, Profile: prof, Policy: pol, Seed: s.Seed,
		SpeculativeTTL: s.SpeculativeTTL, DefaultOutputTokens: s.DefaultOutputTokens,
		TreeMaxBlocks: s.TreeMaxBlocks, Calibrate: s.Calibrate, KVLink: s.KVLink})
	if err != nil {
		return nil, fmt.Errorf("router: %w", err)
	}
	c := &Core{Router: rt, Profile: prof, Policy: pol.Name(), Keyer: keyer, maxPrompt: s.MaxPromptTokens, ignoreTiers: s.IgnoreTiers}
	if s.AdapterBytes < 0 {
		return nil, fmt.Errorf("adapter bytes %d: must be ≥ 0", s.AdapterBytes)
	}
	c.adapterBytes = s.AdapterBytes
	for _, a := range s.Adapters {
		if a == "" {
			return nil, errors.New("adapters: an empty adapter name")
		}
		if c.adapters == nil {
			c.adapters = map[string]bool{}
		}
		c.adapters[a] = true
	}
	return c, nil
}

// Key keys req's prompt and admits it: its keys and prompt tokens, or an
// error wrapping ErrPromptTooLong for a prompt over the bound. A request
// whose model is one of Settings.Adapters is keyed as that adapter's
// (req.Adapter). It takes no lock.
func (c *Core) Key(req *openai.Request) ([]blocks.Key, int, error) {
	if c.adapters[req.Model] {
		req.Adapter = req.Model
	}
	keys, tokens, err := c.Keyer.Keys(req)
	if err != nil {
		return nil, 0, fmt.Errorf("key prompt: %w", err)
	}
	if err := c.Admit(tokens); err != nil {
		return nil, 0, err
	}
	return keys, tokens, nil
}

// Admit rejects a prompt of more than Settings.MaxPromptTokens tokens
// (counted or estimated by the keyer).
func (c *Core) Admit(tokens int) error {
	if c.maxPrompt > 0 && tokens > c.maxPrompt {
		return fmt.Errorf("%w: %d tokens, over the limit of %d (max_prompt_tokens)", ErrPromptTooLong, tokens, c.maxPrompt)
	}
	return nil
}

// ExpireSpeculative unmarks the router's unconfirmed speculative entries
// every interval, under Mu, until ctx ends: Route and CacheStored expire
// them too, and this keeps an idle router's view honest.
func (c *Core) ExpireSpeculative(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			c.Mu.Lock()
			c.Router.ExpireSpeculative(now)
			c.Mu.Unlock()
		}
	}
}
