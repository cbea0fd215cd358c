package container

import (
	"fmt"
	"os"
	"slices"
	"strings"
)

// runcMount is one mount of a container's init, as its mountinfo shows
// it: the topmost mount at each mount point.
type runcMount struct {
	fstype string
	opts   []string // the per-mount options (ro, nosuid, nodev, noexec...)
}

// initMounts reads the mounts of process pid, by mount point, relative to
// its root; a later mount at the same point hides an earlier one.
func initMounts(pid int) (map[string]runcMount, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, fmt.Errorf("container: the run's init's mounts: %w", err)
	}
	ms := map[string]runcMount{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		sep := slices.Index(f, "-")
		if len(f) < 6 || sep < 6 || sep+1 >= len(f) {
			return nil, fmt.Errorf("container: the run's init's mountinfo line %q", line)
		}
		ms[f[4]] = runcMount{fstype: f[sep+1], opts: strings.Split(f[5], ",")}
	}
	return ms, nil
}

// checkMounts checks from the host that the init of a container has the
// mounts of runcSpec and no other: the shared root filesystem read-only;
// /proc, the run's tmpfs mounts nosuid, nodev and noexec; each read-only
// path of /proc read-only and each masked path that the host's /proc has
// hidden by a mount; runc's /dev and its devpts; nothing else (no /sys, no
// cgroup fs, no host path). A runc that ignores part of the spec (its
// seccomp, credentials and namespaces are checked apart) fails the
// preparation, before any code runs.
func (s *spec) checkMounts(pid int) error {
	ms, err := initMounts(pid)
	if err != nil {
		return err
	}
	has := func(m runcMount, opts ...string) bool {
		for _, o := range opts {
			if !slices.Contains(m.opts, o) {
				return false
			}
		}
		return true
	}
	want := map[string]func(m runcMount) bool{
		"/":        func(m runcMount) bool { return has(m, "ro") },
		"/proc":    func(m runcMount) bool { return m.fstype == "proc" && has(m, "nosuid", "nodev", "noexec") },
		"/dev":     func(m runcMount) bool { return m.fstype == "tmpfs" && has(m, "nosuid") },
		"/dev/pts": func(m runcMount) bool { return m.fstype == "devpts" && has(m, "nosuid", "noexec") },
	}
	for _, t := range s.mounts {
		want[t.path] = func(m runcMount) bool { return m.fstype == "tmpfs" && has(m, "nosuid", "nodev", "noexec") }
	}
	for _, p := range readonlyPaths {
		if _, err := os.Lstat(p); err == nil {
			want[p] = func(m runcMount) bool { return m.fstype == "proc" && has(m, "ro") }
		}
	}
	masked := func(m runcMount) bool {
		// runc hides a file with its /dev/null, a directory with an
		// empty read-only tmpfs.
		return m.fstype == "tmpfs" && (has(m, "ro") || has(m, "nosuid"))
	}
	for _, p := range maskedPaths {
		if !strings.HasPrefix(p, "/proc/") {
			continue // under /sys, which a container does not have
		}
		if _, err := os.Lstat(p); err == nil {
			want[p] = masked
		}
	}
	for p, ok := range want {
		m, there := ms[p]
		if !there {
			return fmt.Errorf("container: the run's init has no mount at %s", p)
		}
		if !ok(m) {
			return fmt.Errorf("container: the run's init has %s mounted %s %s", p, m.fstype, strings.Join(m.opts, ","))
		}
	}
	for p, m := range ms {
		if _, ok := want[p]; !ok {
			return fmt.Errorf("container: the run's init has a mount moat did not ask for: %s (%s %s)", p, m.fstype, strings.Join(m.opts, ","))
		}
	}
	return nil
}
