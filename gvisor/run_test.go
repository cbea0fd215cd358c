package gvisor

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestAliveSeesAnExitNotYetWaitedFor checks that a sandbox whose runsc has
// exited is not alive even before the goroutine that waits for runsc has
// run: a pooled sandbox killed from outside must be found stale, not used.
// Here nothing waits for the process at all.
func TestAliveSeesAnExitNotYetWaitedFor(t *testing.T) {
	cmd := exec.Command("/bin/sh", "-c", "exit 0")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	bt := &booted{cmd: cmd, exited: make(chan struct{})}
	// A zombie until waited for.
	deadline := time.Now().Add(5 * time.Second)
	for {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/stat")
		if f := strings.Fields(string(b)); len(f) > 2 && f[2] == "Z" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the child never exited")
		}
		time.Sleep(time.Millisecond)
	}
	if bt.alive() {
		t.Error("alive() = true for a runsc that has exited")
	}
	cmd.Wait()

	live := exec.Command("/bin/sleep", "10")
	if err := live.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { live.Process.Kill(); live.Wait() }()
	if bt := (&booted{cmd: live, exited: make(chan struct{})}); !bt.alive() {
		t.Error("alive() = false for a runsc that runs")
	}
}
