package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/agent"
)

func init() {
	commandUsage["agent"] = `moat agent [flags] [--sessions [--interpreter]] "task..."`
}

// cmdAgent runs a Claude agent whose tools run code in the sandbox the
// operator's flags choose.
func cmdAgent(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("agent")
	sf := addSandboxFlags(fs)
	var cfg agent.Config
	var maxCode, maxOutput moat.Bytes
	fs.StringVar(&cfg.Model, "model", "", "Claude model (default "+agent.DefaultModel+")")
	fs.IntVar(&cfg.MaxTurns, "max-turns", 0, fmt.Sprintf("most requests to the model before giving up (default %d)", agent.DefaultMaxTurns))
	fs.Int64Var(&cfg.MaxTokens, "max-tokens", 0, fmt.Sprintf("most tokens the model may write per turn (default %d)", agent.DefaultMaxTokens))
	fs.StringVar(&cfg.BaseURL, "base-url", "", "Messages API address (default $ANTHROPIC_BASE_URL, else Anthropic's API)")
	fs.Var(&maxCode, "max-code", "largest program the tool accepts (default 1MiB)")
	fs.Var(&maxOutput, "tool-output", "how much of each output stream a tool result shows the model (default 8KiB)")
	verbose := fs.Bool("v", false, "log API requests and tool calls to stderr")
	addToolFlags(fs, &sf.flags.Agent, "task")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	key, err := agent.APIKeyFromEnv(os.LookupEnv)
	if err != nil {
		fmt.Fprintln(stdio.Err, "moat: "+err.Error())
		return exitUsage
	}
	task := strings.TrimSpace(strings.Join(fs.Args(), " "))
	if task == "" {
		return exitFor(stdio, fmt.Errorf(`agent: no task: give one, e.g. moat agent "what is the 30th Fibonacci number?": %w`, moat.ErrInvalid))
	}
	fc, err := sf.resolve()
	if err != nil {
		return exitFor(stdio, err)
	}
	cfg.APIKey = key
	cfg.Sessions, cfg.Interpreter = fc.Agent.Sessions, fc.Agent.Interpreter
	if cfg.BaseURL == "" {
		cfg.BaseURL = os.Getenv("ANTHROPIC_BASE_URL")
	}
	cfg.MaxCode, cfg.MaxOutput = int(maxCode), int(maxOutput)
	cfg.Transcript = stdio.Out
	if *verbose {
		cfg.Logger = slog.New(slog.NewTextHandler(stdio.Err, nil))
	}
	if err := cfg.Validate(); err != nil {
		return exitFor(stdio, err)
	}

	warnHardening(stdio, fc, fc.Level)
	sb, err := openLevel(ctx, fc, fc.Level)
	if err != nil {
		return exitFor(stdio, err)
	}
	defer sb.Close()
	a, err := agent.New(sb, cfg)
	if err != nil {
		return exitFor(stdio, err)
	}
	if _, err := a.Run(ctx, task); err != nil {
		fmt.Fprintln(stdio.Err, "moat: "+oneLine(err.Error()))
		if errors.Is(err, moat.ErrInvalid) {
			return exitUsage
		}
		return exitFailure
	}
	return exitOK
}
