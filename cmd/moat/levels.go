package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/attack"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/microvm"
	"github.com/moatsandbox/moat/subprocess"
)

// fileConfig is the operator's config file (--config), JSON. Flags given on
// the command line override it.
type fileConfig struct {
	Level      moat.Level        `json:"level,omitempty"`
	Limits     moat.Limits       `json:"limits"`
	Subprocess subprocess.Config `json:"subprocess"`
	Container  container.Config  `json:"container"`
	GVisor     gvisor.Config     `json:"gvisor"`
	MicroVM    microvm.Config    `json:"microvm"`
}

// sandboxFlags are the operator's choices that every command that runs code
// shares: the level, the limits, the level's settings.
type sandboxFlags struct {
	fs         *flag.FlagSet
	configPath string
	level      string
	limits     moat.Limits
	hardening  string
	python     string
}

// addSandboxFlags registers the shared flags on fs.
func addSandboxFlags(fs *flag.FlagSet) *sandboxFlags {
	f := &sandboxFlags{fs: fs}
	fs.StringVar(&f.configPath, "config", "", "operator config file (JSON: level, limits, subprocess)")
	fs.StringVar(&f.level, "level", "", "isolation level: subprocess, container, gvisor, microvm (default subprocess)")
	fs.Var(&f.limits.WallTime, "timeout", "wall time per run (default 10s)")
	fs.Var(&f.limits.CPUTime, "cpu", "CPU time per run (default 10s)")
	fs.Var(&f.limits.Memory, "memory", "memory per run, all processes together (default 256MiB)")
	fs.IntVar(&f.limits.Pids, "pids", 0, "processes and threads per run (default 64)")
	fs.Var(&f.limits.FileSize, "file-size", "largest file a run may write (default 16MiB)")
	fs.Var(&f.limits.Disk, "disk", "all files of a run together (default 64MiB)")
	fs.Var(&f.limits.Output, "output", "output per stream, kept and streamed; the first byte past it ends the run (default 1MiB)")
	fs.IntVar(&f.limits.OpenFiles, "open-files", 0, "open files per process (default 256)")
	fs.StringVar(&f.hardening, "hardening", "", "subprocess hardening: strict (default) or tutorial (plain rlimits only, for comparison)")
	fs.StringVar(&f.python, "python", "", "python3 interpreter for the subprocess level (default /usr/bin/python3)")
	return f
}

// resolve merges the config file and the flags that were set.
func (f *sandboxFlags) resolve() (fileConfig, error) {
	var fc fileConfig
	if f.configPath != "" {
		data, err := os.ReadFile(f.configPath)
		if err != nil {
			return fc, fmt.Errorf("config: %w: %w", err, moat.ErrInvalid)
		}
		dec := json.NewDecoder(strings.NewReader(string(data)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&fc); err != nil {
			return fc, fmt.Errorf("config %s: %w: %w", f.configPath, err, moat.ErrInvalid)
		}
	}
	set := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	if set["level"] || fc.Level == "" {
		name := f.level
		if name == "" {
			name = string(fc.Level)
		}
		if name == "" {
			name = string(moat.LevelSubprocess)
		}
		l, err := moat.ParseLevel(name)
		if err != nil {
			return fc, err
		}
		fc.Level = l
	} else if _, err := moat.ParseLevel(string(fc.Level)); err != nil {
		return fc, err
	}
	over := func(name string, apply func()) {
		if set[name] {
			apply()
		}
	}
	over("timeout", func() { fc.Limits.WallTime = f.limits.WallTime })
	over("cpu", func() { fc.Limits.CPUTime = f.limits.CPUTime })
	over("memory", func() { fc.Limits.Memory = f.limits.Memory })
	over("pids", func() { fc.Limits.Pids = f.limits.Pids })
	over("file-size", func() { fc.Limits.FileSize = f.limits.FileSize })
	over("disk", func() { fc.Limits.Disk = f.limits.Disk })
	over("output", func() { fc.Limits.Output = f.limits.Output })
	over("open-files", func() { fc.Limits.OpenFiles = f.limits.OpenFiles })
	over("hardening", func() { fc.Subprocess.Hardening = subprocess.Hardening(f.hardening) })
	over("python", func() { fc.Subprocess.Python = f.python })
	if err := fc.Limits.Validate(); err != nil {
		return fc, err
	}
	if _, err := subprocess.ParseHardening(string(fc.Subprocess.Hardening)); err != nil {
		return fc, err
	}
	return fc, nil
}

// open returns a sandbox at the chosen level.
func (f *sandboxFlags) open(ctx context.Context) (moat.Sandbox, error) {
	fc, err := f.resolve()
	if err != nil {
		return nil, err
	}
	return openLevel(ctx, fc, fc.Level)
}

// levelEntry wires one isolation level into the CLI.
type levelEntry struct {
	level moat.Level
	open  func(ctx context.Context, fc fileConfig) (moat.Sandbox, error)
	check func(ctx context.Context, fc fileConfig) moat.Availability
	// claims says which attacks the level, configured by fc, claims to
	// block.
	claims func(fc fileConfig, a attack.Name) bool
}

func claimsAll(fileConfig, attack.Name) bool { return true }

// levelTable lists the levels this build of moat has, lightest first.
func levelTable() []levelEntry {
	return []levelEntry{
		{
			level: moat.LevelSubprocess,
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				cfg := fc.Subprocess
				cfg.Limits = fc.Limits
				return subprocess.New(cfg)
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				cfg := fc.Subprocess
				cfg.Limits = fc.Limits
				return subprocess.Check(cfg)
			},
			claims: func(fc fileConfig, a attack.Name) bool {
				if h, _ := subprocess.ParseHardening(string(fc.Subprocess.Hardening)); h == subprocess.HardeningTutorial {
					// Plain rlimits stop the loop (CPU, wall timer), the
					// allocation (RLIMIT_AS) and the big file (RLIMIT_FSIZE)
					// and nothing else.
					return a == attack.Loop || a == attack.Memory || a == attack.Disk
				}
				return true
			},
		},
		{
			level: moat.LevelContainer,
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				return container.New(fc.containerConfig())
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				return container.Check(ctx, fc.containerConfig())
			},
			claims: claimsAll,
		},
		{
			level: moat.LevelGVisor,
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				return gvisor.New(fc.gvisorConfig())
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				return gvisor.Check(ctx, fc.gvisorConfig())
			},
			claims: claimsAll,
		},
		{
			level: moat.LevelMicroVM,
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				return microvm.New(fc.microvmConfig())
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				return microvm.Check(fc.microvmConfig())
			},
			claims: claimsAll,
		},
	}
}

func (fc fileConfig) microvmConfig() microvm.Config {
	cfg := fc.MicroVM
	cfg.Limits = fc.Limits
	return cfg
}

func (fc fileConfig) containerConfig() container.Config {
	cfg := fc.Container
	cfg.Limits = fc.Limits
	return cfg
}

func (fc fileConfig) gvisorConfig() gvisor.Config {
	cfg := fc.GVisor
	cfg.Limits = fc.Limits
	return cfg
}

func findLevel(l moat.Level) (levelEntry, error) {
	for _, e := range levelTable() {
		if e.level == l {
			return e, nil
		}
	}
	return levelEntry{}, &moat.UnavailableError{Level: l, Reason: "not built into this version of moat", Remedy: "use one of: " + strings.Join(levelNames(), ", ")}
}

func levelNames() []string {
	var out []string
	for _, e := range levelTable() {
		out = append(out, string(e.level))
	}
	return out
}

func openLevel(ctx context.Context, fc fileConfig, l moat.Level) (moat.Sandbox, error) {
	e, err := findLevel(l)
	if err != nil {
		return nil, err
	}
	return e.open(ctx, fc)
}

// resolveLevels resolves the flags and the levels a command goes over: the
// --level when one is given, else list (a --levels value, see parseLevels).
func (f *sandboxFlags) resolveLevels(ctx context.Context, list string) (fileConfig, []moat.Level, error) {
	fc, err := f.resolve()
	if err != nil {
		return fc, nil, err
	}
	if f.level != "" {
		list = f.level
	}
	lvls, err := parseLevels(ctx, list, fc)
	return fc, lvls, err
}

// parseLevels reads a --levels list: "all" (every level available here) or
// comma-separated names.
func parseLevels(ctx context.Context, s string, fc fileConfig) ([]moat.Level, error) {
	if s == "" || s == "all" {
		var out []moat.Level
		for _, e := range levelTable() {
			if e.check(ctx, fc).Available {
				out = append(out, e.level)
			}
		}
		if len(out) == 0 {
			return nil, errors.New("no level is available here (run 'moat doctor')")
		}
		return out, nil
	}
	var out []moat.Level
	for _, name := range strings.Split(s, ",") {
		l, err := moat.ParseLevel(strings.TrimSpace(name))
		if err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, nil
}

// exitFor maps an error to the exit status and prints it as one line.
func exitFor(stdio Stdio, err error) int {
	msg := oneLine(err.Error())
	if !strings.HasPrefix(msg, "moat: ") {
		msg = "moat: " + msg
	}
	fmt.Fprintln(stdio.Err, msg)
	if errors.Is(err, moat.ErrInvalid) {
		return exitUsage
	}
	return exitInternal
}

func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// commandUsage is the synopsis line of each command, for -h.
var commandUsage = map[string]string{
	"run":    "moat run [flags] (-c CODE | FILE | -)",
	"attack": "moat attack [flags]",
	"bench":  "moat bench [flags]",
	"doctor": "moat doctor [flags]",
}

// parseFlags parses args. A bad flag gets the flag package's one-line
// error and exit status 2; -h prints the command's flags and exits 0. ok is
// false when the command must return code at once.
func parseFlags(fs *flag.FlagSet, args []string, stdio Stdio) (code int, ok bool) {
	fs.SetOutput(stdio.Err)
	fs.Usage = func() {} // errors stay one line; -h is handled below
	err := fs.Parse(args)
	if err == nil {
		return 0, true
	}
	if err == flag.ErrHelp {
		fmt.Fprintf(stdio.Out, "usage: %s\n\nflags:\n", commandUsage[fs.Name()])
		fs.SetOutput(stdio.Out)
		fs.PrintDefaults()
		return exitOK, false
	}
	return exitUsage, false
}

// newFlagSet returns an empty flag set that reports errors instead of
// exiting.
func newFlagSet(name string) *flag.FlagSet {
	return flag.NewFlagSet(name, flag.ContinueOnError)
}
