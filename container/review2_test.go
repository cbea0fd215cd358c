package container_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/docker/docker/api/types/container"
	"github.com/docker/docker/api/types/filters"
	"github.com/docker/docker/client"

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
)

// review2Env makes the test binary a moat process that runs, with a range
// of one uid, code that sleeps, and waits to be killed.
const review2Env = "MOAT_REVIEW2_HELPER"

// review2UID is the one uid of the ranges of TestUIDOfAnOrphanIsNotReused,
// below the levels' default ranges.
const review2UID = 2099000000

func init() {
	if os.Getenv(review2Env) != "1" {
		return
	}
	sb, err := moatcontainer.New(moatcontainer.Config{UIDFirst: review2UID, UIDCount: 1, Warm: -1,
		Limits: moat.Limits{WallTime: moat.Duration(time.Minute)}})
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	sb.Run(context.Background(), moat.Request{
		Code:   []byte("import time\nprint('running', flush=True)\ntime.sleep(60)\n"),
		Stdout: os.Stdout,
	})
	os.Exit(1)
}

// TestUIDOfAnOrphanIsNotReused: a moat process that dies (SIGKILL, a
// crash) leaves its running container behind, still running as its uid,
// until some later New reaps it; the uid's lease, a flock, ended with the
// process. A Sandbox that was already running must not hand that uid to a
// new container while the orphan runs: two live containers would share
// the uid and its per-uid kernel limits.
func TestUIDOfAnOrphanIsNotReused(t *testing.T) {
	needEngine(t)
	// B exists before the helper dies, as a long-lived server would.
	sb, err := moatcontainer.New(moatcontainer.Config{UIDFirst: review2UID, UIDCount: 1, Warm: -1,
		Limits: moat.Limits{WallTime: moat.Duration(20 * time.Second)}})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), review2Env+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	cli, err := client.NewClientWithOpts(client.FromEnv, client.WithAPIVersionNegotiation())
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	owner := filters.NewArgs(filters.Arg("label", moatcontainer.LabelOwner+"="+strconv.Itoa(cmd.Process.Pid)))
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		list, _ := cli.ContainerList(ctx, container.ListOptions{All: true, Filters: owner})
		for _, c := range list {
			cli.ContainerRemove(ctx, c.ID, container.RemoveOptions{Force: true})
		}
	}()
	line, err := bufio.NewReader(out).ReadString('\n')
	if strings.TrimSpace(line) != "running" {
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("helper: %q, %v", line, err)
	}
	cmd.Process.Kill()
	cmd.Wait()

	ctx := context.Background()
	list, err := cli.ContainerList(ctx, container.ListOptions{Filters: owner})
	if err != nil || len(list) != 1 {
		t.Fatalf("the helper's running containers: %v, %v; want one", list, err)
	}
	res, err := sb.Run(ctx, moat.Request{Code: []byte("import os\nprint(os.getuid())\n")})
	still, lerr := cli.ContainerList(ctx, container.ListOptions{Filters: owner})
	if lerr != nil {
		t.Fatal(lerr)
	}
	if err == nil && len(still) == 1 && strings.TrimSpace(string(res.Stdout)) == strconv.Itoa(review2UID) {
		t.Fatalf("a run got uid %d while the dead helper's container %s still ran as it", review2UID, still[0].ID[:12])
	}
}
