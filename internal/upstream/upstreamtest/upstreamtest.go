// Package upstreamtest holds what real engines answered, for the tests of
// the packages that read them (serve, epp, the load generator): llama.cpp's
// llama-server answers captured from a live server (see llamacpp/README.md).
package upstreamtest

import (
	"embed"
	"testing"
)

//go:embed llamacpp
var llamaFS embed.FS

// LlamaCpp returns llamacpp/name, a captured llama-server answer; a name
// that is not there fails t.
func LlamaCpp(t testing.TB, name string) string {
	t.Helper()
	b, err := llamaFS.ReadFile("llamacpp/" + name)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
