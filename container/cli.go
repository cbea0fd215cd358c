package container

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"time"

	"github.com/moatsandbox/moat/internal/uidpool"
)

// CLIArgs returns the arguments of `docker` that run the same hardened
// container as s does for each run (same image, runtime, seccomp profile,
// limits, mounts, labels and command), through `docker run --rm -i`, with
// the first uid of the range standing for the run's own. The bench uses it
// to set moat's Engine API path against the docker CLI's.
func (s *Sandbox) CLIArgs() ([]string, error) {
	if s.b == nil {
		return nil, unavailable("the docker CLI's path needs the Docker engine, which this runc-driven sandbox could not use", "run scripts/setup-docker.sh", nil)
	}
	if s.b.egress != nil {
		return nil, errCLIEgress
	}
	path, err := s.b.spec.seccomp.file()
	if err != nil {
		return nil, err
	}
	return s.b.spec.cliArgs(s.b.uidFirst, path), nil
}

// errCLIEgress is the refusal of the docker CLI's path for a Config with
// an egress proxy: the CLI cannot place moat's listener in the container.
var errCLIEgress = unavailable("the docker CLI cannot run a container with network: moat places its egress proxy in each container itself", "run through the Engine API (New)", nil)

// A cliPlan is how the docker CLI runs with a Config: the spec, the
// profile's file, and the uids to lease one from per run.
type cliPlan struct {
	spec        *spec
	profilePath string
	uids        *uidpool.Pool
	uidFirst    int
}

// newCLIPlan resolves cfg against the engine the way New does (runtime,
// image), without removing anything or running the seccomp probe.
func newCLIPlan(ctx context.Context, cfg Config) (*cliPlan, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	if cfg.Egress != nil {
		return nil, errCLIEgress
	}
	cli, err := newClient()
	if err != nil {
		return nil, unavailable("no Docker client", "set DOCKER_HOST or run scripts/setup-docker.sh", err)
	}
	defer cli.Close()
	eng, err := probe(ctx, cli, cfg)
	if err != nil {
		return nil, err
	}
	if err := eng.refusal(cfg); err != nil {
		return nil, err
	}
	owner, err := ownerLabels()
	if err != nil {
		return nil, fmt.Errorf("container: %w", err)
	}
	prof, err := newProfile(false)
	if err != nil {
		return nil, err
	}
	path, err := prof.file()
	if err != nil {
		return nil, err
	}
	uids, err := uidpool.New(cfg.UIDFirst, cfg.UIDCount, uidLockDir())
	if err != nil {
		return nil, unavailable("cannot set up the uid pool", "", err)
	}
	return &cliPlan{spec: newSpec(cfg, eng.runtime, owner, prof, ""), profilePath: path, uids: uids, uidFirst: cfg.UIDFirst}, nil
}

// CLIArgs returns the `docker` arguments of a run with cfg, resolved against
// the engine the way New does (runtime, image), without removing anything,
// with the first uid of the range standing for the run's own.
func CLIArgs(ctx context.Context, cfg Config) ([]string, error) {
	p, err := newCLIPlan(ctx, cfg)
	if err != nil {
		return nil, err
	}
	return p.spec.cliArgs(p.uidFirst, p.profilePath), nil
}

// cliPlans keeps the resolved plan per Config, so that CLIRun times the
// docker CLI alone after its first call.
var cliPlans sync.Map // string (the Config as JSON) -> *cliPlan

// CLIRun runs print(1) through the docker CLI (`docker run --rm -i` with
// the flags of CLIArgs, a uid of its own leased for the run, the code on
// stdin) and checks that it printed 1. It is the bench's docker-cli row:
// the same hardened run as the container level's, through the CLI instead
// of the Engine API (without the level's seccomp probe and host-side
// checks). The first call for a Config asks the engine how to run; later
// calls only run the CLI.
func CLIRun(ctx context.Context, cfg Config) error {
	key, err := json.Marshal(cfg)
	if err != nil {
		return fmt.Errorf("container: %w", err)
	}
	var p *cliPlan
	if v, ok := cliPlans.Load(string(key)); ok {
		p = v.(*cliPlan)
	} else {
		if p, err = newCLIPlan(ctx, cfg); err != nil {
			return err
		}
		cliPlans.Store(string(key), p)
	}
	docker, err := exec.LookPath("docker")
	if err != nil {
		return unavailable("the docker CLI is not installed", "apt-get install docker.io", err)
	}
	lease, err := p.uids.Acquire()
	if err != nil {
		return fmt.Errorf("container: a uid for the run: %w", err)
	}
	// The container has exited when the CLI returns: no process of it runs
	// as the uid any more.
	defer lease.Release()
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, docker, p.spec.cliArgs(lease.UID, p.profilePath)...)
	cmd.Env = os.Environ() // the CLI needs DOCKER_HOST, HOME for its config
	cmd.Stdin = bytes.NewReader([]byte("print(1)\n"))
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("container: docker run: %w: %s", err, bytes.TrimSpace(stderr.Bytes()))
	}
	if got := stdout.String(); got != "1\n" {
		return fmt.Errorf("container: docker run printed %q, want \"1\\n\" (stderr %q)", got, stderr.String())
	}
	return nil
}
