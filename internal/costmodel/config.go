package costmodel

import (
	"errors"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"

	yamlv2 "go.yaml.in/yaml/v2"
	"sigs.k8s.io/yaml"
)

// ErrInvalidProfile is wrapped by every error Validate returns (one precise
// error per rule, after hashicorp/raft's ValidateConfig; STYLE.md).
var ErrInvalidProfile = errors.New("costmodel: invalid profile")

// Kind names the functional form of a profile in a Config.
type Kind string

// The kinds a Config can name. See docs/profiles.md for each one's fields.
const (
	// KindRoofline computes times from Model, GPU and Assumptions
	// (ALGORITHMS.md §5, "Roofline").
	KindRoofline Kind = "roofline"
	// KindLinear is a fitted regression: PrefillMS, DecodeMS and
	// KVCapacityTokens (the form of Preble's Llama-3-70B fits).
	KindLinear Kind = "linear"
	// KindPrebleMistral is Preble's piecewise Mistral-7B / A6000 fit
	// (arXiv 2407.00023; WukLab/preble model_equations_numpy.py), with only
	// KVCapacityTokens to give.
	KindPrebleMistral Kind = "preble-mistral"
)

// kinds lists the known kinds, for error messages.
var kinds = []Kind{KindLinear, KindPrebleMistral, KindRoofline}

// Config describes a profile; it is what a YAML profile file holds (schema in
// docs/profiles.md) and what the built-in profiles are written as. There are
// no defaults: every figure a kind needs is given, and fields of other kinds
// are rejected.
type Config struct {
	// Name is the profile's name (Profile.Name).
	Name string `json:"name"`
	// Kind selects the functional form.
	Kind Kind `json:"kind"`

	// KVCapacityTokens is the KV capacity of a fitted profile (linear,
	// preble-mistral); a roofline computes its own.
	KVCapacityTokens int `json:"kv_capacity_tokens,omitempty"`
	// PrefillMS is the prefill regression of a linear profile.
	PrefillMS *PrefillFit `json:"prefill_ms,omitempty"`
	// DecodeMS is the decode-step regression of a linear profile.
	DecodeMS *DecodeFit `json:"decode_ms,omitempty"`

	// Model, GPU and Assume are the figures of a roofline profile.
	Model  *Model       `json:"model,omitempty"`
	GPU    *GPU         `json:"gpu,omitempty"`
	Assume *Assumptions `json:"assume,omitempty"`

	// Batching, for every kind, is the engine's iteration budget
	// (Profile's Batching). Nil means the default: VLLMBatching(*GPU) for a
	// roofline, DefaultBatching for the other kinds.
	Batching *Batching `json:"batching,omitempty"`

	// AdapterLoad, for every kind, prices loading a LoRA adapter into a GPU
	// slot (Profile's AdapterLoad). Nil means DefaultAdapterLoad.
	AdapterLoad *AdapterLoad `json:"adapter_load,omitempty"`
}

// Validate checks c and returns the first rule it breaks, as an error that
// wraps ErrInvalidProfile and names the field, or nil.
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return fmt.Errorf("%w %q: %s: %s", ErrInvalidProfile, c.Name, field, fmt.Sprintf(format, args...))
	}
	if strings.TrimSpace(c.Name) == "" {
		return bad("name", "missing")
	}
	if c.Name != strings.TrimSpace(c.Name) {
		return bad("name", "has leading or trailing space")
	}
	switch c.Kind {
	case KindPrebleMistral, KindLinear, KindRoofline:
	case "":
		return bad("kind", "missing (one of %s)", kindList())
	default:
		return bad("kind", "unknown kind %q (one of %s)", c.Kind, kindList())
	}
	onlyFor := func(field string, set bool, kind Kind) error {
		if set && c.Kind != kind {
			return bad(field, "only used by kind %s, not %s", kind, c.Kind)
		}
		return nil
	}
	for _, e := range []error{
		onlyFor("prefill_ms", c.PrefillMS != nil, KindLinear),
		onlyFor("decode_ms", c.DecodeMS != nil, KindLinear),
		onlyFor("model", c.Model != nil, KindRoofline),
		onlyFor("gpu", c.GPU != nil, KindRoofline),
		onlyFor("assume", c.Assume != nil, KindRoofline),
	} {
		if e != nil {
			return e
		}
	}
	var err error
	switch c.Kind {
	case KindPrebleMistral:
		err = positiveInt(bad, "kv_capacity_tokens", c.KVCapacityTokens)
	case KindLinear:
		err = c.validateLinear(bad)
	default: // KindRoofline
		err = c.validateRoofline(bad)
	}
	if err != nil {
		return err
	}
	if c.AdapterLoad != nil {
		if err := validateAdapterLoad(bad, *c.AdapterLoad); err != nil {
			return err
		}
	}
	if c.Batching == nil {
		return nil
	}
	return validateBatching(bad, *c.Batching)
}

// batching is the batching of c's profile: c.Batching if given, else the
// kind's default (VLLMBatching for a roofline, DefaultBatching otherwise).
func (c Config) batching() Batching {
	switch {
	case c.Batching != nil:
		return *c.Batching
	case c.Kind == KindRoofline && c.GPU != nil:
		return VLLMBatching(*c.GPU)
	default:
		return DefaultBatching
	}
}

type badFunc func(field, format string, args ...any) error

func (c Config) validateLinear(bad badFunc) error {
	if c.PrefillMS == nil {
		return bad("prefill_ms", "missing")
	}
	if c.DecodeMS == nil {
		return bad("decode_ms", "missing")
	}
	p, d := c.PrefillMS, c.DecodeMS
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"prefill_ms.c0", p.C0}, {"prefill_ms.new", p.New}, {"prefill_ms.seq", p.Seq}, {"prefill_ms.new_seq", p.NewSeq},
		{"decode_ms.c0", d.C0}, {"decode_ms.per_seq", d.PerSeq}, {"decode_ms.per_context_token", d.PerContextToken},
	} {
		if err := finite(bad, f.name, f.v, false); err != nil {
			return err
		}
	}
	if p.C0 == 0 && p.New == 0 && p.Seq == 0 && p.NewSeq == 0 {
		return bad("prefill_ms", "all coefficients are 0")
	}
	if d.C0 == 0 && d.PerSeq == 0 && d.PerContextToken == 0 {
		return bad("decode_ms", "all coefficients are 0")
	}
	return positiveInt(bad, "kv_capacity_tokens", c.KVCapacityTokens)
}

func (c Config) validateRoofline(bad badFunc) error {
	if c.KVCapacityTokens != 0 {
		return bad("kv_capacity_tokens", "not used by kind roofline (computed from gpu.memory_bytes and assume.memory_fraction)")
	}
	if c.Model == nil {
		return bad("model", "missing")
	}
	if c.GPU == nil {
		return bad("gpu", "missing")
	}
	if c.Assume == nil {
		return bad("assume", "missing")
	}
	m, g, a := c.Model, c.GPU, c.Assume
	if err := finite(bad, "model.params", m.Params, true); err != nil {
		return err
	}
	for _, f := range []struct {
		name string
		v    int
	}{
		{"model.layers", m.Layers}, {"model.heads", m.Heads}, {"model.kv_heads", m.KVHeads},
		{"model.head_dim", m.HeadDim}, {"model.dtype_bytes", m.DTypeBytes}, {"gpu.count", g.Count},
	} {
		if err := positiveInt(bad, f.name, f.v); err != nil {
			return err
		}
	}
	if m.KVHeads > m.Heads {
		return bad("model.kv_heads", "%d exceeds model.heads (%d)", m.KVHeads, m.Heads)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"gpu.peak_flops", g.PeakFLOPS}, {"gpu.hbm_bytes_per_s", g.HBMBandwidth}, {"gpu.memory_bytes", g.MemoryBytes},
	} {
		if err := finite(bad, f.name, f.v, true); err != nil {
			return err
		}
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"assume.mfu", a.MFU}, {"assume.mbu", a.MBU}, {"assume.memory_fraction", a.MemoryFraction},
	} {
		if err := finite(bad, f.name, f.v, true); err != nil {
			return err
		}
		if f.v > 1 {
			return bad(f.name, "must be at most 1, got %g", f.v)
		}
	}
	if err := finite(bad, "assume.overhead_ms", a.OverheadMS, false); err != nil {
		return err
	}
	if a.KVBlockTokens < 0 {
		return bad("assume.kv_block_tokens", "must be >= 0, got %d", a.KVBlockTokens)
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"model weights", m.WeightBytes()}, {"KV bytes per token", m.KVBytesPerToken()},
		{"replica FLOP/s", float64(g.Count) * g.PeakFLOPS * a.MFU},
		{"replica bandwidth", float64(g.Count) * g.HBMBandwidth * a.MBU},
	} {
		if math.IsInf(f.v, 0) || f.v == 0 {
			return bad("model", "%s is %g: out of range", f.name, f.v)
		}
	}
	if kvCapacity(*m, *g, *a) == 0 {
		usable := float64(g.Count) * g.MemoryBytes * a.MemoryFraction
		return bad("assume.memory_fraction", "no room for KV cache: weights take %.4g GB of %.4g GB usable (gpu.count·gpu.memory_bytes·assume.memory_fraction)",
			m.WeightBytes()/1e9, usable/1e9)
	}
	return nil
}

// finite checks that v is a finite number ≥ 0 (> 0 when positive).
func finite(bad badFunc, field string, v float64, positive bool) error {
	switch {
	case math.IsNaN(v):
		return bad(field, "is NaN; want a finite number")
	case math.IsInf(v, 0):
		return bad(field, "is infinite; want a finite number")
	case v < 0:
		return bad(field, "must be >= 0, got %g", v)
	case positive && v == 0:
		return bad(field, "must be > 0, got 0")
	}
	return nil
}

func positiveInt(bad badFunc, field string, v int) error {
	if v <= 0 {
		return bad(field, "must be > 0, got %d", v)
	}
	return nil
}

func kindList() string {
	s := make([]string, len(kinds))
	for i, k := range kinds {
		s[i] = string(k)
	}
	return strings.Join(s, ", ")
}

// New validates c and builds its profile: Preble's Mistral fit, a linear
// fit or a roofline (ALGORITHMS.md §5). The profile implements Batcher.
func New(c Config) (Profile, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	b, a := c.batching(), c.adapterLoad()
	switch c.Kind {
	case KindPrebleMistral:
		return &prebleMistral{name: c.Name, kv: c.KVCapacityTokens, batching: b, adapter: a}, nil
	case KindLinear:
		return &linear{name: c.Name, prefill: *c.PrefillMS, decode: *c.DecodeMS, kv: c.KVCapacityTokens, batching: b, adapter: a}, nil
	default: // KindRoofline; Validate rejected the rest
		r := newRoofline(c.Name, *c.Model, *c.GPU, *c.Assume, b)
		r.adapter = a
		return r, nil
	}
}

// ParseConfig decodes a YAML profile (schema in docs/profiles.md) strictly:
// unknown and duplicate fields are errors. It does not validate; see Parse.
func ParseConfig(data []byte) (Config, error) {
	var c Config
	if err := yaml.UnmarshalStrict(data, &c); err != nil {
		if field, what := nonFinite(data); field != "" {
			return Config{}, fmt.Errorf("costmodel: parse profile: %s: %s is not a finite number", field, what)
		}
		return Config{}, fmt.Errorf("costmodel: parse profile: %w", err)
	}
	return c, nil
}

// Parse decodes, validates and builds a YAML profile (docs/profiles.md).
func Parse(data []byte) (Profile, error) {
	c, err := ParseConfig(data)
	if err != nil {
		return nil, err
	}
	return New(c)
}

// Load reads, validates and builds the YAML profile in the file at path
// (docs/profiles.md). It is the package's only I/O.
func Load(path string) (Profile, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("costmodel: load profile: %w", err)
	}
	p, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%w (file %s)", err, path)
	}
	return p, nil
}

// nonFinite explains the commonest reason YAML-to-JSON conversion fails:
// JSON has no NaN or infinity, so sigs.k8s.io/yaml reports ".nan" only as
// "unsupported value". It returns the dotted path and value of the first
// such number (in sorted key order), or "" if there is none.
func nonFinite(data []byte) (field, what string) {
	var doc any
	if yamlv2.Unmarshal(data, &doc) != nil {
		return "", ""
	}
	return findNonFinite("", doc)
}

func findNonFinite(path string, v any) (string, string) {
	switch t := v.(type) {
	case float64:
		if math.IsNaN(t) || math.IsInf(t, 0) {
			return path, fmt.Sprint(t)
		}
	case map[any]any:
		keys := make([]string, 0, len(t))
		vals := make(map[string]any, len(t))
		for k, x := range t {
			ks := fmt.Sprint(k)
			keys = append(keys, ks)
			vals[ks] = x
		}
		sort.Strings(keys)
		for _, k := range keys {
			p := k
			if path != "" {
				p = path + "." + k
			}
			if f, w := findNonFinite(p, vals[k]); f != "" {
				return f, w
			}
		}
	case []any:
		for i, x := range t {
			if f, w := findNonFinite(fmt.Sprintf("%s[%d]", path, i), x); f != "" {
				return f, w
			}
		}
	}
	return "", ""
}
