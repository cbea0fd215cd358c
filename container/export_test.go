package container

import (
	"context"
	"time"

	"github.com/moatsandbox/moat/internal/egress"
)

// ProbeWithProfile runs the seccomp probe of a Sandbox made with cfg whose
// containers get profileJSON instead of moat's profile, and returns its
// error. Tests use it to show that the probe refuses a profile that lets
// the probe's calls through.
func ProbeWithProfile(cfg Config, profileJSON string) error {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cli, err := newClient()
	if err != nil {
		return err
	}
	defer cli.Close()
	eng, err := probe(ctx, cli, cfg)
	if err != nil {
		return err
	}
	b, err := newBackend(cfg, cli, eng)
	if err != nil {
		return err
	}
	b.spec.seccomp.json = profileJSON
	_, err = b.probeSeccomp(ctx)
	return err
}

// EgressRun is what a container or session uses of its egress run.
type EgressRun = egressRun

// SetEgressRuns makes the Sandboxes made after it get their containers'
// and sessions' egress runs from f instead of the proxy, and returns what
// restores the proxy's. Tests use it to see the listener moat places and
// the notes and closes of each run, whatever the proxy does.
func SetEgressRuns(f func(*egress.Proxy) EgressRun) (restore func()) {
	old := newEgressRun
	newEgressRun = f
	return func() { newEgressRun = old }
}
