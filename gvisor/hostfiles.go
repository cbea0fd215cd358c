package gvisor

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
)

// The host working directory of a session with a live interpreter.
//
// Its /work is a size-limited tmpfs on the host (nosuid, nodev, noexec,
// owned by the sandbox's uid, mode 0700) in the sandbox's bundle,
// bind-mounted into the sandbox: gVisor's gofer serves it, the sentry sees
// only that directory (it resolves every path, links included, in the
// sandbox's own mount tree, so a link the code plants names the sandbox's
// files, never the host's), and with runsc's --file-access-mounts=shared
// (its default, restated in sessionArgs) the sentry revalidates what it
// caches of it, so changes made on the host are seen by the code.
//
// The file operations are done on the host, through an os.Root opened on
// that directory, with the subprocess level's semantics: no path — "..",
// absolute, or through a link the code planted — reaches outside it, and
// links are never followed out of it. They need nothing of the sandbox, so
// it stays paused while they run: between runs nothing of the session
// runs, the interpreter and what its runs left included.

// mountHostWork mounts a tmpfs of size disk at dir, which it creates.
func mountHostWork(dir string, disk moat.Bytes) error {
	if err := os.Mkdir(dir, 0o700); err != nil {
		return fmt.Errorf("gvisor: %w", err)
	}
	inodes := max(int64(disk/(4*moat.KiB)), 64)
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=0700,uid=%d,gid=%d", int64(disk), inodes, sandboxUID, sandboxGID)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, opts); err != nil {
		return unavailable("cannot mount the session's size-limited working directory on the host", "", err)
	}
	return nil
}

// unmountHostWork unmounts what mountHostWork mounted at dir, if it is
// there; a dir that is no mount point is left as it is.
func unmountHostWork(dir string) error {
	err := unix.Unmount(dir, unix.MNT_DETACH)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("gvisor: unmount %s: %w", dir, err)
}

// hostWorkMount is the spec's mount of the host working directory dir.
func hostWorkMount(dir string) ociMount {
	return ociMount{Destination: image.WorkDir, Type: "bind", Source: dir,
		Options: []string{"bind", "rw", "nosuid", "nodev", "noexec"}}
}

// hostFiles are the file operations of a session on its host working
// directory; see moat.Files.
type hostFiles struct{ ss *session }

var _ moat.Files = hostFiles{}

// enter counts a file operation in, unless the session is closed; the
// caller calls done. Close waits for those in progress before it unmounts
// the directory.
func (h hostFiles) enter(ctx context.Context) (*os.Root, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ss := h.ss
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil, fmt.Errorf("gvisor: session: %w", moat.ErrClosed)
	}
	ss.fileOps.Add(1)
	ss.mu.Unlock()
	root, err := os.OpenRoot(ss.bt.work)
	if err != nil {
		ss.fileOps.Done()
		return nil, fmt.Errorf("gvisor: session: %w", err)
	}
	return root, nil
}

func (h hostFiles) done(root *os.Root) {
	root.Close()
	h.ss.fileOps.Done()
}

// checkName validates a session file name (the engine has, with
// engine.CleanName; this is the same check, as cheap).
func checkName(name string) error {
	if name == "" || name == "." || !fs.ValidPath(name) || strings.ContainsRune(name, 0) {
		return fmt.Errorf("gvisor: file name %q must be a relative slash-separated path without \".\" or \"..\" elements: %w", name, moat.ErrInvalid)
	}
	return nil
}

// fileError maps an error of a file operation to moat's classes: escapes
// and wrong kinds of file are invalid; missing files stay fs.ErrNotExist.
func fileError(op, name string, err error) error {
	if err == nil {
		return nil
	}
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return fmt.Errorf("gvisor: %s %q: %w", op, name, fs.ErrNotExist)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EFBIG), errors.Is(err, syscall.EDQUOT):
		return fmt.Errorf("gvisor: %s %q: the session's disk limit is reached: %w", op, name, moat.ErrInvalid)
	case errors.Is(err, moat.ErrInvalid):
		return err
	}
	var pe *fs.PathError
	var le *os.LinkError
	if errors.As(err, &pe) || errors.As(err, &le) {
		// Escapes from the root, link loops, a directory where a file is
		// expected and the like: the caller's name is at fault.
		return fmt.Errorf("gvisor: %s %q: %v: %w", op, name, err, moat.ErrInvalid)
	}
	return fmt.Errorf("gvisor: %s %q: %w", op, name, err)
}

// WriteFile creates or replaces name, owned by the sandbox's uid; see
// moat.Files. A file larger than the file size limit, or one that would
// pass the disk limit, is refused and nothing changes.
func (h hostFiles) WriteFile(ctx context.Context, name string, r io.Reader) error {
	if err := checkName(name); err != nil {
		return err
	}
	root, err := h.enter(ctx)
	if err != nil {
		return err
	}
	defer h.done(root)
	if dir := path.Dir(name); dir != "." {
		if err := mkdirAllOwned(root, dir); err != nil {
			return fileError("write", name, err)
		}
	}
	var rnd [6]byte
	rand.Read(rnd[:])
	tmp := path.Join(path.Dir(name), ".moat-upload-"+hex.EncodeToString(rnd[:]))
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return fileError("write", name, err)
	}
	ok := false
	defer func() {
		if !ok {
			root.Remove(tmp)
		}
	}()
	limit := int64(h.ss.b.limits.FileSize)
	n, err := io.Copy(f, io.LimitReader(readerCtx{ctx, r}, limit+1))
	if err == nil && n > limit {
		err = fmt.Errorf("gvisor: write %q: larger than the file size limit %v: %w", name, h.ss.b.limits.FileSize, moat.ErrInvalid)
	}
	if err == nil {
		err = f.Chown(sandboxUID, sandboxGID)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fileError("write", name, err)
	}
	if err := root.Rename(tmp, name); err != nil {
		return fileError("write", name, err)
	}
	ok = true
	return nil
}

// readerCtx stops a copy when ctx ends.
type readerCtx struct {
	ctx context.Context
	r   io.Reader
}

func (r readerCtx) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.r.Read(p)
}

// mkdirAllOwned creates dir and its missing parents inside root, owned by
// the sandbox's uid.
func mkdirAllOwned(root *os.Root, dir string) error {
	parts := strings.Split(dir, "/")
	for i := range parts {
		p := strings.Join(parts[:i+1], "/")
		err := root.Mkdir(p, 0o755)
		if errors.Is(err, fs.ErrExist) {
			// Only a directory is there already as it should be; Stat
			// follows a link only inside root.
			fi, err := root.Stat(p)
			if err != nil {
				return err
			}
			if !fi.IsDir() {
				return &fs.PathError{Op: "mkdir", Path: p, Err: syscall.ENOTDIR}
			}
			continue
		}
		if err != nil {
			return err
		}
		if err := root.Lchown(p, sandboxUID, sandboxGID); err != nil {
			return err
		}
	}
	return nil
}

// ReadFile opens name for reading; see moat.Files. Only regular files can
// be read: a directory, a FIFO or a socket the code made is refused.
func (h hostFiles) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	root, err := h.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer h.done(root)
	// O_NONBLOCK: opening a FIFO the code planted must not block.
	f, err := root.OpenFile(name, os.O_RDONLY|syscall.O_NONBLOCK|syscall.O_NOCTTY, 0)
	if err != nil {
		return nil, fileError("read", name, err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fileError("read", name, err)
	}
	if !st.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("gvisor: read %q: not a regular file (%v): %w", name, st.Mode().Type(), moat.ErrInvalid)
	}
	// A file the code is still writing reads as it was when opened, never
	// past the size it had then.
	return limitedFile{io.LimitReader(f, st.Size()), f, st}, nil
}

// limitedFile reads a file up to its size when opened, which its Stat
// reports.
type limitedFile struct {
	io.Reader
	io.Closer
	st fs.FileInfo
}

func (f limitedFile) Stat() (fs.FileInfo, error) { return f.st, nil }

// Caps of a listing, sessionfiles' (the levels whose files are listed in
// their sandbox): the code controls the tree, and in a deep one every
// entry's name holds all its parents', so the names of a listing grow with
// the square of its depth.
const (
	maxList      = 100000
	maxListBytes = 64 << 20
)

// ListFiles lists the session's files, recursively, without following
// links. A tree of more than maxList entries, or whose names and
// descriptions take more than maxListBytes, is refused with an error
// wrapping moat.ErrInvalid.
func (h hostFiles) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	root, err := h.enter(ctx)
	if err != nil {
		return nil, err
	}
	defer h.done(root)
	out := []moat.FileInfo{}
	total := 0
	err = fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == "." {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		total += len(p) + 64
		if len(out) >= maxList || total > maxListBytes {
			return fmt.Errorf("gvisor: list files: more than %d files or %d bytes of names: %w", maxList, maxListBytes, moat.ErrInvalid)
		}
		info, err := d.Info()
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		out = append(out, moat.FileInfo{Name: p, Size: info.Size(), Mode: info.Mode(), ModTime: info.ModTime(), IsDir: d.IsDir()})
		return nil
	})
	if errors.Is(err, moat.ErrInvalid) {
		return nil, err
	}
	if err != nil {
		return nil, fmt.Errorf("gvisor: list files: %w", err)
	}
	return out, nil
}

// RemoveFile removes name, a file or an empty directory; a link is removed
// itself, never what it points to.
func (h hostFiles) RemoveFile(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	root, err := h.enter(ctx)
	if err != nil {
		return err
	}
	defer h.done(root)
	return fileError("remove", name, root.Remove(name))
}

// Stat describes name without following a link; see moat.Files.
func (h hostFiles) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	if err := checkName(name); err != nil {
		return moat.FileInfo{}, err
	}
	root, err := h.enter(ctx)
	if err != nil {
		return moat.FileInfo{}, err
	}
	defer h.done(root)
	info, err := root.Lstat(name)
	if err != nil {
		return moat.FileInfo{}, fileError("stat", name, err)
	}
	return moat.FileInfo{Name: name, Size: info.Size(), Mode: info.Mode(), ModTime: info.ModTime(), IsDir: info.IsDir()}, nil
}

// Mkdir creates the directory name and its missing parents, owned by the
// sandbox's uid; see moat.Files.
func (h hostFiles) Mkdir(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	root, err := h.enter(ctx)
	if err != nil {
		return err
	}
	defer h.done(root)
	return fileError("mkdir", name, mkdirAllOwned(root, name))
}

// Rename moves from to to inside the session's directory; see moat.Files.
func (h hostFiles) Rename(ctx context.Context, from, to string) error {
	if err := checkName(from); err != nil {
		return err
	}
	if err := checkName(to); err != nil {
		return err
	}
	root, err := h.enter(ctx)
	if err != nil {
		return err
	}
	defer h.done(root)
	return fileError("rename", from, root.Rename(from, to))
}
