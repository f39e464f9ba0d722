package workload

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// ErrUnknownWorkload is returned (wrapped, with the known names) by Generate
// and Spec.Validate for a workload name that is not in Names().
var ErrUnknownWorkload = errors.New("workload: unknown workload")

// Spec selects a workload generator and sets its parameters. Every generator
// reads the common fields and its own parameter struct; the others are ignored.
// Fill it with DefaultSpec (the published settings), flags (AddFlags) or by
// hand, then call Generate. A Spec is a plain value: generation is a pure
// function of it.
type Spec struct {
	// Name is the generator: one of Names().
	Name string `json:"name"`
	// Requests is how many requests to generate.
	Requests int `json:"requests"`
	// Seed makes the workload reproducible: the same Spec gives the same
	// requests, token for token.
	Seed int64 `json:"seed"`
	// Replicas is the cluster size the workload is sized for. Preble states
	// several settings "per 2 replicas" (200 tools, 200 environments, 150
	// videos, 24 documents) and multiplies them by Replicas/2 (its
	// scale_to_gpu); Replicas scales those counts the same way. Default 2.
	Replicas int `json:"replicas"`
	// OutputTokens, when positive, overrides every request's output length
	// (the engine ignores EOS); 0 keeps each generator's own lengths.
	OutputTokens int `json:"output_tokens,omitempty"`

	ToolBench    ToolBenchParams    `json:"toolbench"`
	Agent        AgentParams        `json:"agent"`
	Programming  ProgrammingParams  `json:"programming"`
	VideoQA      VideoQAParams      `json:"videoqa"`
	LooGLE       LooGLEParams       `json:"loogle"`
	CodingAgent  CodingAgentParams  `json:"coding_agent"`
	RAG          RAGParams          `json:"rag"`
	SharedPrefix SharedPrefixParams `json:"shared_prefix"`
	LoRA         LoRAParams         `json:"lora"`
}

// ToolBenchParams shapes the `toolbench` workload (Preble §6, ToolBench): K
// tools, each prompt the chosen tool's long description (the shared prefix)
// followed by a short user query.
type ToolBenchParams struct {
	// Tools is K per 2 replicas (Preble: 200).
	Tools int `json:"tools"`
	// Zipf is the exponent of tool popularity: P(tool i) ∝ (i+1)^-Zipf, as
	// Preble draws np.random.zipf(a)-1 truncated to K. 0 selects tools evenly
	// (Preble's EVEN: the same number of requests per tool, shuffled).
	// Preble's skewed setting is 1.1.
	Zipf float64 `json:"zipf"`
	// DescMedian, DescMin and DescMax give the tool-description length in
	// tokens: log-normal around DescMedian (σ = 0.45), clipped. Measured on
	// ToolBench's data_example: ~360 tokens of system prompt plus ~160 tokens
	// per API schema, 714–2534 tokens, median 1331 over 15 traces.
	DescMedian int `json:"desc_median"`
	DescMin    int `json:"desc_min"`
	DescMax    int `json:"desc_max"`
	// QueryMin and QueryMax bound the user query (ToolBench queries: 51–96).
	QueryMin int `json:"query_min"`
	QueryMax int `json:"query_max"`
	// OutputMin and OutputMax bound the output (a function call: tens of tokens).
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
}

// AgentParams shapes the `agent` workload (Preble's embodied-agent, "virtualenv"):
// sessions in which each step re-sends the whole conversation so far plus the
// environment's new observation.
type AgentParams struct {
	// Environments is the number of distinct environments per 2 replicas
	// (Preble: 200). A session runs in one environment; environments are reused
	// by later sessions, so their descriptions are shared.
	Environments int `json:"environments"`
	// SystemTokens is the instruction prompt common to every session.
	SystemTokens int `json:"system_tokens"`
	// EnvMin and EnvMax bound each environment's description.
	EnvMin int `json:"env_min"`
	EnvMax int `json:"env_max"`
	// StepsMin and StepsMax bound the steps (requests) of a session.
	StepsMin int `json:"steps_min"`
	StepsMax int `json:"steps_max"`
	// ObsMin and ObsMax bound the observation appended after each step.
	ObsMin int `json:"obs_min"`
	ObsMax int `json:"obs_max"`
	// Output is the output of every step (Preble: 26 tokens), which the next
	// step re-sends.
	Output int `json:"output"`
	// Concurrent is how many sessions are in progress at once; their steps
	// interleave. 0 means Environments (scaled).
	Concurrent int `json:"concurrent"`
}

// ProgrammingParams shapes the `programming` workload (Preble's APPS-style
// programming): one long shared instruction prefix and a unique problem.
type ProgrammingParams struct {
	// PrefixTokens is the shared prefix (Preble: 2,400 tokens).
	PrefixTokens int `json:"prefix_tokens"`
	// ProblemMin and ProblemMax bound the unique problem statement.
	ProblemMin int `json:"problem_min"`
	ProblemMax int `json:"problem_max"`
	// OutputMin and OutputMax bound the output (Preble crops at 512).
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
}

// VideoQAParams shapes the `videoqa` workload (Preble's video QA): a system
// prompt, the video as 256 tokens per second (capped at 8,192), and a question.
type VideoQAParams struct {
	// Videos is the number of videos per 2 replicas (Preble: 150).
	Videos int `json:"videos"`
	// SystemTokens is the system prompt shared by every request.
	SystemTokens int `json:"system_tokens"`
	// TokensPerSecond is the video encoding rate (Preble: 256).
	TokensPerSecond int `json:"tokens_per_second"`
	// MaxVideoTokens caps a video's tokens (Preble: 8,192).
	MaxVideoTokens int `json:"max_video_tokens"`
	// SecondsMin and SecondsMax bound a video's duration in seconds.
	SecondsMin int `json:"seconds_min"`
	SecondsMax int `json:"seconds_max"`
	// QuestionMin and QuestionMax bound the question.
	QuestionMin int `json:"question_min"`
	QuestionMax int `json:"question_max"`
	// OutputMin and OutputMax bound the answer.
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
}

// LooGLEParams shapes the `loogle` workload (Preble's LooGLE long-document QA):
// a long document and one of its questions, with Preble's prompt
// "Please answer the question based on the long texts below. \n{doc}\nQuestion: {Q}\nAnswer: ".
type LooGLEParams struct {
	// Documents is the number of documents per 2 replicas (Preble: 24).
	Documents int `json:"documents"`
	// DocMin and DocMax bound a document's tokens: LooGLE shortdep_qa
	// documents are 66k–127k characters, ~16k–32k tokens, and Preble
	// truncates prompts to 32,768 tokens.
	DocMin int `json:"doc_min"`
	DocMax int `json:"doc_max"`
	// QuestionsMin and QuestionsMax bound the questions per document
	// (LooGLE test samples: 6–25). Requests pick a document and one of its
	// questions uniformly; with more requests than questions, prompts repeat.
	QuestionsMin int `json:"questions_min"`
	QuestionsMax int `json:"questions_max"`
	// QuestionMin and QuestionMax bound a question's tokens.
	QuestionMin int `json:"question_min"`
	QuestionMax int `json:"question_max"`
	// OutputMax caps the answer (Preble: max_tokens_override=45); answers are
	// drawn from [OutputMin, OutputMax].
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
}

// CodingAgentParams shapes the `coding-agent` workload (the "Orbit" case): a
// few repositories, each a 30–60k-token prefix (tool schemas common to all,
// then the repository), and overlapping multi-turn sessions whose history grows.
type CodingAgentParams struct {
	// Repos is the number of repositories (not scaled by Replicas).
	Repos int `json:"repos"`
	// SchemaTokens is the tool-schema and instruction prefix all repositories share.
	SchemaTokens int `json:"schema_tokens"`
	// PrefixMin and PrefixMax bound the whole repository prefix (schemas included).
	PrefixMin int `json:"prefix_min"`
	PrefixMax int `json:"prefix_max"`
	// TurnsMin and TurnsMax bound the turns (requests) of a session.
	TurnsMin int `json:"turns_min"`
	TurnsMax int `json:"turns_max"`
	// UserMin/UserMax bound the user or tool-result text appended each turn.
	UserMin int `json:"user_min"`
	UserMax int `json:"user_max"`
	// OutputMin/OutputMax bound each turn's output (re-sent by the next turn).
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
	// MaxContext ends a session before its prompt would exceed it.
	MaxContext int `json:"max_context"`
	// Concurrent is how many sessions overlap in time.
	Concurrent int `json:"concurrent"`
}

// RAGParams shapes the `rag` workload: a short shared system prompt, several
// retrieved chunks (from a large corpus, in query-dependent order, so they
// rarely form a shared prefix) and the question. Little sharing: balance wins.
type RAGParams struct {
	// SystemTokens is the shared system prompt.
	SystemTokens int `json:"system_tokens"`
	// Chunks is the number of retrieved chunks per request.
	Chunks int `json:"chunks"`
	// ChunkTokens is each chunk's length.
	ChunkTokens int `json:"chunk_tokens"`
	// Corpus is the number of distinct chunks retrieval draws from.
	Corpus int `json:"corpus"`
	// QuestionMin and QuestionMax bound the question.
	QuestionMin int `json:"question_min"`
	QuestionMax int `json:"question_max"`
	// OutputMin and OutputMax bound the answer.
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
}

// SharedPrefixParams shapes the `shared-prefix` workload: llm-d's precise
// prefix-cache benchmark, inference-perf's shared_prefix data generator. G
// groups, each a P-token system prompt and U fixed Q-token questions; each
// request picks a group and one of its questions uniformly at random, so G·U
// distinct prompts repeat. Not scaled by Replicas (llm-d ran it on 8 pods).
type SharedPrefixParams struct {
	// Groups is G (llm-d: 150).
	Groups int `json:"groups"`
	// SystemTokens is P (llm-d: 6,000).
	SystemTokens int `json:"system_tokens"`
	// Questions is U, the fixed questions per group (llm-d: 5).
	Questions int `json:"questions"`
	// QuestionTokens is Q (llm-d: 1,200).
	QuestionTokens int `json:"question_tokens"`
	// Output is every request's output, EOS ignored (llm-d: 1,000).
	Output int `json:"output"`
}

// LoRAParams shapes the `lora` workload: one base model serving N LoRA
// adapters (vLLM serves each under its own model name), adapter popularity
// Zipf, each adapter with its own few system prompts, each request one of
// its adapter's system prompts (chosen evenly) and a fresh user query. Not
// scaled by Replicas.
type LoRAParams struct {
	// Adapters is N.
	Adapters int `json:"adapters"`
	// Zipf is the exponent of adapter popularity: P(adapter i) ∝
	// (i+1)^-Zipf; 0 spreads requests evenly.
	Zipf float64 `json:"zipf"`
	// AdapterMB is each adapter's size in MB (10^6 bytes). The default, 84,
	// is a rank-16 adapter of Llama-3.1-8B on all seven projections in
	// bf16: 32 layers · 16 · (4096+4096 + 2·(4096+1024) + 4096+4096 +
	// 3·(4096+14336)) · 2 bytes = 83.9 MB.
	AdapterMB float64 `json:"adapter_mb"`
	// SystemPrompts is the number of system prompts per adapter.
	SystemPrompts int `json:"system_prompts"`
	// SystemMin and SystemMax bound a system prompt's tokens (uniform).
	SystemMin int `json:"system_min"`
	SystemMax int `json:"system_max"`
	// QueryMin and QueryMax bound the user query (uniform).
	QueryMin int `json:"query_min"`
	QueryMax int `json:"query_max"`
	// OutputMin and OutputMax bound the output (uniform).
	OutputMin int `json:"output_min"`
	OutputMax int `json:"output_max"`
}

// DefaultSpec returns the published settings for the named workload (Preble's
// prototype, WukLab/preble multi_node/benchmarks, and llm-d's benchmark), with
// 1,000 requests, seed 1 and 2 replicas. It does not check the name.
func DefaultSpec(name string) Spec {
	return Spec{
		Name:     name,
		Requests: 1000,
		Seed:     1,
		Replicas: 2,
		ToolBench: ToolBenchParams{
			Tools: 200, Zipf: 0,
			DescMedian: 1300, DescMin: 600, DescMax: 3000,
			QueryMin: 50, QueryMax: 100,
			OutputMin: 10, OutputMax: 60,
		},
		Agent: AgentParams{
			Environments: 200, SystemTokens: 600,
			EnvMin: 200, EnvMax: 600,
			StepsMin: 5, StepsMax: 25,
			ObsMin: 20, ObsMax: 80,
			Output: 26,
		},
		Programming: ProgrammingParams{
			PrefixTokens: 2400,
			ProblemMin:   100, ProblemMax: 600,
			OutputMin: 32, OutputMax: 512,
		},
		VideoQA: VideoQAParams{
			Videos: 150, SystemTokens: 100,
			TokensPerSecond: 256, MaxVideoTokens: 8192,
			SecondsMin: 2, SecondsMax: 60,
			QuestionMin: 10, QuestionMax: 40,
			OutputMin: 10, OutputMax: 100,
		},
		LooGLE: LooGLEParams{
			Documents: 24,
			DocMin:    16000, DocMax: 32000,
			QuestionsMin: 6, QuestionsMax: 25,
			QuestionMin: 10, QuestionMax: 40,
			OutputMin: 4, OutputMax: 45,
		},
		CodingAgent: CodingAgentParams{
			Repos: 4, SchemaTokens: 8000,
			PrefixMin: 30000, PrefixMax: 60000,
			TurnsMin: 10, TurnsMax: 40,
			UserMin: 50, UserMax: 1000,
			OutputMin: 30, OutputMax: 400,
			MaxContext: 128000,
			Concurrent: 8,
		},
		RAG: RAGParams{
			SystemTokens: 200, Chunks: 5, ChunkTokens: 300, Corpus: 10000,
			QuestionMin: 10, QuestionMax: 60,
			OutputMin: 50, OutputMax: 300,
		},
		SharedPrefix: SharedPrefixParams{
			Groups: 150, SystemTokens: 6000, Questions: 5, QuestionTokens: 1200, Output: 1000,
		},
		LoRA: LoRAParams{
			Adapters: 32, Zipf: 1.1, AdapterMB: 84, SystemPrompts: 4,
			SystemMin: 500, SystemMax: 3000,
			QueryMin: 50, QueryMax: 500,
			OutputMin: 50, OutputMax: 300,
		},
	}
}

// generator builds Requests requests (Arrival zero, list order = send order).
type generator func(s *Spec) []Request

var generators = map[string]generator{
	"toolbench":     genToolBench,
	"agent":         genAgent,
	"programming":   genProgramming,
	"videoqa":       genVideoQA,
	"loogle":        genLooGLE,
	"coding-agent":  genCodingAgent,
	"rag":           genRAG,
	"shared-prefix": genSharedPrefix,
	"lora":          genLoRA,
}

// Names returns the workload names Generate knows, sorted.
func Names() []string {
	names := make([]string, 0, len(generators))
	for n := range generators {
		names = append(names, n)
	}
	slices.Sort(names)
	return names
}

// scaled multiplies a "per 2 replicas" count by Replicas/2 (at least 1).
func (s *Spec) scaled(n int) int {
	return max(1, n*s.Replicas/2)
}

// Validate reports the first invalid setting of the chosen generator.
func (s *Spec) Validate() error {
	if _, ok := generators[s.Name]; !ok {
		return fmt.Errorf("%w %q (known: %s)", ErrUnknownWorkload, s.Name, strings.Join(Names(), ", "))
	}
	var errs []string
	check := func(ok bool, format string, args ...any) {
		if !ok {
			errs = append(errs, fmt.Sprintf(format, args...))
		}
	}
	rng := func(name string, lo, hi, min int) {
		check(lo >= min, "%s min %d must be >= %d", name, lo, min)
		check(hi >= lo, "%s max %d must be >= min %d", name, hi, lo)
	}
	check(s.Requests >= 1, "requests %d must be >= 1", s.Requests)
	check(s.Replicas >= 1, "replicas %d must be >= 1", s.Replicas)
	check(s.OutputTokens >= 0, "output tokens %d must be >= 0", s.OutputTokens)
	switch s.Name {
	case "toolbench":
		p := s.ToolBench
		check(p.Tools >= 1, "toolbench tools %d must be >= 1", p.Tools)
		check(p.Zipf >= 0, "toolbench zipf %g must be >= 0", p.Zipf)
		rng("toolbench description", p.DescMin, p.DescMax, 1)
		check(p.DescMedian >= 1, "toolbench description median %d must be >= 1", p.DescMedian)
		rng("toolbench query", p.QueryMin, p.QueryMax, 1)
		rng("toolbench output", p.OutputMin, p.OutputMax, 1)
	case "agent":
		p := s.Agent
		check(p.Environments >= 1, "agent environments %d must be >= 1", p.Environments)
		check(p.SystemTokens >= 0, "agent system tokens %d must be >= 0", p.SystemTokens)
		rng("agent environment", p.EnvMin, p.EnvMax, 1)
		rng("agent steps", p.StepsMin, p.StepsMax, 1)
		rng("agent observation", p.ObsMin, p.ObsMax, 1)
		check(p.Output >= 1, "agent output %d must be >= 1", p.Output)
		check(p.Concurrent >= 0, "agent concurrent %d must be >= 0", p.Concurrent)
	case "programming":
		p := s.Programming
		check(p.PrefixTokens >= 0, "programming prefix tokens %d must be >= 0", p.PrefixTokens)
		rng("programming problem", p.ProblemMin, p.ProblemMax, 1)
		rng("programming output", p.OutputMin, p.OutputMax, 1)
	case "videoqa":
		p := s.VideoQA
		check(p.Videos >= 1, "videoqa videos %d must be >= 1", p.Videos)
		check(p.SystemTokens >= 0, "videoqa system tokens %d must be >= 0", p.SystemTokens)
		check(p.TokensPerSecond >= 1, "videoqa tokens per second %d must be >= 1", p.TokensPerSecond)
		check(p.MaxVideoTokens >= 1, "videoqa max video tokens %d must be >= 1", p.MaxVideoTokens)
		rng("videoqa seconds", p.SecondsMin, p.SecondsMax, 1)
		rng("videoqa question", p.QuestionMin, p.QuestionMax, 1)
		rng("videoqa output", p.OutputMin, p.OutputMax, 1)
	case "loogle":
		p := s.LooGLE
		check(p.Documents >= 1, "loogle documents %d must be >= 1", p.Documents)
		rng("loogle document", p.DocMin, p.DocMax, 1)
		rng("loogle questions per document", p.QuestionsMin, p.QuestionsMax, 1)
		rng("loogle question", p.QuestionMin, p.QuestionMax, 1)
		rng("loogle output", p.OutputMin, p.OutputMax, 1)
	case "coding-agent":
		p := s.CodingAgent
		check(p.Repos >= 1, "coding-agent repos %d must be >= 1", p.Repos)
		check(p.SchemaTokens >= 0, "coding-agent schema tokens %d must be >= 0", p.SchemaTokens)
		rng("coding-agent prefix", p.PrefixMin, p.PrefixMax, p.SchemaTokens+1)
		rng("coding-agent turns", p.TurnsMin, p.TurnsMax, 1)
		rng("coding-agent user", p.UserMin, p.UserMax, 1)
		rng("coding-agent output", p.OutputMin, p.OutputMax, 1)
		check(p.MaxContext > p.PrefixMax+p.UserMax, "coding-agent max context %d must exceed prefix max + user max (%d)", p.MaxContext, p.PrefixMax+p.UserMax)
		check(p.Concurrent >= 1, "coding-agent concurrent %d must be >= 1", p.Concurrent)
	case "rag":
		p := s.RAG
		check(p.SystemTokens >= 0, "rag system tokens %d must be >= 0", p.SystemTokens)
		check(p.Chunks >= 0, "rag chunks %d must be >= 0", p.Chunks)
		check(p.ChunkTokens >= 1, "rag chunk tokens %d must be >= 1", p.ChunkTokens)
		check(p.Corpus >= 1, "rag corpus %d must be >= 1", p.Corpus)
		rng("rag question", p.QuestionMin, p.QuestionMax, 1)
		rng("rag output", p.OutputMin, p.OutputMax, 1)
	case "shared-prefix":
		p := s.SharedPrefix
		check(p.Groups >= 1, "shared-prefix groups %d must be >= 1", p.Groups)
		check(p.SystemTokens >= 0, "shared-prefix system tokens %d must be >= 0", p.SystemTokens)
		check(p.Questions >= 1, "shared-prefix questions %d must be >= 1", p.Questions)
		check(p.QuestionTokens >= 1, "shared-prefix question tokens %d must be >= 1", p.QuestionTokens)
		check(p.Output >= 1, "shared-prefix output %d must be >= 1", p.Output)
	case "lora":
		p := s.LoRA
		check(p.Adapters >= 1, "lora adapters %d must be >= 1", p.Adapters)
		check(p.Zipf >= 0, "lora zipf %g must be >= 0", p.Zipf)
		check(p.AdapterMB >= 0 && p.AdapterMB < 1e6, "lora adapter MB %g must be in [0, 1e6)", p.AdapterMB)
		check(p.SystemPrompts >= 1, "lora system prompts %d must be >= 1", p.SystemPrompts)
		rng("lora system prompt", p.SystemMin, p.SystemMax, 0)
		rng("lora query", p.QueryMin, p.QueryMax, 1)
		rng("lora output", p.OutputMin, p.OutputMax, 1)
	}
	if len(errs) > 0 {
		return fmt.Errorf("workload %s: %s", s.Name, errs[0])
	}
	return nil
}

// Generate builds the workload s describes: s.Requests requests in send order
// with IDs 0..n-1, Arrival zero (apply an arrival process with Arrivals), and
// a session's steps in order. It is deterministic under s.Seed. Prompts that
// are equal, or that are earlier steps of one session, share backing arrays:
// treat Tokens as read-only.
func Generate(s Spec) ([]Request, error) {
	if err := s.Validate(); err != nil {
		return nil, err
	}
	reqs := generators[s.Name](&s)
	for i := range reqs {
		reqs[i].ID = i
		if s.OutputTokens > 0 {
			reqs[i].OutputTokens = s.OutputTokens
		}
	}
	return reqs, nil
}
