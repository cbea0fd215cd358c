package microvm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// requireSharedRAM fails under CI=true, and skips elsewhere, where QEMU
// cannot map a read-only memory file (QEMU 7.2: setup-microvm.sh installs
// QEMU 10 from bookworm-backports).
func requireSharedRAM(t *testing.T, sb *Sandbox) {
	t.Helper()
	if sb.b.vmm.SharedRAM {
		return
	}
	msg := sb.b.vmm.Name() + " cannot map a read-only memory file: run scripts/setup-microvm.sh (QEMU from bookworm-backports)"
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

// ramMapping is what /proc/PID/smaps says of one process's mappings of
// one file.
type ramMapping struct {
	perms       []string // e.g. "rw-p"
	sharedClean int64    // KiB
	rss         int64    // KiB
}

func smapsOf(t *testing.T, pid int, path string) ramMapping {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		t.Fatal(err)
	}
	var m ramMapping
	in := false
	for _, l := range strings.Split(string(b), "\n") {
		f := strings.Fields(l)
		if len(f) >= 5 && strings.Contains(f[0], "-") && !strings.HasSuffix(f[0], ":") {
			in = len(f) >= 6 && strings.Join(f[5:], " ") == path
			if in {
				m.perms = append(m.perms, f[1])
			}
			continue
		}
		if !in || len(f) < 2 {
			continue
		}
		n, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "Shared_Clean:":
			m.sharedClean += n
		case "Rss:":
			m.rss += n
		}
	}
	return m
}

// fdModes returns the access modes (O_RDONLY, O_WRONLY, O_RDWR) of pid's
// descriptors of path.
func fdModes(t *testing.T, pid int, path string) []int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	var modes []int
	for _, e := range ents {
		target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		if err != nil || target != path {
			continue
		}
		info, err := os.ReadFile(fmt.Sprintf("/proc/%d/fdinfo/%s", pid, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(l, "flags:"); ok {
				flags, err := strconv.ParseInt(strings.TrimSpace(v), 8, 64)
				if err != nil {
					t.Fatal(err)
				}
				modes = append(modes, int(flags)&syscall.O_ACCMODE)
			}
		}
	}
	return modes
}

// uidOf returns the real uid of pid.
func uidOf(t *testing.T, pid int) int {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Uid:"); ok {
			uid, err := strconv.Atoi(strings.Fields(v)[0])
			if err != nil {
				t.Fatal(err)
			}
			return uid
		}
	}
	t.Fatalf("no Uid in /proc/%d/status", pid)
	return 0
}

// openAs tries, as uid, to open path for appending (without changing it)
// and returns the shell's error.
func openAs(uid int, path string) error {
	cmd := exec.Command("/bin/sh", "-c", `exec 3>>"$1"`, "sh", path)
	cmd.Env = []string{}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid), Groups: []uint32{}}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, out)
	}
	return nil
}

// Two VMs restored from the template share the pages of its memory file
// (Shared_Clean of the file's mapping in both QEMUs), map it privately
// from a read-only descriptor, and their uid cannot open it for writing.
func TestTemplateRAMShared(t *testing.T) {
	parallel(t)
	sb := shared(t)
	requireSharedRAM(t, sb)
	b := sb.b
	if b.meta == nil || !b.meta.SharedRAM {
		t.Fatalf("the template's memory is not in a file: %+v", b.meta)
	}
	ram := filepath.Join(b.tmpl, ramFile)
	st, err := os.Stat(ram)
	if err != nil {
		t.Fatal(err)
	}
	if st.Mode().Perm() != 0o444 || st.Sys().(*syscall.Stat_t).Uid != 0 {
		t.Errorf("%s is %v, uid %d: want root's, 0444", ram, st.Mode(), st.Sys().(*syscall.Stat_t).Uid)
	}
	if stream, err := os.Stat(filepath.Join(b.tmpl, "state")); err != nil || stream.Size() > 8<<20 {
		t.Errorf("the template's stream holds more than the devices (%v bytes, %v): its memory went into it", stream.Size(), err)
	}
	before, err := os.ReadFile(ram)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var vms []VM
	defer func() {
		for _, vm := range vms {
			vm.Kill()
		}
	}()
	for i := 0; i < 2; i++ {
		vm, err := b.restore(ctx, b.spec)
		if err != nil {
			t.Fatalf("restore: %v", err)
		}
		vms = append(vms, vm)
	}
	// The guests run their agents: give them a moment to touch their
	// memory.
	time.Sleep(time.Second)
	for _, vm := range vms {
		pid := vm.Pid()
		m := smapsOf(t, pid, ram)
		if len(m.perms) == 0 {
			t.Fatalf("qemu %d does not map %s", pid, ram)
		}
		for _, p := range m.perms {
			if !strings.HasSuffix(p, "p") {
				t.Errorf("qemu %d maps %s %s: not private", pid, ram, p)
			}
		}
		if m.sharedClean <= 0 {
			t.Errorf("qemu %d shares no page of %s with the other VM (Rss %d KiB, Shared_Clean %d KiB)", pid, ram, m.rss, m.sharedClean)
		}
		modes := fdModes(t, pid, ram)
		if len(modes) == 0 {
			t.Errorf("qemu %d holds no descriptor of %s", pid, ram)
		}
		for _, mode := range modes {
			if mode != syscall.O_RDONLY {
				t.Errorf("qemu %d holds %s open with access mode %d, not read-only", pid, ram, mode)
			}
		}
		uid := uidOf(t, pid)
		if uid == 0 {
			t.Fatalf("qemu %d runs as root", pid)
		}
		if err := openAs(uid, ram); err == nil {
			t.Errorf("qemu %d's uid %d can open %s for writing", pid, uid, ram)
		}
		// The control: that uid can open a file of its own so.
		dir := t.TempDir()
		os.Chmod(filepath.Dir(dir), 0o755)
		os.Chmod(dir, 0o755)
		own := filepath.Join(dir, "own")
		os.WriteFile(own, nil, 0o644)
		os.Chown(own, uid, uid)
		if err := openAs(uid, own); err != nil {
			t.Errorf("the control failed: uid %d cannot open a file of its own for writing: %v", uid, err)
		}
	}
	for _, vm := range vms {
		vm.Kill()
	}
	after, err := os.ReadFile(ram)
	if err != nil {
		t.Fatal(err)
	}
	if string(before) != string(after) {
		t.Errorf("%s changed under the VMs restored from it", ram)
	}
}

// A RAM file that is not sealed (root's, 0444, one link, its size) is
// refused before any VM maps it, and so is one whose bytes changed since
// its digest was taken, holes included.
func TestRAMFileChecked(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the sealed file is root's")
	}
	dir := t.TempDir()
	path := filepath.Join(dir, ramFile)
	const size = 8 << 20
	f, err := createRAM(path, 65534, 65534)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(size)
	f.WriteAt([]byte("guest memory"), 1<<20)
	f.Close()
	if _, err := openRAM(path); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("openRAM of a file of uid 65534, mode 0600: %v, want ErrInvalid", err)
	}
	// Root's 0600 (a server's copy of a state) is sealed too, and made
	// readable for the VM's reopening.
	os.Chown(path, 0, 0)
	if r, err := openRAM(path); err != nil {
		t.Errorf("openRAM of root's file, mode 0600: %v", err)
	} else {
		r.Close()
	}
	if st, _ := os.Stat(path); st == nil || st.Mode().Perm() != 0o444 {
		t.Errorf("openRAM left root's 0600 file as %v, want 0444", st)
	}
	if err := sealRAM(path, size); err != nil {
		t.Fatal(err)
	}
	sum, err := hashFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := verifyRAM(path, size, sum); err != nil {
		t.Fatalf("verifyRAM of the sealed file: %v", err)
	}
	if _, err := verifyRAM(path, size+4096, sum); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("verifyRAM of another size: %v, want ErrInvalid", err)
	}
	for _, c := range []struct {
		name string
		off  int64
	}{{"data", 1 << 20}, {"hole", 5 << 20}} {
		os.Chmod(path, 0o644)
		w, err := os.OpenFile(path, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		w.WriteAt([]byte("X"), c.off)
		w.Close()
		os.Chmod(path, 0o444) // a new change time: checked again
		if _, err := verifyRAM(path, size, sum); !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("verifyRAM after a byte changed in a %s: %v, want ErrInvalid", c.name, err)
		}
	}
	os.Chmod(path, 0o644)
	if _, err := openRAM(path); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("openRAM of a file mode 0644: %v, want ErrInvalid", err)
	}
	os.Chmod(path, 0o444)
	os.Chown(path, 65534, 65534)
	if _, err := openRAM(path); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("openRAM of a file of uid 65534: %v, want ErrInvalid", err)
	}
	os.Chown(path, 0, 0)
	os.Link(path, path+".2")
	if _, err := openRAM(path); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("openRAM of a file with two links: %v, want ErrInvalid", err)
	}
}

// The forks of one suspended state share its memory file copy-on-write
// and nothing writable: a fork that overwrites a 50 MiB array leaves its
// sibling's, a later fork's and the state's file as they were. The host
// memory (sum of the QEMUs' Pss) of N forks is less than that of N fresh
// sessions holding the same array.
func TestForksShareMemory(t *testing.T) {
	sb := open(t, noPool(t), moat.Limits{})
	requireSharedRAM(t, sb)
	ctx := context.Background()
	opts := moat.SessionOptions{Interpreter: true}
	const fill = "data = bytearray(b'p') * (50 << 20)\nprint(len(data))"
	const count = "print(data.count(b'A'), data.count(b'p'))"
	const want = "0 52428800\n"
	mib := func(b int64) string { return fmt.Sprintf("%.0f MiB", float64(b)/(1<<20)) }

	parent, err := sb.NewSession(ctx, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer parent.Close()
	runOK(t, parent, fill)
	start := time.Now()
	dir, info := suspendOne(t, parent)
	suspend := time.Since(start)
	vmDir := filepath.Join(dir, "state") // the engine's directory for the backend
	ram := filepath.Join(vmDir, ramFile)
	st, err := os.Stat(ram)
	if err != nil {
		t.Fatalf("the state has no RAM file: %v", err)
	}
	if st.Mode().Perm() != 0o444 || st.Sys().(*syscall.Stat_t).Uid != 0 {
		t.Errorf("%s is %v, uid %d: want root's, 0444", ram, st.Mode(), st.Sys().(*syscall.Stat_t).Uid)
	}
	stream, err := os.Stat(filepath.Join(vmDir, savedStateFile))
	if err != nil || stream.Size() > 8<<20 {
		t.Errorf("the state's stream holds the memory (%v bytes, %v)", stream.Size(), err)
	}
	sumBefore, err := hashFile(ram)
	if err != nil {
		t.Fatal(err)
	}

	const N = 5
	var forks []moat.Session
	start = time.Now()
	for range N {
		f := resumeOne(t, sb, dir)
		if out := runOK(t, f, count); out != want {
			t.Fatalf("a fork's array: %q, want %q", out, want)
		}
		forks = append(forks, f)
	}
	resumeEach := time.Since(start) / N
	nf, frss, fpss := qemuMemory(t)
	var shared int64
	for _, p := range listVMs() {
		m := smapsOf(t, p.pid, ram)
		shared += m.sharedClean
	}
	if shared <= 0 {
		t.Errorf("the forks share no page of %s", ram)
	}
	// Isolation: fork 0 overwrites the array; its sibling and a new fork
	// of the state still see the parent's bytes, and the file is as it
	// was.
	if out := runOK(t, forks[0], "data[:] = b'A' * len(data)\n"+count); out != "52428800 0\n" {
		t.Fatalf("the writing fork: %q", out)
	}
	if out := runOK(t, forks[1], count); out != want {
		t.Errorf("a sibling of the fork that wrote sees %q, want %q", out, want)
	}
	later := resumeOne(t, sb, dir)
	if out := runOK(t, later, count); out != want {
		t.Errorf("a fork made after another wrote sees %q, want %q", out, want)
	}
	later.Close()
	if sum, err := hashFile(ram); err != nil || sum != sumBefore {
		t.Errorf("the state's RAM file changed under its forks (%v)", err)
	}
	for _, f := range forks {
		f.Close()
	}

	var fresh []moat.Session
	for range N {
		s, err := sb.NewSession(ctx, opts)
		if err != nil {
			t.Fatal(err)
		}
		fresh = append(fresh, s)
		runOK(t, s, fill)
		if out := runOK(t, s, count); out != want {
			t.Fatalf("a fresh session's array: %q", out)
		}
	}
	ns, srss, spss := qemuMemory(t)
	for _, s := range fresh {
		s.Close()
	}

	// A RAM file changed after the suspend (a byte in one of its holes)
	// is refused before any VM starts.
	os.Chmod(ram, 0o644)
	if w, err := os.OpenFile(ram, os.O_WRONLY, 0); err == nil {
		w.WriteAt([]byte{1}, st.Size()-4096)
		w.Close()
	}
	os.Chmod(ram, 0o444)
	if s, _, err := sb.ResumeSession(ctx, dir); !errors.Is(err, moat.ErrInvalid) {
		if s != nil {
			s.Close()
		}
		t.Errorf("resuming a state whose RAM file changed: %v, want ErrInvalid", err)
	}
	if n, _, _ := qemuMemory(t); n != 0 {
		t.Errorf("the refused resume left %d QEMU processes", n)
	}
	t.Logf("accel %s (TCG is emulation): suspend %v (%s on disk, ram file %s apparent); resume + first run per fork %v",
		sb.Accel(), suspend.Round(time.Millisecond), mib(info.Bytes), mib(st.Size()), resumeEach.Round(time.Millisecond))
	t.Logf("host memory, a 50 MiB bytearray each: %d forks of one state Rss %s Pss %s (Shared_Clean of the ram file %s); %d fresh sessions Rss %s Pss %s",
		nf, mib(frss), mib(fpss), mib(shared<<10), ns, mib(srss), mib(spss))
	if nf != N || ns != N {
		t.Fatalf("counted %d and %d QEMUs, want %d", nf, ns, N)
	}
	if fpss >= spss {
		t.Errorf("%d forks of one state use %s (Pss), no less than %d fresh sessions' %s: they share nothing", N, mib(fpss), N, mib(spss))
	}
}

// With SharedRAM the guest's memory is the object "ram": a template's boot
// maps its file shared, a restore read-only and private, by the descriptor
// moat passes, and the restore's migration is set up over QMP; without
// (QEMU 7.2), the command line is as it was.
func TestQEMUArgsSharedRAM(t *testing.T) {
	spec := VMSpec{Kernel: "/k", Initrd: "/i", Disk: "/d", Cmdline: "c", MemoryMiB: 512, VCPUs: 1, Accel: AccelTCG}
	for _, c := range []struct {
		name   string
		shared bool
		mod    func(*VMSpec)
		want   []string
		not    []string
	}{
		{"7.2 restore", false, func(s *VMSpec) { s.Restore = "/s" }, []string{"-incoming\x00fd:5", "-m\x00512M"}, []string{"memory-backend", "-S"}},
		{"boot", true, func(s *VMSpec) { s.RAM, s.RAMWritable = "/r", true },
			[]string{"memory-backend=ram", "memory-backend-file,id=ram,size=512M,mem-path=/proc/self/fd/6,share=on"}, []string{"share=off", "-incoming", "/r"}},
		{"restore", true, func(s *VMSpec) { s.Restore, s.RAM = "/s", "/r" },
			[]string{"mem-path=/proc/self/fd/6,share=off,readonly=on,rom=off", "-incoming\x00defer"}, []string{"share=on", "fd:5", "/r"}},
		{"conversion", true, func(s *VMSpec) { s.Restore, s.RAM, s.RAMWritable, s.Frozen = "/s", "/r", true, true },
			[]string{"share=on", "-S", "-incoming\x00defer"}, []string{"share=off"}},
		{"anonymous", true, func(s *VMSpec) { s.Restore = "/s" }, []string{"memory-backend-ram,id=ram,size=512M"}, []string{"memory-backend-file"}},
	} {
		q := &QEMU{Binary: "/q", Version: "x", SharedRAM: c.shared}
		s := spec
		c.mod(&s)
		args := strings.Join(q.args(s, "tag"), "\x00")
		for _, w := range c.want {
			if !strings.Contains(args, w) {
				t.Errorf("%s: the command line lacks %q: %q", c.name, w, args)
			}
		}
		for _, bad := range c.not {
			if strings.Contains(args, bad) {
				t.Errorf("%s: the command line holds %q: %q", c.name, bad, args)
			}
		}
	}
}
