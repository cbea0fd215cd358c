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
	f, err := createRAM(path, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(size)
	f.WriteAt([]byte("guest memory"), 1<<20)
	f.Close()
	if _, err := openRAM(path); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("openRAM of a file mode 0600: %v, want ErrInvalid", err)
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
