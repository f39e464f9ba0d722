package d

import (
	"testing"
	"time"
)

func TestHang(t *testing.T) { t.Log("waiting"); time.Sleep(time.Minute) }
