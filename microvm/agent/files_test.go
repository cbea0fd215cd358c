package main

import (
	"bytes"
	"encoding/json"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// The session's file operations, run on this host's kernel in a temporary
// directory: what they do, and that no symbolic link the code planted takes
// them out of the working directory.

// recorder keeps the frames the agent sends.
type recorder struct {
	mu     sync.Mutex
	frames []recorded
}

type recorded struct {
	k wire.Kind
	p []byte
}

func (r *recorder) send(k wire.Kind, p []byte) error {
	if len(p) > wire.MaxReport {
		return wire.ErrTooLarge
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.frames = append(r.frames, recorded{k, append([]byte(nil), p...)})
	return nil
}

func (r *recorder) sendJSON(k wire.Kind, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return r.send(k, b)
}

// take returns the frames sent since the last take.
func (r *recorder) take() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := r.frames
	r.frames = nil
	return f
}

type session struct {
	t    *testing.T
	dir  string // the working directory
	out  string // a directory beside it, outside
	f    *files
	rec  *recorder
	next uint64
}

func newSession(t *testing.T) *session {
	t.Helper()
	root := t.TempDir()
	s := &session{t: t, dir: filepath.Join(root, "work"), out: filepath.Join(root, "outside"), rec: &recorder{}}
	for _, d := range []string{s.dir, s.out} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(s.out, "secret"), []byte("host secret"), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := openFiles(s.dir, os.Getuid(), os.Getgid(), 1<<20, s.rec)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(f.root) })
	s.f = f
	return s
}

// op runs one operation and returns its replies and the data it sent.
func (s *session) op(op, name, to string) ([]wire.FileReply, []byte) {
	s.t.Helper()
	s.next++
	s.f.do(&wire.File{ID: s.next, Op: op, Name: name, To: to})
	var replies []wire.FileReply
	var data []byte
	for _, fr := range s.rec.take() {
		switch fr.k {
		case wire.KindReply:
			var r wire.FileReply
			if err := json.Unmarshal(fr.p, &r); err != nil {
				s.t.Fatal(err)
			}
			if r.ID != s.next {
				s.t.Fatalf("%s %q: a reply to operation %d, want %d", op, name, r.ID, s.next)
			}
			replies = append(replies, r)
		case wire.KindData:
			id, b, err := wire.DataID(fr.p)
			if err != nil || id != s.next {
				s.t.Fatalf("%s %q: data of operation %d (%v), want %d", op, name, id, err, s.next)
			}
			data = append(data, b...)
		default:
			s.t.Fatalf("%s %q: the agent sent %s", op, name, fr.k)
		}
	}
	if len(replies) == 0 || replies[len(replies)-1].More {
		s.t.Fatalf("%s %q: replies %+v do not end", op, name, replies)
	}
	return replies, data
}

// errno runs op and returns the error number of its last reply.
func (s *session) errno(op, name, to string) syscall.Errno {
	s.t.Helper()
	r, _ := s.op(op, name, to)
	return syscall.Errno(r[len(r)-1].Errno)
}

// write writes content to name in chunks and commits it.
func (s *session) write(name string, content []byte, chunk int) syscall.Errno {
	s.t.Helper()
	s.next++
	id := s.next
	s.f.do(&wire.File{ID: id, Op: wire.OpWrite, Name: name})
	for len(content) > 0 {
		n := min(chunk, len(content))
		s.f.data(id, content[:n])
		content = content[n:]
	}
	s.f.do(&wire.File{ID: id, Op: wire.OpCommit})
	frames := s.rec.take()
	if len(frames) != 1 || frames[0].k != wire.KindReply {
		s.t.Fatalf("write %q: frames %v, want one reply at the commit", name, frames)
	}
	var r wire.FileReply
	json.Unmarshal(frames[0].p, &r)
	if r.ID != id || r.More {
		s.t.Fatalf("write %q: reply %+v", name, r)
	}
	return syscall.Errno(r.Errno)
}

func (s *session) read(name string) ([]byte, syscall.Errno) {
	s.t.Helper()
	r, data := s.op(wire.OpRead, name, "")
	last := r[len(r)-1]
	if last.Errno != 0 {
		return nil, syscall.Errno(last.Errno)
	}
	if len(r) != 2 || int64(len(data)) != r[0].Size {
		s.t.Fatalf("read %q: replies %+v, %d bytes", name, r, len(data))
	}
	return data, 0
}

func TestFilesWriteRead(t *testing.T) {
	s := newSession(t)
	big := bytes.Repeat([]byte("0123456789abcdef"), 40000) // 640000 bytes: many Data frames
	if e := s.write("a/b/c.bin", big, 100000); e != 0 {
		t.Fatalf("write: %v", e)
	}
	got, e := s.read("a/b/c.bin")
	if e != 0 || !bytes.Equal(got, big) {
		t.Fatalf("read back %d bytes (%v), want %d", len(got), e, len(big))
	}
	// Replacing keeps no trace of the upload file.
	if e := s.write("a/b/c.bin", []byte("short"), 2); e != 0 {
		t.Fatal(e)
	}
	if got, _ := s.read("a/b/c.bin"); string(got) != "short" {
		t.Errorf("after the second write: %q", got)
	}
	ents, _ := os.ReadDir(filepath.Join(s.dir, "a/b"))
	if len(ents) != 1 {
		t.Errorf("a/b holds %v, want only c.bin", ents)
	}
	// An empty file.
	if e := s.write("empty", nil, 1); e != 0 {
		t.Fatal(e)
	}
	if got, e := s.read("empty"); e != 0 || len(got) != 0 {
		t.Errorf("empty: %q %v", got, e)
	}
}

func TestFilesWriteTooLarge(t *testing.T) {
	s := newSession(t)
	s.write("f", []byte("before"), 10)
	if e := s.write("f", make([]byte, 1<<20+1), 1<<16); e != unix.EFBIG {
		t.Fatalf("a write past the file size limit: %v, want EFBIG", e)
	}
	if got, _ := s.read("f"); string(got) != "before" {
		t.Errorf("after a refused write the file holds %q, want it as it was", got)
	}
	ents, _ := os.ReadDir(s.dir)
	if len(ents) != 1 {
		t.Errorf("the directory holds %v after a refused write, want f only", ents)
	}
	// An aborted write leaves nothing.
	s.next++
	s.f.do(&wire.File{ID: s.next, Op: wire.OpWrite, Name: "g"})
	s.f.data(s.next, []byte("x"))
	s.f.do(&wire.File{ID: s.next, Op: wire.OpAbort})
	if f := s.rec.take(); len(f) != 0 {
		t.Errorf("abort sent %v", f)
	}
	if ents, _ := os.ReadDir(s.dir); len(ents) != 1 {
		t.Errorf("an aborted write left %v", ents)
	}
}

// No operation follows a symbolic link, whether it is the name's last
// element or one before it, inside the directory or out of it.
func TestFilesNoSymlinks(t *testing.T) {
	s := newSession(t)
	os.Symlink(s.out, filepath.Join(s.dir, "out"))
	os.Symlink(filepath.Join(s.out, "secret"), filepath.Join(s.dir, "secret"))
	os.Symlink("../outside/secret", filepath.Join(s.dir, "rel"))
	os.Mkdir(filepath.Join(s.dir, "in"), 0o755)
	os.WriteFile(filepath.Join(s.dir, "in", "x"), []byte("x"), 0o644)
	os.Symlink("in", filepath.Join(s.dir, "inlink"))
	for _, name := range []string{"out/secret", "secret", "rel", "inlink/x", "inlink"} {
		if _, e := s.read(name); e == 0 {
			t.Errorf("read %q through a symbolic link", name)
		}
	}
	if e := s.write("out/planted", []byte("x"), 1); e == 0 {
		t.Errorf("write through a symbolic link to a directory outside succeeded")
	}
	if e := s.write("inlink/y", []byte("x"), 1); e == 0 {
		t.Errorf("write through a symbolic link to a directory inside succeeded")
	}
	if e := s.errno(wire.OpMkdir, "out/d", ""); e == 0 {
		t.Errorf("mkdir through a symbolic link succeeded")
	}
	if e := s.errno(wire.OpRemove, "out/secret", ""); e == 0 {
		t.Errorf("remove through a symbolic link succeeded")
	}
	if e := s.errno(wire.OpRename, "in/x", "out/x"); e == 0 {
		t.Errorf("rename through a symbolic link succeeded")
	}
	if e := s.errno(wire.OpStat, "out/secret", ""); e == 0 {
		t.Errorf("stat through a symbolic link succeeded")
	}
	for _, name := range []string{"../outside/secret", "/etc/passwd", "a/../../outside/secret", ""} {
		if _, e := s.read(name); e != unix.EINVAL {
			t.Errorf("read %q: %v, want EINVAL", name, e)
		}
	}
	// Writing onto a link replaces the link, never its target.
	if e := s.write("secret", []byte("mine"), 4); e != 0 {
		t.Fatal(e)
	}
	if b, _ := os.ReadFile(filepath.Join(s.out, "secret")); string(b) != "host secret" {
		t.Errorf("the file outside now holds %q", b)
	}
	// Removing a link removes the link itself.
	if e := s.errno(wire.OpRemove, "rel", ""); e != 0 {
		t.Fatal(e)
	}
	if _, err := os.Stat(filepath.Join(s.out, "secret")); err != nil {
		t.Errorf("removing a link removed its target: %v", err)
	}
	// Stat describes the link.
	r, _ := s.op(wire.OpStat, "out", "")
	if r[0].Info == nil || fs.FileMode(r[0].Info.Mode)&fs.ModeSymlink == 0 || r[0].Info.Name != "out" {
		t.Errorf("stat of a link: %+v", r[0].Info)
	}
	if b, _ := os.ReadFile(filepath.Join(s.out, "secret")); string(b) != "host secret" {
		t.Errorf("the file outside holds %q", b)
	}
	if ents, _ := os.ReadDir(s.out); len(ents) != 1 {
		t.Errorf("the directory outside holds %v", ents)
	}
}

func TestFilesOps(t *testing.T) {
	s := newSession(t)
	if e := s.errno(wire.OpMkdir, "d/e/f", ""); e != 0 {
		t.Fatal(e)
	}
	if e := s.errno(wire.OpMkdir, "d/e/f", ""); e != 0 {
		t.Errorf("mkdir of a directory that is there: %v", e)
	}
	s.write("d/e/f/x", []byte("xx"), 1)
	if e := s.errno(wire.OpMkdir, "d/e/f/x", ""); e != unix.ENOTDIR && e != unix.EEXIST {
		t.Errorf("mkdir of a file: %v, want ENOTDIR or EEXIST", e)
	}
	if e := s.errno(wire.OpRename, "d/e/f/x", "y"); e != 0 {
		t.Fatal(e)
	}
	if got, _ := s.read("y"); string(got) != "xx" {
		t.Errorf("after the rename: %q", got)
	}
	if e := s.errno(wire.OpRemove, "d/e", ""); e != unix.ENOTEMPTY {
		t.Errorf("remove of a directory with something in it: %v, want ENOTEMPTY", e)
	}
	if e := s.errno(wire.OpRemove, "d/e/f", ""); e != 0 {
		t.Errorf("remove of an empty directory: %v", e)
	}
	if e := s.errno(wire.OpRemove, "nothing", ""); e != unix.ENOENT {
		t.Errorf("remove of a missing file: %v, want ENOENT", e)
	}
	if _, e := s.read("d"); e != unix.EISDIR {
		t.Errorf("read of a directory: %v, want EISDIR", e)
	}
	if err := unix.Mkfifo(filepath.Join(s.dir, "fifo"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, e := s.read("fifo"); e != unix.EINVAL {
		t.Errorf("read of a FIFO: %v, want EINVAL (and no hang)", e)
	}
	r, _ := s.op(wire.OpStat, "y", "")
	if i := r[0].Info; i == nil || i.Name != "y" || i.Size != 2 || !fs.FileMode(i.Mode).IsRegular() || fs.FileMode(i.Mode).Perm() != 0o644 {
		t.Errorf("stat y: %+v", r[0].Info)
	}
	if e := s.errno(wire.OpStat, "missing", ""); e != unix.ENOENT {
		t.Errorf("stat of a missing file: %v", e)
	}
	if e := s.errno("chmod", "y", ""); e != unix.EINVAL {
		t.Errorf("an unknown operation: %v, want EINVAL", e)
	}
}

func TestFilesList(t *testing.T) {
	s := newSession(t)
	// Enough names, long ones, to need several replies.
	long := strings.Repeat("n", 200)
	var want []string
	for i := range 300 {
		name := filepath.Join("dir", long+string(rune('a'+i%26))+strings.Repeat("x", i/26))
		want = append(want, name)
	}
	want = append(want, "dir", "link")
	os.Mkdir(filepath.Join(s.dir, "dir"), 0o755)
	for _, n := range want[:300] {
		os.WriteFile(filepath.Join(s.dir, n), []byte("1"), 0o644)
	}
	os.Symlink(s.out, filepath.Join(s.dir, "link"))
	r, _ := s.op(wire.OpList, "", "")
	if len(r) < 3 {
		t.Errorf("%d replies for a long list, want it split", len(r))
	}
	var got []string
	for _, rep := range r {
		for _, e := range rep.Entries {
			got = append(got, e.Name)
			if strings.HasPrefix(e.Name, "link/") {
				t.Errorf("the list followed a link: %s", e.Name)
			}
		}
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("listed %d names, want %d", len(got), len(want))
	}
}

// A tree the code made deep enough that its names pass the host's 4096
// bytes (and one of them a frame): the listing fails with ENAMETOOLONG,
// which the host takes as the caller's error, rather than send a name the
// host refuses as no answer of the agent's or drop a batch too large to
// send and end the listing short as if whole.
func TestFilesListDeep(t *testing.T) {
	s := newSession(t)
	long := strings.Repeat("d", 250)
	d, err := unix.Open(s.dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	for range 300 { // 75 kB of name at the bottom, more than wire.MaxReport
		if err := unix.Mkdirat(d, long, 0o755); err != nil {
			t.Fatal(err)
		}
		next, err := unix.Openat(d, long, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		unix.Close(d)
		if err != nil {
			t.Fatal(err)
		}
		d = next
	}
	unix.Close(d)
	r, _ := s.op(wire.OpList, "", "")
	if e := syscall.Errno(r[len(r)-1].Errno); e != syscall.ENAMETOOLONG {
		n := 0
		for _, rep := range r {
			n += len(rep.Entries)
		}
		t.Errorf("listing a tree 300 deep: errno %v after %d entries, want ENAMETOOLONG", e, n)
	}
	for _, rep := range r {
		for _, e := range rep.Entries {
			if len(e.Name) > 4096 {
				t.Fatalf("the listing sent a name of %d bytes", len(e.Name))
			}
		}
	}
}
