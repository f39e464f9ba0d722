package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/prefixlb/prefixlb/internal/keying"
	"github.com/prefixlb/prefixlb/internal/loadgen"
	"github.com/prefixlb/prefixlb/internal/report"
	"github.com/prefixlb/prefixlb/internal/tokenize"
	"github.com/prefixlb/prefixlb/internal/tokenize/prompttext"
	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
	"github.com/prefixlb/prefixlb/internal/upstream"
)

// probeTimeout bounds each request of the /tokenize probe.
const probeTimeout = 10 * time.Second

// SizeTolerance is how far the mean prompt the server counted may be from
// the workload's (plus the chat template's) before bench warns: 5%.
const SizeTolerance = 0.05

// textSetup is how text and chat prompts are rendered in a run.
type textSetup struct {
	// render renders a prompt's ids (loadgen.Config.Text).
	render func([]uint32) string
	// tokenizer names the tokenizer in force and why (report.Result.Tokenizer).
	tokenizer string
	// words is the renderer's vocabulary size.
	words int
	// template is the tokens the chat template adds a request (chat mode
	// with a template); hasTemplate says it was measured.
	template    int
	hasTemplate bool
	// dataset says the run replays a dataset: its requests carry their
	// own text and messages, and their token ids are counted with this
	// tokenizer (in chat mode, the chat template's tokens included).
	dataset bool
}

// apply returns cfg rendering text with t; a nil t leaves cfg as it is.
func (t *textSetup) apply(cfg loadgen.Config) loadgen.Config {
	if t != nil {
		cfg.Text = t.render
	}
	return cfg
}

// annotate records in res which tokenizer rendered the prompts and the
// chat template's tokens; a nil t does nothing.
func (t *textSetup) annotate(res *report.Result) {
	if t == nil {
		return
	}
	res.Tokenizer = t.tokenizer
	if t.hasTemplate {
		res.ChatTemplateTokens = t.template
	}
}

// header is bench's line about the tokenizer in force.
func (t *textSetup) header(mode loadgen.Mode) string {
	if t.dataset {
		how := map[loadgen.Mode]string{loadgen.ModeText: "as its text", loadgen.ModeChat: "as its messages, its prompt sizes counting the chat template's tokens"}[mode]
		if how == "" {
			how = "as its token ids"
		}
		return fmt.Sprintf("bench: tokenizer %s; the dataset is tokenized with it and sent %s", t.tokenizer, how)
	}
	s := fmt.Sprintf("bench: tokenizer %s; each token id renders as one of its %d whole-word tokens", t.tokenizer, t.words)
	if mode == loadgen.ModeChat {
		if t.hasTemplate {
			s += fmt.Sprintf("; chat template adds %d tokens a request", t.template)
		} else {
			s += "; it has no chat template, so the template's tokens are not known"
		}
	}
	return s
}

// setupText learns the target's tokenizer and builds the renderer: the
// one spec names (--tokenizer), else the bundled Qwen3 when the target's
// /tokenize gives Qwen3's ids (keying.TokenizerCheck's probe, as vLLM,
// SGLang, prefixlb engine and serve speak it, then as llama.cpp does),
// else the bundled Qwen3 with a warning on stderr. A tokenizer known only
// through /tokenize is not used: bench renders with a local tokenizer.json
// or not at all, so that every rendered prompt's length is checked
// locally (docs/bench.md).
func setupText(ctx context.Context, spec string, mode loadgen.Mode, target string, header http.Header, stderr io.Writer) (*textSetup, error) {
	var tok *tokenize.Tokenizer
	var why string
	if spec != "" {
		t, err := keying.LoadTokenizer(spec)
		if err != nil {
			return nil, fmt.Errorf("bench: --tokenizer %s: %w", spec, err)
		}
		tok, why = t, spec+" (--tokenizer)"
	} else {
		q, err := qwen3.Shared()
		if err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		tok = q
		state, err := probeTokenizer(ctx, q, target, header)
		switch state {
		case keying.TokenizerMatch:
			why = "qwen3 (bundled; the target's /tokenize gives the same ids)"
		case keying.TokenizerMismatch:
			why = "qwen3 (bundled; the target's /tokenize DIFFERS: give --tokenizer)"
			fmt.Fprintf(stderr, "bench: warning: the target's /tokenize gives other ids than the bundled Qwen3 tokenizer (%v); "+
				"text prompts are rendered with Qwen3 and will not be the workload's size: give --tokenizer (the target model's tokenizer.json or directory)\n", err)
		default:
			why = "qwen3 (bundled; the target's /tokenize could not be read)"
			fmt.Fprintf(stderr, "bench: warning: cannot learn the target's tokenizer from its /tokenize (%v); "+
				"rendering text with the bundled Qwen3 tokenizer: give --tokenizer unless the target serves a Qwen3 model\n", err)
		}
	}
	r, err := renderer(tok)
	if err != nil {
		return nil, fmt.Errorf("bench: tokenizer %s: %w", why, err)
	}
	t := &textSetup{render: r.Render, tokenizer: why, words: r.Words()}
	if mode == loadgen.ModeChat && tok.HasChatTemplate() {
		if t.template, err = templateTokens(tok, r); err != nil {
			return nil, fmt.Errorf("bench: tokenizer %s: %w", why, err)
		}
		t.hasTemplate = true
	}
	return t, nil
}

// renderer returns tok's Renderer, built on first use.
func renderer(tok *tokenize.Tokenizer) (*prompttext.Renderer, error) { return prompttext.Shared(tok) }

// templateTokens measures the tokens the chat template adds around one
// user message, as bench's chat requests send it (vLLM's default
// add_generation_prompt): the chat's tokens less the content's, for
// contents of 1, 100 and 1,000 rendered tokens, which must agree.
func templateTokens(tok *tokenize.Tokenizer, r *prompttext.Renderer) (int, error) {
	rng := rand.New(rand.NewPCG(31, 31))
	overhead := -1
	for _, n := range []int{1, 100, 1000} {
		ids := make([]uint32, n)
		for i := range ids {
			ids[i] = rng.Uint32N(1 << 20)
		}
		chat, err := tok.EncodeChat([]tokenize.Message{{Role: "user", Content: r.Render(ids)}},
			tokenize.ChatOptions{AddGenerationPrompt: true})
		if err != nil {
			return 0, fmt.Errorf("measure the chat template: %w", err)
		}
		o := len(chat) - n
		if overhead >= 0 && o != overhead {
			return 0, fmt.Errorf("measure the chat template: it adds %d tokens to a %d-token message but %d to a shorter one", o, n, overhead)
		}
		overhead = o
	}
	return overhead, nil
}

// probeTokenizer compares tok with the target's /tokenize: as vLLM,
// SGLang and prefixlb speak it, then, when that gives no usable answer, as
// llama.cpp does. header (Authorization) goes with every request.
func probeTokenizer(ctx context.Context, tok *tokenize.Tokenizer, target string, header http.Header) (keying.TokenizerState, error) {
	client := &http.Client{Transport: headerTransport{header, http.DefaultTransport}}
	check := keying.NewTokenizerCheck(tok)
	check.Timeout = probeTimeout
	base := loadgenBase(target)
	state, err := check.Compare(ctx, client, base)
	if state != keying.TokenizerUnknown || errors.Is(err, upstream.ErrNoAnswer) {
		return state, err
	}
	if s2, err2 := check.CompareKind(ctx, client, base, upstream.LlamaCpp); s2 != keying.TokenizerUnknown {
		return s2, err2
	}
	return state, err
}

// headerTransport adds header to every request.
type headerTransport struct {
	header http.Header
	next   http.RoundTripper
}

func (h headerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if len(h.header) > 0 {
		r = r.Clone(r.Context())
		for k, vs := range h.header {
			r.Header[k] = vs
		}
	}
	return h.next.RoundTrip(r)
}

// loadgenBase strips trailing slashes and "/v1" from a --target, as the
// load generator does: /tokenize lives at the server's root.
func loadgenBase(target string) string {
	for len(target) > 0 && target[len(target)-1] == '/' {
		target = target[:len(target)-1]
	}
	if len(target) >= 3 && target[len(target)-3:] == "/v1" {
		target = target[:len(target)-3]
	}
	return target
}

// checkSizes warns on stderr when the mean prompt the server counted
// differs from the workload's mean (plus the chat template's tokens) by
// more than SizeTolerance.
func checkSizes(res report.Result, stderr io.Writer) {
	if res.PromptTokensMean <= 0 || res.WorkloadPromptTokensMean <= 0 {
		return
	}
	want := res.WorkloadPromptTokensMean + float64(res.ChatTemplateTokens)
	off := res.PromptTokensMean/want - 1
	if math.Abs(off) <= SizeTolerance {
		return
	}
	tmpl := ""
	if res.ChatTemplateTokens > 0 {
		tmpl = fmt.Sprintf(" + %d of chat template", res.ChatTemplateTokens)
	}
	fmt.Fprintf(stderr, "bench: warning: the target counted %.0f prompt tokens a request, the workload %.0f%s: %+.1f%%, beyond ±%.0f%%; "+
		"the run measured another workload than it names (a different tokenizer? give --tokenizer)\n",
		res.PromptTokensMean, res.WorkloadPromptTokensMean, tmpl, 100*off, 100*SizeTolerance)
}
