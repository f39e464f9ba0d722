package e

import "testing"

func TestPanic(t *testing.T) { var m map[string]int; m["x"] = 1 }
func TestAfter(t *testing.T) {}
