package subprocess_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// TestNoInheritedFD checks that a file descriptor moat itself inherited
// without close-on-exec (from a careless parent, a socket activator) does
// not reach the code, for one-shot runs and a session's live interpreter.
func TestNoInheritedFD(t *testing.T) {
	requireRoot(t)
	fd, err := syscall.Open("/etc/hostname", syscall.O_RDONLY, 0) // no O_CLOEXEC
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	code := fmt.Sprintf("import os\ntry:\n    os.fstat(%d)\n    print('open')\nexcept OSError:\n    print('closed')\n", fd)

	// Positive control: a plain child of this process does inherit it.
	pid, err := syscall.ForkExec("/bin/sh", []string{"sh", "-c", fmt.Sprintf("test -e /proc/self/fd/%d", fd)}, &syscall.ProcAttr{Files: []uintptr{0, 1, 2}})
	if err != nil {
		t.Fatal(err)
	}
	var ws syscall.WaitStatus
	syscall.Wait4(pid, &ws, 0, nil)
	if !ws.Exited() || ws.ExitStatus() != 0 {
		t.Fatalf("positive control: a plain child does not see fd %d (status %v)", fd, ws)
	}

	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if got := strings.TrimSpace(string(run(t, sb, code).Stdout)); got != "closed" {
		t.Errorf("one-shot run: inherited fd %d is %s", fd, got)
	}
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	if got := out(srun(t, ss, code)); got != "closed" {
		t.Errorf("session interpreter: inherited fd %d is %s", fd, got)
	}
}

// sysvShmCode creates a System V shared memory segment under key and prints
// its id.
const sysvShmCode = `import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print(libc.shmget(%d, 4096, 0o1666))
`

// TestSysVIPCDiesWithTheRun checks that System V IPC objects the code makes
// (which outlive their processes and are shared by uid, not by run) are
// gone with the run, and never in the host's IPC namespace.
func TestSysVIPCDiesWithTheRun(t *testing.T) {
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	key := 0x6d6f0000 + os.Getpid()%0xffff
	res := run(t, sb, fmt.Sprintf(sysvShmCode, key))
	if id := strings.TrimSpace(string(res.Stdout)); id == "-1" || id == "" {
		t.Fatalf("positive control: shmget in the sandbox failed: %q %s", res.Stdout, res.Stderr)
	}
	if hostHasShmKey(t, key) {
		t.Errorf("a System V segment of key %#x made by a run is in the host's IPC namespace", key)
	}
}

// hostHasShmKey reports whether this IPC namespace has a segment of key.
func hostHasShmKey(t *testing.T, key int) bool {
	t.Helper()
	data, err := os.ReadFile("/proc/sysvipc/shm")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n")[1:] {
		f := strings.Fields(line)
		if len(f) > 0 && f[0] == fmt.Sprint(key) {
			id := 0
			fmt.Sscan(f[1], &id)
			// Remove it, so that a failure does not leak it past the test.
			syscall.Syscall(syscall.SYS_SHMCTL, uintptr(id), 0 /* IPC_RMID */, 0)
			return true
		}
	}
	return false
}

// TestFilesGoneWhenRunReturns: the files a run wrote are gone from the
// host's tree when Run returns, however late the rest of the teardown
// (the helper's exit, the cgroup's removal) finishes. CI once found a
// run's file still in /run/moat/runs when the removal was all after the
// result.
func TestFilesGoneWhenRunReturns(t *testing.T) {
	requireRoot(t)
	for _, h := range []subprocess.Hardening{subprocess.HardeningStrict, subprocess.HardeningTutorial} {
		t.Run(string(h), func(t *testing.T) {
			sb, err := subprocess.New(subprocess.Config{Limits: moat.Limits{}.WithDefaults(), Hardening: h})
			if err != nil {
				t.Fatal(err)
			}
			release := subprocess.HoldTeardown()
			defer func() {
				release()
				if err := sb.Close(); err != nil {
					t.Errorf("Close: %v", err)
				}
			}()
			res := run(t, sb, "import os; open('moatgone', 'w').write('x'); print(os.path.join(os.getcwd(), 'moatgone'))")
			path := strings.TrimSpace(string(res.Stdout))
			if res.ExitCode != 0 || !filepath.IsAbs(path) {
				t.Fatalf("the run did not write its file: exit %d, stdout %q, stderr %q", res.ExitCode, res.Stdout, res.Stderr)
			}
			if _, err := os.Lstat(path); err == nil {
				t.Errorf("%s, which the run wrote, is still on the host after Run returned", path)
			}
		})
	}
}
