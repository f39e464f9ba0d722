package dataset

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"

	"github.com/prefixlb/prefixlb/internal/workload"
)

// Conversation is one ShareGPT conversation as the OpenAI chat API names
// its messages: user and assistant turns alternating, starting with the
// user's.
type Conversation struct {
	// ID is the entry's "id" (its index in the file, "#N", when absent).
	ID string
	// Messages alternate user, assistant, user, ...; a conversation may end
	// with a user message the file records no answer to.
	Messages []workload.Message
}

// ShareGPTStats counts what ReadShareGPT read and dropped.
type ShareGPTStats struct {
	// Entries is the entries of the file.
	Entries int
	// Dropped is the entries dropped: no user message, a role ShareGPT
	// does not use, or turns that do not alternate (vLLM's
	// convert_sharegpt_to_openai drops these too).
	Dropped int
}

// shareGPTMessage is one message of an entry: {"from": ..., "value": ...}.
type shareGPTMessage struct {
	From  *string `json:"from"`
	Value *string `json:"value"`
}

// shareGPTEntry is one element of the file's top-level array. SGLang also
// accepts the key "conversation" (sample_sharegpt_requests).
type shareGPTEntry struct {
	ID            json.RawMessage   `json:"id"`
	Conversations []shareGPTMessage `json:"conversations"`
	Conversation  []shareGPTMessage `json:"conversation"`
}

// ErrFormat is wrapped by every error about a dataset file that is not in
// its format.
var ErrFormat = errors.New("dataset: malformed file")

// maxDepth bounds the nesting of the Python literals in LooGLE's qa_pairs.
const maxDepth = 64

// ReadShareGPT reads a ShareGPT file: a JSON array of entries
// {"id": ..., "conversations": [{"from": "human", "value": "..."},
// {"from": "gpt", "value": "..."}, ...]}, the format of
// ShareGPT_V3_unfiltered_cleaned_split.json that vLLM's
// (vllm/benchmarks/datasets/sharegpt.py at 237145ea) and SGLang's
// (python/sglang/benchmark/datasets/sharegpt.py at 09716a6e) benchmarks
// read. Roles are mapped as vLLM's multi-turn benchmark maps them
// (benchmarks/multi_turn/convert_sharegpt_to_openai.py at 045d7575):
// human and user are the user; gpt, bing, chatgpt and bard the assistant;
// a leading assistant message is skipped (the conversation continues an
// earlier one), and an entry whose turns then do not alternate user,
// assistant, ... (or that has a system message, or another role) is
// dropped and counted. Unlike vLLM's single-turn reader, which keeps the
// first two messages of entries with at least two, every turn is kept and
// an entry of a lone user message is kept too (its answer unrecorded).
//
// A file that is not such an array, an entry that is not such an object,
// or a message without a string "from" and "value" is an error that names
// the entry, wrapping ErrFormat.
func ReadShareGPT(r io.Reader) ([]Conversation, ShareGPTStats, error) {
	var st ShareGPTStats
	dec := json.NewDecoder(r)
	tok, err := dec.Token()
	if err != nil {
		return nil, st, fmt.Errorf("%w: sharegpt: %v", ErrFormat, err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return nil, st, fmt.Errorf("%w: sharegpt: want a JSON array of conversations, found %v", ErrFormat, tok)
	}
	var out []Conversation
	for i := 0; dec.More(); i++ {
		var e shareGPTEntry
		if err := dec.Decode(&e); err != nil {
			return nil, st, fmt.Errorf("%w: sharegpt entry %d: %v", ErrFormat, i, err)
		}
		st.Entries++
		c, ok, err := e.conversation(i)
		if err != nil {
			return nil, st, err
		}
		if !ok {
			st.Dropped++
			continue
		}
		out = append(out, c)
	}
	if _, err := dec.Token(); err != nil {
		return nil, st, fmt.Errorf("%w: sharegpt: after entry %d: %v", ErrFormat, st.Entries, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, st, fmt.Errorf("%w: sharegpt: data after the array", ErrFormat)
	}
	return out, st, nil
}

// conversation turns entry i into a Conversation; false when it is to be
// dropped.
func (e *shareGPTEntry) conversation(i int) (Conversation, bool, error) {
	c := Conversation{ID: fmt.Sprintf("#%d", i)}
	if len(e.ID) > 0 && string(e.ID) != "null" {
		var s string
		if json.Unmarshal(e.ID, &s) == nil {
			c.ID = s
		} else {
			c.ID = string(e.ID) // a number
		}
	}
	msgs := e.Conversations
	if msgs == nil {
		msgs = e.Conversation
	}
	ok := true
	for j, m := range msgs {
		if m.From == nil || m.Value == nil {
			return c, false, fmt.Errorf("%w: sharegpt entry %d (%s) message %d: want string \"from\" and \"value\"", ErrFormat, i, c.ID, j)
		}
		role := ""
		switch *m.From {
		case "human", "user":
			role = "user"
		case "gpt", "bing", "chatgpt", "bard":
			role = "assistant"
		}
		if j == 0 && role == "assistant" {
			continue
		}
		want := "user"
		if len(c.Messages)%2 == 1 {
			want = "assistant"
		}
		if role != want {
			ok = false // another role, a system message, or no alternation
			continue
		}
		c.Messages = append(c.Messages, workload.Message{Role: role, Content: *m.Value})
	}
	return c, ok && len(c.Messages) > 0, nil
}
