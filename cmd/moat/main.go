// Command moat runs untrusted Python code at a chosen isolation level, and
// measures how well and how fast each level does it.
//
// Usage:
//
//	moat run [flags] (-c CODE | FILE | -) [ARG...] [-- ARG...]
//	                                        run code, print its output
//	moat attack [flags]                     run the hostile programs at each level
//	moat bench [flags]                      time print(1) at each level
//	moat doctor [--json]                    say which levels can run here
//	moat serve [flags]                      the HTTP API with sessions
//	moat session COMMAND [ARGS]             a running server's sessions: create, run, suspend, snapshot, end
//	moat agent [flags] "task"               a Claude agent with one tool, run_python
//	moat mcp [--http ADDR]                  run_python as an MCP server
//	moat version                            the build: version, revision, Go (also moat --version)
//	moat completion bash|zsh                a shell completion script
//
// Run `moat help` or `moat COMMAND -h` for the flags.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
)

// Stdio is where a command reads and writes. Tests pass buffers.
type Stdio struct {
	In       io.Reader
	Out, Err io.Writer
}

// command is one subcommand: it parses args and returns the exit status.
type command struct {
	name  string
	usage string
	run   func(ctx context.Context, args []string, stdio Stdio) int
}

func commands() []command {
	return []command{
		{"run", "run code in a sandbox and print its output", cmdRun},
		{"attack", "run the six hostile programs against each level", cmdAttack},
		{"bench", "time print(1) at each level against a direct python3 start", cmdBench},
		{"doctor", "say which levels can run on this machine, and what to do if not", cmdDoctor},
		{"image", "build or inspect the sandbox image (Debian + python3) the container, gvisor and microvm levels share", cmdImage},
		{"session", "create, run in, suspend, snapshot and end the sessions of a running moat serve", cmdSession},
		{"serve", "serve the HTTP API (sessions, files, streaming) to agents in any language", cmdServe},
		{"agent", "run a Claude agent whose one tool, run_python, runs code in the sandbox", cmdAgent},
		{"mcp", "serve run_python over MCP (stdio, or --http on a loopback address)", cmdMCP},
		{"version", "print moat's version, VCS revision and Go version (also moat --version)", cmdVersion},
		{"completion", "print a shell completion script: moat completion bash|zsh", cmdCompletion},
	}
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := dispatch(ctx, os.Args[1:], Stdio{In: os.Stdin, Out: os.Stdout, Err: os.Stderr})
	stop()
	os.Exit(code)
}

func dispatch(ctx context.Context, args []string, stdio Stdio) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		usage(stdio.Out)
		if len(args) == 0 {
			return exitUsage
		}
		return exitOK
	}
	if args[0] == "--version" || args[0] == "-version" {
		return cmdVersion(ctx, args[1:], stdio)
	}
	for _, c := range commands() {
		if c.name == args[0] {
			return c.run(ctx, args[1:], stdio)
		}
	}
	fmt.Fprintf(stdio.Err, "moat: unknown command %q (run 'moat help')\n", args[0])
	return exitUsage
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "moat runs code that AI agents write, behind swappable isolation levels.")
	fmt.Fprintln(w, "\nUsage: moat COMMAND [flags]\n\nCommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.usage)
	}
	fmt.Fprintln(w, "\nRun 'moat COMMAND -h' for a command's flags. Exit statuses: 0 ok, 1 the work failed,")
	fmt.Fprintln(w, "2 bad usage, 3 the machine not ready (address in use, state dir locked), 125 a level or")
	fmt.Fprintln(w, "protection unavailable, 130 interrupted; moat run exits with the code's own: docs/exit-status.md.")
}
