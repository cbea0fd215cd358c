package subprocess

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

	"github.com/moatsandbox/moat"
)

// Files.
//
// Every file operation goes through an os.Root opened on the session's
// directory, so that no path — "..", absolute, or through a symbolic link the
// code planted — reaches outside it. The engine has checked the names
// (engine.CleanName); they are checked here again, as cheaply, and refused
// with an error wrapping moat.ErrInvalid. File operations may run while a
// run is in progress; Close waits for those in progress.

// enter counts a file operation in, unless the session is closed; the
// caller calls ss.ops.Done.
func (ss *session) enter(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.closed {
		return ss.errClosed()
	}
	ss.ops.Add(1)
	return nil
}

// checkName validates a session file name.
func checkName(name string) error {
	if name == "" || name == "." || !fs.ValidPath(name) || strings.ContainsRune(name, 0) {
		return fmt.Errorf("subprocess: file name %q must be a relative slash-separated path without \".\" or \"..\" elements: %w", name, moat.ErrInvalid)
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
		return fmt.Errorf("subprocess: %s %q: %w", op, name, fs.ErrNotExist)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EFBIG), errors.Is(err, syscall.EDQUOT):
		return fmt.Errorf("subprocess: %s %q: the session's disk limit is reached: %w", op, name, moat.ErrInvalid)
	case errors.Is(err, moat.ErrInvalid):
		return err
	}
	var pe *fs.PathError
	var le *os.LinkError
	if errors.As(err, &pe) || errors.As(err, &le) {
		// Escapes from the root, symlink loops, a directory where a file
		// is expected and the like: the caller's name is at fault.
		return fmt.Errorf("subprocess: %s %q: %v: %w", op, name, err, moat.ErrInvalid)
	}
	return fmt.Errorf("subprocess: %s %q: %w", op, name, err)
}

// WriteFile creates or replaces name; see moat.Files. The file belongs to
// the session's uid. A file larger than the file size limit, or one that
// would pass the disk limit, is refused and nothing changes.
func (ss *session) WriteFile(ctx context.Context, name string, r io.Reader) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := ss.enter(ctx); err != nil {
		return err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	uid, gid := ss.uid()
	if dir := path.Dir(name); dir != "." {
		if err := mkdirAllOwned(root, dir, uid, gid); err != nil {
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
	limit := int64(ss.b.limits.FileSize)
	n, err := io.Copy(f, io.LimitReader(readerCtx{ctx, r}, limit+1))
	if err == nil && n > limit {
		err = fmt.Errorf("subprocess: write %q: larger than the file size limit %v: %w", name, ss.b.limits.FileSize, moat.ErrInvalid)
	}
	if err == nil && uid >= 0 {
		err = f.Chown(uid, gid)
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
// uid and gid (-1: moat's).
func mkdirAllOwned(root *os.Root, dir string, uid, gid int) error {
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
		if uid >= 0 {
			if err := root.Lchown(p, uid, gid); err != nil {
				return err
			}
		}
	}
	return nil
}

// ReadFile opens name for reading; see moat.Files. Only regular files can
// be read: a directory, a FIFO or a socket the code made is refused.
func (ss *session) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	if err := ss.enter(ctx); err != nil {
		return nil, err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
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
		return nil, fmt.Errorf("subprocess: read %q: not a regular file (%v): %w", name, st.Mode().Type(), moat.ErrInvalid)
	}
	// A file the code is still writing reads as it was when opened, never
	// past the size it had then.
	return limitedFile{io.LimitReader(f, st.Size()), f, st}, nil
}

// limitedFile reads a file up to its size when opened, which its Stat
// reports (the server announces it as the Content-Length).
type limitedFile struct {
	io.Reader
	io.Closer
	st fs.FileInfo
}

func (f limitedFile) Stat() (fs.FileInfo, error) { return f.st, nil }

// The most a listing holds: entries, and bytes of names and descriptions
// (a chain of nested directories makes names that grow with its depth).
var (
	maxList      = 100000
	maxListBytes = 64 << 20
)

// ListFiles lists the session's files, recursively, without following
// symbolic links. A tree of more than maxList entries or maxListBytes of
// names is refused with an error wrapping moat.ErrInvalid: the code built
// it, and moat must not hold it in memory.
func (ss *session) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	if err := ss.enter(ctx); err != nil {
		return nil, err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
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
			return fmt.Errorf("more than %d files or %d bytes of names: %w", maxList, maxListBytes, moat.ErrInvalid)
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
	if err != nil {
		return nil, fmt.Errorf("subprocess: list files: %w", err)
	}
	return out, nil
}

// RemoveFile removes name, a file or an empty directory; a symbolic link is
// removed itself, never what it points to.
func (ss *session) RemoveFile(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := ss.enter(ctx); err != nil {
		return err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	return fileError("remove", name, root.Remove(name))
}

// Stat describes name without following a symbolic link; see moat.Files.
func (ss *session) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	if err := checkName(name); err != nil {
		return moat.FileInfo{}, err
	}
	if err := ss.enter(ctx); err != nil {
		return moat.FileInfo{}, err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return moat.FileInfo{}, fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	info, err := root.Lstat(name)
	if err != nil {
		return moat.FileInfo{}, fileError("stat", name, err)
	}
	return moat.FileInfo{Name: name, Size: info.Size(), Mode: info.Mode(), ModTime: info.ModTime(), IsDir: info.IsDir()}, nil
}

// Mkdir creates the directory name and its missing parents, owned by the
// session's uid; see moat.Files.
func (ss *session) Mkdir(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := ss.enter(ctx); err != nil {
		return err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	uid, gid := ss.uid()
	return fileError("mkdir", name, mkdirAllOwned(root, name, uid, gid))
}

// Rename moves from to to inside the session's directory; see moat.Files.
func (ss *session) Rename(ctx context.Context, from, to string) error {
	if err := checkName(from); err != nil {
		return err
	}
	if err := checkName(to); err != nil {
		return err
	}
	if err := ss.enter(ctx); err != nil {
		return err
	}
	defer ss.ops.Done()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	return fileError("rename", from, root.Rename(from, to))
}
