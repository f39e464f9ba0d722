package good

import "testing"

func TestGood(t *testing.T) {}
