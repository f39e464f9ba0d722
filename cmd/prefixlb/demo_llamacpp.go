package main

import (
	"github.com/spf13/pflag"

	"github.com/prefixlb/prefixlb/internal/demo"
	"github.com/prefixlb/prefixlb/internal/llamacpp"
)

// addLlamaCppFlags adds demo's flags for real llama.cpp replicas
// (--engine llamacpp, demo.LlamaCppConfig); flags not given take
// demo.LlamaCppDefaults.
func addLlamaCppFlags(fs *pflag.FlagSet, c *demo.Config) {
	l := &c.LlamaCpp
	fs.StringVar(&c.Engine, "engine", demo.EngineModel, "replicas: model (prefixlb engine, a modelled GPU) or llamacpp (real llama.cpp llama-server processes on this CPU)")
	fs.StringVar(&l.Server, "llama-server", "", "llama-server binary for --engine llamacpp (default $PREFIXLB_LLAMA_SERVER, else $"+llamacpp.EnvServer+")")
	fs.StringVar(&l.Model, "llama-model", "", "GGUF model for --engine llamacpp (default $PREFIXLB_LLAMA_MODEL; else built once with "+llamacpp.ModelScript+" beside the binary, which needs python3-numpy)")
	fs.IntVar(&l.Threads, "llama-threads", 1, "--engine llamacpp: CPU threads per llama-server (-t)")
	fs.IntVar(&l.Slots, "llama-slots", 2, "--engine llamacpp: slots per llama-server (-np): one cached prompt each")
	fs.IntVar(&l.Context, "llama-context", 16384, "--engine llamacpp: context per llama-server in tokens (-c), split between its slots")
	fs.IntVar(&l.Rounds, "rounds", 1, "--engine llamacpp: run every policy this many times, interleaved (policy order rotates each round); figures pool the rounds")
	fs.StringVar(&l.LogDir, "llama-logs", "", "--engine llamacpp: write each llama-server's output to a file in this folder")
	fs.BoolVar(&l.Calibrate, "calibrate", true, "--engine llamacpp: the router learns each replica's speed (serve's --calibrate); what it learnt is printed against llama.cpp's own timings")
	fs.StringVar(&l.Records, "records", "", "--engine llamacpp: write every request's record and llama.cpp's timings of it to this file, one JSON object a line")
	fs.BoolVar(&l.Timings, "calibrate-timings", true, "--engine llamacpp: calibration learns from llama.cpp's timings too (false: from the router's own clock only, busy periods and token gaps; the timings then only check it)")
}
