package bench_test

import (
	"context"
	"fmt"
	"os"

	"github.com/moatsandbox/moat/bench"
)

// Measure a level against the baseline and print the table. Any
// moat.Sandbox fits SandboxTarget; here a command stands in for a level.
func Example() {
	ctx := context.Background()
	// With a level: bench.SandboxTarget("subprocess", sb).
	other := bench.CommandTarget("python3-isolated", "/usr/bin/python3", "-I", "-S", "-c", bench.Code)
	other.Note = "python3 -I -S"
	rep, err := bench.Run(ctx, bench.Config{Runs: 5, Progress: os.Stderr}, bench.PythonTarget(""), other)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return
	}
	rep.WriteTable(os.Stdout)
	if err := rep.Err(); err != nil {
		fmt.Fprintln(os.Stderr, err)
	}
}
