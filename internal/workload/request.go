// Package workload generates the request streams prefixlb is measured on (the
// workloads of Preble and llm-d's benchmarks) and reads traces, so that the
// simulator, the load generator and the analyzer all consume one type.
package workload

import "time"

// Request is one request of a workload: its prompt as token ids, when it
// arrives, and how many tokens it generates.
type Request struct {
	// ID is the request's index in its workload, starting at 0.
	ID int
	// Arrival is the time since the start of the run at which it is sent.
	Arrival time.Duration
	// Tokens is the prompt. Requests that share a prefix share its token ids
	// (and may share the backing array: treat Tokens as read-only).
	Tokens []uint32
	// OutputTokens is the number of tokens the request generates (ignore EOS).
	OutputTokens int
	// Session groups the requests of one conversation or agent run ("" if none).
	Session string
	// Group names the shared prefix the generator built the prompt on (a tool,
	// a document, a repository, a system prompt), for analysis; "" if none.
	Group string
	// Adapter names the LoRA adapter the request asks for (the model name
	// vLLM serves it under); "" for the base model.
	Adapter string
	// AdapterBytes is the size of Adapter's weights (what loading it into a
	// GPU slot copies); 0 when Adapter is "".
	AdapterBytes int64
	// Priority orders the request in a router-side queue (higher first;
	// GIE's InferenceObjective priority); 0 unless a class says otherwise
	// (Flags.Priorities).
	Priority int
	// Tenant names who sent it, for fair shares between tenants ("" if
	// none; Flags.Tenants).
	Tenant string
	// Text is the prompt as real text, for a request read from a dataset
	// (internal/dataset): the conversation so far as one text, which
	// Tokens encodes under the dataset's tokenizer unless the dataset was
	// tokenized as chats. "": none (a generated workload or a trace, whose
	// text a load generator renders from Tokens).
	Text string
	// Messages is the prompt as chat messages, for a request read from a
	// dataset: the conversation so far, ending with the user's turn. When
	// the dataset was tokenized as chats, Tokens encodes their rendering
	// by the tokenizer's chat template. Nil: none.
	Messages []Message
	// AwaitPrevious marks the next turn of a conversation: a client sends
	// it only once the answer to its Session's previous request (the last
	// one before it in the list with the same Session) has arrived, and not
	// before its Arrival, as a user's chat client does. bench and sim do so.
	AwaitPrevious bool
}

// Message is one chat message of a dataset request: its role (system,
// user or assistant, as the OpenAI chat API names them) and its text.
type Message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}
