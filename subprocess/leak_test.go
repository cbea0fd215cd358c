package subprocess_test

import (
	"context"
	"fmt"
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
