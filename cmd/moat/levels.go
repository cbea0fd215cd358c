package main

import (
	"context"
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

// sandboxFlags are the operator's choices that every command that runs code
// shares: the config file, the level, the limits, the level's settings.
type sandboxFlags struct {
	fs         *flag.FlagSet
	configPath string
	// flags is what the flags set; resolve takes from it only the
	// settings whose flag was given.
	flags fileConfig
	// allowHosts are the --allow-host values, added to network.allow.
	allowHosts hostList
}

// hostList is a repeatable flag of HOST[:PORT] patterns.
type hostList []string

func (h *hostList) String() string { return strings.Join(*h, ",") }

func (h *hostList) Set(s string) error {
	if _, err := moat.ParseHostPattern(s); err != nil {
		return err
	}
	*h = append(*h, s)
	return nil
}

// addSandboxFlags registers the shared flags on fs. Each flag is named for
// its config key (limits.wall_time is --wall-time).
func addSandboxFlags(fs *flag.FlagSet) *sandboxFlags {
	f := &sandboxFlags{fs: fs}
	l := &f.flags.Limits
	fs.StringVar(&f.configPath, "config", "", "operator config file, JSON (see docs/config.md); flags given override it")
	fs.StringVar((*string)(&f.flags.Level), "level", "", "isolation level: subprocess, container, gvisor, microvm (default subprocess)")
	fs.Var(&l.WallTime, "wall-time", "wall time per run (default 10s)")
	deprecate(fs, "timeout", "wall-time")
	fs.Var(&l.CPUTime, "cpu-time", "CPU time per run, all processes together (default 10s)")
	deprecate(fs, "cpu", "cpu-time")
	fs.Var(&l.Memory, "memory", "memory per run, all processes together (default 256MiB)")
	fs.IntVar(&l.Pids, "pids", 0, "processes and threads per run (default 64)")
	fs.Var(&l.FileSize, "file-size", "largest file a run may write (default 16MiB)")
	fs.Var(&l.Disk, "disk", "all files of a run together (default 64MiB)")
	fs.Var(&l.Output, "output", "output per stream, kept and streamed; the first byte past it ends the run (default 1MiB)")
	fs.IntVar(&l.OpenFiles, "open-files", 0, "open files per process (default 256)")
	fs.StringVar((*string)(&f.flags.Subprocess.Hardening), "hardening", "", "subprocess hardening: strict (default) or tutorial (plain rlimits only, for comparison)")
	fs.StringVar(&f.flags.Subprocess.Python, "python", "", "python3 interpreter for the subprocess level (default /usr/bin/python3)")
	fs.Var(&f.allowHosts, "allow-host", "a host the code may reach through moat's egress proxy, HOST[:PORT] or *.DOMAIN[:PORT] (repeatable; adds to network.allow; default: no network)")
	return f
}

// deprecatedPrefix starts the usage of a flag kept only as an old spelling.
const deprecatedPrefix = "deprecated spelling of --"

// deprecate registers old as a second spelling of the flag name, which
// must be registered already. parseFlags warns when it is used.
func deprecate(fs *flag.FlagSet, old, name string) {
	fs.Var(fs.Lookup(name).Value, old, deprecatedPrefix+name)
}

// canonical is the name of the setting a flag sets: the flag's own, or, for
// a deprecated spelling, the one it stands for.
func canonical(f *flag.Flag) string {
	if name, ok := strings.CutPrefix(f.Usage, deprecatedPrefix); ok {
		return name
	}
	return f.Name
}

// setFlags are the settings given on the command line, by canonical name.
func setFlags(fs *flag.FlagSet) map[string]bool {
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[canonical(fl)] = true })
	return set
}

// resolve merges the config file and the flags that were set.
func (f *sandboxFlags) resolve() (fileConfig, error) {
	var fc fileConfig
	if f.configPath != "" {
		data, err := os.ReadFile(f.configPath)
		if err != nil {
			return fc, fmt.Errorf("config: %w", moat.Invalid(err))
		}
		if fc, err = decodeConfig(data); err != nil {
			if msg, ok := strings.CutSuffix(err.Error(), ": "+moat.ErrInvalid.Error()); ok {
				return fc, fmt.Errorf("%s (in %s): %w", msg, f.configPath, moat.ErrInvalid)
			}
			return fc, fmt.Errorf("%w (in %s)", err, f.configPath)
		}
	}
	if err := checkZeroLimitFlags(f.fs, &f.flags); err != nil {
		return fc, err
	}
	set := setFlags(f.fs)
	for name, key := range flagKeys(f.fs, &f.flags) {
		if set[name] {
			setKey(&fc, &f.flags, key)
		}
	}
	if fc.Level == "" {
		fc.Level = moat.LevelSubprocess
	}
	l, err := moat.ParseLevel(string(fc.Level))
	if err != nil {
		return fc, err
	}
	fc.Level = l
	if err := fc.Limits.Validate(); err != nil {
		return fc, err
	}
	if _, err := subprocess.ParseHardening(string(fc.Subprocess.Hardening)); err != nil {
		return fc, err
	}
	if err := fc.Image.Validate(); err != nil {
		return fc, err
	}
	if len(f.allowHosts) > 0 {
		n := moat.Network{}
		if fc.Network != nil {
			n = *fc.Network
		}
		n.Allow = append(append([]string(nil), n.Allow...), f.allowHosts...)
		fc.Network = &n
	}
	if err := fc.validateEgress(); err != nil {
		return fc, err
	}
	return fc, nil
}

// hardeningWarning is what a command that runs code at l with fc says on
// stderr, in one line, when fc makes the level block less than it can:
// which of the tutorial's six attacks (attack.All[:6]) the level then
// lets through, as its claims say. It is "" when it blocks them all.
func hardeningWarning(fc fileConfig, l moat.Level) string {
	e, err := findLevel(l)
	if err != nil {
		return ""
	}
	var through []string
	basic := attack.All[:6]
	for _, a := range basic {
		if !e.claims(fc, a) {
			through = append(through, string(a))
		}
	}
	if len(through) == 0 {
		return ""
	}
	return fmt.Sprintf("moat: warning: %s with hardening=%s blocks only %d of the tutorial's %d attacks: %s get through (moat attack shows them); never give it code you do not trust",
		l, fc.Subprocess.Hardening, len(basic)-len(through), len(basic), strings.Join(through, ", "))
}

// warnHardening prints hardeningWarning's line, if any, on stderr.
func warnHardening(stdio Stdio, fc fileConfig, l moat.Level) {
	if w := hardeningWarning(fc, l); w != "" {
		fmt.Fprintln(stdio.Err, w)
	}
}

// levelEntry wires one isolation level into the CLI.
type levelEntry struct {
	level moat.Level
	open  func(ctx context.Context, fc fileConfig) (moat.Sandbox, error)
	check func(ctx context.Context, fc fileConfig) moat.Availability
	// claims says which attacks the level, configured by fc, claims to
	// block.
	claims func(fc fileConfig, a attack.Name) bool
	// checking says what check looks at, for moat doctor's progress
	// line as it starts: "checking microvm: ...".
	checking string
}

func claimsAll(fileConfig, attack.Name) bool { return true }

// levelTable lists the levels this build of moat has, lightest first.
func levelTable() []levelEntry {
	return []levelEntry{
		{
			level:    moat.LevelSubprocess,
			checking: "checking subprocess: root, Landlock, seccomp, cgroups",
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				cfg := fc.Subprocess
				cfg.Limits = fc.Limits
				p, err := fc.proxy()
				if err != nil {
					return nil, err
				}
				cfg.Egress = p
				return subprocess.New(cfg)
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				cfg := fc.Subprocess
				cfg.Limits = fc.Limits
				p, err := fc.proxy()
				if err != nil {
					return moat.Unavailable(moat.LevelSubprocess, err)
				}
				cfg.Egress = p
				return subprocess.Check(ctx, cfg)
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
			level:    moat.LevelContainer,
			checking: "checking container: the Docker engine, its runtime and the image",
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				cfg, err := fc.containerConfig()
				if err != nil {
					return nil, err
				}
				return container.New(cfg)
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				cfg, err := fc.containerConfig()
				if err != nil {
					return moat.Unavailable(moat.LevelContainer, err)
				}
				return container.Check(ctx, cfg)
			},
			// The runc driver refuses a network policy: it makes no
			// claim about the egress probes, which need one.
			claims: func(fc fileConfig, a attack.Name) bool {
				return fc.Container.Driver != container.DriverRunc || !attack.IsEgress(a)
			},
		},
		{
			level:    moat.LevelGVisor,
			checking: "checking gvisor: runsc and the image",
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				cfg, err := fc.gvisorConfig()
				if err != nil {
					return nil, err
				}
				return gvisor.New(cfg)
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				cfg, err := fc.gvisorConfig()
				if err != nil {
					return moat.Unavailable(moat.LevelGVisor, err)
				}
				return gvisor.Check(ctx, cfg)
			},
			claims: claimsAll,
		},
		{
			level:    moat.LevelMicroVM,
			checking: "checking microvm: QEMU, the guest kernel, the disk; probing KVM (first time, up to 20 s)",
			open: func(ctx context.Context, fc fileConfig) (moat.Sandbox, error) {
				cfg, err := fc.microvmConfig()
				if err != nil {
					return nil, err
				}
				return microvm.New(cfg)
			},
			check: func(ctx context.Context, fc fileConfig) moat.Availability {
				cfg, err := fc.microvmConfig()
				if err != nil {
					return moat.Unavailable(moat.LevelMicroVM, err)
				}
				return microvm.Check(ctx, cfg)
			},
			claims: claimsAll,
		},
	}
}

func (fc fileConfig) microvmConfig() (microvm.Config, error) {
	cfg := fc.MicroVM
	cfg.Limits = fc.Limits
	cfg.Image = fc.Image
	p, err := fc.proxy()
	cfg.Egress = p
	return cfg, err
}

func (fc fileConfig) containerConfig() (container.Config, error) {
	cfg := fc.Container
	cfg.Limits = fc.Limits
	cfg.SharedImage = fc.Image
	p, err := fc.proxy()
	cfg.Egress = p
	return cfg, err
}

func (fc fileConfig) gvisorConfig() (gvisor.Config, error) {
	cfg := fc.GVisor
	cfg.Limits = fc.Limits
	cfg.SharedImage = fc.Image
	p, err := fc.proxy()
	cfg.Egress = p
	return cfg, err
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
	if setFlags(f.fs)["level"] {
		list = string(fc.Level)
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
	if err == flag.ErrHelp {
		fmt.Fprintf(stdio.Out, "usage: %s\n\nflags:\n", commandUsage[fs.Name()])
		fs.SetOutput(stdio.Out)
		fs.PrintDefaults()
		if fs.Lookup("config") != nil {
			fmt.Fprintln(stdio.Out, "\nA flag given overrides the same setting of the --config file; docs/config.md lists both.")
		}
		return exitOK, false
	}
	if err != nil {
		return exitUsage, false
	}
	given := map[string]string{}
	var clash error
	fs.Visit(func(f *flag.Flag) {
		name := canonical(f)
		if name != f.Name {
			fmt.Fprintf(stdio.Err, "moat: --%s is deprecated: use --%s\n", f.Name, name)
		}
		if other, ok := given[name]; ok && clash == nil {
			clash = fmt.Errorf("--%s and --%s are the same setting: give one: %w", other, f.Name, moat.ErrInvalid)
		}
		given[name] = f.Name
	})
	if clash != nil {
		return exitFor(stdio, clash), false
	}
	return 0, true
}

// newFlagSet returns an empty flag set that reports errors instead of
// exiting.
func newFlagSet(name string) *flag.FlagSet {
	return flag.NewFlagSet(name, flag.ContinueOnError)
}
