package gvisor_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/sandboxtest"
)

// TestSessions runs the sessions' conformance suite. The level keeps no
// live interpreter (NewSession refuses one); its leftovers are the
// bundles, runsc state and cgroups named after this process's owner id.
func TestSessions(t *testing.T) {
	need(t, gvisor.Config{})
	me := self(t)
	sandboxtest.TestSessions(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		return newSandbox(t, gvisor.Config{Limits: l, Warm: -1})
	}, sandboxtest.SessionsOptions{
		NoInterpreter: true,
		Leftovers: func(*testing.T) error {
			if left := leftovers(gvisor.DefaultStateDir, me); len(left) > 0 {
				return errors.New("left on the host: " + strings.Join(left, ", "))
			}
			return nil
		},
	})
}
