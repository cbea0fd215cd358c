package attack

import (
	"bytes"
	"os"
	"strconv"
	"syscall"
	"time"
)

// The programs name every process they create with the run's tag (through
// /proc/self/comm). After a run, the harness looks on the host for
// processes with that name: the sandbox promised that nothing of the run
// is left when Run returns. The check sees only processes that share the
// host's kernel (not those inside gVisor or a VM), and only when the program
// could write its name.

// settleTime is how long a process of the run may take to finish dying
// after Run returns before it counts as left running. It covers a process
// killed but not yet through its exit, not one the sandbox forgot.
const settleTime = time.Second

// reapLeftovers returns how many processes named tag were still alive after
// settleTime, and kills them.
func reapLeftovers(tag string) int {
	if tag == "" {
		return 0
	}
	deadline := time.Now().Add(settleTime)
	for {
		pids := findTagged(tag)
		if len(pids) == 0 {
			return 0
		}
		if time.Now().After(deadline) {
			for _, pid := range pids {
				syscall.Kill(pid, syscall.SIGKILL)
			}
			return len(pids)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// findTagged returns the live (not zombie) processes whose name is tag.
func findTagged(tag string) []int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, ent := range ents {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		comm, err := os.ReadFile("/proc/" + ent.Name() + "/comm")
		if err != nil || string(bytes.TrimSuffix(comm, []byte("\n"))) != tag {
			continue
		}
		if stat, err := os.ReadFile("/proc/" + ent.Name() + "/stat"); err == nil {
			// pid (comm) S ...: the state follows the last ')'.
			if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
				if s := stat[i+2]; s == 'Z' || s == 'X' {
					continue
				}
			}
		}
		pids = append(pids, pid)
	}
	return pids
}
