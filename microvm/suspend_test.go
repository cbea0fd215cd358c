package microvm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
)

// The suspend suite with memory: a live interpreter's variables come back,
// in each of two forks of one state.
func TestSuspend(t *testing.T) {
	cfg := requireVMs(t)
	cfg.Warm = -1      // no VM of the pool: every QEMU left is the sessions'
	t.Cleanup(func() { // after the sandbox's Close
		if left := leftovers(); len(left) > 0 {
			t.Errorf("left on the host: %s", strings.Join(left, ", "))
		}
	})
	sandboxtest.TestSuspend(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		c := cfg
		c.Limits = l
		sb, err := New(c)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		return sb
	}, sandboxtest.SuspendOptions{Memory: true})
}

// noPool is a configuration of sandboxes that keep no VM ahead of runs.
func noPool(t *testing.T) Config {
	cfg := requireVMs(t)
	cfg.Warm = -1
	return cfg
}

// suspendOne suspends ss into a new directory of t's and returns it.
func suspendOne(t *testing.T, ss moat.Session) (string, moat.SuspendInfo) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "s")
	info, err := ss.(moat.Suspender).Suspend(context.Background(), dir)
	if err != nil {
		t.Fatalf("Suspend: %v", err)
	}
	return dir, info
}

func resumeOne(t *testing.T, sb *Sandbox, dir string) moat.Session {
	t.Helper()
	s, _, err := sb.ResumeSession(context.Background(), dir)
	if err != nil {
		t.Fatalf("ResumeSession: %v", err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// A resumed VM has the host's clock before its first run (the Refresh),
// not the clock saved in its state; forks of one state do not share the
// kernel's random numbers.
func TestSuspendRefresh(t *testing.T) {
	parallel(t)
	sb := shared(t)
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	runOK(t, ss, "import os\nx = 1")
	dir, _ := suspendOne(t, ss)
	const away = 5 * time.Second
	time.Sleep(away)
	a := resumeOne(t, sb, dir)
	before := time.Now()
	// A file operation, before any run: its time is the guest's clock.
	if err := a.WriteFile(context.Background(), "t", strings.NewReader("x")); err != nil {
		t.Fatal(err)
	}
	fi, err := a.Stat(context.Background(), "t")
	if err != nil {
		t.Fatal(err)
	}
	if lag := before.Sub(fi.ModTime); lag > away/2 {
		t.Errorf("a file written right after the resume has the time %v, %v before the host's: the guest's clock was not set", fi.ModTime, lag)
	}
	b := resumeOne(t, sb, dir)
	rnd := "print(os.urandom(16).hex(), x)"
	ra, rb := runOK(t, a, rnd), runOK(t, b, rnd)
	if ra == rb || !strings.HasSuffix(ra, " 1\n") {
		t.Errorf("two forks of one state: os.urandom and x: %q and %q", ra, rb)
	}
}

// A state is restored only by the machine that saved it, with the options
// it was saved with; the refusal starts nothing.
func TestSuspendOtherMachine(t *testing.T) {
	sb := open(t, noPool(t), moat.Limits{})
	key, err := templateKey(sb.b.vmm, sb.b.spec)
	if err != nil {
		t.Fatal(err)
	}
	for name, m := range map[string]savedVM{
		"another machine": {Format: savedFormat, Template: "0123456789abcdef01234567"},
		"another format":  {Format: savedFormat + 1, Template: key},
		"other options":   {Format: savedFormat, Template: key, Interpreter: true},
	} {
		dir := t.TempDir()
		b, _ := json.Marshal(m)
		os.WriteFile(filepath.Join(dir, savedMetaFile), b, 0o600)
		os.WriteFile(filepath.Join(dir, savedStateFile), []byte("not a migration stream"), 0o600)
		inst, err := sb.b.RestoreState(context.Background(), dir, moat.SessionOptions{})
		if !errors.Is(err, moat.ErrInvalid) {
			if inst != nil {
				inst.Close()
			}
			t.Errorf("%s: RestoreState = %v, want an error wrapping ErrInvalid", name, err)
		}
	}
	if left := leftovers(); len(left) > 0 {
		t.Errorf("a refused state started %s", strings.Join(left, ", "))
	}
}

// A session with a network is refused with ErrInvalid, and goes on.
func TestSuspendNetworkRefused(t *testing.T) {
	cfg, _ := fakeProxy(t)
	sb := open(t, cfg, moat.Limits{})
	ss := newSession(t, sb)
	runOK(t, ss, "x = 1")
	_, err := ss.(moat.Suspender).Suspend(context.Background(), filepath.Join(t.TempDir(), "s"))
	if !errors.Is(err, moat.ErrInvalid) {
		t.Fatalf("Suspend of a session with a network: %v, want ErrInvalid", err)
	}
	if out := runOK(t, ss, "print(2)"); out != "2\n" {
		t.Errorf("the session after a refused suspend: %q", out)
	}
}

// qemuMemory is the resident memory of this process's QEMUs, in bytes:
// their Rss and their Pss (which splits the pages they share).
func qemuMemory(t *testing.T) (n int, rss, pss int64) {
	t.Helper()
	me, err := owner.Self(ownersDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range listVMs() {
		if p.owner != me {
			continue
		}
		b, err := os.ReadFile("/proc/" + strconv.Itoa(p.pid) + "/smaps_rollup")
		if err != nil {
			continue
		}
		n++
		for _, line := range strings.Split(string(b), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			switch f[0] {
			case "Rss:":
				rss += kb << 10
			case "Pss:":
				pss += kb << 10
			}
		}
	}
	return n, rss, pss
}

// The figures for the README: suspend time and size, resume to the first
// output against a fresh session's first output, the host memory of a
// suspended session and of three forks against three fresh sessions.
func TestSuspendFigures(t *testing.T) {
	sb := open(t, noPool(t), moat.Limits{})
	ctx := context.Background()
	opts := moat.SessionOptions{Interpreter: true}
	mib := func(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

	start := time.Now()
	fresh, err := sb.NewSession(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	runOK(t, fresh, "print(1)")
	freshFirst := time.Since(start)
	fresh.Close()

	ss, err := sb.NewSession(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	runOK(t, ss, "import json\nx = list(range(100000))\nprint(len(x))")
	start = time.Now()
	dir, info := suspendOne(t, ss)
	suspend := time.Since(start)
	n, rss, _ := qemuMemory(t)
	if n != 0 {
		t.Errorf("a suspended session leaves %d QEMU processes (%s resident)", n, mib(rss))
	}
	start = time.Now()
	r := resumeOne(t, sb, dir)
	if out := runOK(t, r, "print(len(x))"); out != "100000\n" {
		t.Errorf("the resumed session's x: %q", out)
	}
	resumeFirst := time.Since(start)
	r.Close()
	t.Logf("accel %s: suspend %v, %d bytes on disk (%s); resume to first output %v, a fresh session (NewSession + first run) %v; host memory while suspended: %d QEMU, %s",
		sb.Accel(), suspend.Round(time.Millisecond), info.Bytes, mib(info.Bytes), resumeFirst.Round(time.Millisecond), freshFirst.Round(time.Millisecond), n, mib(rss))

	const N = 3
	var forks []moat.Session
	for range N {
		f := resumeOne(t, sb, dir)
		runOK(t, f, "print(len(x))")
		forks = append(forks, f)
	}
	_, frss, fpss := qemuMemory(t)
	for _, f := range forks {
		f.Close()
	}
	for range N {
		s, err := sb.NewSession(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		runOK(t, s, "x = list(range(100000))\nprint(len(x))")
	}
	_, srss, spss := qemuMemory(t)
	t.Logf("host memory of %d QEMUs: %d forks of one state Rss %s Pss %s; %d fresh sessions Rss %s Pss %s",
		N, N, mib(frss), mib(fpss), N, mib(srss), mib(spss))
}

// A suspend does not give a session its CPU budget back: the resumed
// session goes on counting from what its runs had used.
func TestSuspendKeepsBudget(t *testing.T) {
	cfg := noPool(t)
	cfg.SessionCPUTime = moat.Duration(3 * time.Second)
	sb := open(t, cfg, moat.Limits{CPUTime: moat.Duration(10 * time.Second), WallTime: moat.Duration(30 * time.Second)})
	ss := newSession(t, sb)
	burn := "import time\nend = time.process_time() + 2\nwhile time.process_time() < end:\n    pass\nprint('done')\n"
	if res := runIn(t, ss, burn); res.Reason != moat.ReasonNone {
		t.Fatalf("the first 2s of a 3s budget: %q", res.Reason)
	}
	dir, _ := suspendOne(t, ss)
	r := resumeOne(t, sb, dir)
	if res := runIn(t, r, burn); res.Reason != moat.ReasonTimeout {
		t.Errorf("2s more after the resume: reason %q, want the budget's timeout", res.Reason)
	}
}
