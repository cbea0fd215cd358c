package cgroup

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// newManager detects a parent of this test process's own and removes it at
// the end. Cgroups need root, which CI has.
func newManager(t *testing.T) *Manager {
	t.Helper()
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root: cgroups need it")
		}
		t.Skip("cgroups need root (CI runs this as root)")
	}
	m, err := Detect(fmt.Sprintf("moat-cgtest-%d", os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	if m.Freezer() != nil {
		// Sessions with a live interpreter need it; CI has it.
		t.Fatal(m.Freezer())
	}
	t.Cleanup(func() {
		for _, d := range append(slices.Clip(m.dirs), m.freezer) {
			if d == "" {
				continue
			}
			if err := rmdirRetry(d); err != nil {
				t.Errorf("parent left behind: %v", err)
			}
		}
	})
	return m
}

// start runs script under sh after the shell has joined g the way the
// subprocess helper does (writing "0" into each of g.JoinFiles), so that
// everything the script starts is in g.
func start(t *testing.T, g *Group, script string) *exec.Cmd {
	t.Helper()
	var join strings.Builder
	for _, f := range g.JoinFiles() {
		fmt.Fprintf(&join, "echo 0 > %s || exit 99; ", f)
	}
	cmd := exec.Command("/bin/sh", "-c", join.String()+script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd
}

// waitFor polls cond for up to about ten seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for range 2000 {
		if cond() {
			return
		}
		syscall.Nanosleep(&syscall.Timespec{Nsec: 5e6}, nil)
	}
	t.Fatalf("timed out waiting for %s", what)
}

func TestDetectRejectsBadParent(t *testing.T) {
	for _, p := range []string{"", "..", "a/../../b"} {
		if _, err := Detect(p); err == nil {
			t.Errorf("Detect(%q) succeeded", p)
		}
	}
}

func TestNewWritesLimits(t *testing.T) {
	m := newManager(t)
	g, err := m.New("1-limits", Limits{Memory: 48 << 20, Pids: 7})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Remove()
	memFile, pidsFile := "memory.limit_in_bytes", "pids.max"
	if m.v2 {
		memFile = "memory.max"
	}
	for file, want := range map[string]string{memFile: strconv.Itoa(48 << 20), pidsFile: "7"} {
		data, err := os.ReadFile(filepath.Join(g.dirFor(file), file))
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(string(data)); got != want {
			t.Errorf("%s = %s, want %s", file, got, want)
		}
	}
	if _, err := m.New("1-limits", Limits{Memory: 48 << 20, Pids: 7}); err == nil {
		t.Error("a second group of the same name was created")
	}
}

// TestKillEmptiesAForkingGroup checks that Kill leaves no process behind,
// even one that keeps forking, and that Remove then removes every directory
// (twice is fine).
func TestKillEmptiesAForkingGroup(t *testing.T) {
	for _, freezable := range []bool{false, true} {
		t.Run("freezable="+strconv.FormatBool(freezable), func(t *testing.T) {
			testKillEmptiesAForkingGroup(t, freezable)
		})
	}
}

func testKillEmptiesAForkingGroup(t *testing.T, freezable bool) {
	m := newManager(t)
	g, err := m.New("1-kill", Limits{Memory: 64 << 20, Pids: 1000, Freezable: freezable})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Remove()
	cmd := start(t, g, "while :; do sleep 100 & sleep 0.005; done")
	waitFor(t, "the group to fill", func() bool { return len(g.Pids()) >= 8 })
	if !slices.Contains(g.Pids(), cmd.Process.Pid) {
		t.Errorf("the joined shell %d is not among the group's pids %v", cmd.Process.Pid, g.Pids())
	}
	if err := g.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if pids := g.Pids(); len(pids) != 0 {
		t.Fatalf("processes left after Kill: %v", pids)
	}
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}
	for _, d := range g.allDirs() {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("%s still there after Remove (%v)", d, err)
		}
	}
	if err := g.Remove(); err != nil {
		t.Errorf("second Remove: %v", err)
	}
}

// TestEvents checks that each limit shows in Events only once it is hit.
func TestEvents(t *testing.T) {
	m := newManager(t)
	g, err := m.New("1-events", Limits{Memory: 32 << 20, Pids: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { g.Kill(); g.Remove() }()
	if ev := g.Events(); ev != (Events{}) {
		t.Fatalf("fresh group has events %+v", ev)
	}
	// Within both limits.
	if err := start(t, g, "sleep 0").Wait(); err != nil {
		t.Fatal(err)
	}
	if ev := g.Events(); ev != (Events{}) {
		t.Fatalf("events %+v after a run within the limits", ev)
	}
	// Past the pids limit: forks fail, nothing is killed.
	start(t, g, "for i in 1 2 3 4 5 6 7 8; do sleep 100 & done; wait").Wait()
	g.Kill()
	if ev := g.Events(); !ev.PidsMax || ev.OOMKill {
		t.Errorf("after forking past the pids limit: %+v, want PidsMax only", ev)
	}
	if err := g.Remove(); err != nil {
		t.Fatal(err)
	}

	// Past the memory limit: the kernel kills.
	g, err = m.New("1-oom", Limits{Memory: 32 << 20, Pids: 8})
	if err != nil {
		t.Fatal(err)
	}
	cmd := start(t, g, "exec /usr/bin/python3 -c 'b = bytearray(256 << 20); b[::4096] = b\"x\" * len(b[::4096])'")
	err = cmd.Wait()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("python3 past the memory limit ended with %v, want SIGKILL", err)
	}
	if ev := g.Events(); !ev.OOMKill || ev.PidsMax {
		t.Errorf("after python3 went past the memory limit: %+v, want OOMKill only", ev)
	}
}

func TestCPUUsageCountsTheDead(t *testing.T) {
	m := newManager(t)
	g, err := m.New("1-cpu", Limits{Memory: 64 << 20, Pids: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { g.Kill(); g.Remove() }()
	before, err := g.CPUUsage()
	if err != nil {
		t.Fatal(err)
	}
	if err := start(t, g, "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done").Wait(); err != nil {
		t.Fatal(err)
	}
	after, err := g.CPUUsage()
	if err != nil {
		t.Fatal(err)
	}
	if after <= before {
		t.Errorf("CPU usage %v after a busy loop that ended, %v before", after, before)
	}
}

// TestReapDead checks that ReapDead kills and removes only the groups it is
// told are dead.
func TestReapDead(t *testing.T) {
	m := newManager(t)
	dead, err := m.New("dead-1", Limits{Memory: 64 << 20, Pids: 8})
	if err != nil {
		t.Fatal(err)
	}
	live, err := m.New("live-1", Limits{Memory: 64 << 20, Pids: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { dead.Kill(); dead.Remove(); live.Kill(); live.Remove() }()
	cmd := start(t, dead, "sleep 100")
	waitFor(t, "the shell to join", func() bool { return len(dead.Pids()) > 0 })
	names, err := m.ReapDead(func(name string) bool { return strings.HasPrefix(name, "dead-") })
	if err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	if !slices.Equal(names, []string{"dead-1"}) {
		t.Errorf("reaped %v, want [dead-1]", names)
	}
	for i := range dead.dirs {
		if _, err := os.Stat(dead.dirs[i]); !os.IsNotExist(err) {
			t.Errorf("%s still there after ReapDead (%v)", dead.dirs[i], err)
		}
		if _, err := os.Stat(live.dirs[i]); err != nil {
			t.Errorf("live group's %s: %v", live.dirs[i], err)
		}
	}
}

func TestOwnerPid(t *testing.T) {
	for _, c := range []struct {
		name string
		pid  int
		ok   bool
	}{{"12-ab", 12, true}, {"12", 0, false}, {"x-1", 0, false}, {"0-1", 0, false}, {"-1-2", 0, false}} {
		pid, ok := OwnerPid(c.name)
		if ok != c.ok || (ok && pid != c.pid) {
			t.Errorf("OwnerPid(%q) = %d, %v; want %d, %v", c.name, pid, ok, c.pid, c.ok)
		}
	}
}

// TestWatchCPU: a busy loop in the group is killed once it has used the
// limit beyond the base, and a stopped watch kills nothing.
func TestWatchCPU(t *testing.T) {
	m := newManager(t)
	g, err := m.New("1-watch", Limits{Memory: 64 << 20, Pids: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { g.Kill(); g.Remove() }()

	idle := start(t, g, "sleep 30")
	var quiet atomic.Bool
	stop := g.WatchCPU(0, time.Hour, func() { idle.Process.Kill() }, &quiet)
	time.Sleep(3 * CPUPoll)
	stop()
	if quiet.Load() {
		t.Error("an idle group under an hour's limit was judged over it")
	}
	idle.Process.Kill()
	idle.Wait()

	base, err := g.CPUUsage()
	if err != nil {
		t.Fatal(err)
	}
	busy := start(t, g, "while :; do :; done")
	var over atomic.Bool
	killed := make(chan struct{})
	stop = g.WatchCPU(base, 300*time.Millisecond, func() { busy.Process.Kill(); close(killed) }, &over)
	defer stop()
	select {
	case <-killed:
	case <-time.After(30 * time.Second):
		t.Fatal("a busy loop past a 300ms CPU limit was not killed")
	}
	busy.Wait()
	if !over.Load() {
		t.Error("over not set when the watch killed")
	}
	if used, _ := g.CPUUsage(); used-base < 300*time.Millisecond {
		t.Errorf("killed after %v of CPU, before the 300ms limit", used-base)
	}
}
