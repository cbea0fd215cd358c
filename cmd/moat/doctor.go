package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/version"
)

// cmdDoctor checks each level and says which can run here, why not, and
// what to do. It exits exitOK when at least one level is available and
// exitInternal (125) when none is. As it goes it says on stderr what it
// checks, a line per level as the level's check starts (the first
// microvm check boots a VM to probe KVM, up to 20 s): when stderr is a
// terminal, or always with --progress. Nothing but the report goes to
// stdout.
func cmdDoctor(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("doctor")
	sf := addSandboxFlags(fs)
	asJSON := fs.Bool("json", false, "print {version, levels: [{level, available, reason, remedy, details, suspend_memory}]}")
	progress := fs.Bool("progress", false, "say on stderr which level is being checked (default: when stderr is a terminal)")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	fc, err := sf.resolve()
	if err != nil {
		return exitFor(stdio, err)
	}
	say := func(string) {}
	if *progress || isTerminal(stdio.Err) {
		say = func(s string) { fmt.Fprintf(stdio.Err, "moat doctor: %s...\n", s) }
	}
	var out []doctorLine
	available := 0
	for _, l := range moat.Levels {
		e, err := findLevel(l)
		if err != nil {
			out = append(out, doctorLine{Availability: moat.Availability{Level: l, Reason: "not built into this version of moat", Remedy: "a later version adds it"}})
			continue
		}
		say(e.checking)
		d := doctorLine{Availability: e.check(ctx, fc)}
		if d.Available {
			available++
			kept := suspendKeepsMemory[l]
			d.SuspendMemory = &kept
		}
		out = append(out, d)
	}
	code := exitOK
	if available == 0 {
		code = exitInternal
	}
	if *asJSON {
		enc := json.NewEncoder(stdio.Out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Version string       `json:"version"`
			Levels  []doctorLine `json:"levels"`
			Image   doctorImage  `json:"image"`
		}{version.String(), out, newDoctorImage(fc.Image)}); err != nil {
			return exitFor(stdio, err)
		}
		return code
	}
	tw := tabwriter.NewWriter(stdio.Out, 0, 4, 2, ' ', 0)
	for _, a := range out {
		state := "available"
		if !a.Available {
			state = "unavailable"
		}
		line := fmt.Sprintf("%s\t%s\t%s", a.Level, state, a.Reason)
		if a.Remedy != "" {
			line += " (" + a.Remedy + ")"
		}
		fmt.Fprintln(tw, line)
		for _, d := range a.Details {
			fmt.Fprintf(tw, "\t\t%s\n", d)
		}
		switch {
		case a.SuspendMemory == nil:
		case *a.SuspendMemory:
			fmt.Fprintf(tw, "\t\tsessions suspend with their memory: a live interpreter's variables come back on resume\n")
		default:
			fmt.Fprintf(tw, "\t\tsessions suspend with their files only: a live interpreter starts fresh on resume\n")
		}
	}
	tw.Flush()
	fmt.Fprintln(stdio.Out, newDoctorImage(fc.Image))
	if available == 0 {
		fmt.Fprintln(stdio.Err, "moat: no level is available here: each line above says why and what to do (exit status 125, see docs/exit-status.md)")
	}
	return code
}

// doctorImage is what moat doctor says of the shared image the config
// names (its "image" section): its key, its packages, whether it is built.
type doctorImage struct {
	Key      string   `json:"key"`
	Packages []string `json:"packages"`
	Built    bool     `json:"built"`
	Path     string   `json:"path"`
	build    string
}

func newDoctorImage(c image.Config) doctorImage {
	st := image.GetStatus(c)
	return doctorImage{Key: st.Key, Packages: c.PackageList(), Built: st.Exists, Path: st.Path, build: c.BuildCommand()}
}

func (d doctorImage) String() string {
	state := "built"
	if !d.Built {
		state = "not built (" + d.build + ")"
	}
	return fmt.Sprintf("image: %s, %s: %s (container, gvisor and microvm run it; subprocess runs the host's python3 and packages)",
		d.Key[:12], state, strings.Join(d.Packages, " "))
}

// doctorLine is what moat doctor says of one level: its Availability and,
// when it is available, whether a suspend keeps its sessions' memory.
type doctorLine struct {
	moat.Availability
	SuspendMemory *bool `json:"suspend_memory,omitempty"`
}

// suspendKeepsMemory says which levels keep a session's memory (a live
// interpreter's variables) across a suspend; the others keep its files.
// It is what each level's sandbox says as a moat.MemoryKeeper, written down
// here so that doctor need not open a sandbox (a microvm boots its
// template, the others start warm instances and reap leftovers) only to
// ask; TestDoctorSuspendMemoryMatchesLevels opens each available level and
// checks the two agree.
var suspendKeepsMemory = map[moat.Level]bool{
	moat.LevelSubprocess: false,
	moat.LevelContainer:  false,
	moat.LevelGVisor:     true,
	moat.LevelMicroVM:    true,
}
