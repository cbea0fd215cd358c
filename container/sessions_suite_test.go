package container_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/moatsandbox/moat/sandboxtest"
)

// TestSessions runs the sessions' conformance suite on the level, with the
// live interpreter: the containers labelled as this process's are the
// leftovers it must not leave.
func TestSessions(t *testing.T) {
	needEngine(t)
	sandboxtest.TestSessions(t, factory, sandboxtest.SessionsOptions{
		Leftovers: func(*testing.T) error {
			if left := leftovers(); len(left) > 0 {
				return errors.New("left in the engine: " + strings.Join(left, ", "))
			}
			return nil
		},
	})
}

// TestSuspend runs the suspended sessions' suite: the files come back, the
// live interpreter starts fresh (this level keeps no memory yet).
func TestSuspend(t *testing.T) {
	needEngine(t)
	sandboxtest.TestSuspend(t, factory, sandboxtest.SuspendOptions{})
}
