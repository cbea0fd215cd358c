package container

import (
	"context"
	"time"
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
