package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/attack"
)

func cmdAttack(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("attack")
	sf := addSandboxFlags(fs)
	levels := fs.String("levels", "all", "comma-separated levels to attack, or all (every level available here)")
	only := fs.String("attacks", "", "comma-separated attacks to run (default all)")
	asJSON := fs.Bool("json", false, "print one JSON object {results: [{level, attack, blocked, how}]}")
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	fc, lvls, err := sf.resolveLevels(ctx, *levels)
	if err != nil {
		return exitFor(stdio, err)
	}
	names := append(append([]attack.Name(nil), attack.All...), attack.EgressAttacks...)
	if *only != "" {
		names = nil
		for _, s := range strings.Split(*only, ",") {
			n, err := attack.ParseName(strings.TrimSpace(s))
			if err != nil {
				return exitFor(stdio, moat.Invalid(err))
			}
			names = append(names, n)
		}
	}
	env, err := attack.Plant(ctx)
	if err != nil {
		return exitFor(stdio, err)
	}
	defer env.Close()

	var plain, egressed []attack.Name
	for _, n := range names {
		if attack.IsEgress(n) {
			egressed = append(egressed, n)
		} else {
			plain = append(plain, n)
		}
	}
	// The egress probes run in a sandbox of their own with the harness's
	// network policy in force, in place of the operator's.
	efc := fc
	pc := env.ProxyConfig()
	efc.proxyConfig = &pc

	var outcomes []attack.Outcome
	for _, l := range lvls {
		for _, set := range []struct {
			fc    fileConfig
			names []attack.Name
		}{{fc, plain}, {efc, egressed}} {
			if len(set.names) == 0 {
				continue
			}
			sb, err := openLevel(ctx, set.fc, l)
			if err != nil {
				if set.fc.proxyConfig == nil {
					return exitFor(stdio, err)
				}
				// A level that cannot confine a network refuses one:
				// its egress probes prove nothing either way.
				fmt.Fprintf(stdio.Err, "moat: %s: no sandbox with a network: %s\n", l, oneLine(err.Error()))
				for _, n := range set.names {
					outcomes = append(outcomes, attack.Outcome{Level: l, Attack: n, Verdict: attack.Inconclusive,
						How: "no network here", Detail: oneLine(err.Error())})
				}
				continue
			}
			for _, n := range set.names {
				if !*asJSON {
					fmt.Fprintf(stdio.Err, "moat: attack %s at %s...\n", n, l)
				}
				outcomes = append(outcomes, attack.Run(ctx, sb, env, n))
			}
			sb.Close()
		}
	}
	if *asJSON {
		if err := attack.JSON(stdio.Out, outcomes); err != nil {
			return exitFor(stdio, err)
		}
	} else if err := attack.Scoreboard(stdio.Out, outcomes); err != nil {
		return exitFor(stdio, err)
	}
	claims := func(l moat.Level, a attack.Name) bool {
		e, err := findLevel(l)
		return err == nil && e.claims(fc, a)
	}
	if b := attack.Breaches(outcomes, claims); len(b) > 0 {
		for _, o := range b {
			fmt.Fprintf(stdio.Err, "moat: %s: %s %s (%s) although the level claims to block it\n", o.Level, o.Attack, o.Verdict, o.How)
		}
		return exitFailure
	}
	return exitOK
}
