package llamacpp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/prefixlb/prefixlb/internal/tokenize/qwen3"
)

// Environment variables the real-engine tests read.
const (
	// EnvServer is the path of llama.cpp's llama-server; its folder also
	// holds make_tiny_gguf.py, which builds the tests' model.
	EnvServer = "PREFIXLB_TEST_LLAMA_SERVER"
	// EnvPython is the Python with numpy that runs make_tiny_gguf.py
	// (default /usr/bin/python3, Debian's, with python3-numpy).
	EnvPython = "PREFIXLB_TEST_PYTHON"
)

// ModelScript is the name of llama.cpp's tiny-model builder beside the
// binary.
const ModelScript = "make_tiny_gguf.py"

// BuildTinyModel runs script (make_tiny_gguf.py) with python to write a
// small random-weight Llama-shaped GGUF that carries the embedded Qwen3
// tokenizer, to out. It takes about 10 s and writes about 31 MB.
func BuildTinyModel(ctx context.Context, python, script, out string) error {
	dir, err := os.MkdirTemp("", "prefixlb-qwen3-tok-")
	if err != nil {
		return fmt.Errorf("llamacpp: build model: %w", err)
	}
	defer os.RemoveAll(dir)
	if err := qwen3.WriteDir(dir); err != nil {
		return fmt.Errorf("llamacpp: build model: %w", err)
	}
	tmp := out + ".tmp" + fmt.Sprint(os.Getpid())
	cmd := exec.CommandContext(ctx, python, script, dir, tmp)
	if b, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("llamacpp: %s %s: %w: %s", python, script, err, b)
	}
	if err := os.Rename(tmp, out); err != nil {
		return fmt.Errorf("llamacpp: build model: %w", err)
	}
	return nil
}

// ForTest returns the llama-server binary named by PREFIXLB_TEST_LLAMA_SERVER
// and the tiny model for it, built once per machine into the temp folder
// (named by a hash of the builder script, so a new script builds anew). When
// the engine is not available it returns skip, a message saying why and how
// to get it.
func ForTest() (binary, model, skip string) {
	binary = os.Getenv(EnvServer)
	if binary == "" {
		return "", "", EnvServer + " is unset: point it at llama.cpp's llama-server (with " + ModelScript +
			" beside it and Debian's python3-numpy), e.g. ../shared/engines/llama.cpp/llama-server, to run the real-engine tests"
	}
	if _, err := os.Stat(binary); err != nil {
		return "", "", fmt.Sprintf("%s=%s: %v", EnvServer, binary, err)
	}
	script := filepath.Join(filepath.Dir(binary), ModelScript)
	src, err := os.ReadFile(script)
	if err != nil {
		return "", "", fmt.Sprintf("no model builder beside %s: %v", binary, err)
	}
	python := os.Getenv(EnvPython)
	if python == "" {
		python = "/usr/bin/python3"
	}
	sum := sha256.Sum256(src)
	model = filepath.Join(os.TempDir(), "prefixlb-tiny-"+hex.EncodeToString(sum[:6])+".gguf")
	if _, err := os.Stat(model); err == nil {
		return binary, model, ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := BuildTinyModel(ctx, python, script, model); err != nil {
		return "", "", fmt.Sprintf("could not build the tiny model (is python3-numpy installed? set %s): %v", EnvPython, err)
	}
	return binary, model, ""
}
