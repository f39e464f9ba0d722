package h

import (
	"fmt"
	"os"
	"testing"
)

func TestMain(m *testing.M) { fmt.Println("setup failed: no database"); os.Exit(3) }
func TestH(t *testing.T)    {}
