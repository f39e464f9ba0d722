package j

import (
	"example.com/mixed/c"
	"testing"
)

func TestJ(t *testing.T) { c.F() }
