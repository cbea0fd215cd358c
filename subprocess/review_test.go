package subprocess_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/subprocess"
)

// Tests from a hostile review of the run's own root (root.go) and network
// namespace (helperproc.go). Each probe runs on the host first, where it must get
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

// TestReviewDatagramSocketInBoundDir: a datagram socket file of the host
// that lies inside a directory bound into the run's root (/usr, /etc/ssl,
// the interpreter's prefix) is the same inode there, and neither the mount
// nor the network namespace stands between it and a socketpair end aimed
// at it with sendto or sendmsg. Landlock (ABI 7) does not govern it either.
func TestReviewDatagramSocketInBoundDir(t *testing.T) {
	requireRoot(t)
	path := filepath.Join(boundScratch(t), "log")
	got := dgramListener(t, path)
	code := fmt.Sprintf("ADDRS = [%s]\n", strconv.Quote(path)) + reaimProbe

	onHost(t, code)
	if d := received(got, 200*time.Millisecond); len(d) != 3 {
		t.Fatalf("on the host the probe delivered %q, want all three datagrams: it is broken", d)
	}
	sb := newStrict(t, moat.Limits{})
	defer sb.Close()
	res := run(t, sb, code)
	if !strings.Contains(string(res.Stdout), "done") {
		t.Fatalf("the probe did not run to its end: %q %q", res.Stdout, res.Stderr)
	}
	if d := received(got, 200*time.Millisecond); len(d) > 0 {
		t.Errorf("a run delivered %q to the host socket %s (stdout %q)", d, path, res.Stdout)
	}
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

// TestReviewPythonPrefixIsOnlyTheInterpreter: an interpreter installed
// directly under a home directory (/home/NAME/bin/python3) gives a prefix of
// /home/NAME, which the top-level check accepts: the whole home becomes
// readable to the code. Either the interpreter is refused, or the code sees
// no file of that tree beyond the interpreter's own.
func TestReviewPythonPrefixIsOnlyTheInterpreter(t *testing.T) {
	requireRoot(t)
	home := filepath.Join("/home", "moat-review-"+randomName(t))
	if err := os.MkdirAll(filepath.Join(home, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(home)
	os.Chmod(home, 0o755)
	src, err := os.ReadFile("/usr/bin/python3")
	if err != nil {
		t.Fatal(err)
	}
	py := filepath.Join(home, "bin", "python3")
	if err := os.WriteFile(py, src, 0o755); err != nil {
		t.Fatal(err)
	}
	token := randomName(t)
	secret := filepath.Join(home, "notes.txt") // as a user's files often are: 0644
	if err := os.WriteFile(secret, []byte(token), 0o644); err != nil {
		t.Fatal(err)
	}
	code := fmt.Sprintf("try:\n    print(open(%s).read())\nexcept OSError as e:\n    print('denied', e.errno)\n", strconv.Quote(secret))
	if got := onHost(t, code); !strings.Contains(got, token) {
		t.Fatalf("on the host the probe got %q, want the token: it is broken", got)
	}
	sb, err := subprocess.New(subprocess.Config{Python: py})
	if err != nil {
		if !errors.Is(err, moat.ErrUnavailable) {
			t.Errorf("got %v, want an error wrapping ErrUnavailable", err)
		}
		return // refused: fine
	}
	defer sb.Close()
	res := run(t, sb, code)
	if strings.Contains(string(res.Stdout), token) {
		t.Errorf("a run read %s, outside the interpreter's own files, through the prefix %s", secret, home)
	}
}

// TestReviewRootFailsClosed: when the run's root cannot be built, nothing
// runs and Run says the sandbox is unavailable.
func TestReviewRootFailsClosed(t *testing.T) {
	requireRoot(t)
	runDir, err := os.MkdirTemp("/run", "moat-review-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(runDir)
	// No pool: an instance prepared before the mount point went was
	// set up whole, and would run soundly.
	sb, err := subprocess.New(subprocess.Config{RunDir: runDir, Warm: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if res := run(t, sb, "print('ran')"); strings.TrimSpace(string(res.Stdout)) != "ran" {
		t.Fatalf("positive control: %q %q", res.Stdout, res.Stderr)
	}
	if err := os.Remove(filepath.Join(runDir, "root")); err != nil {
		t.Fatal(err)
	}
	res, err := sb.Run(context.Background(), moat.Request{Code: []byte("print('ran')")})
	if err == nil {
		t.Fatalf("a run without its root's mount point ran: %q %q", res.Stdout, res.Stderr)
	}
	if !errors.Is(err, moat.ErrUnavailable) {
		t.Errorf("got %v, want an error wrapping ErrUnavailable", err)
	}
}

// TestReviewSessionInterpreterOwnRoot: a session's live interpreter gets
// the same root and network namespace as a one-shot run.
func TestReviewSessionInterpreterOwnRoot(t *testing.T) {
	requireRoot(t)
	code := `
import os
f = os.statvfs("/").f_flag
print(os.path.exists("/run/moat/uids"), os.path.exists("/proc/1"), os.path.exists("/tmp"), bool(f & os.ST_RDONLY))
`
	if got := strings.TrimSpace(onHost(t, code)); got != "True True True False" {
		t.Fatalf("on the host the probe got %q: it is broken", got)
	}
	sb, err := subprocess.New(subprocess.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	ss, err := sb.NewSession(context.Background(), moat.SessionOptions{Interpreter: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ss.Close()
	for i := 0; i < 2; i++ { // the interpreter lives across runs
		if got := out(srun(t, ss, code)); got != "False False False True" {
			t.Errorf("session run %d: got %q, want False False False True", i, got)
		}
	}
}
