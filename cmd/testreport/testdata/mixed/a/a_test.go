package a

import (
	"testing"
	"time"
)

func TestSlow(t *testing.T) { time.Sleep(100 * time.Millisecond) }
func TestSkip(t *testing.T) { t.Skip("no Redis (set PREFIXLB_TEST_REDIS)") }
