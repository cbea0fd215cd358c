package main

import (
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/attack"
	"github.com/moatsandbox/moat/container"
)

// TestContainerClaimsByDriver: the container level claims every attack
// with the docker driver, and all but the egress probes (which need a
// network policy it refuses) with the runc driver.
func TestContainerClaimsByDriver(t *testing.T) {
	e, err := findLevel(moat.LevelContainer)
	if err != nil {
		t.Fatal(err)
	}
	var docker, runc fileConfig
	runc.Container.Driver = container.DriverRunc
	egress := 0
	for _, a := range append(append([]attack.Name{}, attack.All...), attack.EgressAttacks...) {
		if !e.claims(docker, a) {
			t.Errorf("the docker driver does not claim %s", a)
		}
		if got := e.claims(runc, a); got == attack.IsEgress(a) {
			t.Errorf("the runc driver claims %s: %v", a, got)
		}
		if attack.IsEgress(a) {
			egress++
		}
	}
	if egress == 0 {
		t.Error("inconclusive: no egress attack in attack.All")
	}
}
