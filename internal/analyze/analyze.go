// Package analyze is `prefixlb analyze`: the prefix-sharing statistics of a
// trace or a generated workload (workload.Analyze), as a table or a JSON
// document naming its source.
package analyze

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/prefixlb/prefixlb/internal/workload"
)

// Config is one analysis: the flags of `prefixlb analyze`.
type Config struct {
	// Workload is the trace (Trace), the generated workload (Spec.Name)
	// or the dataset (Dataset.Name): exactly one of them.
	Workload workload.Flags
	// BlockSize is the KV block size in tokens for the sharing figures.
	BlockSize int
	// JSONPath also gets the statistics as a Document ("": none; "-":
	// stdout, instead of the table).
	JSONPath string
}

// Document is the JSON that `prefixlb analyze --json` writes.
type Document struct {
	// Source describes the trace or workload (workload.Flags.Describe).
	Source string `json:"source"`
	// Skipped counts the malformed trace lines skipped.
	Skipped int            `json:"skipped_lines"`
	Stats   workload.Stats `json:"stats"`
}

// Analyze loads c's workload and computes its statistics; skipped
// malformed lines are listed on stderr.
func Analyze(c Config, stderr io.Writer) (Document, error) {
	f := c.Workload
	n := 0
	for _, given := range []bool{f.Trace != "", f.Spec.Name != "", f.Dataset.Name != ""} {
		if given {
			n++
		}
	}
	if n != 1 {
		return Document{}, fmt.Errorf("analyze: give exactly one of --trace FILE, --workload NAME or --dataset NAME FILE")
	}
	reqs, skipped, err := f.Load()
	if err != nil {
		return Document{}, fmt.Errorf("analyze: %w", err)
	}
	for _, le := range skipped {
		fmt.Fprintf(stderr, "skipped: %v\n", &le)
	}
	st, err := workload.Analyze(reqs, c.BlockSize)
	if err != nil {
		return Document{}, err
	}
	return Document{Source: f.Describe(), Skipped: len(skipped), Stats: st}, nil
}

// WriteText prints doc as `prefixlb analyze` does: the source, the count
// of skipped lines and the statistics table.
func (doc Document) WriteText(w io.Writer) error {
	fmt.Fprintf(w, "%s\n", doc.Source)
	if doc.Skipped > 0 {
		fmt.Fprintf(w, "skipped %d malformed lines\n", doc.Skipped)
	}
	return doc.Stats.WriteTable(w)
}

// Run loads the workload, analyses it and writes the statistics: the JSON
// document when asked, and the table unless the JSON went to stdout.
// Skipped malformed lines are listed on stderr.
func Run(c Config, stdout, stderr io.Writer) error {
	doc, err := Analyze(c, stderr)
	if err != nil {
		return err
	}
	if c.JSONPath != "" {
		if err := WriteJSON(c.JSONPath, stdout, doc); err != nil {
			return fmt.Errorf("analyze: %w", err)
		}
		if c.JSONPath == "-" {
			return nil
		}
	}
	return doc.WriteText(stdout)
}

// WriteJSON writes doc, indented, to the file name, or to stdout for "-".
func WriteJSON(name string, stdout io.Writer, doc Document) error {
	if name == "-" {
		return encode(stdout, doc)
	}
	fh, err := os.Create(name)
	if err != nil {
		return err
	}
	if err := encode(fh, doc); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

func encode(w io.Writer, doc Document) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
}
