package subprocess_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// prestarted finds the python3 processes waiting in a bootstrap of the
// uid range [first, first+count): pid to its /proc status.
func prestarted(first, count int) map[int]string {
	out := map[int]string{}
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if !bytes.Contains(cmdline, []byte("_moat_main")) {
			continue
		}
		status, err := os.ReadFile(filepath.Join("/proc", e.Name(), "status"))
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(status), "\n") {
			if f := strings.Fields(line); len(f) >= 2 && f[0] == "Uid:" {
				if uid, _ := strconv.Atoi(f[1]); uid >= first && uid < first+count {
					out[pid] = string(status)
				}
			}
		}
	}
	return out
}

func statusField(status, name string) string {
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// TestPrestartedInterpreter: a prepared instance holds a python3 that has
// started, before any code is known, under the run's restrictions (its own
// uid, no_new_privs, seccomp), and that python3 is the one that runs the
// code, once: the run's uid is its uid, and after the run it is gone. A
// second run gets another python3.
func TestPrestartedInterpreter(t *testing.T) {
	requireRoot(t)
	first := 2100000000 + 70000 + int(time.Now().UnixNano()%1000)*8
	sb, err := subprocess.New(subprocess.Config{UIDFirst: first, UIDCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	var waiting map[int]string
	deadline := time.Now().Add(30 * time.Second)
	for len(waiting) != 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		waiting = prestarted(first, 8)
	}
	if len(waiting) != 1 {
		t.Fatalf("want one python3 waiting in the pool, found %d", len(waiting))
	}
	var pid int
	var status string
	for pid, status = range waiting {
	}
	if nnp, sc := statusField(status, "NoNewPrivs"), statusField(status, "Seccomp"); nnp != "1" || sc != "2" {
		t.Errorf("the waiting python3 has NoNewPrivs %q and Seccomp %q, want 1 and 2 (filter)", nnp, sc)
	}
	waitingUID := strings.Fields(statusField(status, "Uid"))[0]
	if st := sb.PoolStats(); st.Ready != 1 {
		t.Fatalf("pool %+v, want one ready", st)
	}
	res := run(t, sb, "import os, sys; print(os.getuid(), sys.argv[0].endswith('.py'), __name__)")
	if got, want := strings.TrimSpace(string(res.Stdout)), waitingUID+" True __main__"; got != want {
		t.Errorf("the run printed %q, want %q (the waiting python3's uid)", got, want)
	}
	if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err == nil {
		t.Errorf("the python3 that ran the code (pid %d) outlived the run", pid)
	}
	if st := sb.PoolStats(); st.Hits != 1 || st.Misses != 0 {
		t.Errorf("pool %+v, want the run to have taken the prepared instance", st)
	}
	// Each run has a python3 of its own: another hash seed.
	seen := map[string]bool{}
	for range 3 {
		r, err := sb.Run(t.Context(), moat.Request{Code: []byte("print(hash('moat'))")})
		if err != nil || r.ExitCode != 0 {
			t.Fatalf("%v %+v", err, r)
		}
		seen[string(r.Stdout)] = true
	}
	if len(seen) < 2 {
		t.Errorf("three runs printed one hash of a string: %v", seen)
	}
}

// TestNothingLeftWhenRunReturns: a run returns once the helper has
// reported, before the helper itself has exited; by then every process
// the code started, a daemon in a session of its own among them, is gone.
func TestNothingLeftWhenRunReturns(t *testing.T) {
	requireRoot(t)
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	code := `import os, subprocess, sys
print(os.getuid(), flush=True)
subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:
    os.setsid()
    os.execvp("sleep", ["sleep", "61"])
`
	for range 3 {
		res := run(t, sb, code)
		uid, err := strconv.Atoi(strings.TrimSpace(string(res.Stdout)))
		if err != nil || res.ExitCode != 0 {
			t.Fatalf("%q %q exit %d", res.Stdout, res.Stderr, res.ExitCode)
		}
		if left := processesOf(uid); len(left) != 0 {
			t.Errorf("processes of the run (uid %d) left as Run returned: %v", uid, left)
		}
	}
}

// TestPoolRefillsAfterTheRun: the pool prepares the instance that replaces
// the one a run took once that run has ended, not while it runs (a
// Prepare, python3's start among it, would take CPU from the run), and
// then it does.
func TestPoolRefillsAfterTheRun(t *testing.T) {
	requireRoot(t)
	first := 2100000000 + 80000 + int(time.Now().UnixNano()%1000)*8
	sb, err := subprocess.New(subprocess.Config{UIDFirst: first, UIDCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	waitFor := func(what string, n int) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for len(prestarted(first, 8)) != n || sb.PoolStats().Ready != 1 {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d python3 in the pool's bootstrap, pool %+v; want %d and one ready", what, len(prestarted(first, 8)), sb.PoolStats(), n)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	waitFor("before the run", 1)
	done := make(chan *moat.Result, 1)
	go func() {
		res, err := sb.Run(t.Context(), moat.Request{Code: []byte("import time; time.sleep(1.5); print('ran')")})
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	// Enough for a refill started with the run to have its python3 up.
	time.Sleep(time.Second)
	if n := len(prestarted(first, 8)); n != 1 {
		t.Errorf("during the run: %d python3 in the bootstrap, want the run's own alone (pool %+v)", n, sb.PoolStats())
	}
	if res := <-done; res == nil || string(res.Stdout) != "ran\n" {
		t.Fatalf("the run: %+v", res)
	}
	waitFor("after the run", 1)
}
