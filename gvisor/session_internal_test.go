package gvisor

import (
	"fmt"
	"slices"
	"testing"

	"github.com/moatsandbox/moat"
)

// TestSessionSpec checks a session sandbox's spec: the run's hardening,
// an init that is not the code's (root, no capability, nothing to do), and
// nearly all of the disk for the working directory, the sizes still adding
// up to the disk limit.
func TestSessionSpec(t *testing.T) {
	b := &backend{rootfs: "/images/x/rootfs", limits: moat.Limits{Disk: 64 * moat.MiB}.WithDefaults()}
	spec, work := b.sessionSpec(false)
	if work != 0 {
		t.Errorf("a session without an interpreter has a host working directory of %v, want none", work)
	}
	p := spec.Process
	if p.User.UID != 0 || len(p.Capabilities.Bounding)+len(p.Capabilities.Effective)+len(p.Capabilities.Permitted) > 0 || !p.NoNewPrivileges {
		t.Errorf("init user %+v, caps %+v, no_new_privs %v: want root with no capability", p.User, p.Capabilities, p.NoNewPrivileges)
	}
	if spec.Linux.Seccomp == nil || !spec.Root.Readonly {
		t.Error("the session's spec lacks the seccomp filter or the read-only root")
	}
	sizes := map[string]int64{}
	var disk int64
	for _, m := range spec.Mounts {
		for _, o := range m.Options {
			var n int64
			if _, err := fmt.Sscanf(o, "size=%d", &n); err == nil {
				sizes[m.Destination] = n
				disk += n
			}
		}
	}
	if l := int64(b.limits.Disk); disk > l || disk < l-3*4096 || sizes["/work"] < l*9/10 {
		t.Errorf("tmpfs sizes %v (total %d): want them to add up to the disk %d, /work 90%% of it", sizes, disk, l)
	}
}

// TestSessionSpecInterpreter: with a live interpreter the working
// directory is no tmpfs of the sandbox but the host's, given the same share
// of the disk.
func TestSessionSpecInterpreter(t *testing.T) {
	b := &backend{rootfs: "/images/x/rootfs", limits: moat.Limits{Disk: 64 * moat.MiB}.WithDefaults()}
	spec, work := b.sessionSpec(true)
	plain, _ := b.sessionSpec(false)
	for _, m := range spec.Mounts {
		if m.Destination == "/work" {
			t.Errorf("the spec mounts %+v at /work; want it left to boot", m)
		}
	}
	var want int64
	for _, m := range plain.Mounts {
		if m.Destination == "/work" {
			fmt.Sscanf(m.Options[2], "size=%d", &want)
		}
	}
	if int64(work) != want || want == 0 {
		t.Errorf("the host working directory gets %d bytes, want %d (the tmpfs's share without an interpreter)", work, want)
	}
	if m := hostWorkMount("/b/work"); m.Type != "bind" || m.Source != "/b/work" || !slices.Contains(m.Options, "nosuid") || !slices.Contains(m.Options, "nodev") || !slices.Contains(m.Options, "noexec") {
		t.Errorf("host work mount %+v: want a nosuid, nodev, noexec bind mount of the directory", m)
	}
}
