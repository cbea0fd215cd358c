//go:build linux && (amd64 || arm64)

package seccomp

import (
	"encoding/json"
	"fmt"
	"os"
	"syscall"
	"testing"
)

const python = "/usr/bin/python3"

// pythonScript does what ordinary Python code does (fork, threads,
// subprocess, posix_spawn, unix sockets) and reports, as JSON, how each
// went and what socket(AF_INET) and socket(AF_INET6) returned.
const pythonScript = `
import json, os, socket, subprocess, threading

r = {}
with open("/proc/self/status") as f:
    for line in f:
        if line.startswith(("Seccomp:", "NoNewPrivs:")):
            k, v = line.split(":")
            r[k] = int(v)

pid = os.fork()
if pid == 0:
    os._exit(7)
r["fork"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

out = []
ts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]
for t in ts:
    t.start()
for t in ts:
    t.join()
r["threads"] = sorted(out)

r["subprocess"] = subprocess.run(["/bin/true"]).returncode
r["subprocess_output"] = subprocess.run(["/bin/echo", "hi"], capture_output=True).stdout.decode()
pid = os.posix_spawn("/bin/true", ["true"], {})
r["posix_spawn"] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def sock(family):
    try:
        socket.socket(family, socket.SOCK_STREAM).close()
        return 0
    except OSError as e:
        return e.errno

r["inet"] = sock(socket.AF_INET)
r["inet6"] = sock(socket.AF_INET6)
r["unix"] = sock(socket.AF_UNIX)
a, b = socket.socketpair()
a.sendall(b"x")
r["socketpair"] = b.recv(1).decode()
print(json.dumps(r))
`

// pythonMain replaces the child with python3, as the real helper does.
func pythonMain() int {
	err := syscall.Exec(python, []string{"python3", "-I", "-c", pythonScript}, []string{"PATH=/usr/bin:/bin"})
	fmt.Fprintln(os.Stderr, "exec:", err)
	return 2
}

type pythonReport struct {
	Seccomp          int    `json:"Seccomp"`
	NoNewPrivs       int    `json:"NoNewPrivs"`
	Fork             int    `json:"fork"`
	Threads          []int  `json:"threads"`
	Subprocess       int    `json:"subprocess"`
	SubprocessOutput string `json:"subprocess_output"`
	PosixSpawn       int    `json:"posix_spawn"`
	Inet             int    `json:"inet"`
	Inet6            int    `json:"inet6"`
	Unix             int    `json:"unix"`
	Socketpair       string `json:"socketpair"`
}

func runPython(t *testing.T, mode string) pythonReport {
	t.Helper()
	out, state := runChild(t, mode)
	if !state.Success() {
		t.Fatalf("child %s: %v; stdout %q", mode, state, out)
	}
	var rep pythonReport
	if err := json.Unmarshal(out, &rep); err != nil {
		t.Fatalf("child %s printed %q: %v", mode, out, err)
	}
	return rep
}

// checkOrdinary checks that everyday Python worked.
func checkOrdinary(t *testing.T, rep pythonReport) {
	t.Helper()
	if rep.Fork != 7 {
		t.Errorf("os.fork child exit code %d, want 7", rep.Fork)
	}
	if fmt.Sprint(rep.Threads) != "[0 1 2 3]" {
		t.Errorf("threads ran %v, want [0 1 2 3]", rep.Threads)
	}
	if rep.Subprocess != 0 || rep.SubprocessOutput != "hi\n" {
		t.Errorf("subprocess.run: code %d, output %q; want 0, \"hi\\n\"", rep.Subprocess, rep.SubprocessOutput)
	}
	if rep.PosixSpawn != 0 {
		t.Errorf("posix_spawn exit code %d, want 0", rep.PosixSpawn)
	}
	if rep.Socketpair != "x" {
		t.Errorf("AF_UNIX socketpair read %q, want \"x\"", rep.Socketpair)
	}
}

// TestPythonUnderFilter installs the filter and execs python3: ordinary
// Python must work, and IPv4 and IPv6 sockets must fail with EAFNOSUPPORT.
func TestPythonUnderFilter(t *testing.T) {
	t.Parallel()
	rep := runPython(t, "python")
	if rep.Seccomp != 2 || rep.NoNewPrivs != 1 {
		t.Errorf("python3 runs with Seccomp %d, NoNewPrivs %d; want 2, 1", rep.Seccomp, rep.NoNewPrivs)
	}
	checkOrdinary(t, rep)
	if syscall.Errno(rep.Unix) != syscall.EPERM {
		t.Errorf("socket(AF_UNIX) errno %d, want EPERM (%d): a unix socket reaches the host's socket files", rep.Unix, syscall.EPERM)
	}
	if syscall.Errno(rep.Inet) != syscall.EAFNOSUPPORT || syscall.Errno(rep.Inet6) != syscall.EAFNOSUPPORT {
		t.Errorf("socket(AF_INET) errno %d, socket(AF_INET6) errno %d; want EAFNOSUPPORT (%d)", rep.Inet, rep.Inet6, syscall.EAFNOSUPPORT)
	}
}

// TestPythonPlain is the positive control for TestPythonUnderFilter.
func TestPythonPlain(t *testing.T) {
	t.Parallel()
	rep := runPython(t, "python-plain")
	if rep.Seccomp != 0 {
		t.Errorf("python3 runs with Seccomp %d, want 0", rep.Seccomp)
	}
	checkOrdinary(t, rep)
	if rep.Unix != 0 || rep.Inet != 0 || rep.Inet6 != 0 {
		t.Errorf("without the filter socket(AF_UNIX) errno %d, socket(AF_INET) errno %d, socket(AF_INET6) errno %d; want 0", rep.Unix, rep.Inet, rep.Inet6)
	}
}
