package main

import (
	"context"
	"flag"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/bench"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/gvisor"
)

func cmdBench(ctx context.Context, args []string, stdio Stdio) int {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stdio.Err)
	sf := addSandboxFlags(fs)
	levels := fs.String("levels", "all", "comma-separated levels to time, or all (every level available here)")
	runs := fs.Int("runs", 0, "measured runs per row (default 10)")
	warmup := fs.Int("warmup", 0, "unmeasured runs per row first (default 1; -1 for none)")
	asJSON := fs.Bool("json", false, "print one JSON object {rows: [{name, level, runs, min_ms, median_ms, p90_ms, max_ms, ratio}]}")
	quiet := fs.Bool("quiet", false, "no progress lines on standard error")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	fc, err := sf.resolve()
	if err != nil {
		return exitFor(stdio, err)
	}
	if sf.level != "" {
		*levels = sf.level
	}
	lvls, err := parseLevels(ctx, *levels, fc)
	if err != nil {
		return exitFor(stdio, err)
	}
	cfg := bench.Config{Runs: *runs, Warmup: *warmup}
	if !*quiet {
		cfg.Progress = stdio.Err
	}
	if err := cfg.Validate(); err != nil {
		return exitFor(stdio, err)
	}
	python := fc.Subprocess.Python
	if python == "" {
		python = bench.DefaultPython
	}
	var targets []bench.Target
	for _, l := range lvls {
		sb, err := openLevel(ctx, fc, l)
		if err != nil {
			return exitFor(stdio, err)
		}
		defer sb.Close()
		t := bench.SandboxTarget(string(l), sb)
		if g, ok := sb.(*gvisor.Sandbox); ok {
			t.Note = "runsc " + g.Version() + ", platform " + string(g.Platform()) + ", sandboxes booted ahead of runs"
		}
		targets = append(targets, t)
		targets = append(targets, extraBenchTargets(fc, l)...)
	}
	rep, err := bench.Run(ctx, cfg, bench.PythonTarget(python), targets...)
	if err != nil {
		return exitFor(stdio, err)
	}
	if *asJSON {
		err = rep.WriteJSON(stdio.Out)
	} else {
		err = rep.WriteTable(stdio.Out)
	}
	if err != nil {
		return exitFor(stdio, err)
	}
	if rep.Err() != nil {
		return exitFailure
	}
	return exitOK
}

// extraBenchTargets adds the comparison rows a level brings (docker-cli
// for container, microvm-cold for microvm).
func extraBenchTargets(fc fileConfig, l moat.Level) []bench.Target {
	switch l {
	case moat.LevelContainer:
		cfg := fc.containerConfig()
		return []bench.Target{{
			Name:  "docker-cli",
			Level: moat.LevelContainer,
			Note:  "the same hardened run through docker run --rm -i",
			Run:   func(ctx context.Context) error { return container.CLIRun(ctx, cfg) },
		}}
	}
	return nil
}
