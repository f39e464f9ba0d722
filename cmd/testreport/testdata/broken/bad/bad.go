// Package bad does not compile: a build failure must fail the run.
package bad

func Bad() int { return "not an int" }
