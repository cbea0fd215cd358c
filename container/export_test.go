package container

import (
	"context"
	"io"
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

// Prepared is one container prepared by a Sandbox's backend as its pool
// prepares them, for tests that act on it between Prepare and Start.
type Prepared struct{ in *instance }

// Prepare prepares one container of sb as the pool does.
func Prepare(ctx context.Context, sb *Sandbox) (*Prepared, error) {
	in, err := sb.b.Prepare(ctx)
	if err != nil {
		return nil, err
	}
	return &Prepared{in.(*instance)}, nil
}

// ID is the container's id.
func (p *Prepared) ID() string { return p.in.id }

// Start starts code in the container, as the engine does, discarding
// its output, and waits for its end; it returns Start's error, if any.
func (p *Prepared) Start(ctx context.Context, code []byte) error {
	proc, err := p.in.Start(ctx, code, io.Discard, io.Discard)
	if err != nil {
		return err
	}
	_, err = proc.Wait()
	return err
}

// Discard discards the container.
func (p *Prepared) Discard() { p.in.Discard() }
