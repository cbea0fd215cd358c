package container

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/seccomp"
)

// TestRuncSpec checks the OCI spec of a run of the runc driver against
// every protection of the Docker path: nothing of it may be missing.
func TestRuncSpec(t *testing.T) {
	cfg, err := Config{Limits: moat.Limits{Memory: 96 * moat.MiB, Pids: 40, Disk: 32 * moat.MiB, OpenFiles: 77, FileSize: 3 * moat.MiB}, CPUs: 0.5}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	prof, err := newProfile(false)
	if err != nil {
		t.Skip(err) // an architecture without moat's profile
	}
	sc, err := ociSeccompOf(prof)
	if err != nil {
		t.Fatal(err)
	}
	s := newSpec(cfg, "", nil, prof, "").runcSpec("/rootfs", "/moat-runc/x", 2100065600, sc)
	p := s.Process
	if p.User.UID != 2100065600 || p.User.GID != 2100065600 || p.User.AdditionalGids == nil || len(p.User.AdditionalGids) != 0 {
		t.Errorf("user %+v, want the leased uid:gid and no supplementary group", p.User)
	}
	c := p.Capabilities
	for _, set := range [][]string{c.Bounding, c.Effective, c.Inheritable, c.Permitted, c.Ambient} {
		if set == nil || len(set) != 0 {
			t.Errorf("capabilities %+v, want every set explicitly empty", c)
		}
	}
	if !p.NoNewPrivileges || p.OOMScoreAdj != 1000 || p.Terminal {
		t.Errorf("process %+v", p)
	}
	if !slices.Equal(p.Env, []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/work", "LANG=C.UTF-8"}) {
		t.Errorf("env %q", p.Env)
	}
	rl := map[string][2]uint64{}
	for _, r := range p.Rlimits {
		rl[r.Type] = [2]uint64{r.Soft, r.Hard}
	}
	for k, v := range map[string][2]uint64{"RLIMIT_NOFILE": {77, 77}, "RLIMIT_FSIZE": {3 << 20, 3 << 20}, "RLIMIT_CORE": {0, 0}, "RLIMIT_CPU": {10, 11}} {
		if rl[k] != v {
			t.Errorf("%s %v, want %v", k, rl[k], v)
		}
	}
	if !s.Root.Readonly || s.Root.Path != "/rootfs" {
		t.Errorf("root %+v", s.Root)
	}
	var ns []string
	for _, n := range s.Linux.Namespaces {
		ns = append(ns, n.Type)
	}
	slices.Sort(ns)
	if !slices.Equal(ns, []string{"cgroup", "ipc", "mount", "network", "pid", "uts"}) {
		t.Errorf("namespaces %v", ns)
	}
	r := s.Linux.Resources
	if r.Memory.Limit != 96<<20 || r.Memory.Swap != r.Memory.Limit || r.Pids.Limit != 40 || r.CPU.Quota != 50000 || r.CPU.Period != 100000 {
		t.Errorf("resources %+v", r)
	}
	if len(r.Devices) != 1 || r.Devices[0].Allow || r.Devices[0].Access != "rwm" {
		t.Errorf("devices %+v, want all denied (runc adds its defaults)", r.Devices)
	}
	for _, m := range []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware", "/proc/scsi", "/proc/acpi"} {
		if !slices.Contains(s.Linux.MaskedPaths, m) {
			t.Errorf("%s is not masked", m)
		}
	}
	for _, m := range []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"} {
		if !slices.Contains(s.Linux.ReadonlyPaths, m) {
			t.Errorf("%s is not read-only", m)
		}
	}
	var disk int64
	for _, m := range s.Mounts {
		if m.Type == "sysfs" || strings.HasPrefix(m.Destination, "/sys") {
			t.Errorf("a /sys mount: %+v", m)
		}
		switch m.Destination {
		case "/work", "/tmp", "/dev/shm":
			o := strings.Join(m.Options, ",")
			for _, want := range []string{"nosuid", "nodev", "noexec", "nr_inodes=", "uid=2100065600", "gid=2100065600"} {
				if !strings.Contains(o, want) {
					t.Errorf("%s lacks %s: %s", m.Destination, want, o)
				}
			}
			var size int64
			for _, f := range m.Options {
				if v, ok := strings.CutPrefix(f, "size="); ok {
					json.Unmarshal([]byte(v), &size)
				}
			}
			disk += size
		}
	}
	if disk == 0 || disk > 32<<20 {
		t.Errorf("the tmpfs sizes add up to %d, want at most the disk limit", disk)
	}
	// The filter is moat's profile, field for field.
	var want seccomp.DockerProfile
	if err := json.Unmarshal([]byte(prof.json), &want); err != nil {
		t.Fatal(err)
	}
	if sc.DefaultAction != want.DefaultAction || *sc.DefaultErrnoRet != *want.DefaultErrnoRet || !slices.Equal(sc.Architectures, want.Architectures) || len(sc.Syscalls) != len(want.Syscalls) {
		t.Fatalf("the OCI filter differs from moat's profile: %+v", sc)
	}
	for i, r := range want.Syscalls {
		g := sc.Syscalls[i]
		if !slices.Equal(g.Names, r.Names) || g.Action != r.Action || (g.ErrnoRet == nil) != (r.ErrnoRet == nil) || len(g.Args) != len(r.Args) {
			t.Errorf("rule %d: %+v, want %+v", i, g, r)
			continue
		}
		for j, a := range r.Args {
			if b := g.Args[j]; b.Index != a.Index || b.Value != a.Value || b.ValueTwo != a.ValueTwo || b.Op != a.Op {
				t.Errorf("rule %d arg %d: %+v, want %+v", i, j, b, a)
			}
		}
	}
}

// TestOCISeccompRejectsUnknownFields: a profile field the OCI form lacks
// fails the conversion instead of being dropped.
func TestOCISeccompRejectsUnknownFields(t *testing.T) {
	if _, err := ociSeccompOf(&profile{json: `{"defaultAction":"SCMP_ACT_ERRNO","architectures":["SCMP_ARCH_X86_64"],"syscalls":[{"names":["read"],"action":"SCMP_ACT_ALLOW","excludes":{"caps":["CAP_SYS_ADMIN"]}}]}`}); err == nil {
		t.Error("a rule with excludes converted")
	}
}
