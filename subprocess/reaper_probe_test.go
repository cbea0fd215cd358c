package subprocess_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
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
