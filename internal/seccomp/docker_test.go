//go:build linux && (amd64 || arm64)

package seccomp

import (
	"encoding/json"
	"math/rand/v2"
	"slices"
	"testing"

	"golang.org/x/sys/unix"
)

func dockerProfile(t *testing.T) *DockerProfile {
	t.Helper()
	p, err := Docker()
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// rulesFor returns the profile's rules that name syscall name.
func rulesFor(p *DockerProfile, name string) []DockerSyscall {
	var out []DockerSyscall
	for _, r := range p.Syscalls {
		if slices.Contains(r.Names, name) {
			out = append(out, r)
		}
	}
	return out
}

// TestDockerRefusesWhatTheFilterRefuses checks that every syscall the
// subprocess filter refuses outright (the test's own list, wantDenied) has
// no rule at all in the container profile, so that the default action
// (EPERM) refuses it, and likewise the container's own additions.
func TestDockerRefusesWhatTheFilterRefuses(t *testing.T) {
	p := dockerProfile(t)
	var names []string
	for name := range wantDenied {
		names = append(names, name)
	}
	for name := range wantDeniedArch {
		names = append(names, name)
	}
	names = append(names, "memfd_secret", "fanotify_mark", "socketcall", "ipc", "clock_adjtime64", "clock_settime64", "umount",
		"io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "ptrace")
	for _, name := range names {
		if r := rulesFor(p, name); len(r) != 0 {
			t.Errorf("%s has rules in the container profile: %+v", name, r)
		}
	}
	for _, name := range p.Allowed() {
		if slices.Contains(names, name) {
			t.Errorf("%s is allowed", name)
		}
	}
}

// TestDockerProfileShape checks the profile's form: an allow-list for the
// native architecture only, with the rules that take arguments.
func TestDockerProfileShape(t *testing.T) {
	p := dockerProfile(t)
	b, err := p.JSON()
	if err != nil {
		t.Fatal(err)
	}
	var raw map[string]any
	if err := json.Unmarshal(b, &raw); err != nil {
		t.Fatal(err)
	}
	if raw["defaultAction"] != "SCMP_ACT_ERRNO" || raw["defaultErrnoRet"] != float64(unix.EPERM) {
		t.Errorf("default: %v %v, want SCMP_ACT_ERRNO EPERM", raw["defaultAction"], raw["defaultErrnoRet"])
	}
	if len(p.Architectures) != 1 || p.Architectures[0] != dockerArch {
		t.Errorf("architectures %v, want only %s: a foreign calling convention must be refused", p.Architectures, dockerArch)
	}
	allowed := p.Allowed()
	for _, name := range []string{"read", "write", "openat", "mmap", "futex", "execve", "exit_group", "rt_sigreturn", "wait4", "pipe2",
		"clone", "socket", "socketpair", "ioctl", "personality", "inotify_init1"} {
		if !slices.Contains(allowed, name) {
			t.Errorf("%s is not allowed: ordinary programs need it", name)
		}
	}
	// Rules with arguments: exactly these, and no unconditional entry.
	for _, name := range []string{"socket", "socketpair", "clone", "ioctl", "personality"} {
		for _, r := range rulesFor(p, name) {
			if r.Action == scmpAllow && len(r.Args) == 0 {
				t.Errorf("%s is allowed without conditions", name)
			}
		}
	}
	for _, name := range []string{"socket", "socketpair"} {
		var allow, deny int
		for _, r := range rulesFor(p, name) {
			switch {
			case r.Action == scmpAllow && len(r.Args) == 1 && r.Args[0] == (DockerArg{Index: 0, Value: unix.AF_UNIX, Op: scmpEq}):
				allow++
			case r.Action == scmpErrno && *r.ErrnoRet == uint(unix.EAFNOSUPPORT) && r.Args[0].Op == scmpNe:
				deny++
			default:
				t.Errorf("%s: unexpected rule %+v", name, r)
			}
		}
		if allow != 1 || deny != 1 {
			t.Errorf("%s: %d allow and %d deny rules, want AF_UNIX only and EAFNOSUPPORT for the rest", name, allow, deny)
		}
	}
	clone := rulesFor(p, "clone")
	if len(clone) != 1 || clone[0].Args[0] != (DockerArg{Index: 0, Value: nsFlags, Op: scmpMaskedEq}) {
		t.Errorf("clone: %+v, want allowed only without namespace flags", clone)
	}
	clone3 := rulesFor(p, "clone3")
	if len(clone3) != 1 || clone3[0].Action != scmpErrno || *clone3[0].ErrnoRet != uint(unix.ENOSYS) {
		t.Errorf("clone3: %+v, want ENOSYS", clone3)
	}
	var personas []uint64
	for _, r := range rulesFor(p, "personality") {
		personas = append(personas, r.Args[0].Value)
	}
	if !slices.Equal(personas, []uint64{0, 0xffffffff}) {
		t.Errorf("personality allowed for %v, want 0 and 0xffffffff", personas)
	}
}

// matches evaluates a comparison as libseccomp does, on all 64 bits.
func matches(a DockerArg, v uint64) bool {
	switch a.Op {
	case scmpEq:
		return v == a.Value
	case scmpNe:
		return v != a.Value
	case scmpMaskedEq:
		return v&a.Value == a.ValueTwo
	}
	panic(a.Op)
}

// TestAllowAllBut32 checks the ioctl rules: a command is allowed exactly
// when its low 32 bits are not an excepted one, whatever its high bits.
func TestAllowAllBut32(t *testing.T) {
	except := []uint32{unix.TIOCSTI, unix.TIOCLINUX}
	rules := allowAllBut32(1, except)
	if len(rules) > 32*len(except) {
		t.Errorf("%d rules for %d exceptions", len(rules), len(except))
	}
	allowed := func(v uint64) bool {
		for _, r := range rules {
			if r.Index != 1 {
				t.Fatalf("rule on argument %d", r.Index)
			}
			if matches(r, v) {
				return true
			}
		}
		return false
	}
	rng := rand.New(rand.NewPCG(1, 2))
	values := []uint64{0, 1, 0xffffffff, unix.TCGETS, unix.TIOCINQ, unix.TIOCGWINSZ, unix.TIOCSTI - 1, unix.TIOCSTI + 1, unix.TIOCLINUX + 1}
	for range 100000 {
		values = append(values, rng.Uint64(), uint64(rng.Uint32()), 0x5400|uint64(rng.IntN(256)))
	}
	for _, low := range values {
		for _, high := range []uint64{0, 1 << 32, 0xffffffff << 32, rng.Uint64() &^ 0xffffffff} {
			v := high | low&0xffffffff
			want := !slices.Contains(except, uint32(v))
			if got := allowed(v); got != want {
				t.Fatalf("command %#x: allowed %v, want %v", v, got, want)
			}
		}
	}
	for _, e := range except {
		for _, high := range []uint64{0, 1 << 32, 0xffffffff << 32} {
			if allowed(high | uint64(e)) {
				t.Errorf("excepted command %#x is allowed", high|uint64(e))
			}
		}
	}
	// The profile's ioctl rules are these.
	var got []DockerArg
	for _, r := range rulesFor(dockerProfile(t), "ioctl") {
		if r.Action != scmpAllow || len(r.Args) != 1 {
			t.Fatalf("ioctl rule %+v", r)
		}
		got = append(got, r.Args[0])
	}
	if !slices.Equal(got, rules) {
		t.Errorf("the profile's ioctl rules differ from allowAllBut32's")
	}
}
