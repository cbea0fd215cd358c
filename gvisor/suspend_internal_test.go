package gvisor

import (
	"archive/tar"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/moatsandbox/moat"
)

// openLevel opens the level with cfg, or skips t where it cannot run
// (never under CI=true).
func openLevel(t *testing.T, cfg Config) *Sandbox {
	t.Helper()
	if a := Check(context.Background(), cfg); !a.Available {
		if os.Getenv("CI") == "true" {
			t.Fatalf("the gvisor level cannot run here: %s; CI must test it", a.Reason)
		}
		t.Skipf("the gvisor level cannot run here: %s (%s)", a.Reason, a.Remedy)
	}
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// A state is restored only by a sandbox whose key is the state's (runsc,
// its flags, the root filesystem, the limits, moat's programs), of this
// format and with the options it was saved with; each refusal is
// ErrInvalid and starts nothing.
func TestRestoreRefusesOtherStates(t *testing.T) {
	cfg := Config{StateDir: t.TempDir(), Warm: -1}
	s := openLevel(t, cfg)
	key, err := s.b.stateKey(true)
	if err != nil {
		t.Fatal(err)
	}
	// Another runsc flag is another key.
	other := openLevel(t, Config{StateDir: cfg.StateDir, Warm: -1})
	other.b.testFlags = []string{"--panic-signal=" + strconv.Itoa(int(syscall.SIGUSR2))}
	otherKey, err := other.b.stateKey(true)
	if err != nil {
		t.Fatal(err)
	}
	plainKey, err := s.b.stateKey(false)
	if err != nil {
		t.Fatal(err)
	}
	if otherKey == key || plainKey == key {
		t.Fatal("a sandbox with another runsc flag has the same state key")
	}
	interp := moat.SessionOptions{Interpreter: true}
	for name, c := range map[string]struct {
		m    savedSandbox
		opts moat.SessionOptions
	}{
		"another runsc's flags": {savedSandbox{Format: savedFormat, Key: otherKey, Interpreter: true}, interp},
		"another machine":       {savedSandbox{Format: savedFormat, Key: "0123456789abcdef", Interpreter: true}, interp},
		"another format":        {savedSandbox{Format: savedFormat + 1, Key: key, Interpreter: true}, interp},
		"other options":         {savedSandbox{Format: savedFormat, Key: key, Interpreter: true}, moat.SessionOptions{}},
		"no interpreter's pid":  {savedSandbox{Format: savedFormat, Key: key, Interpreter: true, Live: true, Pid: 1}, interp},
		"a plain one's key":     {savedSandbox{Format: savedFormat, Key: plainKey, Interpreter: true}, interp},
		// A forged account of CPU used would lift the session's budget.
		"a negative CPU used": {savedSandbox{Format: savedFormat, Key: key, Interpreter: true, CPUUsedNS: -1 << 62}, interp},
		"a nonce not moat's": {savedSandbox{Format: savedFormat, Key: key, Interpreter: true, Live: true, Pid: 2,
			Prev: "X0123456789abcdef0123456789abcd\n"}, interp},
	} {
		dir := t.TempDir()
		b, _ := json.Marshal(c.m)
		os.WriteFile(filepath.Join(dir, savedMetaFile), b, 0o600)
		os.Mkdir(filepath.Join(dir, savedImageDir), 0o700)
		os.WriteFile(filepath.Join(dir, savedImageDir, "checkpoint.img"), []byte("not an image"), 0o600)
		inst, err := s.b.RestoreState(context.Background(), dir, c.opts)
		if !errors.Is(err, moat.ErrInvalid) {
			if inst != nil {
				inst.Close()
			}
			t.Errorf("%s: RestoreState = %v, want an error wrapping ErrInvalid", name, err)
		}
	}
	if left, _ := os.ReadDir(s.b.bundles); len(left) > 0 {
		t.Errorf("a refused state made %d bundles", len(left))
	}
	if left, _ := os.ReadDir(s.b.runscRoot); len(left) > 0 {
		t.Errorf("a refused state left %d entries in runsc's root", len(left))
	}
}

// A damaged working directory archive is refused with ErrInvalid: names
// that leave the directory, and kinds of file that archiveWork never
// writes.
func TestExtractWorkRefuses(t *testing.T) {
	for name, write := range map[string]func(w *tarWriter){
		"a name with ..":   func(w *tarWriter) { w.file("../escape", "x") },
		"an absolute name": func(w *tarWriter) { w.file("/etc/escape", "x") },
		"a device":         func(w *tarWriter) { w.dev("null") },
		"a hard link":      func(w *tarWriter) { w.hardlink("l", "/etc/passwd") },
		"a hard link to a name not made": func(w *tarWriter) {
			w.file("f", "x")
			w.hardlink("l", "g")
		},
		"a hard link to a directory": func(w *tarWriter) {
			w.header(&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755})
			w.hardlink("l", "d")
		},
	} {
		t.Run(name, func(t *testing.T) {
			src := filepath.Join(t.TempDir(), "work.tar")
			w := newTarWriter(t, src)
			write(w)
			w.close()
			work := t.TempDir()
			if err := extractWork(src, work); !errors.Is(err, moat.ErrInvalid) {
				t.Errorf("extractWork = %v, want an error wrapping ErrInvalid", err)
			}
			if _, err := os.Stat(filepath.Join(filepath.Dir(work), "escape")); err == nil {
				t.Error("a file was written outside the working directory")
			}
		})
	}
}

// archiveWork and extractWork keep directories, files and links with
// their modes, owners and times.
func TestArchiveWorkRoundTrip(t *testing.T) {
	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "d/e"), 0o750)
	os.WriteFile(filepath.Join(src, "d/f"), []byte("data"), 0o640)
	os.Symlink("../d/f", filepath.Join(src, "d/e/link"))
	for _, name := range []string{".", "d", "d/e", "d/f"} {
		os.Chown(filepath.Join(src, name), sandboxUID, sandboxGID)
	}
	os.Lchown(filepath.Join(src, "d/e/link"), sandboxUID, sandboxGID)
	tarFile := filepath.Join(t.TempDir(), "work.tar")
	if err := archiveWork(src, tarFile, 1<<20); err != nil {
		t.Fatal(err)
	}
	dst := t.TempDir()
	if err := extractWork(tarFile, dst); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"d", "d/e", "d/f", "d/e/link"} {
		a, err1 := os.Lstat(filepath.Join(src, name))
		b, err2 := os.Lstat(filepath.Join(dst, name))
		if err1 != nil || err2 != nil {
			t.Fatalf("%s: %v %v", name, err1, err2)
		}
		sa, sb := a.Sys().(*syscall.Stat_t), b.Sys().(*syscall.Stat_t)
		if a.Mode() != b.Mode() || sa.Uid != sb.Uid || sa.Gid != sb.Gid || (!a.IsDir() && a.Mode()&os.ModeSymlink == 0 && !a.ModTime().Equal(b.ModTime())) {
			t.Errorf("%s: saved %v %d:%d %v, restored %v %d:%d %v", name, a.Mode(), sa.Uid, sa.Gid, a.ModTime(), b.Mode(), sb.Uid, sb.Gid, b.ModTime())
		}
	}
	if l, _ := os.Readlink(filepath.Join(dst, "d/e/link")); l != "../d/f" {
		t.Errorf("the link points to %q", l)
	}
}

// The archive of a working directory is bounded by the directory's size,
// whatever the code made in it: a file of many names (hard links) is
// written once, and files that hold more than they use (sparse ones) are
// refused before anything is written, not written out whole.
func TestSuspendWorkBounded(t *testing.T) {
	const size = 1 << 20
	src := t.TempDir()
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i)
	}
	if err := os.WriteFile(filepath.Join(src, "f"), data, 0o644); err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		if err := os.Link(filepath.Join(src, "f"), filepath.Join(src, "l"+strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	tarFile := filepath.Join(t.TempDir(), "work.tar")
	if err := archiveWork(src, tarFile, 2*size); err != nil {
		t.Fatalf("archiveWork of a file with 41 names: %v", err)
	}
	if st, err := os.Stat(tarFile); err != nil || st.Size() > 2*size {
		t.Fatalf("the archive of a 1 MiB file with 41 names: %v, %d bytes", err, st.Size())
	}
	dst := t.TempDir()
	if err := extractWork(tarFile, dst); err != nil {
		t.Fatal(err)
	}
	a, err1 := os.Stat(filepath.Join(dst, "f"))
	b, err2 := os.Stat(filepath.Join(dst, "l39"))
	if err1 != nil || err2 != nil || !os.SameFile(a, b) || a.Sys().(*syscall.Stat_t).Nlink != 41 {
		t.Fatalf("restored: %v %v, same file %v", err1, err2, err1 == nil && err2 == nil && os.SameFile(a, b))
	}
	if got, _ := os.ReadFile(filepath.Join(dst, "l7")); string(got) != string(data) {
		t.Error("a restored name of the file does not hold its data")
	}

	sparse := t.TempDir()
	for i := range 4 {
		f, err := os.Create(filepath.Join(sparse, "s"+strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		f.Truncate(size)
		f.Close()
	}
	if err := checkWork(sparse, 2*size); err == nil {
		t.Error("checkWork of 4 MiB of sparse files kept within 2 MiB")
	}
	out := filepath.Join(t.TempDir(), "work.tar")
	if err := archiveWork(sparse, out, 2*size); err == nil {
		t.Error("archiveWork of 4 MiB of sparse files kept within 2 MiB")
	}
	if st, err := os.Stat(out); err == nil && st.Size() > 2*size+64<<10 {
		t.Errorf("archiveWork wrote %d bytes for a limit of %d", st.Size(), 2*size)
	}
}

// A damaged archive cannot make a file of another owner than the
// sandbox's uid in the working directory (a setgid directory of root's
// group, a file of root's).
func TestExtractWorkOwners(t *testing.T) {
	src := filepath.Join(t.TempDir(), "work.tar")
	w := newTarWriter(t, src)
	w.header(&tar.Header{Name: "./", Typeflag: tar.TypeDir, Mode: 0o2777})
	w.header(&tar.Header{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o2777})
	w.header(&tar.Header{Name: "d/f", Typeflag: tar.TypeReg, Mode: 0o2755, Size: 1})
	w.tw.Write([]byte("x"))
	w.header(&tar.Header{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "d/f"})
	w.close()
	work := t.TempDir()
	if err := extractWork(src, work); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{".", "d", "d/f", "l"} {
		fi, err := os.Lstat(filepath.Join(work, name))
		if err != nil {
			t.Fatal(err)
		}
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != sandboxUID || st.Gid != sandboxGID {
			t.Errorf("%s: owner %d:%d from an archive of root's, want the sandbox's %d:%d", name, st.Uid, st.Gid, sandboxUID, sandboxGID)
		}
	}
}

// tarWriter writes hand-made archives for the tests of extractWork.
type tarWriter struct {
	t  *testing.T
	f  *os.File
	tw *tar.Writer
}

func newTarWriter(t *testing.T, path string) *tarWriter {
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	return &tarWriter{t: t, f: f, tw: tar.NewWriter(f)}
}

func (w *tarWriter) header(h *tar.Header) {
	if err := w.tw.WriteHeader(h); err != nil {
		w.t.Fatal(err)
	}
}

func (w *tarWriter) file(name, data string) {
	w.header(&tar.Header{Name: name, Typeflag: tar.TypeReg, Mode: 0o644, Size: int64(len(data))})
	w.tw.Write([]byte(data))
}

func (w *tarWriter) dev(name string) {
	w.header(&tar.Header{Name: name, Typeflag: tar.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 3})
}

func (w *tarWriter) hardlink(name, target string) {
	w.header(&tar.Header{Name: name, Typeflag: tar.TypeLink, Linkname: target})
}

func (w *tarWriter) close() {
	w.tw.Close()
	w.f.Close()
}

// A resume takes the interpreter's pid from the restored init, not from
// sandbox.json alone: a state naming another pid than the init runs is
// refused, and one whose interpreter ended just before the checkpoint
// (its end's frames left unread in the old pipe) resumes without it, its
// next run starting a fresh one.
func TestRestoreAsksTheInit(t *testing.T) {
	cfg := Config{StateDir: t.TempDir(), Warm: -1}
	s := openLevel(t, cfg)
	interp := moat.SessionOptions{Interpreter: true}
	save := func(code string) (string, savedSandbox) {
		ss, err := s.NewSession(context.Background(), interp)
		if err != nil {
			t.Fatal(err)
		}
		defer ss.Close()
		if _, err := ss.Run(context.Background(), moat.Request{Code: []byte(code)}); err != nil {
			t.Fatal(err)
		}
		dir := filepath.Join(t.TempDir(), "s")
		if _, err := ss.(moat.Suspender).Suspend(context.Background(), dir); err != nil {
			t.Fatal(err)
		}
		state := filepath.Join(dir, "state")
		var m savedSandbox
		b, err := os.ReadFile(filepath.Join(state, savedMetaFile))
		if err == nil {
			err = json.Unmarshal(b, &m)
		}
		if err != nil {
			t.Fatal(err)
		}
		return state, m
	}
	rewrite := func(state string, m savedSandbox) {
		b, _ := json.Marshal(m)
		if err := os.WriteFile(filepath.Join(state, savedMetaFile), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	live, m := save("x = 1")
	if !m.Live || m.Pid <= 1 {
		t.Fatalf("a live interpreter's state: %+v", m)
	}
	inst, err := s.b.RestoreState(context.Background(), live, interp)
	if err != nil {
		t.Fatal(err)
	}
	if ss := inst.(*session); ss.interp == nil || ss.interp.proc.pid != m.Pid {
		t.Errorf("the restored interpreter: %+v, want pid %d", ss.interp, m.Pid)
	}
	// The session's budget counts on from what its runs used.
	if ss := inst.(*session); m.CPUUsedNS <= 0 || ss.spent != time.Duration(m.CPUUsedNS) {
		t.Errorf("the restored session has spent %v of CPU, its state says %d ns", ss.spent, m.CPUUsedNS)
	}
	inst.Close()
	forged := m
	forged.Pid = m.Pid + 7
	rewrite(live, forged)
	if inst, err := s.b.RestoreState(context.Background(), live, interp); !errors.Is(err, moat.ErrInvalid) {
		if inst != nil {
			inst.Close()
		}
		t.Errorf("RestoreState of a state naming pid %d, the init running %d = %v, want an error wrapping ErrInvalid", forged.Pid, m.Pid, err)
	}

	ended, m := save("import os\nos._exit(0)")
	if m.Live {
		t.Fatalf("the state after the interpreter ended says it is live: %+v", m)
	}
	m.Live, m.Pid = true, 2
	rewrite(ended, m)
	inst, err = s.b.RestoreState(context.Background(), ended, interp)
	if err != nil {
		t.Fatalf("RestoreState of an interpreter the init no longer runs: %v", err)
	}
	if ss := inst.(*session); ss.interp != nil || ss.ended == "" {
		t.Errorf("a restored session whose interpreter had ended: interpreter %+v, ended %q; want none, said", ss.interp, ss.ended)
	}
	inst.Close()
	if left, _ := os.ReadDir(s.b.bundles); len(left) > 0 {
		t.Errorf("%d bundles left", len(left))
	}
}
