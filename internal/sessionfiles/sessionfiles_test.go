package sessionfiles_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/sessionfiles"
	"github.com/moatsandbox/moat/sandboxtest"
)

func TestMain(m *testing.M) {
	os.Exit(sandboxtest.CheckNoChildren(m.Run(), 5*time.Second))
}

// unprivileged is the uid the tests run the program as when they run as
// root, as a level runs it as the session's uid.
const unprivileged = 65534

// python is the host's own python3, which an unprivileged uid can run (a
// python3 first in root's PATH may live in root's home).
const python = "/usr/bin/python3"

// localExec runs argv on this host, as uid when uid >= 0: the instance is
// the host, the session's uid is uid.
func localExec(uid int, calls *atomic.Int64) sessionfiles.Exec {
	return func(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error {
		if calls != nil {
			calls.Add(1)
		}
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Stdin, cmd.Stdout = stdin, stdout
		cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin"}
		cmd.WaitDelay = 2 * time.Second
		if uid >= 0 {
			cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(uid)}}
		}
		return cmd.Run()
	}
}

// env is a working directory and the directory beside it, outside it.
type env struct {
	work, outside string
	uid           int // the program's, -1: the test's own
	calls         atomic.Int64
	files         moat.Files
}

// newEnv makes a working directory the program's uid owns, a directory
// outside it holding "secret", and the Files over them.
func newEnv(t *testing.T, o sessionfiles.Options) *env {
	t.Helper()
	base, err := os.MkdirTemp("", "sessionfiles-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		syscall.Unmount(filepath.Join(base, "work"), syscall.MNT_DETACH)
		os.RemoveAll(base)
	})
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	e := &env{work: filepath.Join(base, "work"), outside: filepath.Join(base, "outside"), uid: -1}
	for _, d := range []string{e.work, e.outside} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(e.outside, "secret"), []byte("secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		e.uid = unprivileged
		if err := os.Chown(e.work, e.uid, e.uid); err != nil {
			t.Fatal(err)
		}
	}
	o.Dir = e.work
	if o.Python == "" {
		o.Python = python
	}
	e.files = sessionfiles.New(localExec(e.uid, &e.calls), o)
	return e
}

// plant makes what code in the session could make, owned by its uid.
func (e *env) plant(t *testing.T, name string, make func(p string) error) {
	t.Helper()
	p := filepath.Join(e.work, name)
	if err := make(p); err != nil {
		t.Fatal(err)
	}
	if e.uid >= 0 {
		if err := os.Lchown(p, e.uid, e.uid); err != nil {
			t.Fatal(err)
		}
	}
}

func link(target string) func(string) error {
	return func(p string) error { return os.Symlink(target, p) }
}

func file(data string) func(string) error {
	return func(p string) error { return os.WriteFile(p, []byte(data), 0o644) }
}

func write(t *testing.T, f moat.Files, name, data string) {
	t.Helper()
	if err := f.WriteFile(context.Background(), name, strings.NewReader(data)); err != nil {
		t.Fatalf("WriteFile(%q): %v", name, err)
	}
}

func read(f moat.Files, name string) (string, error) {
	rc, err := f.ReadFile(context.Background(), name)
	if err != nil {
		return "", err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	return string(b), err
}

func names(t *testing.T, f moat.Files) []string {
	t.Helper()
	list, err := f.ListFiles(context.Background())
	if err != nil {
		t.Fatalf("ListFiles: %v", err)
	}
	var out []string
	for _, fi := range list {
		out = append(out, fi.Name)
	}
	return out
}

func TestRoundTrip(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	f, ctx := e.files, context.Background()
	write(t, f, "a/b/c.txt", "hello")
	if got, err := read(f, "a/b/c.txt"); err != nil || got != "hello" {
		t.Fatalf("ReadFile = %q, %v; want hello", got, err)
	}
	st, err := os.Stat(filepath.Join(e.work, "a/b/c.txt"))
	if err != nil {
		t.Fatal(err)
	}
	if e.uid >= 0 && st.Sys().(*syscall.Stat_t).Uid != uint32(e.uid) {
		t.Errorf("the written file belongs to uid %d, want the program's %d", st.Sys().(*syscall.Stat_t).Uid, e.uid)
	}
	fi, err := f.Stat(ctx, "a/b/c.txt")
	if err != nil || fi.Name != "a/b/c.txt" || fi.Size != 5 || fi.IsDir || !fi.Mode.IsRegular() || !fi.ModTime.Equal(st.ModTime()) {
		t.Errorf("Stat = %+v, %v; want a/b/c.txt, 5 bytes, regular, modified %v", fi, err, st.ModTime())
	}
	if fi, err := f.Stat(ctx, "a/b"); err != nil || !fi.IsDir || !fi.Mode.IsDir() {
		t.Errorf("Stat(a/b) = %+v, %v; want a directory", fi, err)
	}
	write(t, f, "a/b/c.txt", "replaced")
	write(t, f, "empty", "")
	if got, err := read(f, "empty"); err != nil || got != "" {
		t.Errorf("ReadFile(empty) = %q, %v", got, err)
	}
	if err := f.Mkdir(ctx, "x/y"); err != nil {
		t.Fatal(err)
	}
	if err := f.Mkdir(ctx, "x/y"); err != nil {
		t.Errorf("Mkdir of an existing directory = %v, want nil", err)
	}
	if err := f.Mkdir(ctx, "empty/sub"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("Mkdir under a file = %v, want ErrInvalid", err)
	}
	if err := f.Mkdir(ctx, "empty"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("Mkdir over a file = %v, want ErrInvalid", err)
	}
	if err := f.WriteFile(ctx, "x", strings.NewReader("over a dir")); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("WriteFile over a directory = %v, want ErrInvalid", err)
	}
	if err := f.Rename(ctx, "a/b/c.txt", "x/y/c.txt"); err != nil {
		t.Fatal(err)
	}
	write(t, f, "other", "other")
	if err := f.Rename(ctx, "other", "x/y/c.txt"); err != nil {
		t.Fatalf("Rename over a file: %v", err)
	}
	if got, _ := read(f, "x/y/c.txt"); got != "other" {
		t.Errorf("after Rename over a file, it holds %q, want other", got)
	}
	want := []string{"a", "a/b", "empty", "x", "x/y", "x/y/c.txt"}
	if got := names(t, f); !equal(got, want) {
		t.Errorf("ListFiles = %q, want %q", got, want)
	}
	if err := f.RemoveFile(ctx, "x/y"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("RemoveFile of a directory that holds a file = %v, want ErrInvalid", err)
	}
	for _, n := range []string{"x/y/c.txt", "x/y", "a/b"} {
		if err := f.RemoveFile(ctx, n); err != nil {
			t.Errorf("RemoveFile(%q): %v", n, err)
		}
	}
	if got := names(t, f); !equal(got, []string{"a", "empty", "x"}) {
		t.Errorf("ListFiles after the removals = %q", got)
	}
	for name, err := range map[string]error{
		"read":   func() error { _, err := read(f, "nope"); return err }(),
		"stat":   func() error { _, err := f.Stat(ctx, "nope/x"); return err }(),
		"remove": f.RemoveFile(ctx, "nope"),
		"rename": f.Rename(ctx, "nope", "x/nope"),
	} {
		if !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s of a missing file = %v, want fs.ErrNotExist", name, err)
		}
	}
}

func equal(a, b []string) bool { return strings.Join(a, "\n") == strings.Join(b, "\n") }

// TestNeverFollowsLinks plants what code could plant: links to /, to a
// directory outside, to a file outside, to nowhere, and a loop. Every
// operation through them is refused with ErrInvalid and changes nothing
// outside; a link itself can be stated, replaced and removed.
func TestNeverFollowsLinks(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	f, ctx := e.files, context.Background()
	secret := filepath.Join(e.outside, "secret")
	e.plant(t, "escape", link("/"))
	e.plant(t, "out", link(e.outside))
	e.plant(t, "pw", link(secret))
	e.plant(t, "pw2", link(secret))
	e.plant(t, "nowhere", link(filepath.Join(e.outside, "new")))
	e.plant(t, "loop", link("loop"))
	e.plant(t, "f", file("f"))
	refused := map[string]error{
		"ReadFile(escape/etc/passwd)": func() error { _, err := read(f, "escape/etc/passwd"); return err }(),
		"ReadFile(pw)":                func() error { _, err := read(f, "pw"); return err }(),
		"ReadFile(out/secret)":        func() error { _, err := read(f, "out/secret"); return err }(),
		"ReadFile(loop)":              func() error { _, err := read(f, "loop"); return err }(),
		"ReadFile(nowhere)":           func() error { _, err := read(f, "nowhere"); return err }(),
		"WriteFile(escape/x)":         f.WriteFile(ctx, "escape/x", strings.NewReader("x")),
		"WriteFile(out/secret)":       f.WriteFile(ctx, "out/secret", strings.NewReader("x")),
		"WriteFile(out/new/x)":        f.WriteFile(ctx, "out/new/x", strings.NewReader("x")),
		"WriteFile(nowhere/x)":        f.WriteFile(ctx, "nowhere/x", strings.NewReader("x")),
		"Mkdir(out/d)":                f.Mkdir(ctx, "out/d"),
		"Mkdir(nowhere)":              f.Mkdir(ctx, "nowhere"),
		"Stat(out/secret)":            func() error { _, err := f.Stat(ctx, "out/secret"); return err }(),
		"Stat(escape/etc)":            func() error { _, err := f.Stat(ctx, "escape/etc"); return err }(),
		"Rename(f, out/f)":            f.Rename(ctx, "f", "out/f"),
		"Rename(out/secret, stolen)":  f.Rename(ctx, "out/secret", "stolen"),
		"RemoveFile(out/secret)":      f.RemoveFile(ctx, "out/secret"),
	}
	for op, err := range refused {
		if !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("%s = %v, want an error wrapping moat.ErrInvalid", op, err)
		}
	}
	// The links themselves are files of the session.
	if fi, err := f.Stat(ctx, "pw"); err != nil || fi.Mode&fs.ModeSymlink == 0 {
		t.Errorf("Stat(pw) = %+v, %v; want the link itself", fi, err)
	}
	if err := f.RemoveFile(ctx, "pw2"); err != nil {
		t.Errorf("RemoveFile(pw2), a link: %v", err)
	}
	write(t, f, "pw", "replaces the link")
	if fi, err := os.Lstat(filepath.Join(e.work, "pw")); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("after WriteFile(pw), pw is %v, %v; want a regular file in place of the link", fi, err)
	}
	// Nothing outside changed.
	if b, err := os.ReadFile(secret); err != nil || string(b) != "secret" {
		t.Errorf("the file outside holds %q, %v; want it untouched", b, err)
	}
	if ents, _ := os.ReadDir(e.outside); len(ents) != 1 {
		t.Errorf("the directory outside holds %d entries, want only secret", len(ents))
	}
	for _, p := range []string{"/x", filepath.Join(e.work, "stolen")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s exists", p)
		}
	}
	want := []string{"escape", "f", "loop", "nowhere", "out", "pw"}
	if got := names(t, f); !equal(got, want) {
		t.Errorf("ListFiles = %q, want %q (links listed, never followed)", got, want)
	}
}

// TestWorkDirThroughLink: the working directory itself is opened without
// following a link, so code that swapped it for one reaches nothing.
func TestWorkDirThroughLink(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	alias := filepath.Join(filepath.Dir(e.work), "alias")
	if err := os.Symlink(e.outside, alias); err != nil {
		t.Fatal(err)
	}
	f := sessionfiles.New(localExec(e.uid, nil), sessionfiles.Options{Dir: alias, Python: python})
	if _, err := read(f, "secret"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ReadFile through a working directory that is a link = %v, want ErrInvalid", err)
	}
	if _, err := f.ListFiles(context.Background()); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ListFiles of a working directory that is a link = %v, want ErrInvalid", err)
	}
}

func TestRefusesNonRegularFiles(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	e.plant(t, "fifo", func(p string) error { return syscall.Mkfifo(p, 0o644) })
	e.plant(t, "dir", func(p string) error { return os.Mkdir(p, 0o755) })
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, name := range []string{"fifo", "dir"} {
		rc, err := e.files.ReadFile(ctx, name)
		if err == nil {
			rc.Close()
		}
		if !errors.Is(err, moat.ErrInvalid) {
			t.Errorf("ReadFile(%s) = %v, want ErrInvalid without blocking", name, err)
		}
	}
	if fi, err := e.files.Stat(ctx, "fifo"); err != nil || fi.Mode&fs.ModeNamedPipe == 0 {
		t.Errorf("Stat(fifo) = %+v, %v; want a named pipe", fi, err)
	}
}

// TestRefusesBadNames: names the engine's CleanName refuses never reach the
// instance.
func TestRefusesBadNames(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	f, ctx := e.files, context.Background()
	for _, name := range []string{"", ".", "..", "../x", "a/../b", "/etc/passwd", "a//b", "a/", "./a", "a\\b", "a\x00b", strings.Repeat("a", 4097)} {
		errs := []error{
			f.WriteFile(ctx, name, strings.NewReader("x")),
			func() error { _, err := f.ReadFile(ctx, name); return err }(),
			func() error { _, err := f.Stat(ctx, name); return err }(),
			f.Mkdir(ctx, name),
			f.Rename(ctx, name, "x"),
			f.Rename(ctx, "x", name),
			f.RemoveFile(ctx, name),
		}
		for i, err := range errs {
			if !errors.Is(err, moat.ErrInvalid) {
				t.Errorf("operation %d with name %q = %v, want ErrInvalid", i, name, err)
			}
		}
	}
	if n := e.calls.Load(); n != 0 {
		t.Errorf("bad names reached the instance %d times", n)
	}
}

func TestFileSizeLimit(t *testing.T) {
	const limit = 1 << 20
	e := newEnv(t, sessionfiles.Options{FileSize: limit})
	f, ctx := e.files, context.Background()
	write(t, f, "f", "old")
	err := f.WriteFile(ctx, "f", bytes.NewReader(make([]byte, limit+1)))
	if !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("WriteFile one byte past the limit = %v, want ErrInvalid", err)
	}
	if got, err := read(f, "f"); err != nil || got != "old" {
		t.Errorf("after the refused write, f holds %q, %v; want old", got, err)
	}
	if got := names(t, f); !equal(got, []string{"f"}) {
		t.Errorf("after the refused write, the directory holds %q, want only f", got)
	}
	if err := f.WriteFile(ctx, "g", bytes.NewReader(make([]byte, limit))); err != nil {
		t.Errorf("WriteFile at the limit: %v", err)
	}
	// A file the code made past the limit is refused, not streamed.
	e.plant(t, "big", func(p string) error { return os.WriteFile(p, make([]byte, limit+1), 0o644) })
	if _, err := read(f, "big"); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ReadFile of a file past the limit = %v, want ErrInvalid", err)
	}
}

// TestDiskFull: a write that fills the disk is refused and leaves the old
// file and no temporary file.
func TestDiskFull(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a small tmpfs needs root (CI runs this as root)")
	}
	e := newEnv(t, sessionfiles.Options{FileSize: 16 << 20})
	if err := syscall.Mount("tmpfs", e.work, "tmpfs", syscall.MS_NOSUID|syscall.MS_NODEV, fmt.Sprintf("size=1m,mode=0755,uid=%d,gid=%d", e.uid, e.uid)); err != nil {
		t.Fatal(err)
	}
	f, ctx := e.files, context.Background()
	write(t, f, "f", "old")
	err := f.WriteFile(ctx, "f", bytes.NewReader(make([]byte, 2<<20)))
	if !errors.Is(err, moat.ErrInvalid) || !strings.Contains(err.Error(), "disk") {
		t.Errorf("WriteFile past the disk = %v, want ErrInvalid naming the disk limit", err)
	}
	if got, err := read(f, "f"); err != nil || got != "old" {
		t.Errorf("after the refused write, f holds %q, %v; want old", got, err)
	}
	if got := names(t, f); !equal(got, []string{"f"}) {
		t.Errorf("after the refused write, the directory holds %q, want only f", got)
	}
}

// pattern is a reader of n deterministic bytes, without holding them.
type pattern struct{ off, n int64 }

func (p *pattern) Read(b []byte) (int, error) {
	if p.off >= p.n {
		return 0, io.EOF
	}
	if int64(len(b)) > p.n-p.off {
		b = b[:p.n-p.off]
	}
	for i := range b {
		x := p.off + int64(i)
		b[i] = byte(x ^ x>>8 ^ x>>16)
	}
	p.off += int64(len(b))
	return len(b), nil
}

// TestLargeFileStreams writes and reads 50 MB; the Go side holds a small
// fraction of it at any time.
func TestLargeFileStreams(t *testing.T) {
	const size = 50_000_000
	e := newEnv(t, sessionfiles.Options{FileSize: 64 << 20})
	f, ctx := e.files, context.Background()
	want := sha256.New()
	io.Copy(want, &pattern{n: size})

	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	start := time.Now()
	if err := f.WriteFile(ctx, "big", &pattern{n: size}); err != nil {
		t.Fatal(err)
	}
	wrote := time.Since(start)
	rc, err := f.ReadFile(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	got := sha256.New()
	n, err := io.Copy(got, rc)
	rc.Close()
	runtime.ReadMemStats(&after)
	if err != nil || n != size || !bytes.Equal(got.Sum(nil), want.Sum(nil)) {
		t.Fatalf("read back %d bytes, %v; want the %d bytes written", n, err, size)
	}
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("50 MB: write %v, write+read %v, %d bytes allocated", wrote, time.Since(start), alloc)
	if alloc > size/4 {
		t.Errorf("writing and reading %d bytes allocated %d bytes: the contents are held, not streamed", size, alloc)
	}
}

// TestReadWhileWritten: a read concurrent with writes of the same name gets
// one whole version, never a mix; a read of a file that grows gets a prefix.
func TestReadWhileWritten(t *testing.T) {
	const size = 256 << 10
	e := newEnv(t, sessionfiles.Options{})
	f, ctx := e.files, context.Background()
	write(t, f, "f", strings.Repeat("a", size))
	e.plant(t, "log", file(""))
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if err := f.WriteFile(ctx, "f", strings.NewReader(strings.Repeat(string(rune('a'+i%26)), size))); err != nil {
				t.Errorf("WriteFile: %v", err)
				return
			}
		}
	})
	wg.Go(func() {
		lf, err := os.OpenFile(filepath.Join(e.work, "log"), os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Error(err)
			return
		}
		defer lf.Close()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			lf.Write([]byte(fmt.Sprintf("%08d\n", i)))
			if i%100 == 99 {
				time.Sleep(time.Millisecond) // about 1 MB/s: far below the file size limit in this test's time
			}
		}
	})
	for i := range 15 {
		got, err := read(f, "f")
		if err != nil || len(got) != size || strings.Count(got, got[:1]) != size {
			t.Errorf("read %d of a file being rewritten: %d bytes, %v; want %d bytes of one letter", i, len(got), err, size)
		}
		lg, err := read(f, "log")
		if err != nil || len(lg)%9 != 0 {
			t.Errorf("read %d of a file being appended to: %d bytes, %v; want whole lines", i, len(lg), err)
			continue
		}
		for j := 0; j < len(lg); j += 9 {
			if want := fmt.Sprintf("%08d\n", j/9); lg[j:j+9] != want {
				t.Errorf("read %d of a file being appended to: line %d is %q, want %q", i, j/9, lg[j:j+9], want)
				break
			}
		}
	}
	close(stop)
	wg.Wait()
}

// TestCancelAndClose: closing a reader or cancelling its context midway
// ends the program.
func TestCancelAndClose(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{FileSize: 64 << 20})
	if err := e.files.WriteFile(context.Background(), "big", &pattern{n: 32 << 20}); err != nil {
		t.Fatal(err)
	}
	rc, err := e.files.ReadFile(context.Background(), "big")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(rc, make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	rc.Close()
	if _, err := rc.Read(make([]byte, 10)); err == nil {
		t.Error("Read after Close succeeded")
	}

	ctx, cancel := context.WithCancel(context.Background())
	rc, err = e.files.ReadFile(ctx, "big")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(rc, make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	cancel()
	if _, err := io.Copy(io.Discard, rc); !errors.Is(err, context.Canceled) {
		t.Errorf("reading on after the context was cancelled = %v, want context.Canceled", err)
	}
	rc.Close()
	if left := sandboxtest.ChildrenLeft(5 * time.Second); len(left) > 0 {
		t.Errorf("programs left running: %q", left)
	}
}

func TestListCap(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{MaxList: 5})
	for i := range 5 {
		e.plant(t, fmt.Sprint(i), file(""))
	}
	if got := names(t, e.files); len(got) != 5 {
		t.Errorf("ListFiles at the cap = %q, want 5 names", got)
	}
	e.plant(t, "5", file(""))
	if _, err := e.files.ListFiles(context.Background()); !errors.Is(err, moat.ErrInvalid) {
		t.Errorf("ListFiles past the cap = %v, want ErrInvalid", err)
	}
}

func TestListSkipsNonUTF8(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	e.plant(t, "bad\xff", file(""))
	e.plant(t, "d", func(p string) error { return os.Mkdir(p, 0o755) })
	e.plant(t, "d/ok \"é\"\n", file("x"))
	if got := names(t, e.files); !equal(got, []string{"d", "d/ok \"é\"\n"}) {
		t.Errorf("ListFiles = %q", got)
	}
}

func TestNoPython(t *testing.T) {
	e := newEnv(t, sessionfiles.Options{})
	f := sessionfiles.New(localExec(e.uid, nil), sessionfiles.Options{Dir: e.work, Python: "/nonexistent/python3"})
	_, err := f.Stat(context.Background(), "x")
	if err == nil || errors.Is(err, moat.ErrInvalid) || errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "/nonexistent/python3") {
		t.Errorf("Stat with no python = %v, want the Exec's error, neither ErrInvalid nor ErrNotExist", err)
	}
}
