package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/owner"
	"github.com/moatsandbox/moat/sandboxtest"
)

// The VM tests share one template: every sandbox they build has limits whose
// guest memory is the default's (see GuestMemoryMiB), so the first New boots
// and saves it (or finds it in the state directory) and every other one
// restores it.
//
// The tests that count this process's VMs on the host (leftovers), measure
// figures, or spend a CPU budget run one at a time, first. The others call
// parallel and run two at a time once those are done (go test -parallel,
// GOMAXPROCS by default: under TCG each running guest keeps a host CPU
// busy). Those that need a sandbox of the default limits and do not test
// what a sandbox of their own would (its pool, its Close) share one
// (shared), whose MaxVMs bounds the VMs they run at once.

// parallel marks t as a test that runs beside the others (see above). It
// must come before the test makes a VM: a parallel test waits there until
// the sequential ones are done.
func parallel(t *testing.T) {
	t.Helper()
	requireVMs(t)
	t.Parallel()
}

// sharedBox is the sandbox of shared, closed by TestMain.
var sharedBox struct {
	once sync.Once
	sb   *Sandbox
	err  error
}

// shared returns the sandbox of the default limits that the parallel tests
// share; t must be parallel.
func shared(t *testing.T) *Sandbox {
	t.Helper()
	cfg := requireVMs(t)
	sharedBox.once.Do(func() { sharedBox.sb, sharedBox.err = New(cfg) })
	if sharedBox.err != nil {
		t.Fatalf("New: %v", sharedBox.err)
	}
	return sharedBox.sb
}

func TestMain(m *testing.M) {
	code := m.Run()
	if sb := sharedBox.sb; sb != nil {
		sb.Close()
		if left := leftovers(); len(left) > 0 && code == 0 {
			fmt.Fprintf(os.Stderr, "microvm: VMs left after the tests and the shared sandbox's Close: %s\n", strings.Join(left, ", "))
			code = 1
		}
	}
	os.Exit(code)
}

// requireVMs skips the test where QEMU or the guest kernel is missing,
// except under CI=true, where it must fail instead.
func requireVMs(t *testing.T) Config {
	t.Helper()
	cfg := Config{}.withDefaults()
	var missing []string
	if os.Geteuid() != 0 {
		missing = append(missing, "not root")
	}
	if _, err := os.Stat(cfg.QEMU); err != nil {
		missing = append(missing, "no "+cfg.QEMU)
	}
	if _, err := findKernel(cfg.StateDir, ""); err != nil {
		missing = append(missing, err.Error())
	}
	if len(missing) > 0 {
		msg := "the microvm level cannot run here (" + strings.Join(missing, "; ") + "); run scripts/setup-microvm.sh as root"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return Config{}
}

// open returns a sandbox of cfg with limits l, closed when t ends.
func open(t *testing.T, cfg Config, l moat.Limits) *Sandbox {
	t.Helper()
	cfg.Limits = l
	sb, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { sb.Close() })
	return sb
}

// leftovers lists this process's QEMU processes that are still there.
func leftovers() []string {
	me, err := owner.Self(ownersDir)
	if err != nil {
		return []string{"no owner id: " + err.Error()}
	}
	var out []string
	for _, p := range listVMs() {
		if p.owner == me {
			out = append(out, fmt.Sprintf("qemu pid %d", p.pid))
		}
	}
	return out
}

// The concurrency check runs the suite's default 20 runs at once: the
// sandbox runs as many VMs at a time as the host has CPUs (Config.MaxVMs)
// and queues the others.
func TestConformance(t *testing.T) {
	cfg := requireVMs(t)
	sandboxtest.Run(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		c := cfg
		c.Limits = l
		sb, err := New(c)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		return sb
	}, sandboxtest.Options{Leftovers: leftovers, Dirs: []string{filepath.Join(cfg.withDefaults().StateDir, "microvm")}})
}

// The sessions' conformance suite: one VM per session.
func TestSessions(t *testing.T) {
	cfg := requireVMs(t)
	sandboxtest.TestSessions(t, func(t *testing.T, l moat.Limits) moat.Sandbox {
		c := cfg
		c.Limits = l
		sb, err := New(c)
		if err != nil {
			t.Fatalf("New: %v", err)
		}
		return sb
	}, sandboxtest.SessionsOptions{
		Leftovers: func(*testing.T) error {
			if left := leftovers(); len(left) > 0 {
				return errors.New("left on the host: " + strings.Join(left, ", "))
			}
			return nil
		},
		Dirs: []string{filepath.Join(cfg.withDefaults().StateDir, "microvm")},
	})
}

func run(t *testing.T, sb *Sandbox, code string) *moat.Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := sb.Run(ctx, moat.Request{Code: []byte(code)})
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	if res.ExitCode != 0 {
		t.Fatalf("exit %d, reason %q, stderr %s", res.ExitCode, res.Reason, res.Stderr)
	}
	return res
}

// The guest has no network device: its only interface is loopback.
func TestNoNetworkDevice(t *testing.T) {
	parallel(t)
	sb := shared(t)
	res := run(t, sb, `
import json
ifs = [l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]]
print(json.dumps(ifs))
`)
	var ifs []string
	if err := json.Unmarshal(res.Stdout, &ifs); err != nil {
		t.Fatalf("the guest's interfaces do not parse: %v: %q", err, res.Stdout)
	}
	if len(ifs) != 1 || ifs[0] != "lo" {
		t.Errorf("the guest's network interfaces are %q, want only lo", ifs)
	}
}

// The code runs on the guest's kernel, not the host's.
func TestGuestKernel(t *testing.T) {
	parallel(t)
	cfg := requireVMs(t)
	sb := shared(t)
	res := run(t, sb, "import os; print(os.uname().release); print(open('/proc/version').read().strip())")
	lines := strings.SplitN(strings.TrimSpace(string(res.Stdout)), "\n", 2)
	var uts unix.Utsname
	unix.Uname(&uts)
	host := unix.ByteSliceToString(uts.Release[:])
	k, err := findKernel(cfg.withDefaults().StateDir, "")
	if err != nil {
		t.Fatal(err)
	}
	if lines[0] == host {
		t.Errorf("the code sees the host's kernel %q", host)
	}
	if lines[0] != k.Release {
		t.Errorf("the code sees kernel %q, want the guest kernel %q", lines[0], k.Release)
	}
}

// Each run starts as a restore of the template, with a clock set from the
// host's and randomness of its own.
func TestRestore(t *testing.T) {
	parallel(t)
	sb := shared(t)
	if sb.b.tmpl == "" || sb.b.meta == nil {
		t.Fatal("the sandbox has no template")
	}
	code := "import os, random, time; print(os.urandom(8).hex() + '%x' % random.getrandbits(64), time.time())"
	var seen []string
	for i := 0; i < 2; i++ {
		before := float64(time.Now().UnixNano()) / 1e9
		res := run(t, sb, code)
		after := float64(time.Now().UnixNano()) / 1e9
		var rnd string
		var now float64
		if _, err := fmt.Sscanf(string(res.Stdout), "%s %g", &rnd, &now); err != nil {
			t.Fatalf("output %q: %v", res.Stdout, err)
		}
		if now < before-1 || now > after+1 {
			t.Errorf("the guest's clock says %f, the host's was between %f and %f", now, before, after)
		}
		if slices.Contains(seen, rnd) {
			t.Errorf("two restores of one template drew the same random bytes %s", rnd)
		}
		seen = append(seen, rnd)
		if !slices.ContainsFunc(res.Notes, func(n string) bool { return strings.HasPrefix(n, "vm: restored from template") }) {
			t.Errorf("the notes %q do not say the VM was restored", res.Notes)
		}
	}
}

// The accelerator is reported, and RequireKVM refuses to fall back.
func TestAccelReported(t *testing.T) {
	parallel(t)
	cfg := requireVMs(t)
	a := Check(context.Background(), cfg)
	if !a.Available {
		t.Fatalf("Check: unavailable: %s (%s)", a.Reason, a.Remedy)
	}
	sb := shared(t)
	accel := sb.Accel()
	if accel != AccelKVM && accel != AccelTCG {
		t.Fatalf("Accel() = %q", accel)
	}
	if !strings.HasPrefix(a.Reason, string(accel)+" ") {
		t.Errorf("Check's reason %q does not name the accelerator %s first", a.Reason, accel)
	}
	res := run(t, sb, "print(1)")
	if !slices.Contains(res.Notes, sb.b.note) || !strings.HasPrefix(sb.b.note, "accel: "+string(accel)) {
		t.Errorf("the result's notes %q do not name the accelerator %s", res.Notes, accel)
	}
	req := cfg
	req.RequireKVM = true
	strict, err := New(req)
	switch {
	case accel == AccelTCG && (err == nil || !errors.Is(err, moat.ErrUnavailable)):
		t.Errorf("New with RequireKVM where KVM cannot boot the guest: %v, want ErrUnavailable", err)
	case accel == AccelKVM && err != nil:
		t.Errorf("New with RequireKVM where KVM works: %v", err)
	}
	if strict != nil {
		strict.Close()
	}
	if a := Check(context.Background(), req); accel == AccelTCG && a.Available {
		t.Errorf("Check with RequireKVM where KVM cannot boot the guest says available: %s", a.Reason)
	}
}

// A cold sandbox boots a fresh VM for the run.
func TestCold(t *testing.T) {
	cfg := requireVMs(t)
	cfg.Cold = true
	sb := open(t, cfg, moat.Limits{})
	res := run(t, sb, "print(6 * 7)")
	if string(res.Stdout) != "42\n" {
		t.Errorf("stdout %q, want 42", res.Stdout)
	}
	if !slices.ContainsFunc(res.Notes, func(n string) bool { return strings.HasPrefix(n, "vm: cold boot") }) {
		t.Errorf("the notes %q do not say the VM was booted cold", res.Notes)
	}
	if left := leftovers(); len(left) > 0 {
		t.Errorf("VMs left after the run: %v", left)
	}
}

// The code runs as `python3 FILE` runs it, though the interpreter started
// in the template: as __main__, with its own globals and argv, and a
// traceback that shows only its own frames.
func TestRunsAsScript(t *testing.T) {
	parallel(t)
	sb := shared(t)
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte(`
import json, sys
print(json.dumps({"name": __name__, "argv": sys.argv, "file": __file__, "path0": sys.path[0],
    "globals": sorted(k for k in globals() if not k.startswith("__")),
    "main": sys.modules["__main__"].__dict__ is globals()}))
def f():
    raise KeyError("deep")
f()
`)})
	if err != nil {
		t.Fatal(err)
	}
	var got struct {
		Name, File, Path0 string
		Argv, Globals     []string
		Main              bool
	}
	if err := json.Unmarshal(bytes.SplitN(res.Stdout, []byte("\n"), 2)[0], &got); err != nil {
		t.Fatalf("output %q: %v", res.Stdout, err)
	}
	if got.Name != "__main__" || len(got.Argv) != 1 || got.Argv[0] != got.File || got.Path0 != filepath.Dir(got.File) ||
		!slices.Equal(got.Globals, []string{"json", "sys"}) || !got.Main {
		t.Errorf("the code's view of itself: %+v; want __main__, argv [__file__], sys.path[0] its directory, only its own globals", got)
	}
	stderr := string(res.Stderr)
	if res.ExitCode != 1 || strings.Count(stderr, "File ") != 2 || !strings.Contains(stderr, "in f\n") ||
		!strings.HasSuffix(stderr, "KeyError: 'deep'\n") || strings.Contains(stderr, "zygote") {
		t.Errorf("an uncaught exception two frames deep: exit %d, stderr %q; want exit 1 and a traceback of the code's two frames only", res.ExitCode, stderr)
	}
}

// Code larger than the file size limit is not a file the run wrote: a run
// of it that ends well has no reason.
func TestCodeOverFileSize(t *testing.T) {
	parallel(t)
	sb := open(t, requireVMs(t), moat.Limits{FileSize: 64 * moat.KiB})
	code := "print('ok')\n#" + strings.Repeat("x", 80<<10) + "\n"
	res := run(t, sb, code)
	if string(res.Stdout) != "ok\n" || res.Reason != moat.ReasonNone {
		t.Errorf("stdout %q, reason %q; want ok and no reason", res.Stdout, res.Reason)
	}
}
