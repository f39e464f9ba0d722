package i

import "example.com/mixed/c"

func I() int { return c.F() }
