package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/moatsandbox/moat"
)

func cmdRun(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("run")
	sf := addSandboxFlags(fs)
	code := fs.String("c", "", "the code to run")
	asJSON := fs.Bool("json", false, "print one JSON object: level, stdout, stderr, exit_code, duration_ms, reason, truncated")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	codeSet := false
	fs.Visit(func(f *flag.Flag) { codeSet = codeSet || f.Name == "c" })
	src, err := readCode(fs, codeSet, *code, stdio.In)
	if err != nil {
		return exitFor(stdio, err)
	}
	sb, err := sf.open(ctx, stdio)
	if err != nil {
		return exitFor(stdio, err)
	}
	defer sb.Close()

	req := moat.Request{Code: src}
	if !*asJSON {
		// Stream the code's output as it comes: the sandbox passes on only
		// what is under the output cap, and ends the run past it.
		req.Stdout, req.Stderr = stdio.Out, stdio.Err
	}
	res, err := sb.Run(ctx, req)
	if err != nil {
		return exitFor(stdio, err)
	}
	if *asJSON {
		if err := json.NewEncoder(stdio.Out).Encode(res); err != nil {
			return exitFor(stdio, err)
		}
	} else if res.Reason == moat.ReasonOutput {
		fmt.Fprintf(stdio.Err, "\nmoat: run ended: %s (exit %d): the output passed the cap (--output) and was cut there\n", res.Reason, res.ExitCode)
	} else if res.Reason != "" {
		fmt.Fprintf(stdio.Err, "moat: run ended: %s (exit %d)\n", res.Reason, res.ExitCode)
	}
	return res.ExitCode
}

// readCode takes the code from -c, a file, or standard input ("-").
func readCode(fs *flag.FlagSet, codeSet bool, code string, stdin io.Reader) ([]byte, error) {
	rest := fs.Args()
	var src []byte
	switch {
	case codeSet && len(rest) > 0:
		return nil, fmt.Errorf("give the code either with -c or as a file, not both: %w", moat.ErrInvalid)
	case codeSet:
		src = []byte(code)
	case len(rest) > 1:
		return nil, fmt.Errorf("one file at a time (got %d): %w", len(rest), moat.ErrInvalid)
	case len(rest) == 1 && rest[0] == "-":
		b, err := io.ReadAll(stdin)
		if err != nil {
			return nil, fmt.Errorf("reading standard input: %w", err)
		}
		src = b
	case len(rest) == 1:
		b, err := os.ReadFile(rest[0])
		if err != nil {
			return nil, moat.Invalid(err)
		}
		src = b
	default:
		return nil, fmt.Errorf("no code: give -c CODE, a FILE, or - for standard input: %w", moat.ErrInvalid)
	}
	if len(src) == 0 {
		return nil, fmt.Errorf("the code is empty: %w", moat.ErrInvalid)
	}
	return src, nil
}
