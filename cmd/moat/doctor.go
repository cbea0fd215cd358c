package main

import (
	"context"
	"encoding/json"
	"fmt"
	"text/tabwriter"

	"github.com/moatsandbox/moat"
)

func cmdDoctor(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("doctor")
	sf := addSandboxFlags(fs)
	asJSON := fs.Bool("json", false, "print {levels: [{level, available, reason, remedy}]}")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	fc, err := sf.resolve()
	if err != nil {
		return exitFor(stdio, err)
	}
	var out []moat.Availability
	for _, l := range moat.Levels {
		e, err := findLevel(l)
		if err != nil {
			out = append(out, moat.Availability{Level: l, Reason: "not built into this version of moat", Remedy: "a later version adds it"})
			continue
		}
		out = append(out, e.check(ctx, fc))
	}
	if *asJSON {
		enc := json.NewEncoder(stdio.Out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Levels []moat.Availability `json:"levels"`
		}{out}); err != nil {
			return exitFor(stdio, err)
		}
		return exitOK
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
	}
	tw.Flush()
	return exitOK
}
