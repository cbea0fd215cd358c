package subprocess

import (
	"context"
	"time"
)

// Hooks for the external tests.

// InterpreterCPU returns the CPU time the session's live interpreter has
// used so far, read from its cgroup's account, and false when it has none.
func (ss *Session) InterpreterCPU() (time.Duration, bool, error) {
	if err := ss.acquire(context.Background()); err != nil {
		return 0, false, err
	}
	defer ss.release()
	if ss.interp == nil || ss.interp.group == nil {
		return 0, false, nil
	}
	used, err := ss.interp.group.CPUUsage()
	return used, true, err
}

// InterpreterFrozen reports whether the cgroup of the session's live
// interpreter is frozen.
func (ss *Session) InterpreterFrozen() (bool, error) {
	if err := ss.acquire(context.Background()); err != nil {
		return false, err
	}
	defer ss.release()
	if ss.interp == nil || ss.interp.group == nil {
		return false, nil
	}
	return ss.interp.group.Frozen()
}

// WithoutFreezer makes the sandbox behave as on a host without a cgroup
// freezer.
func (s *Sandbox) WithoutFreezer() { s.cg = s.cg.WithoutFreezer() }
