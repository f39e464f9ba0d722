//go:build !race

package decisiontest

// RaceEnabled reports whether the test binary runs under the race
// detector: the replays then shorten (Run.Prefix) to stay quick.
const RaceEnabled = false
