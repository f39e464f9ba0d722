package c

func F() int { return "x" }
