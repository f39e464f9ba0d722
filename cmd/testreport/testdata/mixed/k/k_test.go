package k

import "testing"

func TestTable(t *testing.T) {
	for _, c := range []string{"redis", "plain"} {
		t.Run(c, func(t *testing.T) {
			t.Parallel()
			if c == "redis" {
				t.Skipf("no Redis\n(set PREFIXLB_TEST_REDIS)")
			}
		})
	}
}

func TestSkipNow(t *testing.T) { t.SkipNow() }
