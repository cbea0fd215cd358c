package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/container"
	"github.com/moatsandbox/moat/image"
)

const imageUsage = `usage: moat image build [--config FILE] [--packages P1,P2] [--state-dir DIR] [--force] [--json]
       moat image status [--config FILE] [--packages P1,P2] [--state-dir DIR] [--json]

build makes the sandbox root filesystem (Debian with python3 and pip, from Debian's
packages with debootstrap; needs root) into moat's state directory and
imports it into Docker; a second build with the same inputs does nothing.
--packages adds Debian packages (python3-numpy,python3-pandas) to it: they are
part of the image's key, so each list is an image of its own, and the
container, gvisor and microvm levels run the one whose packages the config
file's "image" section names (the same list). status says whether it is
built, when, how big, and whether Docker has it.`

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
	configPath := fs.String("config", "", "operator config file, JSON: its \"image\" section (see docs/config.md); flags given override it")
	stateDir := fs.String("state-dir", "", "moat's state directory (default "+image.DefaultStateDir()+")")
	var pkgs packageList
	fs.Var(&pkgs, "packages", "Debian packages to add to the image, comma-separated, e.g. python3-numpy,python3-pandas (default: none beyond python3, python3-pip, ca-certificates)")
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
	if *configPath != "" {
		data, err := os.ReadFile(*configPath)
		if err != nil {
			fmt.Fprintf(stdio.Err, "moat: config: %v\n", err)
			return cfg, false, exitUsage, false
		}
		fc, err := decodeConfig(data)
		if err != nil {
			fmt.Fprintf(stdio.Err, "moat: %s (in %s)\n", strings.TrimSuffix(err.Error(), ": "+moat.ErrInvalid.Error()), *configPath)
			return cfg, false, exitUsage, false
		}
		cfg = fc.Image
	}
	set := setFlags(fs)
	if set["state-dir"] {
		cfg.StateDir = *stateDir
	}
	if set["packages"] {
		cfg.Packages = pkgs
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintf(stdio.Err, "moat: %s\n", oneLine(err.Error()))
		return cfg, false, exitUsage, false
	}
	return cfg, *js, 0, true
}

// packageList is the --packages flag: Debian package names, separated by
// commas (and spaces).
type packageList []string

func (p *packageList) String() string { return strings.Join(*p, ",") }

func (p *packageList) Set(s string) error {
	*p = nil
	for _, f := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		*p = append(*p, f)
	}
	return nil
}

// buildResult is what `moat image build` did; --json prints it.
type buildResult struct {
	Record   image.Record `json:"record"`
	Path     string       `json:"path"`
	Tag      string       `json:"tag,omitempty"`      // the Docker image, when imported
	ImageID  string       `json:"image_id,omitempty"` // its Docker ID
	Cached   bool         `json:"cached"`             // the root filesystem was already built
	Imported bool         `json:"imported"`           // the Docker image was (re)imported now
	Docker   string       `json:"docker,omitempty"`   // why the Docker step was skipped, if it was
}

// buildImage makes the root filesystem for cfg unless it is already built,
// then has the container level import it into Docker unless the engine
// holds it already. When no Docker engine answers, the root filesystem is
// still made and Docker says why the import was skipped (the gvisor and
// microvm levels need no Docker); any other Docker failure is an error.
func buildImage(ctx context.Context, cfg image.Config) (*buildResult, error) {
	rec, cached, err := image.BuildRootFS(ctx, cfg)
	if err != nil {
		return nil, err
	}
	res := &buildResult{Record: *rec, Path: image.Path(cfg), Cached: cached}
	d, err := container.ImportImage(ctx, cfg)
	if errors.Is(err, moat.ErrUnavailable) {
		res.Docker = err.Error()
		image.NewProgress(cfg.Progress, cfg.Terminal).Say("docker: %v; the root filesystem is built, the Docker image is not", err)
		return res, nil
	}
	if err != nil {
		return res, err
	}
	res.Tag, res.ImageID, res.Imported = d.Tag, d.ID, d.Imported
	return res, nil
}

// imageStatus is what `moat image status` reports: the root filesystem,
// and whether the Docker engine holds its image (Docker says why the
// engine could not be asked, if it could not).
type imageStatus struct {
	image.Status
	InDocker bool   `json:"in_docker"`
	DockerID string `json:"docker_id,omitempty"`
	Docker   string `json:"docker,omitempty"`
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
	cfg.Terminal = isTerminal(cfg.Progress)
	start := time.Now()
	res, err := buildImage(ctx, cfg)
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
	st := imageStatus{Status: image.GetStatus(cfg)}
	if d, err := container.InspectImage(ctx, cfg); err != nil {
		st.Docker = err.Error()
	} else {
		st.InDocker, st.DockerID = d.Present, d.ID
	}
	if asJSON {
		return printJSON(stdio, st)
	}
	if st.Exists {
		fmt.Fprintf(stdio.Out, "rootfs: built %s ago (%s), %.1f MiB, python %s\n        %s\n",
			st.Age, st.BuiltAt.Local().Format(time.RFC3339), float64(st.Size)/(1<<20), st.Python, st.Path)
	} else {
		fmt.Fprintf(stdio.Out, "rootfs: not built (run '%s' as root)\n        %s\n", cfg.BuildCommand(), st.Path)
	}
	switch {
	case st.InDocker:
		fmt.Fprintf(stdio.Out, "docker: %s (%s)\n", st.Tag, st.DockerID)
	case st.Docker != "":
		fmt.Fprintf(stdio.Out, "docker: %s: cannot tell: %s\n", st.Tag, oneLine(st.Docker))
	default:
		fmt.Fprintf(stdio.Out, "docker: %s is not imported (run '%s')\n", st.Tag, cfg.BuildCommand())
	}
	return exitOK
}

// isTerminal reports whether w is a terminal: the build's progress then
// rewrites a status line instead of printing a line per event.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

func printJSON(stdio Stdio, v any) int {
	enc := json.NewEncoder(stdio.Out)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return exitFor(stdio, err)
	}
	return exitOK
}
