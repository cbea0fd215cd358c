package container

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPidsV2Children: on cgroup v2 a cgroup.procs lists only its own
// cgroup's processes, and a session's live interpreter, with everything the
// code forks in it, lives in a child cgroup of the container's
// (interpFreezer). The kill at a run's end and a run's Kill list the
// container's processes with pids: it must list the child's too, or the
// interpreter and the code's children outlive every kill (a run past its
// wall time keeps running) on a v2 host.
func TestPidsV2Children(t *testing.T) {
	dir := t.TempDir()
	interp := filepath.Join(dir, interpFreezer)
	deeper := filepath.Join(interp, "x")
	for _, d := range []string{interp, deeper} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for d, procs := range map[string]string{dir: "1\n", interp: "10\n11\n", deeper: "12\n"} {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(procs), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	c := cgroupFiles{v2: true, procs: filepath.Join(dir, "cgroup.procs"), freezer: dir}
	pids, err := c.pids()
	slices.Sort(pids)
	if err != nil || !slices.Equal(pids, []int{1, 10, 11, 12}) {
		t.Errorf("v2 pids %v, %v: want the container's and its child cgroups' [1 10 11 12]", pids, err)
	}
	// On v1 procs is the pids hierarchy's, which holds every process of
	// the container; only it is read.
	c.v2 = false
	if pids, err := c.pids(); err != nil || !slices.Equal(pids, []int{1}) {
		t.Errorf("v1 pids %v, %v: want [1]", pids, err)
	}
}

// TestKillFailureBreaksSession: when the kill at a run's end fails (the
// freezer cannot be written, or processes survive their SIGKILL), what the
// run left may still be there; the engine does not break a session on a
// Wait error, so the session must refuse every later run itself, or those
// processes would run again with the next one.
func TestKillFailureBreaksSession(t *testing.T) {
	fd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	dir := t.TempDir()
	s := &session{initFd: fd, initPid: 1, cg: cgroupFiles{v2: true, procs: filepath.Join(dir, "cgroup.procs"), freezer: filepath.Join(dir, "gone")}}
	if err := s.killAllButInit(); err == nil {
		t.Fatal("a kill without a freezer succeeded")
	}
	if err := s.enter(context.Background(), true); err == nil {
		t.Error("a run entered a session whose last kill failed")
	}
	if err := s.enter(context.Background(), false); err == nil {
		t.Error("a file operation entered a session whose last kill failed")
	}
}
