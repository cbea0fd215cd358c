package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/moatsandbox/moat/image"
)

const imageUsage = `usage: moat image build [--state-dir DIR] [--force] [--json]
       moat image status [--state-dir DIR] [--json]

build makes the sandbox root filesystem (Debian with python3, from Debian's
packages with debootstrap; needs root) into moat's state directory and
imports it into Docker; a second build with the same inputs does nothing.
status says whether it is built, when, how big, and whether Docker has it.`

// cmdImage implements `moat image build` and `moat image status`.
func cmdImage(ctx context.Context, args []string, stdio Stdio) int {
	if len(args) == 0 {
		fmt.Fprintln(stdio.Err, "moat: image: missing subcommand (build or status; see 'moat image -h')")
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprintln(stdio.Out, imageUsage)
		return exitOK
	case "build":
		return cmdImageBuild(ctx, args[1:], stdio)
	case "status":
		return cmdImageStatus(ctx, args[1:], stdio)
	}
	fmt.Fprintf(stdio.Err, "moat: image: unknown subcommand %q (build or status)\n", args[0])
	return exitUsage
}

// imageFlags parses the flags of an image subcommand; ok is false when the
// command must return code at once.
func imageFlags(name string, args []string, stdio Stdio, force *bool) (cfg image.Config, asJSON bool, code int, ok bool) {
	fs := flag.NewFlagSet("image "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	stateDir := fs.String("state-dir", "", "moat's state directory (default "+image.DefaultStateDir()+")")
	js := fs.Bool("json", false, "print one JSON object")
	if force != nil {
		fs.BoolVar(force, "force", false, "rebuild and re-import even when cached")
	}
	if err := fs.Parse(args); err != nil {
		if err == flag.ErrHelp {
			fmt.Fprintln(stdio.Out, imageUsage+"\n\nflags:")
			fs.SetOutput(stdio.Out)
			fs.PrintDefaults()
			return cfg, false, exitOK, false
		}
		fmt.Fprintf(stdio.Err, "moat: image %s: %v\n", name, err)
		return cfg, false, exitUsage, false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stdio.Err, "moat: image %s: unexpected argument %q\n", name, fs.Arg(0))
		return cfg, false, exitUsage, false
	}
	cfg = image.Config{StateDir: *stateDir}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintf(stdio.Err, "moat: %s\n", oneLine(err.Error()))
		return cfg, false, exitUsage, false
	}
	return cfg, *js, 0, true
}

func cmdImageBuild(ctx context.Context, args []string, stdio Stdio) int {
	var force bool
	cfg, asJSON, code, ok := imageFlags("build", args, stdio, &force)
	if !ok {
		return code
	}
	cfg.Force = force
	cfg.Progress = stdio.Out
	if asJSON {
		cfg.Progress = stdio.Err
	}
	start := time.Now()
	res, err := image.Build(ctx, cfg)
	if err != nil {
		return exitFor(stdio, err)
	}
	if asJSON {
		return printJSON(stdio, res)
	}
	if res.Cached && !res.Imported {
		fmt.Fprintf(stdio.Out, "moat: image already built, nothing to do: %s\n", res.Path)
	} else {
		fmt.Fprintf(stdio.Out, "moat: image built in %s: %s\n", time.Since(start).Round(100*time.Millisecond), res.Path)
	}
	if res.Tag != "" {
		fmt.Fprintf(stdio.Out, "moat: docker image %s\n", res.Tag)
	} else {
		fmt.Fprintf(stdio.Out, "moat: not imported into Docker: %s\n", res.Docker)
	}
	return exitOK
}

func cmdImageStatus(ctx context.Context, args []string, stdio Stdio) int {
	cfg, asJSON, code, ok := imageFlags("status", args, stdio, nil)
	if !ok {
		return code
	}
	st := image.GetStatus(ctx, cfg)
	if asJSON {
		return printJSON(stdio, st)
	}
	if st.Exists {
		fmt.Fprintf(stdio.Out, "rootfs: built %s ago (%s), %.1f MiB, python %s\n        %s\n",
			st.Age, st.BuiltAt.Local().Format(time.RFC3339), float64(st.Size)/(1<<20), st.Python, st.Path)
	} else {
		fmt.Fprintf(stdio.Out, "rootfs: not built (run 'moat image build' as root)\n        %s\n", st.Path)
	}
	switch {
	case st.InDocker:
		fmt.Fprintf(stdio.Out, "docker: %s (%s)\n", st.Tag, st.DockerID)
	case st.Docker != "":
		fmt.Fprintf(stdio.Out, "docker: %s: cannot tell: %s\n", st.Tag, oneLine(st.Docker))
	default:
		fmt.Fprintf(stdio.Out, "docker: %s is not imported (run 'moat image build')\n", st.Tag)
	}
	return exitOK
}

func printJSON(stdio Stdio, v any) int {
	enc := json.NewEncoder(stdio.Out)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return exitFor(stdio, err)
	}
	return exitOK
}
