package container

import (
	"os"
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// TestIPCClearKeepsThreads checks that ipcClear does not end the thread
// it borrows: a thread that ends kills the children started from it with a
// parent death signal (runc's unshare is one), which under load killed
// fresh containers of the runc driver while a recycled one was reset.
func TestIPCClearKeepsThreads(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root (setns)")
	}
	// The container: a process in an IPC namespace of its own.
	target := exec.Command("unshare", "--ipc", "sleep", "60")
	if err := target.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { target.Process.Kill(); target.Wait() }()
	time.Sleep(100 * time.Millisecond)
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	// Children with a parent death signal, each started from a thread of
	// its own, as exec.Cmd.Start does from whatever thread runs it.
	var kids []*exec.Cmd
	for range 8 {
		done := make(chan *exec.Cmd)
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			c := exec.Command("sleep", "60")
			c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			if err := c.Start(); err != nil {
				t.Error(err)
			}
			done <- c
		}()
		kids = append(kids, <-done)
	}
	defer func() {
		for _, c := range kids {
			c.Process.Kill()
			c.Wait()
		}
	}()
	dir := t.TempDir()
	for range 100 {
		if err := ipcClear(target.Process.Pid, dir); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(50 * time.Millisecond)
	for i, c := range kids {
		if err := c.Process.Signal(syscall.Signal(0)); err != nil {
			t.Fatalf("child %d, started with a parent death signal, died while ipcClear ran: %v", i, err)
		}
		var ws syscall.WaitStatus
		if pid, _ := syscall.Wait4(c.Process.Pid, &ws, syscall.WNOHANG, nil); pid != 0 {
			t.Fatalf("child %d, started with a parent death signal, died while ipcClear ran: %v", i, ws)
		}
	}
}
