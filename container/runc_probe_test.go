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

	"github.com/moatsandbox/moat"
	moatcontainer "github.com/moatsandbox/moat/container"
)

// Probes of the runc driver from a hostile reviewer: each fails where a
// protection is missing.

const runcProbeHelperEnv = "MOAT_RUNC_PROBE_HELPER"

func init() {
	if os.Getenv(runcProbeHelperEnv) == "1" {
		os.Exit(runcProbeHelperMain())
	}
}

// runcProbeHelperMain is a moat that starts a long run whose code prints
// its uid and sleeps, then is killed -9 by the test.
func runcProbeHelperMain() int {
	sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1,
		Limits: moat.Limits{WallTime: moat.Duration(10 * time.Minute)}})
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("owner", moatcontainer.RuncOwner(sb))
	sb.Run(context.Background(), moat.Request{
		Code:   []byte("import os, time\nprint('uid', os.getuid(), flush=True)\ntime.sleep(600)\n"),
		Stdout: os.Stdout,
	})
	return 1
}

// TestRuncProbeMoatDeathEndsRun: a moat killed -9 in the middle of a run
// must not leave the run's code running, unbounded by its wall time, as a
// uid whose lease died with moat (another moat, of any level, may lease it
// at once), until some later moat with the runc driver happens to reap it.
func TestRuncProbeMoatDeathEndsRun(t *testing.T) {
	needRunc(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), runcProbeHelperEnv+"=1")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	r := bufio.NewReader(out)
	var id string
	uid := -1
	for uid < 0 {
		line, err := r.ReadString('\n')
		if err != nil {
			t.Fatalf("the helper ended: %v (%q)", err, line)
		}
		f := strings.Fields(line)
		switch {
		case len(f) == 2 && f[0] == "owner":
			id = f[1]
		case len(f) == 2 && f[0] == "uid":
			uid, _ = strconv.Atoi(f[1])
		}
	}
	if len(uidProcs(uid)) == 0 {
		t.Fatalf("inconclusive: no process of the run's uid %d while it runs", uid)
	}
	cmd.Process.Kill()
	cmd.Wait()
	defer func() {
		// Reap what the dead moat left, whatever the verdict.
		if sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1}); err == nil {
			sb.Close()
		}
		if left := moatcontainer.RuncLeftoversOf(id); len(left) > 0 {
			t.Errorf("after a later New, the dead moat's leftovers remain: %v", left)
		}
	}()
	var left []string
	for range 50 {
		if left = uidProcs(uid); len(left) == 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Errorf("5 s after moat was killed -9, the run's code still runs as uid %d: %v", uid, left)
}
