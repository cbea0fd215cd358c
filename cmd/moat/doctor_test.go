package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
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

// With --progress, doctor says on stderr which level it checks, one line
// per level as the check starts, in order; stdout holds the report alone,
// JSON that parses, with moat's version. Without the flag, and stderr not
// a terminal, it says nothing there.
func TestDoctorProgressOnStderr(t *testing.T) {
	stdout, stderr, _ := runMoat(t, "", "doctor", "--json", "--progress")
	var got struct {
		Version string `json:"version"`
		Levels  []struct {
			Level moat.Level `json:"level"`
		} `json:"levels"`
	}
	if err := json.Unmarshal([]byte(stdout), &got); err != nil {
		t.Fatalf("stdout is not the JSON report alone: %v\n%s", err, stdout)
	}
	if got.Version == "" || got.Version == "unknown" {
		t.Errorf("version %q", got.Version)
	}
	lines := strings.Split(strings.TrimSpace(stderr), "\n")
	var checked []string
	for _, l := range lines {
		if rest, ok := strings.CutPrefix(l, "moat doctor: checking "); ok {
			name, _, _ := strings.Cut(rest, ":")
			checked = append(checked, name)
		}
	}
	var want []string
	for _, e := range levelTable() {
		want = append(want, string(e.level))
	}
	if strings.Join(checked, ",") != strings.Join(want, ",") {
		t.Errorf("progress checked %v, want %v:\n%s", checked, want, stderr)
	}
	if !strings.Contains(stderr, "probing KVM (first time, up to 20 s)") {
		t.Errorf("progress does not say the microvm check may take 20 s:\n%s", stderr)
	}

	_, quiet, _ := runMoat(t, "", "doctor", "--json")
	if strings.Contains(quiet, "checking") {
		t.Errorf("progress without --progress, stderr not a terminal:\n%s", quiet)
	}
}

// isTerminal is true of a terminal, false of a pipe, a buffer or another
// character device.
func TestIsTerminal(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	defer w.Close()
	if isTerminal(w) || isTerminal(&strings.Builder{}) {
		t.Error("a pipe or a buffer is a terminal")
	}
	null, err := os.OpenFile("/dev/null", os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer null.Close()
	if isTerminal(null) {
		t.Error("/dev/null is a terminal")
	}
	tty, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tty.Close()
	if !isTerminal(tty) {
		t.Error("a pseudo-terminal is not a terminal")
	}
}

// When no level is available doctor still prints its report, says so in
// one line on stderr and exits 125 (docs/exit-status.md).
func TestDoctorNoLevelAvailableExits125(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "missing")
	cfg := filepath.Join(t.TempDir(), "moat.json")
	if err := os.WriteFile(cfg, []byte(`{"subprocess": {"python": "`+missing+`"}, "gvisor": {"runsc": "`+missing+`"}, "microvm": {"qemu": "`+missing+`"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("DOCKER_HOST", "unix://"+missing)
	for _, args := range [][]string{{"doctor", "--config", cfg}, {"doctor", "--config", cfg, "--json"}} {
		stdout, stderr, code := runMoat(t, "", args...)
		if code != exitInternal {
			t.Errorf("%v: exit %d, want %d\n%s%s", args, code, exitInternal, stdout, stderr)
		}
		if strings.Count(stdout, "unavailable")+strings.Count(stdout, `"available": false`) < len(moat.Levels) {
			t.Errorf("%v: the report does not say each level is unavailable:\n%s", args, stdout)
		}
	}
	_, stderr, _ := runMoat(t, "", "doctor", "--config", cfg)
	if !strings.Contains(stderr, "no level is available here") {
		t.Errorf("stderr %q", stderr)
	}
}

// A run under the tutorial profile says on stderr, in one line, every
// time, what that profile lets through; a strict run says nothing of it.
func TestTutorialRunWarns(t *testing.T) {
	for i := 0; i < 2; i++ {
		for _, args := range [][]string{
			{"run", "--hardening", "tutorial", "-c", "print(6 * 7)"},
			{"run", "--hardening", "tutorial", "--json", "-c", "print(6 * 7)"},
		} {
			stdout, stderr, code := runMoat(t, "", args...)
			if code != 0 || !strings.Contains(stdout, "42") {
				t.Fatalf("%v: exit %d, stdout %q, stderr %q", args, code, stdout, stderr)
			}
			if strings.Contains(stdout, "warning") {
				t.Errorf("%v: the warning is on stdout: %q", args, stdout)
			}
			var warnings []string
			for _, l := range strings.Split(stderr, "\n") {
				if strings.HasPrefix(l, "moat: warning:") {
					warnings = append(warnings, l)
				}
			}
			if len(warnings) != 1 {
				t.Fatalf("%v: %d warning lines, want 1: %q", args, len(warnings), stderr)
			}
			if !strings.Contains(warnings[0], "3 of the tutorial's 6") || !strings.Contains(warnings[0], "fork_flood, credentials, network get through") {
				t.Errorf("%v: the warning does not say what gets through: %q", args, warnings[0])
			}
		}
	}
	requireRoot(t)
	_, stderr, code := runMoat(t, "", "run", "-c", "print(1)")
	if code != 0 || strings.Contains(stderr, "warning") {
		t.Errorf("strict run: exit %d, stderr %q", code, stderr)
	}
}
