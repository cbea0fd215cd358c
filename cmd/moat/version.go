package main

import (
	"context"
	"fmt"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/version"
)

func init() {
	commandUsage["version"] = "moat version"
}

// cmdVersion prints the build (what moat --version prints too): the
// module version, the VCS revision and the Go version.
func cmdVersion(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("version")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return exitFor(stdio, fmt.Errorf("version: unexpected argument %q: %w", fs.Arg(0), moat.ErrInvalid))
	}
	fmt.Fprintf(stdio.Out, "moat %s\n", version.String())
	return exitOK
}
