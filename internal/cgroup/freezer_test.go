package cgroup

import (
	"errors"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestFreezeHoldsAgainstSIGCONT checks what SIGSTOP cannot do: a frozen
// group uses no CPU, even when its processes are sent SIGCONT and while
// one of them was forking, and it runs again once thawed.
func TestFreezeHoldsAgainstSIGCONT(t *testing.T) {
	m := newManager(t)
	g, err := m.New("1-freeze", Limits{Memory: 64 << 20, Pids: 64, Freezable: true})
	if err != nil {
		t.Fatal(err)
	}
	// Two spinners, and a loop that keeps forking more short-lived ones.
	cmd := start(t, g, "(while :; do :; done) & (while :; do :; done) & while :; do (i=0; while [ $i -lt 200 ]; do i=$((i+1)); done) & sleep 0.01; done")
	defer func() {
		if err := g.Kill(); err != nil {
			t.Error(err)
		}
		cmd.Wait()
		g.Remove()
	}()
	waitFor(t, "the spinners to start", func() bool { return len(g.Pids()) >= 3 })

	// Positive control: thawed, the group uses CPU.
	const gap = 500 * time.Millisecond
	if used := cpuOver(t, g, gap, nil); used < gap/4 {
		t.Fatalf("positive control: the spinners used only %v of CPU in %v", used, gap)
	}

	if err := g.Freeze(); err != nil {
		t.Fatal(err)
	}
	if frozen, err := g.Frozen(); err != nil || !frozen {
		t.Fatalf("Frozen() = %v, %v right after Freeze", frozen, err)
	}
	pids := g.Pids()
	sigcont := func() {
		for _, p := range g.Pids() {
			syscall.Kill(p, syscall.SIGCONT)
		}
	}
	if used := cpuOver(t, g, gap, sigcont); used*20 > gap {
		t.Errorf("frozen and sent SIGCONT every 10ms, the group used %v of CPU in %v (want under 5%%)", used, gap)
	}
	if got := g.Pids(); !slices.Equal(got, pids) {
		t.Errorf("the frozen group's processes changed from %v to %v", pids, got)
	}
	if err := g.Freeze(); err != nil {
		t.Errorf("freezing a frozen group: %v", err)
	}

	if err := g.Thaw(); err != nil {
		t.Fatal(err)
	}
	if frozen, err := g.Frozen(); err != nil || frozen {
		t.Fatalf("Frozen() = %v, %v right after Thaw", frozen, err)
	}
	if used := cpuOver(t, g, gap, nil); used < gap/4 {
		t.Errorf("thawed, the spinners used only %v of CPU in %v", used, gap)
	}
}

// cpuOver returns the CPU the group used during d, calling poke every 10ms
// meanwhile if it is not nil.
func cpuOver(t *testing.T, g *Group, d time.Duration, poke func()) time.Duration {
	t.Helper()
	before, err := g.CPUUsage()
	if err != nil {
		t.Fatal(err)
	}
	for end := time.Now().Add(d); time.Now().Before(end); {
		if poke != nil {
			poke()
		}
		time.Sleep(10 * time.Millisecond)
	}
	after, err := g.CPUUsage()
	if err != nil {
		t.Fatal(err)
	}
	return after - before
}

// TestKillFrozen checks that Kill and ReapDead empty a frozen group (on v1
// a frozen process dies only once thawed).
func TestKillFrozen(t *testing.T) {
	m := newManager(t)
	for _, reap := range []bool{false, true} {
		g, err := m.New("dead-frozen", Limits{Memory: 64 << 20, Pids: 8, Freezable: true})
		if err != nil {
			t.Fatal(err)
		}
		cmd := start(t, g, "sleep 100 & sleep 100")
		waitFor(t, "the sleeps to start", func() bool { return len(g.Pids()) >= 2 })
		if err := g.Freeze(); err != nil {
			t.Fatal(err)
		}
		if reap {
			names, err := m.ReapDead(func(name string) bool { return strings.HasPrefix(name, "dead-") })
			if err != nil || !slices.Equal(names, []string{"dead-frozen"}) {
				t.Errorf("ReapDead = %v, %v", names, err)
			}
		} else if err := g.Kill(); err != nil {
			t.Error(err)
		}
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("reap=%v: the frozen shell did not die", reap)
		}
		if pids := g.Pids(); len(pids) != 0 {
			t.Errorf("reap=%v: processes left: %v", reap, pids)
		}
		if err := g.Remove(); err != nil {
			t.Error(err)
		}
	}
}

// TestFreezerRequired checks that a freezable group is refused where there
// is no freezer, and that a group not made freezable cannot be frozen.
func TestFreezerRequired(t *testing.T) {
	m := newManager(t)
	g, err := m.New("1-plain", Limits{Memory: 64 << 20, Pids: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Remove()
	if err := g.Freeze(); err == nil {
		t.Error("a group not made freezable was frozen")
	}
	if g.freezer != "" {
		t.Errorf("a group not made freezable has a freezer directory %s", g.freezer)
	}

	none := *m
	none.freezer, none.noFreezer = "", ErrNoFreezer
	if _, err := none.New("1-nofreezer", Limits{Memory: 64 << 20, Pids: 8, Freezable: true}); !errors.Is(err, ErrNoFreezer) {
		t.Errorf("New(Freezable) without a freezer: %v, want ErrNoFreezer", err)
	}
}
