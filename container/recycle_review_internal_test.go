package container

import (
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestReviewIPCClearThreadExit: ipcClear locks an OS thread and lets it
// die; every child that thread forked with Pdeathsig (as startWith starts
// each runc container's unshare) then gets SIGKILL. Children started from
// the engine's goroutines, as containers are, must outlive any number of
// ipcClear calls made from other goroutines, as resets make them.
func TestReviewIPCClearThreadExit(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("ipcClear needs root")
	}
	// A throwaway IPC namespace to clear: never the host's.
	ns := exec.Command("unshare", "--ipc", "sleep", "60")
	if err := ns.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { ns.Process.Kill(); ns.Wait() }()
	time.Sleep(100 * time.Millisecond)
	var mu sync.Mutex
	var kids []*exec.Cmd
	var wg sync.WaitGroup
	start := func() {
		c := exec.Command("sleep", "60")
		c.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		if err := c.Start(); err != nil {
			t.Error(err)
			return
		}
		mu.Lock()
		kids = append(kids, c)
		mu.Unlock()
	}
	round := func(clear bool) (dead, n int) {
		kids = nil
		for range 20 {
			// Children started as a pool and the recycler start containers:
			// from goroutines on whatever thread they run.
			for range 4 {
				wg.Go(start)
			}
			wg.Wait()
			// A reset: from a goroutine of its own, as the recycler's after.
			if clear {
				wg.Go(func() {
					if err := ipcClear(ns.Process.Pid, t.TempDir()); err != nil {
						t.Errorf("ipcClear: %v", err)
					}
				})
				wg.Wait()
			}
		}
		time.Sleep(50 * time.Millisecond)
		for _, c := range kids {
			var ws syscall.WaitStatus
			if p, _ := syscall.Wait4(c.Process.Pid, &ws, syscall.WNOHANG, nil); p == c.Process.Pid && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
				dead++
			}
			c.Process.Kill()
			c.Wait()
		}
		return dead, len(kids)
	}
	// The control: without ipcClear, none dies.
	if dead, n := round(false); dead != 0 {
		t.Fatalf("control: %d of %d children died with no ipcClear", dead, n)
	}
	dead, n := round(true)
	if dead > 0 {
		t.Fatalf("%d of %d children started with Pdeathsig were killed by 20 ipcClear calls (their forking thread died with ipcClear's goroutine)", dead, n)
	}
}
