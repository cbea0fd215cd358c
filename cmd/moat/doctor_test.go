package main

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// What doctor says of a level's suspend is what the level's own sandbox
// says as a moat.MemoryKeeper. Every level doctor finds available here is
// opened (without warm instances, the microvm without its template) and
// asked: a claim doctor makes is a claim checked. CI has every level.
func TestDoctorSuspendMemoryMatchesLevels(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("the levels need root (CI runs this as root)")
	}
	ctx := context.Background()
	var fc fileConfig
	fc.Subprocess.Warm, fc.Container.Warm, fc.GVisor.Warm = -1, -1, -1
	fc.MicroVM.Cold = true
	for _, e := range levelTable() {
		if _, ok := suspendKeepsMemory[e.level]; !ok {
			t.Errorf("%s: doctor does not know whether its suspend keeps memory", e.level)
		}
		if a := e.check(ctx, fc); !a.Available {
			t.Logf("%s: unavailable here, doctor claims nothing of it: %s", e.level, a.Reason)
			continue
		}
		sb, err := e.open(ctx, fc)
		if err != nil {
			t.Errorf("%s: %v", e.level, err)
			continue
		}
		mk, ok := sb.(moat.MemoryKeeper)
		_, res := sb.(moat.Resumer)
		if !ok || !res {
			t.Errorf("%s: its sandbox is not a Resumer and MemoryKeeper", e.level)
		} else if got := mk.SuspendKeepsMemory(); got != suspendKeepsMemory[e.level] {
			t.Errorf("%s: the sandbox says a suspend keeps memory: %v, doctor says %v", e.level, got, suspendKeepsMemory[e.level])
		}
		sb.Close()
	}
}

// Each available level's doctor line says how its sessions suspend, in
// text and JSON; an unavailable one says nothing of it.
func TestDoctorSaysHowSessionsSuspend(t *testing.T) {
	stdout, _, code := runMoat(t, "", "doctor", "--json")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	var got struct {
		Levels []struct {
			Level         moat.Level `json:"level"`
			Available     bool       `json:"available"`
			SuspendMemory *bool      `json:"suspend_memory"`
		} `json:"levels"`
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatal(err)
	}
	available := 0
	for _, l := range got.Levels {
		if l.Available != (l.SuspendMemory != nil) {
			t.Errorf("%s: available %v, suspend_memory %v", l.Level, l.Available, l.SuspendMemory)
		}
		if l.SuspendMemory != nil {
			available++
			if *l.SuspendMemory != suspendKeepsMemory[l.Level] {
				t.Errorf("%s: suspend_memory %v", l.Level, *l.SuspendMemory)
			}
		}
	}
	if os.Geteuid() == 0 && available == 0 {
		t.Error("as root at least the subprocess level is available")
	}
	text, _, _ := runMoat(t, "", "doctor")
	if n := strings.Count(text, "sessions suspend with their memory") + strings.Count(text, "sessions suspend with their files only"); n != available {
		t.Errorf("%d suspend lines for %d available levels:\n%s", n, available, text)
	}
}
