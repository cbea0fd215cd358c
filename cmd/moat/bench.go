package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/bench"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/microvm"
	"golang.org/x/sys/unix"
)

func cmdBench(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("bench")
	sf := addSandboxFlags(fs)
	levels := fs.String("levels", "all", "comma-separated levels to time, or all (every level available here)")
	runs := fs.Int("runs", 0, "measured runs per row (default 10)")
	warmup := fs.Int("warmup", 0, "unmeasured runs per row first (default 1; -1 for none)")
	asJSON := fs.Bool("json", false, "print one JSON object {rows: [{name, level, runs, min_ms, median_ms, p90_ms, max_ms, ratio}]}")
	quiet := fs.Bool("quiet", false, "no progress lines on standard error")
	idle := fs.Int("idle", 0, "instead of latency, open this many idle sessions per level (plain and interpreter) and report the host memory each holds")
	suspendN := fs.Int("suspend", 0, "instead of run latency, suspend and resume a session holding a 10 MiB file (and a variable) this many times per level, plain and interpreter, and report the medians")
	forksN := fs.Int("forks", 0, "instead of run latency, fork this many sessions from one suspended session per level (plain and interpreter) against as many fresh ones: start time, host memory, and how many fit on this machine")
	sustained := fs.Bool("sustained", false, "instead of one run at a time, run --clients concurrent clients for --duration at each level and against the bare python3 start: runs/s, p50, p99, ratio")
	clients := fs.Int("clients", 8, "concurrent clients of --sustained")
	duration := fs.Duration("duration", 10*time.Second, "how long --sustained loads each row")
	egressN := fs.Int("egress", 0, "instead of run latency, time this many small fetches (and one of 64MiB) over loopback directly and through moat's egress proxy")
	htmlFile := fs.String("html", "", "also write one self-contained HTML page to this file: the latency table and a chart of every run, then the --sustained table (--clients, --duration), and the machine")
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
	var sessions []moat.Session
	defer func() {
		for _, ss := range sessions {
			ss.Close()
		}
		for _, sb := range opened {
			sb.Close()
		}
	}()
	modes := 0
	for name, v := range map[string]int{"idle": *idle, "suspend": *suspendN, "egress": *egressN, "forks": *forksN} {
		if v < 0 {
			return exitFor(stdio, fmt.Errorf("--%s %d must not be negative: %w", name, v, moat.ErrInvalid))
		}
		if v > 0 {
			modes++
		}
	}
	if *sustained {
		modes++
		if *clients <= 0 || *duration <= 0 {
			return exitFor(stdio, fmt.Errorf("--clients %d and --duration %v must be positive: %w", *clients, *duration, moat.ErrInvalid))
		}
	}
	if modes > 1 {
		return exitFor(stdio, fmt.Errorf("give one of --idle, --suspend, --egress, --forks and --sustained at a time: %w", moat.ErrInvalid))
	}
	if *htmlFile != "" {
		if modes > 0 {
			return exitFor(stdio, fmt.Errorf("--html measures the latency and the sustained tables itself: give it without --idle, --suspend, --egress, --forks or --sustained: %w", moat.ErrInvalid))
		}
		if *clients <= 0 || *duration <= 0 {
			return exitFor(stdio, fmt.Errorf("--clients %d and --duration %v must be positive: %w", *clients, *duration, moat.ErrInvalid))
		}
		// Checked before anything is measured: a page that cannot be
		// written loses nothing.
		f, err := os.OpenFile(*htmlFile, os.O_WRONLY|os.O_CREATE, 0o644)
		if err != nil {
			return exitFor(stdio, fmt.Errorf("--html: %w", moat.Invalid(err)))
		}
		f.Close()
	}
	if *forksN > 0 {
		return benchForks(ctx, fc, lvls, *forksN, *asJSON, stdio, &opened)
	}
	if *egressN > 0 {
		return benchEgress(ctx, *egressN, *asJSON, stdio)
	}
	if *suspendN > 0 {
		return benchSuspend(ctx, fc, lvls, *suspendN, *asJSON, stdio, &opened)
	}
	if *idle > 0 {
		return benchIdle(ctx, fc, lvls, *idle, *asJSON, stdio, &opened)
	}
	// loadTargets are the rows of a sustained table: a fresh instance
	// per run at each level (and the docker CLI at container).
	var loadTargets []bench.Target
	for _, l := range lvls {
		sb, err := openLevel(ctx, fc, l)
		if err != nil {
			return exitFor(stdio, err)
		}
		opened = append(opened, sb)
		t := bench.SandboxTarget(string(l), sb)
		if d, ok := sb.(moat.Describer); ok {
			t.Note = d.Describe()
		}
		targets = append(targets, t)
		loadTargets = append(loadTargets, t)
		if *sustained {
			// Under load every row is a fresh instance per run: one
			// session's runs take turns, and a cold VM per run is the
			// latency table's comparison, not a load.
			if l == moat.LevelContainer || l == moat.LevelGVisor {
				extra, err := extraBenchTargets(ctx, fc, l, &opened)
				if err != nil {
					return exitFor(stdio, err)
				}
				targets = append(targets, extra...)
			}
			continue
		}
		st, err := sessionTargets(ctx, sb, &sessions, stdio)
		if err != nil {
			return exitFor(stdio, err)
		}
		targets = append(targets, st...)
		extra, err := extraBenchTargets(ctx, fc, l, &opened)
		if err != nil {
			return exitFor(stdio, err)
		}
		targets = append(targets, extra...)
		if l == moat.LevelContainer || l == moat.LevelGVisor {
			loadTargets = append(loadTargets, extra...)
		}
	}
	if *sustained {
		return benchSustained(ctx, *clients, *duration, bench.PythonTarget(python), targets, *asJSON, stdio)
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
	if *htmlFile != "" {
		if code := benchHTML(ctx, *htmlFile, rep, *clients, *duration, bench.PythonTarget(python), loadTargets, python, stdio); code != exitOK {
			return code
		}
	}
	if rep.Err() != nil {
		return exitFailure
	}
	return exitOK
}

// benchSustained prints what each row sustains with clients concurrent
// clients for d, against the bare python3 start under the same load.
func benchSustained(ctx context.Context, clients int, d time.Duration, baseline bench.Target, targets []bench.Target, asJSON bool, stdio Stdio) int {
	fmt.Fprintf(stdio.Err, "bench: %d clients for %v on each of %d rows\n", clients, d, len(targets)+1)
	rows, err := bench.MeasureSustained(ctx, clients, d, baseline, targets...)
	if err != nil {
		return exitFor(stdio, err)
	}
	if asJSON {
		if err := json.NewEncoder(stdio.Out).Encode(map[string]any{"sustained": rows}); err != nil {
			return exitFor(stdio, err)
		}
	} else {
		ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e6) }
		fmt.Fprintf(stdio.Out, "%-22s %8s %7s %7s %9s %9s %9s %7s\n", "row", "clients", "runs", "errors", "runs/s", "p50 ms", "p99 ms", "ratio")
		for _, r := range rows {
			fmt.Fprintf(stdio.Out, "%-22s %8d %7d %7d %9.1f %9s %9s %6.2fx\n", r.Name, r.Clients, r.Runs, r.Errors, r.RunsPerSec, ms(r.P50), ms(r.P99), r.Ratio)
		}
		fmt.Fprintf(stdio.Out, "each row loaded for %v; ratio = runs/s over the bare python3 start's under the same %d clients\n", d, clients)
	}
	failed := false
	for _, r := range rows {
		if r.Runs == 0 && r.Errors == 0 {
			fmt.Fprintf(stdio.Err, "bench: %s: no run ended within %v under %d clients\n", r.Name, d, clients)
		}
		if r.Errors > 0 {
			fmt.Fprintf(stdio.Err, "bench: %s: %d failed runs, the first: %s\n", r.Name, r.Errors, r.FirstError)
			failed = true
		}
	}
	if failed {
		return exitFailure
	}
	return exitOK
}

// extraBenchTargets adds the comparison rows a level brings (docker-cli
// for container, gvisor/recycled for gvisor, microvm-cold for microvm).
func extraBenchTargets(ctx context.Context, fc fileConfig, l moat.Level, closers *[]moat.Sandbox) ([]bench.Target, error) {
	switch l {
	case moat.LevelGVisor:
		// A second sandbox whose runs, all of one tenant, reuse a
		// sandbox reset after each run (gvisor.recycle), beside the
		// fresh sandbox per run.
		fc.GVisor.Recycle = true
		sb, err := openLevel(ctx, fc, l)
		if errors.Is(err, moat.ErrUnavailable) {
			return nil, nil // no recycled row where the level cannot recycle
		}
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, sb)
		t := bench.TenantTarget("gvisor/recycled", sb, "bench")
		t.Note = "one tenant's runs reuse a plain session's sandbox, reset after each run (gvisor.recycle)"
		return []bench.Target{t}, nil
	case moat.LevelContainer:
		// The docker CLI cannot place moat's egress listener: the
		// comparison row runs without a network.
		fc.Network, fc.Secrets = nil, nil
		cfg, err := fc.containerConfig()
		if err != nil {
			return nil, err
		}
		targets := []bench.Target{{
			Name:  "docker-cli",
			Level: moat.LevelContainer,
			Note:  "the same hardened run through docker run --rm -i",
			Run:   func(ctx context.Context) error { return container.CLIRun(ctx, cfg) },
		}}
		// The other driver's row: the level with runc driven directly
		// (or through Docker, when the configuration asks for runc).
		other, name := container.DriverRunc, "container-runc"
		if cfg.Driver == container.DriverRunc {
			other, name = container.DriverDocker, "container-docker"
		}
		ocfg := cfg
		ocfg.Driver, ocfg.Recycle = other, false
		sb, err := container.New(ocfg)
		switch {
		case errors.Is(err, moat.ErrUnavailable):
			// The other driver cannot run here: no row.
		case err != nil:
			return nil, err
		default:
			*closers = append(*closers, sb)
			t := bench.SandboxTarget(name, sb)
			t.Note = sb.Describe()
			targets = append(targets, t)
		}
		// One tenant's runs in a container of the runc driver reset after
		// each run (container.recycle), where the runc driver runs.
		rcfg := cfg
		rcfg.Driver, rcfg.Recycle = container.DriverRunc, true
		rsb, err := container.New(rcfg)
		if errors.Is(err, moat.ErrUnavailable) {
			return targets, nil
		}
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, rsb)
		t := bench.TenantTarget("container-runc/recycled", rsb, "bench")
		t.Note = "one tenant's runs reuse a runc container, reset from the host after each run (container.recycle)"
		return append(targets, t), nil
	case moat.LevelMicroVM:
		// A second sandbox that boots a fresh VM for every run, to show
		// what restoring the template saves.
		cfg, err := fc.microvmConfig()
		if err != nil {
			return nil, err
		}
		cfg.Cold = true
		cold, err := microvm.New(cfg)
		if err != nil {
			return nil, err
		}
		*closers = append(*closers, cold)
		t := bench.SandboxTarget("microvm-cold", cold)
		t.Note = cold.Describe()
		return []bench.Target{t}, nil
	}
	return nil, nil
}

// sessionTargets are the rows of runs in one session of sb, plain and with
// a live interpreter. A level that refuses an interpreter (ErrUnavailable)
// gets no interpreter row, and a line on stderr says why.
func sessionTargets(ctx context.Context, sb moat.Sandbox, keep *[]moat.Session, stdio Stdio) ([]bench.Target, error) {
	ser, ok := sb.(moat.Sessioner)
	if !ok {
		return nil, nil
	}
	var out []bench.Target
	for _, interp := range []bool{false, true} {
		ss, err := ser.NewSession(ctx, moat.SessionOptions{Interpreter: interp})
		if interp && errors.Is(err, moat.ErrUnavailable) {
			fmt.Fprintf(stdio.Err, "bench: %s: no interpreter row: %v\n", sb.Level(), err)
			continue
		}
		if err != nil {
			return nil, err
		}
		*keep = append(*keep, ss)
		name, note := string(sb.Level())+"/session", "runs in one session, its files kept"
		if interp {
			name, note = string(sb.Level())+"/interpreter", "runs in one session with a live interpreter"
		}
		t := bench.SessionTarget(name, sb.Level(), ss)
		t.Note = note
		out = append(out, t)
	}
	return out, nil
}

// benchIdle prints how much host memory n idle sessions of each level hold.
func benchIdle(ctx context.Context, fc fileConfig, lvls []moat.Level, n int, asJSON bool, stdio Stdio, opened *[]moat.Sandbox) int {
	var rows []bench.IdleCost
	for _, l := range lvls {
		sb, err := openLevel(ctx, fc, l)
		if err != nil {
			return exitFor(stdio, err)
		}
		*opened = append(*opened, sb)
		for _, interp := range []bool{false, true} {
			c, err := bench.MeasureIdle(ctx, sb, n, interp)
			if interp && errors.Is(err, moat.ErrUnavailable) {
				fmt.Fprintf(stdio.Err, "bench: %s: no interpreter sessions: %v\n", l, err)
				continue
			}
			if err != nil {
				return exitFor(stdio, err)
			}
			rows = append(rows, c)
		}
	}
	if asJSON {
		enc := json.NewEncoder(stdio.Out)
		if err := enc.Encode(map[string]any{"idle": rows}); err != nil {
			return exitFor(stdio, err)
		}
		return exitOK
	}
	fmt.Fprintf(stdio.Out, "%-12s %-12s %9s %14s %12s\n", "level", "session", "sessions", "MiB/session", "per GiB")
	for _, r := range rows {
		kind := "plain"
		if r.Interpreter {
			kind = "interpreter"
		}
		per := "-" // below what the host's accounting shows
		if r.PerGiB > 0 {
			per = strconv.Itoa(r.PerGiB)
		}
		fmt.Fprintf(stdio.Out, "%-12s %-12s %9d %14.1f %12s\n", r.Level, kind, r.Sessions, float64(r.PerSession)/float64(moat.MiB), per)
	}
	return exitOK
}

// benchSuspend prints what suspending and resuming a session costs at each
// level, plain and with an interpreter.
func benchSuspend(ctx context.Context, fc fileConfig, lvls []moat.Level, n int, asJSON bool, stdio Stdio, opened *[]moat.Sandbox) int {
	rows, err := measureKinds(ctx, fc, lvls, stdio, opened, func(sb moat.Sandbox, interp bool) (bench.SuspendCost, error) {
		return bench.MeasureSuspend(ctx, sb, interp, n)
	})
	if err != nil {
		return exitFor(stdio, err)
	}
	if asJSON {
		if err := json.NewEncoder(stdio.Out).Encode(map[string]any{"suspend": rows}); err != nil {
			return exitFor(stdio, err)
		}
		return exitOK
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e6) }
	mib := func(b int64) string { return fmt.Sprintf("%.1f", float64(b)/float64(moat.MiB)) }
	fmt.Fprintf(stdio.Out, "%-11s %-12s %-7s %11s %10s %9s %10s %9s %7s %12s %14s\n",
		"level", "session", "memory", "suspend ms", "state MiB", "disk MiB", "resume ms", "fresh ms", "ratio", "running MiB", "suspended MiB")
	for _, r := range rows {
		kind, kept := sessionKind(r.Interpreter, r.Memory)
		fmt.Fprintf(stdio.Out, "%-11s %-12s %-7s %11s %10s %9s %10s %9s %6.2fx %12s %14s\n",
			r.Level, kind, kept, ms(r.Suspend), mib(r.StateBytes), mib(r.DiskBytes), ms(r.Resume), ms(r.Fresh), r.Ratio, mib(r.RunningHost), mib(r.SuspendedHost))
	}
	fmt.Fprintf(stdio.Out, "medians of %d; resume = ResumeSession + first run to its output, fresh = NewSession + print(1); host MiB = MemTotal-MemAvailable growth since before the session opened (noisy, may be negative)\n", n)
	return exitOK
}

// measureKinds opens each level, adds it to opened, and measures its plain
// and its interpreter sessions; a level without interpreter sessions gets
// a line on standard error and only its plain row.
func measureKinds[T any](ctx context.Context, fc fileConfig, lvls []moat.Level, stdio Stdio, opened *[]moat.Sandbox, measure func(sb moat.Sandbox, interp bool) (T, error)) ([]T, error) {
	var rows []T
	for _, l := range lvls {
		sb, err := openLevel(ctx, fc, l)
		if err != nil {
			return nil, err
		}
		*opened = append(*opened, sb)
		for _, interp := range []bool{false, true} {
			c, err := measure(sb, interp)
			if interp && errors.Is(err, moat.ErrUnavailable) {
				fmt.Fprintf(stdio.Err, "bench: %s: no interpreter sessions: %v\n", l, err)
				continue
			}
			if err != nil {
				return nil, err
			}
			rows = append(rows, c)
		}
	}
	return rows, nil
}

// sessionKind names a row's session and what its suspend kept.
func sessionKind(interpreter, memory bool) (kind, kept string) {
	kind, kept = "plain", "files"
	if interpreter {
		kind = "interpreter"
	}
	if memory {
		kept = "kept"
	}
	return kind, kept
}

// benchForks prints what sessions forked from one suspended session cost
// at each level against fresh ones, plain and with an interpreter.
func benchForks(ctx context.Context, fc fileConfig, lvls []moat.Level, n int, asJSON bool, stdio Stdio, opened *[]moat.Sandbox) int {
	rows, err := measureKinds(ctx, fc, lvls, stdio, opened, func(sb moat.Sandbox, interp bool) (bench.ForkCost, error) {
		fmt.Fprintf(stdio.Err, "bench: %s: %d forks and %d fresh sessions (interpreter %v)\n", sb.Level(), n, n, interp)
		return bench.MeasureForks(ctx, sb, interp, n)
	})
	if err != nil {
		return exitFor(stdio, err)
	}
	if asJSON {
		if err := json.NewEncoder(stdio.Out).Encode(map[string]any{"forks": rows}); err != nil {
			return exitFor(stdio, err)
		}
		return exitOK
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d)/1e6) }
	mib := func(b int64) string { return fmt.Sprintf("%.1f", float64(b)/float64(moat.MiB)) }
	fmt.Fprintf(stdio.Out, "%-11s %-12s %-7s %9s %9s %12s %12s %10s %14s %12s\n",
		"level", "session", "memory", "fork ms", "fresh ms", "forks MiB", "fresh MiB", "state MiB", "suspended fit", "running fit")
	for _, r := range rows {
		kind, kept := sessionKind(r.Interpreter, r.Memory)
		fit := func(n int64) string {
			if n <= 0 {
				return "-" // the growth it divides by was not positive: noise
			}
			return strconv.FormatInt(n, 10)
		}
		fmt.Fprintf(stdio.Out, "%-11s %-12s %-7s %9s %9s %12s %12s %10s %14s %12s\n",
			r.Level, kind, kept, ms(r.ForkStart), ms(r.FreshStart), mib(r.ForksHost), mib(r.FreshHost), mib(r.StateDisk), fit(r.SuspendedFit), fit(r.RunningFit))
	}
	fmt.Fprintf(stdio.Out, "%d forks of one suspended session (1 MiB file) against %d fresh sessions, opened together; ms = median to first output; MiB = host MemTotal-MemAvailable growth with all open (noisy); fit = free disk / state, MemAvailable / the larger per-session growth\n", n, n)
	return exitOK
}

// benchEgress prints what the egress proxy adds to a fetch over loopback.
func benchEgress(ctx context.Context, n int, asJSON bool, stdio Stdio) int {
	c, err := bench.MeasureEgress(ctx, n, 64<<20)
	if err != nil {
		return exitFor(stdio, err)
	}
	if asJSON {
		if err := json.NewEncoder(stdio.Out).Encode(map[string]any{"egress": c}); err != nil {
			return exitFor(stdio, err)
		}
		return exitOK
	}
	ms := func(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d)/1e6) }
	fmt.Fprintf(stdio.Out, "%-26s %12s %12s %10s\n", "egress, loopback", "direct", "proxy", "ratio")
	fmt.Fprintf(stdio.Out, "%-26s %12s %12s %9.2fx\n", fmt.Sprintf("GET, median of %d", c.Requests), ms(c.Direct), ms(c.Proxied), float64(c.Proxied)/float64(c.Direct))
	fmt.Fprintf(stdio.Out, "%-26s %9.0f MB/s %7.0f MB/s %9.2fx\n", fmt.Sprintf("%d MiB fetch", c.Bytes>>20), c.DirectMBps, c.ProxiedMBps, c.ProxiedMBps/c.DirectMBps)
	fmt.Fprintf(stdio.Out, "the proxy adds %s per request (a new connection each)\n", ms(c.Added))
	return exitOK
}

// benchHTML runs the sustained table and writes the page of it and of rep.
func benchHTML(ctx context.Context, file string, rep *bench.Report, clients int, d time.Duration, baseline bench.Target, targets []bench.Target, python string, stdio Stdio) int {
	fmt.Fprintf(stdio.Err, "bench: --html: %d clients for %v on each of %d rows\n", clients, d, len(targets)+1)
	rows, err := bench.MeasureSustained(ctx, clients, d, baseline, targets...)
	if err != nil {
		return exitFor(stdio, err)
	}
	page := bench.Page{Latency: rep, Sustained: rows, Machine: describeMachine(ctx, python)}
	for _, r := range rep.Rows {
		if r.Level != "" && r.Note != "" && r.Name == string(r.Level) {
			page.Machine.Notes = append(page.Machine.Notes, r.Name+": "+r.Note)
		}
	}
	var buf bytes.Buffer
	if err := bench.WriteHTML(&buf, page); err != nil {
		return exitFor(stdio, err)
	}
	if err := os.WriteFile(file, buf.Bytes(), 0o644); err != nil {
		return exitFor(stdio, fmt.Errorf("--html: %w", err))
	}
	fmt.Fprintf(stdio.Err, "bench: wrote %s\n", file)
	return exitOK
}

// describeMachine says where the figures were measured: cores, memory,
// kernel and OS, and the versions of what the levels run, each read best
// effort (a component that is not installed is left out).
func describeMachine(ctx context.Context, python string) bench.Machine {
	m := bench.Machine{When: time.Now().UTC(), Versions: map[string]string{"go": runtime.Version()}}
	host := []string{fmt.Sprintf("%d cores", runtime.NumCPU())}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		var kb int64
		fmt.Sscanf(string(b), "MemTotal: %d kB", &kb)
		host = append(host, fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20)))
	}
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		host = append(host, "Linux "+unix.ByteSliceToString(u.Release[:]))
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "PRETTY_NAME="); ok {
				host = append(host, strings.Trim(v, `"`))
			}
		}
	}
	m.Host = strings.Join(host, ", ")
	if bi, ok := debug.ReadBuildInfo(); ok {
		v := bi.Main.Version
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" && len(s.Value) >= 12 {
				v = s.Value[:12]
			}
		}
		m.Versions["moat"] = v
	}
	for name, argv := range map[string][]string{
		"python3": {python, "--version"},
		"docker":  {"docker", "version", "--format", "{{.Server.Version}}"},
		"runsc":   {"runsc", "--version"},
		"qemu":    {"qemu-system-x86_64", "--version"},
	} {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		out, err := exec.CommandContext(cctx, argv[0], argv[1:]...).Output()
		cancel()
		if line, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n"); err == nil && line != "" {
			m.Versions[name] = line
		}
	}
	return m
}
