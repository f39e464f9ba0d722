package b

import "testing"

func TestFast(t *testing.T) { t.Log("hello") }
func TestFail(t *testing.T) {
	t.Run("sub", func(t *testing.T) { t.Errorf("bad %d", 1) })
	t.Log("parent log")
}
