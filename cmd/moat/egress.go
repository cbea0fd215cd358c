package main

import (
	"context"

	"github.com/moatsandbox/moat"
)

// openLevelEgress opens level l with the egress policy e in place of the
// top-level one: how moat serve opens a network profile's sandboxes.
func openLevelEgress(ctx context.Context, fc fileConfig, l moat.Level, e moat.Egress) (moat.Sandbox, error) {
	fc.Network, fc.Secrets = e.Network, e.Secrets
	return openLevel(ctx, fc, l)
}
