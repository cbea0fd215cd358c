package gvisor

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"

	"github.com/moatsandbox/moat"
)

// These tests need neither root nor runsc: they check how moat reads what
// runsc prints, on lines copied from runsc 0.0~20240729.0 (Debian 13).

func TestParseVersion(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"runsc version 0.0~20240729.0\nspec: 1.2.0\n", "0.0~20240729.0"},
		{"runsc version release-20240729.0\n", "release-20240729.0"},
		{"runsc: unknown flag\n", ""},
		{"", ""},
	} {
		if got := parseVersion([]byte(c.in)); got != c.want {
			t.Errorf("parseVersion(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParsePlatforms(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"  -platform string\n    \tspecifies which platform to use: systrap (default), ptrace, kvm. (default \"systrap\")\n", []string{"systrap", "ptrace", "kvm"}},
		// Debian 12's runsc (2022) has no systrap.
		{"  -platform string\n    \tspecifies which platform to use: ptrace (default), kvm. (default \"ptrace\")\n", []string{"ptrace", "kvm"}},
		{"  -network value\n", nil},
	} {
		if got := parsePlatforms([]byte(c.in)); !slices.Equal(got, c.want) {
			t.Errorf("parsePlatforms(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParseRunLog(t *testing.T) {
	const head = "I1130 21:07:00.640399   17622 main.go:196] **************** gVisor ****************\n" +
		"W1130 21:07:00.644271   17622 sandbox.go:751] Failed to set RLIMIT_MEMLOCK: operation not permitted\n"
	for _, c := range []struct {
		name, log       string
		exited          bool
		code            int
		signal          syscall.Signal
		fatal           string
		warningsAtLeast int
	}{
		{"exit 0", head + "I1130 21:07:00.796032   17622 main.go:222] Exiting with status: 0\n", true, 0, 0, "", 1},
		{"exit 139, not a signal", head + "I1130 21:07:00.950415   17707 main.go:222] Exiting with status: 35584\n", true, 139, 0, "", 1},
		{"SIGSEGV", head + "I1130 21:07:00.796032   17622 main.go:222] Exiting with status: 11\n", true, 0, syscall.SIGSEGV, "", 1},
		{"killed: no status", head, false, 0, 0, "", 1},
		{"fatal", head + "W1130 21:05:44.580900    2630 util.go:64] FATAL ERROR: creating container: cannot create sandbox\n" +
			"I1130 21:05:44.581000    2630 main.go:222] Exiting with status: 32768\n", true, 128, 0, "creating container: cannot create sandbox", 2},
	} {
		t.Run(c.name, func(t *testing.T) {
			rl := parseRunLog([]byte(c.log))
			if rl.exited != c.exited || rl.fatal != c.fatal || len(rl.warnings) < c.warningsAtLeast {
				t.Fatalf("parseRunLog = %+v, want exited %v, fatal %q, at least %d warnings", rl, c.exited, c.fatal, c.warningsAtLeast)
			}
			if !c.exited {
				return
			}
			if c.signal != 0 {
				if !rl.status.Signaled() || rl.status.Signal() != c.signal {
					t.Errorf("status %#x: want signal %v", uint32(rl.status), c.signal)
				}
			} else if !rl.status.Exited() || rl.status.ExitStatus() != c.code {
				t.Errorf("status %#x: want exit %d", uint32(rl.status), c.code)
			}
		})
	}
}

func TestSentryEvents(t *testing.T) {
	const (
		cloneEAGAIN = "I1130 21:05:21.809370   29928 strace.go:611] [   1:   1] python3 X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 0 (0x0) errno=11 (try again) (513.076µs)"
		cloneOK     = "I1130 21:05:21.560017   29928 strace.go:611] [   1:   1] python3 X clone(CLONE_CHILD_CLEARTID|CLONE_CHILD_SETTID|0x11, 0x0, 0x0, 0x7ee3e0377310, 0x0) = 2 (0x2) (511.833µs)"
		writeEFBIG  = "I1130 21:07:27.178419   19952 strace.go:605] [   1:   1] python3 X write(0x3 /work/big, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=27 (file too large) (1.872µs)"
		writeENOSPC = "I1130 21:07:27.184681   19952 strace.go:605] [   1:   1] python3 X write(0x3 /dev/shm/f, 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=28 (no space left on device) (1.412µs)"
		writeEntry  = "I1130 21:05:51.259174    4536 strace.go:567] [   1:   1] python3 E write(0x1 host:[2], 0xb21e30 \"1\\n\", 0x2)"
		writeEAGAIN = "I1130 21:07:27.184681   19952 strace.go:605] [   1:   1] python3 X write(0x4 pipe:[3], 0xb4a100 \"xxxxxxxx\"..., 0x10000) = 0 (0x0) errno=11 (try again) (1.412µs)"
		panicLine   = "panic: unable to activate mm: createStub: failed to get clone"
		infoLine    = "I1130 21:03:37.904353   11664 vfs.go:978] mounting tmpfs"
	)
	for _, c := range []struct {
		name  string
		lines []string
		want  sentryFacts
	}{
		{"nothing refused", []string{cloneOK, writeEntry, infoLine}, sentryFacts{}},
		{"fork refused", []string{cloneOK, cloneEAGAIN}, sentryFacts{pids: true}},
		{"file too large", []string{writeEFBIG}, sentryFacts{fileSize: true}},
		{"disk full", []string{writeENOSPC}, sentryFacts{disk: true}},
		// A full pipe is not a task limit.
		{"EAGAIN from a write", []string{writeEAGAIN}, sentryFacts{}},
		{"sentry panic", []string{infoLine, panicLine}, sentryFacts{panicked: true}},
		// The code names its files: one named like a refused clone, in a
		// line that is not a refusal, changes nothing.
		{"forged name in a successful write", []string{strings.Replace(cloneOK, "python3 X clone", "python3 X write(0x3 /tmp/a) = 0 (0x0) errno=11 (try again) (1µs)", 1)}, sentryFacts{}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var e sentryEvents
			e.read(strings.NewReader(strings.Join(c.lines, "\n") + "\n"))
			got := e.snapshot()
			if got.pids != c.want.pids || got.fileSize != c.want.fileSize || got.disk != c.want.disk || got.panicked != c.want.panicked {
				t.Errorf("got pids %v filesize %v disk %v panicked %v, want %+v", got.pids, got.fileSize, got.disk, got.panicked, c.want)
			}
		})
	}
}

// FuzzSentryLog feeds arbitrary logs to the reader: it must never panic,
// and a log without the strace mark can report nothing but a panic.
func FuzzSentryLog(f *testing.F) {
	f.Add([]byte("I1130 21:05:21.809370   29928 strace.go:611] [   1:   1] python3 X clone(0x11) = 0 (0x0) errno=11 (try again) (513.076µs)\n"))
	f.Add([]byte("panic: x\n" + strings.Repeat("y", 70000) + "\nfatal error: z"))
	f.Fuzz(func(t *testing.T, log []byte) {
		var e sentryEvents
		e.read(strings.NewReader(string(log)))
		got := e.snapshot()
		if !strings.Contains(string(log), "strace.go:") && (got.pids || got.fileSize || got.disk) {
			t.Errorf("a log with no traced call reported a refusal: %q", log)
		}
		if len(got.last) > 8 {
			t.Errorf("kept %d lines, want at most 8", len(got.last))
		}
	})
}

func TestRunID(t *testing.T) {
	id := "0123456789abcdef-fedcba9876543210"
	for _, c := range []struct {
		name string
		want string
	}{
		{id, id},
		{id + "_sandbox:" + id + ".state", id},
		{id + "_sandbox:" + id + ".lock", id},
		{"runsc-" + id + ".sock", id},
		{"0123456789abcdef", ""},
		{"12345-fedcba9876543210", ""},
		{"zzzzzzzzzzzzzzzz-fedcba9876543210", ""},
		{"0123456789abcdef-zzzzzzzzzzzzzzzz", ""},
	} {
		got, ok := runID(c.name)
		if got != c.want || ok != (c.want != "") {
			t.Errorf("runID(%q) = %q, %v; want %q", c.name, got, ok, c.want)
		}
	}
}

func TestSpec(t *testing.T) {
	l := moat.Limits{Disk: 64 * moat.MiB, Pids: 7}.WithDefaults()
	spec := newSpec("/images/x/rootfs", "/usr/bin/python3", l)
	if !spec.Root.Readonly || spec.Root.Path != "/images/x/rootfs" {
		t.Errorf("root = %+v, want the rootfs, read-only", spec.Root)
	}
	p := spec.Process
	if p.User.UID == 0 || p.User.GID == 0 || !p.NoNewPrivileges || p.Terminal {
		t.Errorf("process user %+v, no_new_privs %v, terminal %v: want non-root, no_new_privs, no terminal", p.User, p.NoNewPrivileges, p.Terminal)
	}
	caps := p.Capabilities
	for _, set := range [][]string{caps.Bounding, caps.Effective, caps.Inheritable, caps.Permitted, caps.Ambient} {
		if set == nil || len(set) > 0 {
			t.Errorf("capabilities %+v: want every set present and empty", caps)
			break
		}
	}
	rl := map[string]uint64{}
	for _, r := range p.Rlimits {
		if r.Soft > r.Hard {
			t.Errorf("%s soft %d above hard %d", r.Type, r.Soft, r.Hard)
		}
		rl[r.Type] = r.Hard
	}
	if rl["RLIMIT_NPROC"] != 7 || rl["RLIMIT_FSIZE"] != uint64(l.FileSize) || rl["RLIMIT_NOFILE"] != uint64(l.OpenFiles) {
		t.Errorf("rlimits %v: want NPROC 7, FSIZE %d, NOFILE %d", rl, l.FileSize, l.OpenFiles)
	}
	var disk int64
	for _, m := range spec.Mounts {
		if m.Type == "bind" || strings.HasPrefix(m.Source, "/") {
			t.Errorf("mount %+v comes from the host", m)
		}
		for _, o := range m.Options {
			var n int64
			if _, err := fmt.Sscanf(o, "size=%d", &n); err == nil {
				disk += n
			}
		}
	}
	if disk > int64(l.Disk) || disk < int64(l.Disk)-3*4096 {
		t.Errorf("the tmpfs sizes add up to %d, want the disk limit %d", disk, int64(l.Disk))
	}
	b, err := json.Marshal(spec)
	if err != nil || !strings.Contains(string(b), `"noNewPrivileges":true`) || !strings.Contains(string(b), `"SCMP_ACT_ERRNO"`) {
		t.Errorf("spec JSON %s (%v): want noNewPrivileges and the seccomp filter", b, err)
	}
}
