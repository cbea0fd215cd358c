package gvisor

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// These tests need neither root nor runsc: they check how moat reads what
// runsc prints, on lines copied from runsc 0.0~20240729.0 (Debian 13).

func TestParseVersion(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"runsc version 0.0~20240729.0\nspec: 1.2.0\n", "0.0~20240729.0"},
		{"runsc version release-20240729.0\n", "release-20240729.0"},
		{"runsc: unknown flag\n", ""},
		{"", ""},
	} {
		if got := parseVersion([]byte(c.in)); got != c.want {
			t.Errorf("parseVersion(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestParsePlatforms(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []string
	}{
		{"  -platform string\n    \tspecifies which platform to use: systrap (default), ptrace, kvm. (default \"systrap\")\n", []string{"systrap", "ptrace", "kvm"}},
		// Debian 12's runsc (2022) has no systrap.
		{"  -platform string\n    \tspecifies which platform to use: ptrace (default), kvm. (default \"ptrace\")\n", []string{"ptrace", "kvm"}},
		{"  -network value\n", nil},
	} {
		if got := parsePlatforms([]byte(c.in)); !slices.Equal(got, c.want) {
			t.Errorf("parsePlatforms(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

func TestRunID(t *testing.T) {
	id := "0123456789abcdef-fedcba9876543210"
	for _, c := range []struct {
		name string
		want string
	}{
		{id, id},
		{id + "_sandbox:" + id + ".state", id},
		{id + "_sandbox:" + id + ".lock", id},
		{"runsc-" + id + ".sock", id},
		{"0123456789abcdef", ""},
		{"12345-fedcba9876543210", ""},
		{"zzzzzzzzzzzzzzzz-fedcba9876543210", ""},
		{"0123456789abcdef-zzzzzzzzzzzzzzzz", ""},
	} {
		got, ok := runID(c.name)
		if got != c.want || ok != (c.want != "") {
			t.Errorf("runID(%q) = %q, %v; want %q", c.name, got, ok, c.want)
		}
	}
}

func TestSpec(t *testing.T) {
	l := moat.Limits{Disk: 64 * moat.MiB, Pids: 7}.WithDefaults()
	spec := newSpec("/images/x/rootfs", "/usr/bin/python3", l)
	if !spec.Root.Readonly || spec.Root.Path != "/images/x/rootfs" {
		t.Errorf("root = %+v, want the rootfs, read-only", spec.Root)
	}
	p := spec.Process
	if p.User.UID == 0 || p.User.GID == 0 || !p.NoNewPrivileges || p.Terminal {
		t.Errorf("process user %+v, no_new_privs %v, terminal %v: want non-root, no_new_privs, no terminal", p.User, p.NoNewPrivileges, p.Terminal)
	}
	caps := p.Capabilities
	for _, set := range [][]string{caps.Bounding, caps.Effective, caps.Inheritable, caps.Permitted, caps.Ambient} {
		if set == nil || len(set) > 0 {
			t.Errorf("capabilities %+v: want every set present and empty", caps)
			break
		}
	}
	rl := map[string]uint64{}
	for _, r := range p.Rlimits {
		if r.Soft > r.Hard {
			t.Errorf("%s soft %d above hard %d", r.Type, r.Soft, r.Hard)
		}
		rl[r.Type] = r.Hard
	}
	if rl["RLIMIT_NPROC"] != 7 || rl["RLIMIT_FSIZE"] != uint64(l.FileSize) || rl["RLIMIT_NOFILE"] != uint64(l.OpenFiles) {
		t.Errorf("rlimits %v: want NPROC 7, FSIZE %d, NOFILE %d", rl, l.FileSize, l.OpenFiles)
	}
	var disk int64
	for _, m := range spec.Mounts {
		if m.Type == "bind" || strings.HasPrefix(m.Source, "/") {
			t.Errorf("mount %+v comes from the host", m)
		}
		for _, o := range m.Options {
			var n int64
			if _, err := fmt.Sscanf(o, "size=%d", &n); err == nil {
				disk += n
			}
		}
	}
	if disk > int64(l.Disk) || disk < int64(l.Disk)-3*4096 {
		t.Errorf("the tmpfs sizes add up to %d, want the disk limit %d", disk, int64(l.Disk))
	}
	b, err := json.Marshal(spec)
	if err != nil || !strings.Contains(string(b), `"noNewPrivileges":true`) || !strings.Contains(string(b), `"SCMP_ACT_ERRNO"`) {
		t.Errorf("spec JSON %s (%v): want noNewPrivileges and the seccomp filter", b, err)
	}
}
