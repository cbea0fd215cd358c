package subprocess_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// Probes from a hostile review of the reaper (reaper.go) and of what a run
// can make of the files it writes. Each probe that can get through on the
// host runs there first, or it proves nothing.

// memfdProbe copies a binary of the host into a memfd, a file the code
// writes that lies on no mount moat made noexec, and runs it two ways: by
// exec (execveat through the descriptor) and through the dynamic loader,
// which maps it executable without exec. Each way that ran prints its
// marker, built at run time from TOKEN so that echoed source cannot fake it.
const memfdProbe = `
import os
def ran(how, argv):
    try:
        fd = os.memfd_create("dropped", 0)
    except OSError as e:
        print(how, "memfd_create refused", e.errno)
        return
    os.write(fd, open("/bin/echo", "rb").read())
    pid = os.fork()
    if pid == 0:
        try:
            argv(fd)
        finally:
            os._exit(99)
    os.waitpid(pid, 0)
ld = "/lib64/ld-linux-x86-64.so.2"
ran("exec", lambda fd: os.execve(fd, ["echo", "RAN-" + "exec-" + TOKEN], {}))
ran("loader", lambda fd: os.execve(ld, [ld, "/proc/self/fd/%d" % fd, "RAN-" + "loader-" + TOKEN], {}))
print("done")
`

// TestProbeMemfdBinaryCannotRun: the README says a run cannot turn the
// files it writes into code (its working directory is noexec). A memfd is
// such a file, and neither exec nor the loader may run one.
func TestProbeMemfdBinaryCannotRun(t *testing.T) {
	requireRoot(t)
	token := randomName(t)
	code := "TOKEN = " + strconv.Quote(token) + "\n" + memfdProbe
	host := onHost(t, code)
	for _, how := range []string{"exec", "loader"} {
		if !strings.Contains(host, "RAN-"+how+"-"+token) {
			t.Fatalf("on the host the probe did not run the memfd by %s (%q): it is broken", how, host)
		}
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	if !strings.Contains(string(res.Stdout), "done") {
		t.Fatalf("the probe did not run to its end: %q %q", res.Stdout, res.Stderr)
	}
	for _, how := range []string{"exec", "loader"} {
		if strings.Contains(string(res.Stdout), "RAN-"+how+"-"+token) {
			t.Errorf("a run ran a binary it wrote into a memfd by %s (stdout %q)", how, res.Stdout)
		}
	}
}

// reachProbe tries every way the code has at PID 1 of its namespace, the
// reaper, which reports the run's end: its status pipe (fd 3) opened by
// path, its executable and memory, and signals. Whatever gets through
// prints "REACHED"; the code then exits with 7, which must be the result.
const reachProbe = `
import os, signal
for path, flags in (("/proc/1/fd/3", os.O_WRONLY), ("/proc/1/exe", os.O_RDONLY), ("/proc/1/mem", os.O_RDWR), ("/proc/1/environ", os.O_RDONLY)):
    try:
        fd = os.open(path, flags)
    except OSError as e:
        continue
    print("REACHED", path)
    if path.endswith("/3"):
        os.write(fd, b"moatend\n" + bytes(152))
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGSTOP, signal.SIGKILL, signal.SIGCHLD):
    try:
        os.kill(1, sig)
        print("REACHED kill", int(sig))
    except OSError:
        pass
print("done", flush=True)
os._exit(7)
`

// TestProbeReaperOutOfReach: the code (the run's uid, in the run's PID
// namespace) can neither write the reaper's report, read its executable or
// memory, nor signal it, and the result is the code's own exit status.
func TestProbeReaperOutOfReach(t *testing.T) {
	requireRoot(t)
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	for i := 0; i < 2; i++ { // the second run takes a pooled instance
		res := run(t, sb, reachProbe)
		out := string(res.Stdout)
		if !strings.Contains(out, "done") {
			t.Fatalf("run %d: the probe did not run to its end: %q %q %+v", i, out, res.Stderr, *res)
		}
		if strings.Contains(out, "REACHED") {
			t.Errorf("run %d: the code reached PID 1: %q", i, out)
		}
		if res.ExitCode != 7 {
			t.Errorf("run %d: exit code %d, want the code's 7 (reason %q, stderr %q)", i, res.ExitCode, res.Reason, res.Stderr)
		}
	}
}

// forgeProbe, under hardening=tutorial, where python3 runs under the
// helper's own uid: it opens the status pipe of its parent, the reaper, by
// path (the host's /proc, where its pid is the parent's), writes a report
// of exit 0 there, and loops until the CPU limit kills it; then it tries to
// ptrace the reaper (pid 1 in its namespace).
const forgeProbe = `
import ctypes, os, struct, sys
pp = [l.split()[1] for l in open("/proc/self/status") if l.startswith("PPid")][0]
libc = ctypes.CDLL(None, use_errno=True)
if MODE == "ptrace":
    print("ptrace", libc.ptrace(16, 1, 0, 0), flush=True)
    sys.exit(0)
try:
    fd = os.open("/proc/%s/fd/3" % pp, os.O_WRONLY)
except OSError as e:
    print("denied", e.errno, flush=True)
    sys.exit(3)
os.write(fd, b"moatend\n" + bytes(152))
while True:
    pass
`

// TestProbeTutorialReportNotForged: under hardening=tutorial moat is not
// root and the code runs under moat's own uid, the helper's and the
// reaper's. Neither their status pipe nor ptrace may be open to it: a
// run the CPU limit killed must not end as the code's forged exit 0, and
// a ptrace of the reaper must fail. The test runs its own binary as nobody.
func TestProbeTutorialReportNotForged(t *testing.T) {
	if os.Getenv("MOAT_TUTORIAL_PROBE") != "" {
		sb, err := subprocess.New(subprocess.Config{Hardening: subprocess.HardeningTutorial, Limits: moat.Limits{CPUTime: moat.Duration(time.Second), WallTime: moat.Duration(5 * time.Second)}})
		if err != nil {
			t.Fatal(err)
		}
		defer sb.Close()
		for _, arg := range []string{"forge", "ptrace"} {
			res, err := sb.Run(context.Background(), moat.Request{Code: []byte("MODE = " + strconv.Quote(arg) + "\n" + forgeProbe)})
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("RESULT %s exit=%d reason=%s stdout=%q\n", arg, res.ExitCode, res.Reason, res.Stdout)
		}
		return
	}
	requireRoot(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "moat-tutorial-probe-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	os.Chmod(dir, 0o755)
	bin := filepath.Join(dir, "subprocess.test")
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, b, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-test.run=^TestProbeTutorialReportNotForged$", "-test.count=1")
	cmd.Env = []string{"MOAT_TUTORIAL_PROBE=1", "HOME=/nonexistent", "PATH=/usr/bin:/bin"}
	cmd.Dir = "/"
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the tutorial run as nobody failed: %v: %s", err, out)
	}
	got := string(out)
	t.Log(got)
	if !strings.Contains(got, "RESULT forge ") || !strings.Contains(got, "RESULT ptrace ") {
		t.Fatalf("the tutorial probe did not report: %s", got)
	}
	if strings.Contains(got, "RESULT forge exit=0 ") {
		t.Errorf("the code wrote the reaper's report: a run it made loop ended as exit 0: %s", got)
	}
	if strings.Contains(got, `ptrace 0\n`) {
		t.Errorf("the code ptrace-attached the reaper: %s", got)
	}
}
