package microvm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// A VM that writes its RAM file (a template's boot, a state's conversion)
// owns it while it runs. Its uid goes back to the host-wide pool when the
// VM is killed, and the next VM of that uid (another sandbox's, in another
// moat process) must find the file no longer its own: with it, it could
// open the file for writing before it is sealed and keep the descriptor,
// and so write the memory of every VM later restored from it (a private
// mapping shows the file's changes in every page it has not copied). The
// file must be root's, writable by no one else, before the uid is
// released; the template's temporary directory is 0755, so the path alone
// does not protect it.
func TestWritableRAMReclaimedBeforeUIDRelease(t *testing.T) {
	parallel(t)
	sb := shared(t)
	requireSharedRAM(t, sb)
	b := sb.b
	ram := filepath.Join(t.TempDir(), ramFile)
	q := *b.vmm
	creds := q.Credentials
	var mu sync.Mutex
	var released []string
	q.Credentials = func() (int, int, []uint32, func(), error) {
		uid, gid, groups, release, err := creds()
		if err != nil {
			return 0, 0, nil, nil, err
		}
		return uid, gid, groups, func() {
			var st syscall.Stat_t
			serr := syscall.Stat(ram, &st)
			mu.Lock()
			switch {
			case serr != nil:
				released = append(released, fmt.Sprintf("uid %d released, %s: %v", uid, ram, serr))
			case st.Uid == uint32(uid) || st.Gid == uint32(gid) || st.Mode&0o077 != 0:
				released = append(released, fmt.Sprintf("uid %d released while %s is uid %d, gid %d, mode %o", uid, ram, st.Uid, st.Gid, st.Mode&0o7777))
			default:
				released = append(released, "")
			}
			mu.Unlock()
			release()
		}, nil
	}
	spec := b.spec
	spec.RAM, spec.RAMWritable, spec.Console = ram, true, io.Discard
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vm, err := q.Start(ctx, spec)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	// The control: while the VM runs the file is its uid's.
	var st syscall.Stat_t
	if err := syscall.Stat(ram, &st); err != nil || st.Uid != uint32(uidOf(t, vm.Pid())) {
		t.Errorf("the control failed: while the VM runs %s is uid %d (%v), the VM's is %d", ram, st.Uid, err, uidOf(t, vm.Pid()))
	}
	vm.Kill()
	mu.Lock()
	defer mu.Unlock()
	if len(released) != 1 {
		t.Fatalf("the uid was released %d times, want once", len(released))
	}
	if released[0] != "" {
		t.Error(released[0])
	}
}

// tmplCopy copies the shared sandbox's template into a directory of the
// test's and returns a backend that restores from the copy, verified as
// New verifies a template.
func tmplCopy(t *testing.T, sb *Sandbox) *backend {
	t.Helper()
	b := *sb.b
	dir := filepath.Join(t.TempDir(), filepath.Base(b.tmpl))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"meta.json", "state", ramFile} {
		copySparse(t, filepath.Join(b.tmpl, name), filepath.Join(dir, name))
	}
	meta, err := readMeta(dir)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.useTemplate(dir, meta); err != nil {
		t.Fatalf("the copy of the template: %v", err)
	}
	return &b
}

// copySparse copies src to dst with the same data extents (which the
// RAM file's digest covers), owner and mode.
func copySparse(t *testing.T, src, dst string) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	var st syscall.Stat_t
	if err := syscall.Fstat(int(in.Fd()), &st); err != nil {
		t.Fatal(err)
	}
	out, err := os.OpenFile(dst, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	if err := out.Truncate(st.Size); err != nil {
		t.Fatal(err)
	}
	for off := int64(0); off < st.Size; {
		data, err := syscall.Seek(int(in.Fd()), off, seekData)
		if errors.Is(err, syscall.ENXIO) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		hole, err := syscall.Seek(int(in.Fd()), data, seekHole)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(io.NewOffsetWriter(out, data), io.NewSectionReader(in, data, hole-data)); err != nil {
			t.Fatal(err)
		}
		off = hole
	}
	if err := out.Sync(); err != nil {
		t.Fatal(err)
	}
	out.Chown(int(st.Uid), int(st.Gid))
	out.Chmod(os.FileMode(st.Mode & 0o777))
}

// flipByte changes one byte of the sealed file at path at off, as root
// may, and seals it again.
func flipByte(t *testing.T, path string, off int64) {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	os.Chmod(path, 0o644)
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 1)
	f.ReadAt(b, off)
	b[0] ^= 0x5a
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
	f.Close()
	os.Chmod(path, os.FileMode(st.Mode&0o777))
}

// firstData returns the offset of the first data extent of path.
func firstData(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	off, err := syscall.Seek(int(f.Fd()), 0, seekData)
	if err != nil {
		t.Fatal(err)
	}
	return off
}

// The template's files are checked when the sandbox is made; a restore
// after that must not map a RAM file, or load a device state, that changed
// since (a byte flipped, truncated, grown, swapped for another file): it
// is refused with ErrInvalid before QEMU starts, at the cost of an fstat,
// not a digest.
func TestTemplateChangedAfterVerifyRefused(t *testing.T) {
	parallel(t)
	sb := shared(t)
	requireSharedRAM(t, sb)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The control: the verified copy restores.
	b := tmplCopy(t, sb)
	vm, err := b.restore(ctx, b.spec)
	if err != nil {
		t.Fatalf("the control failed: a restore of the verified copy: %v", err)
	}
	vm.Kill()

	// The control: a template made again under the same name (new files,
	// the same bytes) is checked again and used.
	b = tmplCopy(t, sb)
	for _, name := range []string{"state", ramFile} {
		p := filepath.Join(b.tmpl, name)
		copySparse(t, p, p+".new")
		if err := os.Rename(p+".new", p); err != nil {
			t.Fatal(err)
		}
	}
	vm, err = b.restore(ctx, b.spec)
	if err != nil {
		t.Fatalf("the control failed: a restore of a template made again: %v", err)
	}
	vm.Kill()

	for _, c := range []struct {
		name   string
		damage func(t *testing.T, dir string)
	}{
		{"a byte of the ram file flipped", func(t *testing.T, dir string) {
			p := filepath.Join(dir, ramFile)
			flipByte(t, p, firstData(t, p))
		}},
		{"the ram file grown", func(t *testing.T, dir string) {
			p := filepath.Join(dir, ramFile)
			os.Chmod(p, 0o644)
			f, _ := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
			f.Write(make([]byte, 4096))
			f.Close()
			os.Chmod(p, 0o444)
		}},
		{"the ram file swapped for a sealed copy", func(t *testing.T, dir string) {
			p := filepath.Join(dir, ramFile)
			copySparse(t, p, p+".new")
			flipByte(t, p+".new", firstData(t, p+".new"))
			if err := os.Rename(p+".new", p); err != nil {
				t.Fatal(err)
			}
		}},
		{"a byte of the device state flipped", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "state")
			st, _ := os.Stat(p)
			flipByte(t, p, st.Size()/2)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := tmplCopy(t, sb)
			c.damage(t, b.tmpl)
			vm, err := b.restore(ctx, b.spec)
			if err == nil {
				vm.Kill()
			}
			if !errors.Is(err, moat.ErrInvalid) {
				t.Errorf("restore after %s: %v, want ErrInvalid", c.name, err)
			}
		})
	}
}

// A descriptor that moat's process holds without close-on-exec (one its
// parent left it, or a library opened with a raw open) is not the VM's:
// QEMU, as a uid of its own, must not get a root-only file through it.
func TestInheritedDescriptorNotTheVMs(t *testing.T) {
	parallel(t)
	sb := shared(t)
	path := filepath.Join(t.TempDir(), "root-only")
	if err := os.WriteFile(path, []byte("moat's\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fd, err := syscall.Open(path, syscall.O_WRONLY|syscall.O_APPEND, 0) // no O_CLOEXEC
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(fd)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	vm, err := sb.b.restore(ctx, sb.b.spec)
	if err != nil {
		t.Fatalf("restore: %v", err)
	}
	defer vm.Kill()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", vm.Pid()))
	if err != nil || len(ents) == 0 {
		t.Fatalf("the control failed: no descriptors of qemu %d (%v)", vm.Pid(), err)
	}
	for _, e := range ents {
		if target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", vm.Pid(), e.Name())); target == path {
			t.Errorf("qemu %d (uid %d) holds %s, moat's descriptor %d, as its %s", vm.Pid(), uidOf(t, vm.Pid()), path, fd, e.Name())
		}
	}
}

// VMs share saved memory only where QEMU maps a memory file read-only
// (its memory-backend-file has readonly and rom: QEMU 8.2 and later) and
// the kernel protects hard links; elsewhere (QEMU 7.2, or
// fs.protected_hardlinks 0) each VM copies it, and says why.
func TestRAMSharingNeeds(t *testing.T) {
	dir := t.TempDir()
	fake := func(name string, opts ...string) string {
		p := filepath.Join(dir, name)
		script := "#!/bin/sh\necho 'memory-backend-file options:'\n"
		for _, o := range opts {
			script += "echo '  " + o + "'\n"
		}
		if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	q10 := fake("qemu-10", "mem-path=<string>", "readonly=<bool>", "rom=<OnOffAuto>        - Whether to create Read Only Memory (ROM)", "share=<bool>")
	q72 := fake("qemu-7.2", "mem-path=<string>", "readonly=<bool>", "share=<bool>")
	sysctl := filepath.Join(dir, "protected_hardlinks")
	old := protectedHardlinks
	protectedHardlinks = sysctl
	defer func() { protectedHardlinks = old }()
	ctx := context.Background()
	for _, c := range []struct {
		name, bin, sysctl string // sysctl "": no such file
		want              bool
	}{
		{"qemu 10, protected", q10, "1\n", true},
		{"qemu 7.2, protected", q72, "1\n", false},
		{"qemu 10, not protected", q10, "0\n", false},
		{"qemu 10, no sysctl", q10, "", false},
	} {
		os.Remove(sysctl)
		if c.sysctl != "" {
			os.WriteFile(sysctl, []byte(c.sysctl), 0o644)
		}
		got, why := ramSharing(ctx, c.bin)
		if got != c.want || (!got && why == "") {
			t.Errorf("%s: ramSharing = %v, %q; want %v (and a reason when false)", c.name, got, why, c.want)
		}
	}
}

// microvm.copy_memory turns the sharing off where QEMU could share: the
// level says so, and its template is another (its key names the mode).
func TestCopyMemoryTurnsSharingOff(t *testing.T) {
	ctx := context.Background()
	shared, err := prepare(ctx, Config{}.withDefaults(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer shared.Close()
	copied, err := prepare(ctx, Config{CopyMemory: true}.withDefaults(), slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer copied.Close()
	if copied.vmm.SharedRAM || !strings.Contains(copied.memoryLine(), "copy_memory") {
		t.Errorf("with copy_memory: shared %v, %q", copied.vmm.SharedRAM, copied.memoryLine())
	}
	if !shared.vmm.SharedRAM {
		msg := "this QEMU cannot share (" + shared.memoryLine() + "): nothing to turn off"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	k1, err1 := templateKey(shared.vmm, shared.spec)
	k2, err2 := templateKey(copied.vmm, copied.spec)
	if err1 != nil || err2 != nil || k1 == k2 {
		t.Errorf("template keys %q (%v) and %q (%v): want two", k1, err1, k2, err2)
	}
}
