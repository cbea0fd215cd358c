package subprocess

import (
	"net"
	"time"

	"github.com/moatsandbox/moat/internal/egress"
)

// Hooks for the external tests. They are meant for the time between runs.

// current returns the session's live interpreter, if any.
func (ss *session) current() *interpreter {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.interp
}

// InterpreterCPU returns the CPU time the session's live interpreter has
// used so far, read from its cgroup's account, and false when it has none.
func (s *Session) InterpreterCPU() (time.Duration, bool, error) {
	in := s.inst.current()
	if in == nil || in.group == nil {
		return 0, false, nil
	}
	used, err := in.group.CPUUsage()
	return used, true, err
}

// InterpreterFrozen reports whether the cgroup of the session's live
// interpreter is frozen.
func (s *Session) InterpreterFrozen() (bool, error) {
	in := s.inst.current()
	if in == nil || in.group == nil {
		return false, nil
	}
	return in.group.Frozen()
}

// WithoutFreezer makes the sandbox behave as on a host without a cgroup
// freezer. Call it before the first session, on a sandbox without a pool
// (Config.Warm -1): the pool prepares its instances with the same manager.
func (s *Sandbox) WithoutFreezer() { s.b.cg = s.b.cg.WithoutFreezer() }

// SetListCaps sets the listing caps for a test and returns a function
// that puts them back.
func SetListCaps(n, bytes int) (restore func()) {
	on, ob := maxList, maxListBytes
	maxList, maxListBytes = n, bytes
	return func() { maxList, maxListBytes = on, ob }
}

// ServeEgress puts handle behind every egress listener a run is given, in
// place of the proxy's Serve, until restore is called. Call it before New
// and restore after Close.
func ServeEgress(handle func(l net.Listener)) (restore func()) {
	old := serve
	serve = func(_ *backend, _ *egress.Run, l net.Listener) { handle(l) }
	return func() { serve = old }
}

// HoldTeardown makes the removals that finish after a run's result wait
// until release is called.
func HoldTeardown() (release func()) {
	gate := make(chan struct{})
	teardownHook = func() { <-gate }
	return func() {
		teardownHook = nil
		close(gate)
	}
}
