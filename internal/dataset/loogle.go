package dataset

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// Document is one LooGLE document and the questions asked about it.
type Document struct {
	// Title is the entry's "title" ("#N", its line, when empty).
	Title string
	// Text is the document, the entry's "input".
	Text string
	// Questions are its question-answer pairs.
	Questions []QA
}

// QA is one question about a document and its reference answer.
type QA struct {
	Q, A string
}

// maxLooGLELine is the longest line ReadLooGLE accepts: LooGLE's longest
// documents are about 130 kB of text, its full test set's a few hundred.
const maxLooGLELine = 64 << 20

// ReadLooGLE reads a LooGLE file (LooGLE-testdata/*.jsonl of
// github.com/bigai-nlco/LooGLE at 32b5d97a, or the Hugging Face dataset
// bigainlco/LooGLE): one JSON object a line with the document in "input",
// its "title", and "qa_pairs", a string holding a Python literal list of
// {'Q': ..., 'A': ..., ...} dicts, which Preble's LooGLE loader evaluates
// (multi_node/benchmarks/benchmark_workload_gen.py of
// github.com/WukLab/preble at 150e400d, LooGLEDataset) and this reads
// with a parser of Python's literal syntax (no code is run). qa_pairs
// "none" (longdep_summarization) gives a document no questions. Other
// fields are ignored; blank lines are skipped.
//
// A line that is not such an object, a qa_pairs that is not a list of
// dicts with string Q and A, or a line longer than 64 MiB is an error that
// names the line, wrapping ErrFormat.
func ReadLooGLE(r io.Reader) ([]Document, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxLooGLELine)
	var out []Document
	for line := 1; sc.Scan(); line++ {
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var e struct {
			Input   *string         `json:"input"`
			Title   json.RawMessage `json:"title"`
			QAPairs json.RawMessage `json:"qa_pairs"`
		}
		if err := json.Unmarshal(b, &e); err != nil {
			return nil, fmt.Errorf("%w: loogle line %d: %v", ErrFormat, line, err)
		}
		if e.Input == nil {
			return nil, fmt.Errorf("%w: loogle line %d: no string \"input\" (the document)", ErrFormat, line)
		}
		d := Document{Title: fmt.Sprintf("#%d", line), Text: *e.Input}
		var title string
		if json.Unmarshal(e.Title, &title) == nil && title != "" {
			d.Title = title
		}
		qs, err := qaPairs(e.QAPairs)
		if err != nil {
			return nil, fmt.Errorf("%w: loogle line %d (%s): qa_pairs: %v", ErrFormat, line, d.Title, err)
		}
		d.Questions = qs
		out = append(out, d)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%w: loogle: %v", ErrFormat, err)
	}
	return out, nil
}

// qaPairs decodes a qa_pairs field: a string holding a Python list of
// dicts (LooGLE's files), or a JSON list of objects (a converted copy).
func qaPairs(raw json.RawMessage) ([]QA, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var v any
	var s string
	if json.Unmarshal(raw, &s) == nil {
		if t := strings.TrimSpace(s); t == "" || strings.EqualFold(t, "none") {
			return nil, nil
		}
		p := &pyParser{s: s}
		var err error
		if v, err = p.literal(); err != nil {
			return nil, err
		}
	} else if err := json.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	list, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("want a list of dicts, found %s", pyType(v))
	}
	out := make([]QA, 0, len(list))
	for i, x := range list {
		m, ok := x.(map[string]any)
		if !ok {
			return nil, fmt.Errorf("item %d: want a dict, found %s", i, pyType(x))
		}
		q, okQ := m["Q"].(string)
		a, okA := m["A"].(string)
		if !okQ || !okA {
			return nil, fmt.Errorf("item %d: want string 'Q' and 'A'", i)
		}
		out = append(out, QA{Q: q, A: a})
	}
	return out, nil
}
