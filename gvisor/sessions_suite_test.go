package gvisor_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/gvisor"
	"github.com/moatsandbox/moat/sandboxtest"
)

// TestSessions runs the sessions' conformance suite, with and without a
// live interpreter; the level's leftovers are the bundles (a session's
// host working directory among them), runsc state and cgroups named after
// this process's owner id.
func TestSessions(t *testing.T) {
	need(t, gvisor.Config{})
	me := self(t)
	sandboxtest.TestSessions(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		return newSandbox(t, gvisor.Config{Limits: l, Warm: -1})
	}, sandboxtest.SessionsOptions{
		// An interpreter session's working directory is a host tmpfs
		// served by the gofer; runsc 20240729 makes only regular files on
		// it and keeps the code's pipes in the sentry.
		InterpreterFIFOsUnseen: true,
		Leftovers: func(*testing.T) error {
			if left := leftovers(gvisor.DefaultStateDir, me); len(left) > 0 {
				return errors.New("left on the host: " + strings.Join(left, ", "))
			}
			return nil
		},
	})
}

// TestSuspend runs the suspended sessions' suite with memory: the files
// come back, and a live interpreter's variables too (the sandbox is
// checkpointed whole), in each of two forks of one state.
func TestSuspend(t *testing.T) {
	need(t, gvisor.Config{})
	sandboxtest.TestSuspend(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		return newSandbox(t, gvisor.Config{Limits: l, Warm: -1})
	}, sandboxtest.SuspendOptions{Memory: true})
}
