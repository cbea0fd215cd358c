package main

import (
	"context"
	"fmt"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/egress"
)

// openLevelEgress opens level l with the egress policy e in place of the
// top-level one: how moat serve opens a network profile's sandboxes.
func openLevelEgress(ctx context.Context, fc fileConfig, l moat.Level, e moat.Egress) (moat.Sandbox, error) {
	fc.Network, fc.Secrets = e.Network, e.Secrets
	return openLevel(ctx, fc, l)
}

// proxy returns the egress proxy of fc's policy, or nil when it gives no
// network. fc.proxyConfig, when set, replaces it whole (moat attack's
// harness policy).
func (fc fileConfig) proxy() (*egress.Proxy, error) {
	if fc.proxyConfig != nil {
		return egress.New(*fc.proxyConfig)
	}
	e := fc.egress()
	if !e.Enabled() {
		return nil, nil
	}
	p, err := egress.New(egress.Config{Egress: e, Logger: fc.logger, Registerer: fc.registerer})
	if err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	return p, nil
}
