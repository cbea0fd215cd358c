package container

import (
	"context"
	"encoding/json"
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

// RuncPrepared is one container prepared by a runc-driven Sandbox's
// backend, for tests that look at it from the host before its run.
type RuncPrepared struct{ in *runcInstance }

// PrepareRunc prepares one container of sb, which must use the runc
// driver, as the pool does.
func PrepareRunc(ctx context.Context, sb *Sandbox) (*RuncPrepared, error) {
	in, err := sb.r.Prepare(ctx)
	if err != nil {
		return nil, err
	}
	return &RuncPrepared{in.(*runcInstance)}, nil
}

// Pid is the host pid of the container's init.
func (p *RuncPrepared) Pid() int { return p.in.pid }

// UID is the uid the container runs as.
func (p *RuncPrepared) UID() int { return p.in.lease.UID }

// Discard discards the container.
func (p *RuncPrepared) Discard() { p.in.Discard() }

// RuncOwner is the owner id under which sb's runc containers, bundles and
// cgroups are named.
func RuncOwner(sb *Sandbox) string { return sb.r.owner }

// RuncLeftoversOf lists what the runc driver of owner id has on the host.
func RuncLeftoversOf(id string) []string { return runcLeftovers(defaultRuncPaths, id) }

// RuncProbeWithSeccomp runs the seccomp probe of a runc-driven Sandbox
// made with cfg whose containers get the OCI filter seccompJSON instead of
// moat's, and returns its error.
func RuncProbeWithSeccomp(cfg Config, seccompJSON string) error {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return err
	}
	b, err := newRuncBackend(cfg, defaultRuncPaths)
	if err != nil {
		return err
	}
	defer b.Close()
	b.seccomp = new(ociSeccomp)
	if err := json.Unmarshal([]byte(seccompJSON), b.seccomp); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, err = b.probeSeccomp(ctx)
	return err
}
