package gvisor

import (
	"fmt"
	"testing"

	"github.com/moatsandbox/moat"
)

// TestSessionSpec checks a session sandbox's spec: the run's hardening,
// an init that is not the code's (root, no capability, nothing to do), and
// nearly all of the disk for the working directory, the sizes still adding
// up to the disk limit.
func TestSessionSpec(t *testing.T) {
	b := &backend{rootfs: "/images/x/rootfs", limits: moat.Limits{Disk: 64 * moat.MiB}.WithDefaults()}
	spec := b.sessionSpec()
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
