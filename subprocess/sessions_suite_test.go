package subprocess_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/moatsandbox/moat/sandboxtest"
)

// TestSessions runs the sessions' conformance suite on the strict level:
// the session's working directories and cgroups (named after this
// process's owner id) are the leftovers it must not leave.
func TestSessions(t *testing.T) {
	requireRoot(t)
	sandboxtest.TestSessions(t, newStrict, sandboxtest.SessionsOptions{
		Leftovers: func(*testing.T) error {
			if left := leftovers(); len(left) > 0 {
				return errors.New("left on the host: " + strings.Join(left, ", "))
			}
			return nil
		},
	})
}

// TestSuspend runs the suspended sessions' suite: the files come back, the
// live interpreter starts fresh (this level keeps no memory).
func TestSuspend(t *testing.T) {
	requireRoot(t)
	sandboxtest.TestSuspend(t, newStrict, sandboxtest.SuspendOptions{})
}
