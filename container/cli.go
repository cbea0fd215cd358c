package container

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"sync"
	"time"
)

// CLIArgs returns the arguments of `docker` that run the same hardened
// container as s does for each run (same image, runtime, limits, mounts,
// user, labels and command), through `docker run --rm -i`. The bench uses it
// to set moat's Engine API path against the docker CLI's.
func (s *Sandbox) CLIArgs() []string { return s.spec.cliArgs() }

// CLIArgs returns the `docker` arguments of a run with cfg, resolved against
// the engine the way New does (runtime, image), without removing anything.
func CLIArgs(ctx context.Context, cfg Config) ([]string, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
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
	return newSpec(cfg, eng.runtime, owner).cliArgs(), nil
}

// cliArgsCache keeps the resolved arguments per Config, so that CLIRun times
// the docker CLI alone after its first call.
var cliArgsCache sync.Map // string (the Config as JSON) -> []string

// CLIRun runs print(1) through the docker CLI (`docker run --rm -i` with
// the flags of CLIArgs, the code on stdin) and checks that it printed 1. It
// is the bench's docker-cli row: the same hardened run as the container
// level's, through the CLI instead of the Engine API. The first call for a
// Config asks the engine how to run; later calls only run the CLI.
func CLIRun(ctx context.Context, cfg Config) error {
	key, err := json.Marshal(cfg)
	if err != nil {
		return fmt.Errorf("container: %w", err)
	}
	var args []string
	if v, ok := cliArgsCache.Load(string(key)); ok {
		args = v.([]string)
	} else {
		if args, err = CLIArgs(ctx, cfg); err != nil {
			return err
		}
		cliArgsCache.Store(string(key), args)
	}
	docker, err := exec.LookPath("docker")
	if err != nil {
		return unavailable("the docker CLI is not installed", "apt-get install docker.io", err)
	}
	var stdout, stderr bytes.Buffer
	cmd := exec.CommandContext(ctx, docker, slices.Clone(args)...)
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
