package i

import "testing"

func TestI(t *testing.T) {}
