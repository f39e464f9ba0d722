package sweep

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/prefixlb/prefixlb/internal/report"
)

// Write prints the results' table (and with Calibrate what the router
// learnt) to stdout, and writes c.JSONPath and c.OutDir's files, records
// being every run's requests (for requests.csv and report.html).
func Write(stdout, stderr io.Writer, c Config, results []report.Result, records []report.RequestRecord) error {
	if err := report.WriteTable(stdout, results); err != nil {
		return err
	}
	if c.Calibrate {
		fmt.Fprintln(stdout, "\nwhat the router learnt of each replica by the end (a cold 1,000-token prefill; one decode step with 1,000 tokens of context):")
		for _, r := range results {
			WriteCalibration(stdout, fmt.Sprintf("%s@%g", r.Policy, r.Rate), r.Calibration)
		}
	}
	if c.JSONPath == "-" {
		if err := WriteJSON(stdout, c.Engine, results); err != nil {
			return err
		}
	} else if c.JSONPath != "" {
		if err := WriteJSONFile(c.JSONPath, c.Engine, results); err != nil {
			return err
		}
	}
	if c.OutDir != "" {
		if err := WriteJSONFile(filepath.Join(c.OutDir, "results.json"), c.Engine, results); err != nil {
			return err
		}
		if err := report.WriteCSVFile(filepath.Join(c.OutDir, "requests.csv"), records); err != nil {
			return err
		}
		if err := report.WriteChartFile(filepath.Join(c.OutDir, "chart.svg"), results); err != nil {
			return err
		}
		if err := report.WriteHTMLFile(filepath.Join(c.OutDir, "report.html"), results, records); err != nil {
			return err
		}
		fmt.Fprintf(stderr, "wrote %s/{results.json,requests.csv,chart.svg,report.html}\n", c.OutDir)
	}
	return nil
}

// engineResult is a result with the engine it modelled. report.Result has
// no engine field; until it has, a sweep adds one for engines other than
// vLLM (whose output stays byte for byte what it was).
type engineResult struct {
	report.Result
	Engine string `json:"engine"`
}

// WriteJSON writes results as report.WriteJSON does, each result naming
// engine unless it is EngineVLLM.
func WriteJSON(w io.Writer, engine string, results []report.Result) error {
	if engine == EngineVLLM {
		return report.WriteJSON(w, results)
	}
	out := make([]engineResult, len(results))
	for i, r := range results {
		out[i] = engineResult{Result: r, Engine: engine}
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(struct {
		Results []engineResult `json:"results"`
	}{out}); err != nil {
		return fmt.Errorf("sim: write json: %w", err)
	}
	return nil
}

// WriteJSONFile writes WriteJSON's output to path.
func WriteJSONFile(path, engine string, results []report.Result) error {
	if engine == EngineVLLM {
		return report.WriteJSONFile(path, results)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	if err := WriteJSON(f, engine, results); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("sim: %w", err)
	}
	return nil
}

// WriteCalibration prints, per replica, what the router learnt of its speed
// against the truth and the prior it started from; label names the run.
func WriteCalibration(w io.Writer, label string, fits []report.CalibrationFit) {
	for _, c := range fits {
		fmt.Fprintf(w, "  %-16s %s: prefill %7.4g s (true %7.4g, told %7.4g; %5d samples), decode step %7.4g ms (true %7.4g, told %7.4g; %5d samples)\n",
			label, c.Replica, c.PrefillSecondsPer1K, c.TruePrefillSecondsPer1K, c.PriorPrefillSecondsPer1K, c.PrefillSamples,
			1e3*c.DecodeStepSeconds, 1e3*c.TrueDecodeStepSeconds, 1e3*c.PriorDecodeStepSeconds, c.DecodeSamples)
	}
}
