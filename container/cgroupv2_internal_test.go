package container

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
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
