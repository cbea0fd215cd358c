package container

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// runcRlimits maps the names of spec.ulimits to their lines in
// /proc/PID/limits.
var runcRlimits = map[string]string{"nofile": "Max open files", "fsize": "Max file size", "core": "Max core file size", "cpu": "Max cpu time"}

// checkLimits checks from the host that the init of a container, in
// cgroup cgroupsPath (runcSpec's), is in that cgroup in every hierarchy
// that limits it, and that the kernel holds runcSpec's limits there: the
// memory limit, memory plus swap at the same (no swap), the pids limit, the
// CPU quota and period; and that the init has the spec's rlimits. A runc
// that leaves any of them out fails the preparation, before any code runs.
func (s *spec) checkLimits(pid int, cgroupsPath string) error {
	// /proc/PID/limits, not prlimit(2), which needs CAP_SYS_RESOURCE.
	lb, err := os.ReadFile(fmt.Sprintf("/proc/%d/limits", pid))
	if err != nil {
		return fmt.Errorf("container: the run's init's rlimits: %w", err)
	}
	for _, u := range s.ulimits() {
		name, ok := runcRlimits[u.Name]
		if !ok {
			return fmt.Errorf("container: no line of /proc/PID/limits for rlimit %s", u.Name)
		}
		var soft, hard string
		for _, line := range strings.Split(string(lb), "\n") {
			if rest, ok := strings.CutPrefix(line, name+" "); ok {
				if f := strings.Fields(rest); len(f) >= 2 {
					soft, hard = f[0], f[1]
				}
			}
		}
		if soft != strconv.FormatInt(u.Soft, 10) || hard != strconv.FormatInt(u.Hard, 10) {
			return fmt.Errorf("container: the run's init has rlimit %s %q/%q, want %d/%d", u.Name, soft, hard, u.Soft, u.Hard)
		}
	}
	dirs, err := initCgroupDirs(pid)
	if err != nil {
		return err
	}
	l := s.limits
	quota := max(int64(s.cpus*100000), 1000)
	type file struct{ ctl, name, want string }
	var files []file
	if _, v2 := dirs[""]; v2 && len(dirs) == 1 {
		files = []file{
			{"", "memory.max", strconv.FormatInt(int64(l.Memory), 10)},
			{"", "memory.swap.max", "0"},
			{"", "pids.max", strconv.FormatInt(int64(l.Pids), 10)},
			{"", "cpu.max", fmt.Sprintf("%d 100000", quota)},
		}
	} else {
		files = []file{
			{"memory", "memory.limit_in_bytes", strconv.FormatInt(int64(l.Memory), 10)},
			{"memory", "memory.memsw.limit_in_bytes", strconv.FormatInt(int64(l.Memory), 10)},
			{"pids", "pids.max", strconv.FormatInt(int64(l.Pids), 10)},
			{"cpu", "cpu.cfs_quota_us", strconv.FormatInt(quota, 10)},
			{"cpu", "cpu.cfs_period_us", "100000"},
		}
	}
	for _, f := range files {
		d, ok := dirs[f.ctl]
		if !ok {
			return fmt.Errorf("container: the run's init is in no %q cgroup", f.ctl)
		}
		if filepath.Clean(d.rel) != filepath.Clean(cgroupsPath) {
			return fmt.Errorf("container: the run's init is in %s cgroup %s, not %s", f.ctl, d.rel, cgroupsPath)
		}
		b, err := os.ReadFile(filepath.Join(d.abs, f.name))
		if err != nil {
			return fmt.Errorf("container: the run's cgroup limit: %w", err)
		}
		if got := strings.TrimSpace(string(b)); got != f.want {
			return fmt.Errorf("container: the run's cgroup has %s %s, want %s", f.name, got, f.want)
		}
	}
	return nil
}

type cgroupDir struct{ rel, abs string }

// initCgroupDirs returns, by controller ("" for the unified hierarchy),
// the cgroup of process pid: its path as /proc/PID/cgroup gives it (from
// moat's cgroup namespace) and its directory.
func initCgroupDirs(pid int) (map[string]cgroupDir, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return nil, fmt.Errorf("container: the run's cgroups: %w", err)
	}
	mounts, err := cgroupMounts()
	if err != nil {
		return nil, err
	}
	dirs := map[string]cgroupDir{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		ctls := strings.Split(parts[1], ",")
		if parts[0] == "0" && parts[1] == "" {
			ctls = []string{""}
		}
		for _, c := range ctls {
			if m, ok := mounts[c]; ok {
				dirs[c] = cgroupDir{parts[2], filepath.Join(m, parts[2])}
			}
		}
	}
	return dirs, nil
}
