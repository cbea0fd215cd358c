package subprocess

import (
	"context"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestReaperHoldsOnlyCapKill: the reaper, root's process in the host's user
// namespace, holds CAP_KILL alone, not the helper's full set; its pooled
// run still ends with the code's own status.
func TestReaperHoldsOnlyCapKill(t *testing.T) {
	requireRootHere(t)
	if runtime.GOARCH != "amd64" {
		t.Skip("the reaper is written for amd64 only; here the Go helper reaps (reaper_other.go)")
	}
	sb, err := New(Config{Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	in, err := sb.b.Prepare(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer in.Discard()
	pid := in.(*instance).h.cmd.Process.Pid
	status := ""
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if status = string(b); strings.Contains(status, "Name:\t"+reaperArg0+"\n") {
			break
		}
	}
	if !strings.Contains(status, "Name:\t"+reaperArg0+"\n") {
		t.Fatalf("the helper did not become the reaper: %q", status)
	}
	want := strconv.FormatUint(1<<unix.CAP_KILL, 16)
	for _, field := range []string{"CapPrm", "CapEff", "CapBnd"} {
		var got string
		for _, line := range strings.Split(status, "\n") {
			if v, ok := strings.CutPrefix(line, field+":\t"); ok {
				got = strings.TrimLeft(v, "0")
			}
		}
		if got != want {
			t.Errorf("the reaper's %s is %q, want %q (CAP_KILL alone)", field, got, want)
		}
	}
}
