package subprocess_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
)

// Tests from a hostile review of the run's own root (root.go) and network
// namespace (warm.go). Each probe runs on the host first, where it must get
// through, or it proves nothing.

// boundScratch makes a fresh directory under /usr (one of the directories
// every strict run sees, bound read-only), removed at the end of the test.
func boundScratch(t *testing.T) string {
	t.Helper()
	dir := filepath.Join("/usr/local/share", "moat-review-"+randomName(t))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dir, 0o755)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// TestReviewSubmountsReadOnly: a mount of the host below a bound system
// directory is read-only, nosuid and nodev in the run's root like the
// directory itself. (A bind remount changes one mount only, so the
// recursive bind's submounts kept the host's flags: rw, and device nodes
// on them openable.)
func TestReviewSubmountsReadOnly(t *testing.T) {
	requireRoot(t)
	dir := boundScratch(t)
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=64k,mode=0755"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(dir, unix.MNT_DETACH)
	dev := filepath.Join(dir, "null")
	if err := unix.Mknod(dev, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	os.Chmod(dev, 0o666)
	code := fmt.Sprintf(`
import os
f = os.statvfs(%[1]s).f_flag
print("ro", bool(f & os.ST_RDONLY), "nosuid", bool(f & os.ST_NOSUID), "nodev", bool(f & os.ST_NODEV))
try:
    open(%[2]s, "rb").read(1)
    print("device opened")
except OSError as e:
    print("device", e.errno)
`, strconv.Quote(dir), strconv.Quote(dev))
	if got := onHost(t, code); !strings.Contains(got, "ro False nosuid False nodev False") || !strings.Contains(got, "device opened") {
		t.Fatalf("on the host the probe got %q, want a writable mount and an openable device: it is broken", got)
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	want := fmt.Sprintf("ro True nosuid True nodev True\ndevice %d", syscall.EACCES)
	if got := strings.TrimSpace(string(res.Stdout)); got != want {
		t.Errorf("in the sandbox the probe got %q (stderr %q), want %q", got, res.Stderr, want)
	}
}
