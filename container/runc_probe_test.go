package container_test

import (
	"bufio"
	"context"
	"errors"
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

// brokenRunc makes a directory for MOAT_LIBEXEC whose runc is moat's,
// except that it rewrites every bundle's config.json with edit (a Python
// expression over the spec c) before running it: a runc that ignores
// part of the spec, as a broken or older one may.
func brokenRunc(t *testing.T, edit string) string {
	t.Helper()
	real := "/usr/local/lib/moat/runc"
	if d := os.Getenv("MOAT_LIBEXEC"); d != "" {
		real = d + "/runc"
	}
	dir := t.TempDir()
	script := `#!/bin/sh
b=""; prev=""
for a in "$@"; do [ "$prev" = "--bundle" ] && b="$a"; prev="$a"; done
if [ -n "$b" ]; then
  /usr/bin/python3 -c 'import json, sys
p = sys.argv[1] + "/config.json"; c = json.load(open(p))
` + edit + `
json.dump(c, open(p, "w"))' "$b" || exit 99
fi
exec ` + real + ` "$@"
`
	if err := os.WriteFile(dir+"/runc", []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestRuncProbeBrokenRuncMounts: a runc that leaves the shared root
// filesystem writable, /proc unmasked or mounts /sys (what the host does
// not see in the init's seccomp, credentials or namespaces) must not get
// code to run: the host checks the init's mounts too.
func TestRuncProbeBrokenRuncMounts(t *testing.T) {
	needRunc(t)
	for name, edit := range map[string]string{
		"root writable":    `c["root"]["readonly"] = False`,
		"proc unmasked":    `c["linux"]["maskedPaths"] = []`,
		"proc/sys rw":      `c["linux"]["readonlyPaths"] = []`,
		"sysfs":            `c["mounts"].append({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]})`,
		"tmpfs exec, suid": `[m.__setitem__("options", [o for o in m["options"] if o not in ("noexec", "nosuid", "nodev")]) for m in c["mounts"] if m["destination"] == "/work"]`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Setenv("MOAT_LIBEXEC", brokenRunc(t, edit))
			sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1})
			if err == nil {
				defer sb.Close()
				var res *moat.Result
				res, err = sb.Run(context.Background(), moat.Request{Code: []byte(`import os
print(open('/proc/self/mountinfo').read())`)})
				if err == nil {
					t.Fatalf("a runc with %s ran the code (exit %d): %s", name, res.ExitCode, res.Stdout)
				}
			}
			if !errors.Is(err, moat.ErrUnavailable) {
				t.Fatalf("a runc with %s: %v, want ErrUnavailable", name, err)
			}
			t.Logf("refused: %v", err)
		})
	}
}

// TestRuncProbeBrokenRuncLimits: a runc that does not set the memory,
// memory+swap, pids or CPU limit of the container's cgroups must not get
// code to run: the host reads the limits back before any code runs.
func TestRuncProbeBrokenRuncLimits(t *testing.T) {
	needRunc(t)
	for name, c := range map[string]struct{ edit, why string }{
		"no memory limit": {`c["linux"]["resources"]["memory"] = {}`, "memory.limit_in_bytes"},
		"no swap limit":   {`del c["linux"]["resources"]["memory"]["swap"]`, "memory.memsw.limit_in_bytes"},
		"no pids limit":   {`c["linux"]["resources"]["pids"] = {"limit": 0}`, "pids.max"},
		"no cpu quota":    {`c["linux"]["resources"]["cpu"] = {}`, "cpu.cfs_quota_us"},
		"no rlimits":      {`c["process"]["rlimits"] = []`, "rlimit"},
	} {
		edit := c.edit
		t.Run(name, func(t *testing.T) {
			t.Setenv("MOAT_LIBEXEC", brokenRunc(t, edit))
			sb, err := moatcontainer.New(moatcontainer.Config{Driver: moatcontainer.DriverRunc, Warm: -1})
			if err == nil {
				defer sb.Close()
				var res *moat.Result
				res, err = sb.Run(context.Background(), moat.Request{Code: []byte(`print(open('/proc/self/limits').read())`)})
				if err == nil {
					t.Fatalf("a runc with %s ran the code (exit %d): %s", name, res.ExitCode, res.Stdout)
				}
			}
			if !errors.Is(err, moat.ErrUnavailable) {
				t.Fatalf("a runc with %s: %v, want ErrUnavailable", name, err)
			}
			t.Logf("refused: %v", err)
			if !strings.Contains(err.Error(), c.why) {
				t.Errorf("the refusal does not name %s: %v", c.why, err)
			}
		})
	}
}

// TestRuncProbeExitCodeForgery: the code's own exit status never decides a
// reason that only host-side evidence may give: exit(137) is not an OOM
// kill, exit(152) (128+SIGXCPU) is not the CPU time limit.
func TestRuncProbeExitCodeForgery(t *testing.T) {
	needRunc(t)
	sb := runcFactory(t, moat.Limits{})
	defer sb.Close()
	for _, code := range []int{137, 152, 153} {
		res, err := sb.Run(context.Background(), moat.Request{Code: []byte(fmt.Sprintf("import os\nos._exit(%d)", code))})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("exit(%d): reason %q signal %q exit %d", code, res.Reason, res.Signal, res.ExitCode)
		switch res.Reason {
		case moat.ReasonMemory, moat.ReasonTimeout, moat.ReasonFileSize, moat.ReasonPids, moat.ReasonDisk:
			t.Errorf("exit(%d) is reported as the %s limit, which the host did not see", code, res.Reason)
		}
	}
}

// TestRuncProbeRealXCPU is the control of TestRuncProbeExitCodeForgery: a
// process that the kernel kills with SIGXCPU at its CPU rlimit (one busy
// process, the rlimit's 1 s under the tree's 1.5 s) is still reported as
// the CPU time limit.
func TestRuncProbeRealXCPU(t *testing.T) {
	needRunc(t)
	sb := runcFactory(t, moat.Limits{CPUTime: moat.Duration(1500 * time.Millisecond), WallTime: moat.Duration(20 * time.Second)})
	defer sb.Close()
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("while True: pass")})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("reason %q signal %q exit %d", res.Reason, res.Signal, res.ExitCode)
	if res.Reason != moat.ReasonTimeout {
		t.Errorf("a busy loop past its CPU rlimit: reason %q, want timeout", res.Reason)
	}
}
