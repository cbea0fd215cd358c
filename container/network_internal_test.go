package container

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"

	"github.com/docker/docker/api/types/mount"

	"github.com/moatsandbox/moat/internal/seccomp"
)

// matches reports whether every comparison of rule r holds for a call
// whose first argument is arg.
func matches(t *testing.T, r seccomp.DockerSyscall, arg uint64) bool {
	t.Helper()
	for _, a := range r.Args {
		if a.Index != 0 {
			t.Fatalf("a socket rule compares argument %d", a.Index)
		}
		var ok bool
		switch a.Op {
		case "SCMP_CMP_EQ":
			ok = arg == a.Value
		case "SCMP_CMP_NE":
			ok = arg != a.Value
		case "SCMP_CMP_GT":
			ok = arg > a.Value
		case "SCMP_CMP_MASKED_EQ":
			ok = arg&a.Value == a.ValueTwo
		default:
			t.Fatalf("unknown op %s", a.Op)
		}
		if !ok {
			return false
		}
	}
	return true
}

// TestInetProfile checks the socket rules of the profile of a Sandbox with
// an egress proxy, value by value: exactly one rule of socket matches each
// family (libseccomp does not order overlapping rules), it allows AF_UNIX,
// AF_INET and AF_INET6 only and refuses the rest with EAFNOSUPPORT, a
// value with high bits included; socketpair stays AF_UNIX only; nothing
// else of the profile changes.
func TestInetProfile(t *testing.T) {
	plain, err := seccomp.Docker()
	if err != nil {
		t.Skip(err)
	}
	inet, err := seccomp.Docker()
	if err != nil {
		t.Fatal(err)
	}
	if err := allowInet(inet); err != nil {
		t.Fatal(err)
	}
	rulesOf := func(p *seccomp.DockerProfile, name string) (out []seccomp.DockerSyscall) {
		for _, r := range p.Syscalls {
			if slices.Contains(r.Names, name) {
				out = append(out, r)
			}
		}
		return out
	}
	values := []uint64{1<<32 | 2, 1<<32 | 1, 1<<63 | 10, 40, 1<<32 | 40, ^uint64(0), 255, 256}
	for v := uint64(0); v < 64; v++ {
		values = append(values, v)
	}
	for _, name := range []string{"socket", "socketpair"} {
		for _, v := range values {
			var hit []seccomp.DockerSyscall
			for _, r := range rulesOf(inet, name) {
				if matches(t, r, v) {
					hit = append(hit, r)
				}
			}
			allow := v == 1 || (name == "socket" && (v == 2 || v == 10))
			switch {
			case len(hit) != 1:
				t.Errorf("%s(%#x): %d rules match, want exactly 1", name, v, len(hit))
			case allow && hit[0].Action != "SCMP_ACT_ALLOW":
				t.Errorf("%s(%#x): %s, want allowed", name, v, hit[0].Action)
			case !allow && (hit[0].Action != "SCMP_ACT_ERRNO" || hit[0].ErrnoRet == nil || *hit[0].ErrnoRet != 97):
				t.Errorf("%s(%#x): %s, want EAFNOSUPPORT", name, v, hit[0].Action)
			}
		}
	}
	// The rest of the profile is the plain one's.
	strip := func(p *seccomp.DockerProfile) string {
		q := *p
		q.Syscalls = slices.DeleteFunc(slices.Clone(p.Syscalls), func(r seccomp.DockerSyscall) bool {
			return slices.Contains(r.Names, "socket") || slices.Contains(r.Names, "socketpair")
		})
		b, _ := json.Marshal(q)
		return string(b)
	}
	if strip(plain) != strip(inet) {
		t.Error("allowInet changed rules other than socket's and socketpair's")
	}
	// And the plain profile allows AF_UNIX only.
	for _, v := range values {
		for _, r := range rulesOf(plain, "socket") {
			if matches(t, r, v) && r.Action == "SCMP_ACT_ALLOW" && v != 1 {
				t.Errorf("the plain profile allows socket(%#x)", v)
			}
		}
	}
	// A profile whose socket rules are not the two allowInet knows is
	// refused rather than loosened some other way.
	odd, _ := seccomp.Docker()
	odd.Syscalls = rulesOf(odd, "read")
	if err := allowInet(odd); err == nil {
		t.Error("allowInet changed a profile without moat's socket rules")
	}
}

// TestEgressMounts: with an egress proxy, the CA bundle is the only host
// file in a container, bind mounted read-only at caPath and over the
// trust store; without one there is no mount at all.
func TestEgressMounts(t *testing.T) {
	cfg, err := Config{Image: "img"}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	for _, ca := range []string{"", "/run/moat/container/ca-0123456789abcdef.pem"} {
		prof, err := newProfile(ca != "")
		if err != nil {
			t.Skip(err)
		}
		hc := newSpec(cfg, "runc-moat", nil, prof, ca).hostConfig(2100065599)
		if ca == "" {
			if len(hc.Mounts) != 0 || len(hc.Binds) != 0 {
				t.Errorf("no proxy: mounts %v binds %v", hc.Mounts, hc.Binds)
			}
			continue
		}
		var targets []string
		for _, m := range hc.Mounts {
			if m.Type != mount.TypeBind || m.Source != ca || !m.ReadOnly {
				t.Errorf("with a proxy: mount %+v, want a read-only bind of %s", m, ca)
			}
			targets = append(targets, m.Target)
		}
		if fmt.Sprint(targets) != fmt.Sprint([]string{caPath, trustStore}) || len(hc.Binds) != 0 {
			t.Errorf("with a proxy: mounts at %v binds %v", targets, hc.Binds)
		}
		if hc.NetworkMode != "none" || !hc.ReadonlyRootfs {
			t.Errorf("with a proxy: network mode %q, read-only root %v", hc.NetworkMode, hc.ReadonlyRootfs)
		}
	}
}
