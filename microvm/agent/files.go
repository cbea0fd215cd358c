package main

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat/microvm/internal/wire"
)

// The file operations of a session, carried out inside the guest on its
// working directory. Every name is resolved beneath the directory with
// openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS |
// RESOLVE_NO_XDEV), one descriptor at a time, so that no symbolic link the
// code planted (in the name's last element or any before it) is followed,
// and no rename racing the walk leads out. The operation's last element is
// then acted on through its parent's descriptor (fstatat, mkdirat,
// renameat, unlinkat) without following it either.

const resolveFlags = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// sender is where replies go: the agent's port.
type sender interface {
	send(k wire.Kind, p []byte) error
	sendJSON(k wire.Kind, v any) error
}

// files is a session's working directory.
type files struct {
	root     int // an O_PATH descriptor of the directory
	uid, gid int // what the agent creates belongs to them
	fileSize int64
	out      sender

	uploads map[uint64]*upload // writes begun and not yet committed

	mu   sync.Mutex
	mine map[uint64]bool // inodes the host wrote since the run began
}

// upload is a write in progress: a new file beside its name, moved onto
// the name at the commit.
type upload struct {
	dir   int // its directory
	tmp   string
	name  string
	fd    int
	n     int64
	errno unix.Errno // the first failure; the write is then dropped
}

// openFiles opens the working directory dir.
func openFiles(dir string, uid, gid int, fileSize int64, out sender) (*files, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: dir, Err: err}
	}
	return &files{root: fd, uid: uid, gid: gid, fileSize: fileSize, out: out,
		uploads: map[uint64]*upload{}, mine: map[uint64]bool{}}, nil
}

// runStarts forgets the files the host wrote before the run begins.
func (f *files) runStarts() {
	f.mu.Lock()
	f.mine = map[uint64]bool{}
	f.mu.Unlock()
}

// committed returns the inodes of the files the host wrote since the run
// began.
func (f *files) committed() map[uint64]bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := make(map[uint64]bool, len(f.mine))
	for k := range f.mine {
		m[k] = true
	}
	return m
}

// openat opens name beneath dir without following any symbolic link.
func openat(dir int, name string, flags int, mode uint32) (int, error) {
	how := unix.OpenHow{Flags: uint64(flags | unix.O_CLOEXEC | unix.O_NOFOLLOW), Mode: uint64(mode), Resolve: resolveFlags}
	for i := 0; ; i++ {
		fd, err := unix.Openat2(dir, name, &how)
		// EAGAIN: a rename raced the resolution; try again a few times.
		if (err == unix.EAGAIN || err == unix.EINTR) && i < 16 {
			continue
		}
		return fd, err
	}
}

// checkName refuses what the host never sends: the host checks names with
// engine.CleanName.
func checkName(name string) error {
	if name == "" || name == "." || strings.HasPrefix(name, "/") || !fs.ValidPath(name) {
		return unix.EINVAL
	}
	return nil
}

// parent opens the directory of name and returns it with name's last
// element.
func (f *files) parent(name string) (int, string, error) {
	if err := checkName(name); err != nil {
		return -1, "", err
	}
	dir, base := path.Split(name)
	if dir == "" {
		dir = "."
	}
	fd, err := openat(f.root, strings.TrimSuffix(dir, "/"), unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, "", err
	}
	return fd, base, nil
}

// mkdirAll creates the directory name and its missing parents, and returns
// it open. "." is the working directory itself.
func (f *files) mkdirAll(name string) (int, error) {
	cur, err := openat(f.root, ".", unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return -1, err
	}
	if name == "." {
		return cur, nil
	}
	if err := checkName(name); err != nil {
		unix.Close(cur)
		return -1, err
	}
	for _, el := range strings.Split(name, "/") {
		err := unix.Mkdirat(cur, el, 0o755)
		if err == nil {
			err = unix.Fchownat(cur, el, f.uid, f.gid, unix.AT_SYMLINK_NOFOLLOW)
		} else if err == unix.EEXIST {
			err = nil
		}
		var next int
		if err == nil {
			next, err = openat(cur, el, unix.O_PATH|unix.O_DIRECTORY, 0)
		}
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}

// entry describes name, at dir/base, without following it.
func entry(dir int, base, name string) (wire.FileEntry, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(dir, base, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return wire.FileEntry{}, err
	}
	return wire.FileEntry{Name: name, Size: st.Size, Mode: uint32(fileMode(st.Mode)), ModNano: st.Mtim.Nano()}, nil
}

// fileMode is Go's fs.FileMode of a stat mode.
func fileMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	switch m & unix.S_IFMT {
	case unix.S_IFDIR:
		mode |= fs.ModeDir
	case unix.S_IFLNK:
		mode |= fs.ModeSymlink
	case unix.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case unix.S_IFSOCK:
		mode |= fs.ModeSocket
	case unix.S_IFCHR:
		mode |= fs.ModeDevice | fs.ModeCharDevice
	case unix.S_IFBLK:
		mode |= fs.ModeDevice
	}
	if m&unix.S_ISUID != 0 {
		mode |= fs.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		mode |= fs.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}

// errnoOf is err's error number, EIO when it has none.
func errnoOf(err error) int {
	if err == nil {
		return 0
	}
	var e unix.Errno
	if errors.As(err, &e) && e != 0 {
		return int(e)
	}
	return int(unix.EIO)
}

// do carries out op and sends its replies.
func (f *files) do(op *wire.File) {
	reply := func(r wire.FileReply) {
		r.ID = op.ID
		f.out.sendJSON(wire.KindReply, r)
	}
	fail := func(err error) { reply(wire.FileReply{Errno: errnoOf(err)}) }
	switch op.Op {
	case wire.OpStat:
		dir, base, err := f.parent(op.Name)
		if err != nil {
			fail(err)
			return
		}
		e, err := entry(dir, base, op.Name)
		unix.Close(dir)
		if err != nil {
			fail(err)
			return
		}
		reply(wire.FileReply{Info: &e})
	case wire.OpList:
		err := f.list(func(batch []wire.FileEntry) {
			reply(wire.FileReply{Entries: batch, More: true})
		})
		if err != nil {
			fail(err)
			return
		}
		reply(wire.FileReply{})
	case wire.OpRead:
		f.read(op.ID, op.Name, reply)
	case wire.OpMkdir:
		fd, err := f.mkdirAll(op.Name)
		if err == nil {
			unix.Close(fd)
		}
		fail(err)
	case wire.OpRename:
		fd, fb, err := f.parent(op.Name)
		if err != nil {
			fail(err)
			return
		}
		defer unix.Close(fd)
		td, tb, err := f.parent(op.To)
		if err != nil {
			fail(err)
			return
		}
		defer unix.Close(td)
		fail(unix.Renameat(fd, fb, td, tb))
	case wire.OpRemove:
		dir, base, err := f.parent(op.Name)
		if err != nil {
			fail(err)
			return
		}
		defer unix.Close(dir)
		err = unix.Unlinkat(dir, base, 0)
		if err == unix.EISDIR {
			err = unix.Unlinkat(dir, base, unix.AT_REMOVEDIR)
		}
		fail(err)
	case wire.OpWrite:
		f.begin(op.ID, op.Name)
	case wire.OpCommit:
		fail(f.commit(op.ID))
	case wire.OpAbort:
		if u := f.uploads[op.ID]; u != nil {
			f.drop(op.ID, u)
		}
	default:
		fail(unix.EINVAL)
	}
}

// maxName is the longest name the host takes (engine.CleanName's bound):
// a listing that reaches a longer one, in a tree the code made deep
// enough, fails with ENAMETOOLONG rather than send a name the host
// refuses as no answer of the agent's, or a batch too large for a frame,
// which would be dropped and leave the listing silently short.
const maxName = 4096

// list walks the working directory, depth first in name order, and hands
// its entries to emit in batches that fit in a reply frame.
func (f *files) list(emit func([]wire.FileEntry)) error {
	var batch []wire.FileEntry
	size := 0
	add := func(e wire.FileEntry) {
		batch = append(batch, e)
		size += len(e.Name)*6 + 96 // the worst of JSON's escapes
		if size > wire.MaxReport/2 {
			emit(batch)
			batch, size = nil, 0
		}
	}
	var walk func(dir int, prefix string) error
	walk = func(dir int, prefix string) error {
		d := os.NewFile(uintptr(dir), "dir")
		defer d.Close()
		names, err := d.Readdirnames(-1)
		if err != nil {
			return err
		}
		sort.Strings(names)
		for _, n := range names {
			if len(prefix)+len(n) > maxName {
				return unix.ENAMETOOLONG
			}
			e, err := entry(dir, n, prefix+n)
			if err == unix.ENOENT {
				continue // gone since the directory was read
			}
			if err != nil {
				return err
			}
			add(e)
			if fs.FileMode(e.Mode).IsDir() {
				sub, err := openat(dir, n, unix.O_RDONLY|unix.O_DIRECTORY, 0)
				if err == unix.ENOENT {
					continue
				}
				if err != nil {
					return err
				}
				if err := walk(sub, prefix+n+"/"); err != nil {
					return err
				}
			}
		}
		return nil
	}
	root, err := openat(f.root, ".", unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return err
	}
	if err := walk(root, ""); err != nil {
		return err
	}
	if len(batch) > 0 {
		emit(batch)
	}
	return nil
}

// read sends name's contents: a reply with its size, Data frames of at
// most that many bytes in all, and a last reply.
func (f *files) read(id uint64, name string, reply func(wire.FileReply)) {
	fail := func(err error) { reply(wire.FileReply{Errno: errnoOf(err)}) }
	if err := checkName(name); err != nil {
		fail(err)
		return
	}
	// O_NONBLOCK: opening a FIFO the code planted must not block.
	fd, err := openat(f.root, name, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY, 0)
	if err != nil {
		fail(err)
		return
	}
	file := os.NewFile(uintptr(fd), name)
	defer file.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		fail(err)
		return
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFDIR:
		fail(unix.EISDIR)
		return
	default:
		fail(unix.EINVAL)
		return
	}
	reply(wire.FileReply{Size: st.Size, More: true})
	buf := make([]byte, wire.MaxData)
	left := st.Size
	for left > 0 {
		n, err := file.Read(buf[:min(int64(len(buf)), left)])
		if n > 0 {
			if err := f.out.send(wire.KindData, wire.DataPayload(id, buf[:n])); err != nil {
				return
			}
			left -= int64(n)
		}
		if err != nil {
			break // shorter than it was: what there was is sent
		}
	}
	reply(wire.FileReply{})
}

// begin opens a write of name: a new file beside it, which commit moves
// onto it.
func (f *files) begin(id uint64, name string) {
	u := &upload{dir: -1, fd: -1, name: name}
	f.uploads[id] = u
	if err := checkName(name); err != nil {
		u.errno = unix.EINVAL
		return
	}
	dir, base := path.Split(name)
	if dir == "" {
		dir = "."
	}
	fd, err := f.mkdirAll(strings.TrimSuffix(dir, "/"))
	if err != nil {
		u.errno = unix.Errno(errnoOf(err))
		return
	}
	u.dir, u.name = fd, base
	var rnd [6]byte
	rand.Read(rnd[:])
	u.tmp = ".moat-upload-" + hex.EncodeToString(rnd[:])
	u.fd, err = openat(fd, u.tmp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL, 0o644)
	if err == nil {
		err = unix.Fchown(u.fd, f.uid, f.gid)
	}
	if err != nil {
		u.errno = unix.Errno(errnoOf(err))
	}
}

// data writes a chunk of the write id.
func (f *files) data(id uint64, b []byte) {
	u := f.uploads[id]
	if u == nil || u.errno != 0 {
		return
	}
	if u.n+int64(len(b)) > f.fileSize {
		u.errno = unix.EFBIG
		return
	}
	for len(b) > 0 {
		n, err := unix.Write(u.fd, b)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			u.errno = unix.Errno(errnoOf(err))
			return
		}
		b = b[n:]
		u.n += int64(n)
	}
}

// commit moves the write id onto its name, or drops it when it failed.
func (f *files) commit(id uint64) error {
	u := f.uploads[id]
	if u == nil {
		return unix.EINVAL
	}
	if u.errno != 0 {
		f.drop(id, u)
		return u.errno
	}
	var st unix.Stat_t
	err := unix.Fstat(u.fd, &st)
	if err == nil {
		err = unix.Renameat(u.dir, u.tmp, u.dir, u.name)
	}
	if err != nil {
		f.drop(id, u)
		return err
	}
	f.mu.Lock()
	f.mine[st.Ino] = true
	f.mu.Unlock()
	u.tmp = ""
	f.drop(id, u)
	return nil
}

// drop closes the write id and removes its file, unless it was committed.
func (f *files) drop(id uint64, u *upload) {
	if u.fd >= 0 {
		unix.Close(u.fd)
	}
	if u.dir >= 0 {
		if u.tmp != "" {
			unix.Unlinkat(u.dir, u.tmp, 0)
		}
		unix.Close(u.dir)
	}
	delete(f.uploads, id)
}
