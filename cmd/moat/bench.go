package main

import (
	"context"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/bench"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/microvm"
)

func cmdBench(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("bench")
	sf := addSandboxFlags(fs)
	levels := fs.String("levels", "all", "comma-separated levels to time, or all (every level available here)")
	runs := fs.Int("runs", 0, "measured runs per row (default 10)")
	warmup := fs.Int("warmup", 0, "unmeasured runs per row first (default 1; -1 for none)")
	asJSON := fs.Bool("json", false, "print one JSON object {rows: [{name, level, runs, min_ms, median_ms, p90_ms, max_ms, ratio}]}")
	quiet := fs.Bool("quiet", false, "no progress lines on standard error")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	fc, lvls, err := sf.resolveLevels(ctx, *levels)
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
	var opened []moat.Sandbox
	defer func() {
		for _, sb := range opened {
			sb.Close()
		}
	}()
	for _, l := range lvls {
		sb, err := openLevel(ctx, fc, l)
		if err != nil {
			return exitFor(stdio, err)
		}
		opened = append(opened, sb)
		t := bench.SandboxTarget(string(l), sb)
		switch v := sb.(type) {
		case *gvisor.Sandbox:
			t.Note = "runsc " + v.Version() + ", platform " + string(v.Platform()) + ", sandboxes booted ahead of runs"
		case *microvm.Sandbox:
			t.Note = "accel " + string(v.Accel()) + ", restored from a saved template"
		}
		targets = append(targets, t)
		extra, err := extraBenchTargets(fc, l, &opened)
		if err != nil {
			return exitFor(stdio, err)
		}
		targets = append(targets, extra...)
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
func extraBenchTargets(fc fileConfig, l moat.Level, closers *[]moat.Sandbox) ([]bench.Target, error) {
	switch l {
	case moat.LevelContainer:
		cfg := fc.containerConfig()
		return []bench.Target{{
			Name:  "docker-cli",
			Level: moat.LevelContainer,
			Note:  "the same hardened run through docker run --rm -i",
			Run:   func(ctx context.Context) error { return container.CLIRun(ctx, cfg) },
		}}, nil
	case moat.LevelMicroVM:
		// A second sandbox that boots a fresh VM for every run, to show
		// what restoring the template saves.
		cfg := fc.microvmConfig()
		cfg.Cold = true
		cold, err := microvm.New(cfg)
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, cold)
		t := bench.SandboxTarget("microvm-cold", cold)
		t.Note = "accel " + string(cold.Accel()) + ", a fresh VM booted for every run"
		return []bench.Target{t}, nil
	}
	return nil, nil
}
