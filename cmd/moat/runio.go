package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/moatsandbox/moat"
)

// What moat run moves between the host and the code's working directory.
//
// The code's argv, its standard input and its input files reach it the
// same way at every level, with no level's help: the files (the standard
// input among them, under a name of its own) are written into a session's
// working directory before the run, and the code is wrapped in a short
// prologue (wrapCode) that sets sys.argv, puts the standard input file on
// fd 0 and runs the user's code under the user's file name. After the run,
// --out reads back what the run wrote through the same session.

// Bounds of --out: the most files it copies, and the most bytes in all
// (limits.disk, which also bounds what the run could write).
const maxOutFiles = 4096

// inputFile is one --file: the local SRC, put in the working directory as
// DST.
type inputFile struct {
	src, dst string
}

// fileList is the repeatable --file flag, SRC[:DST].
type fileList []inputFile

func (l *fileList) String() string {
	var parts []string
	for _, f := range *l {
		parts = append(parts, f.src+":"+f.dst)
	}
	return strings.Join(parts, ",")
}

// Set reads SRC[:DST]. The last ":" separates them, so a SRC that holds
// ":" needs its DST given. DST is a slash-separated path relative to the
// working directory: not absolute, no ".." element.
func (l *fileList) Set(s string) error {
	src, dst := s, ""
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		src, dst = s[:i], s[i+1:]
	}
	if src == "" {
		return fmt.Errorf("no SRC in %q (want SRC[:DST])", s)
	}
	if dst == "" {
		dst = filepath.Base(src)
	}
	if err := checkDst(dst); err != nil {
		return err
	}
	*l = append(*l, inputFile{src, dst})
	return nil
}

// checkDst refuses a destination that is absolute, climbs with "..", or
// names the working directory itself.
func checkDst(dst string) error {
	switch {
	case strings.HasPrefix(dst, "/"):
		return fmt.Errorf("DST %q is absolute: it is a path relative to the code's working directory", dst)
	case slices.Contains(strings.Split(dst, "/"), ".."):
		return fmt.Errorf("DST %q holds \"..\": it must stay in the code's working directory", dst)
	case path.Clean(dst) == ".":
		return fmt.Errorf("DST %q names no file", dst)
	case strings.ContainsRune(dst, 0):
		return fmt.Errorf("DST %q holds a NUL byte", dst)
	}
	return nil
}

// runInputs are the bytes moat run puts in the working directory: the
// standard input's contents (nil when not given), under stdinName.
type runInputs struct {
	stdin     []byte
	stdinName string
}

// prepareInputs reads --stdin (at most lim.FileSize: it is a file of the
// working directory) and checks the --file sources and the --out
// directory, all before any sandbox starts.
func (o *runOptions) prepareInputs(stdin io.Reader, lim moat.Limits) (runInputs, error) {
	var in runInputs
	if o.stdin != "" {
		var r io.Reader
		if o.stdin == "-" {
			if o.name == "<stdin>" {
				return in, fmt.Errorf("run: --stdin - and the code from standard input (-): give the code as a file or with -c: %w", moat.ErrInvalid)
			}
			r = stdin
		} else {
			f, err := os.Open(o.stdin)
			if err != nil {
				return in, fmt.Errorf("run: --stdin: %w: %w", err, moat.ErrInvalid)
			}
			defer f.Close()
			r = f
		}
		b, err := io.ReadAll(io.LimitReader(r, int64(lim.FileSize)+1))
		if err != nil {
			return in, fmt.Errorf("run: --stdin: reading it: %w: %w", err, moat.ErrInvalid)
		}
		if int64(len(b)) > int64(lim.FileSize) {
			return in, fmt.Errorf("run: --stdin: more than %s, the file size limit (limits.file_size, --file-size) the code's standard input is held to: %w", lim.FileSize, moat.ErrInvalid)
		}
		in.stdin = b
		var rnd [8]byte
		rand.Read(rnd[:])
		in.stdinName = ".moat-stdin-" + hex.EncodeToString(rnd[:])
	}
	seen := map[string]string{}
	for _, f := range o.files {
		st, err := os.Stat(f.src)
		if err != nil {
			return in, fmt.Errorf("run: --file: %w: %w", err, moat.ErrInvalid)
		}
		if !st.Mode().IsRegular() {
			return in, fmt.Errorf("run: --file %s: not a regular file: %w", f.src, moat.ErrInvalid)
		}
		key := path.Clean(f.dst)
		if other, ok := seen[key]; ok {
			return in, fmt.Errorf("run: --file %s and --file %s both go to %s: %w", other, f.src, key, moat.ErrInvalid)
		}
		seen[key] = f.src
	}
	if o.out != "" {
		if err := os.MkdirAll(o.out, 0o755); err != nil {
			return in, fmt.Errorf("run: --out: %w: %w", err, moat.ErrInvalid)
		}
	}
	return in, nil
}

// runInSession runs the code in a session of sb made for this run alone:
// the inputs written in, the code run, the files it wrote copied out to
// --out. err is the sandbox's failure (no result); outErr is a failure of
// the copy, after a result.
func runInSession(ctx context.Context, sb moat.Sandbox, req moat.Request, o *runOptions, in runInputs, lim moat.Limits) (res *moat.Result, copied []string, outErr, err error) {
	sr, ok := sb.(moat.Sessioner)
	if !ok {
		return nil, nil, nil, fmt.Errorf("run: level %s has no sessions, which --stdin, --file and --out need: %w", sb.Level(), moat.ErrUnavailable)
	}
	sess, err := sr.NewSession(ctx, moat.SessionOptions{})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("run: %w", err)
	}
	defer sess.Close()
	for _, f := range o.files {
		if err := putFile(ctx, sess, f); err != nil {
			return nil, nil, nil, err
		}
	}
	if in.stdin != nil {
		if err := sess.WriteFile(ctx, in.stdinName, bytes.NewReader(in.stdin)); err != nil {
			return nil, nil, nil, fmt.Errorf("run: --stdin: %w", err)
		}
	}
	before, err := sess.ListFiles(ctx)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("run: listing the working directory: %w", err)
	}
	req.Code = wrapCode(o.src, o.name, o.argv, in.stdinName)
	res, err = sess.Run(ctx, req)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("run: %w", err)
	}
	if o.out != "" {
		copied, outErr = copyOut(ctx, sess, before, o.out, o.force, in.stdinName, lim)
	}
	return res, copied, outErr, nil
}

func putFile(ctx context.Context, sess moat.Session, f inputFile) error {
	r, err := os.Open(f.src)
	if err != nil {
		return fmt.Errorf("run: --file: %w: %w", err, moat.ErrInvalid)
	}
	defer r.Close()
	if err := sess.WriteFile(ctx, path.Clean(f.dst), r); err != nil {
		return fmt.Errorf("run: --file %s: %w", f.src, err)
	}
	return nil
}

// copyOut copies into dir the regular files of the session's working
// directory that the run created or changed: those not in before, or there
// with another size, mode or modification time. Symbolic links are not
// followed, on either side: the session's are skipped, and on the host
// every file is created through an os.Root at dir, which refuses a path
// that leaves it. A file already in dir is not replaced unless force; then
// the whole copy is refused before anything is written. The copy is
// bounded: at most maxOutFiles files, and lim.Disk bytes in all. It
// returns the names copied, slash-separated and relative to dir.
func copyOut(ctx context.Context, sess moat.Session, before []moat.FileInfo, dir string, force bool, skip string, lim moat.Limits) ([]string, error) {
	after, err := sess.ListFiles(ctx)
	if err != nil {
		return nil, fmt.Errorf("run: --out: listing the working directory: %w", err)
	}
	old := map[string]moat.FileInfo{}
	for _, fi := range before {
		old[fi.Name] = fi
	}
	var todo []moat.FileInfo
	var total int64
	for _, fi := range after {
		if fi.IsDir || !fi.Mode.IsRegular() || fi.Name == skip {
			continue // directories come with their files; links and devices never
		}
		if o, ok := old[fi.Name]; ok && o.Size == fi.Size && o.Mode == fi.Mode && o.ModTime.Equal(fi.ModTime) {
			continue
		}
		if !filepath.IsLocal(filepath.FromSlash(fi.Name)) {
			return nil, fmt.Errorf("run: --out: the session listed %q, which is not a local path: %w", fi.Name, moat.ErrInvalid)
		}
		todo = append(todo, fi)
		total += fi.Size
	}
	sort.Slice(todo, func(i, j int) bool { return todo[i].Name < todo[j].Name })
	if len(todo) > maxOutFiles {
		return nil, fmt.Errorf("run: --out: the run wrote %d files, more than the %d --out copies: nothing copied: %w", len(todo), maxOutFiles, moat.ErrInvalid)
	}
	if total > int64(lim.Disk) {
		return nil, fmt.Errorf("run: --out: the run's files hold %s, more than the disk limit (%s) --out copies: nothing copied: %w", moat.Bytes(total), lim.Disk, moat.ErrInvalid)
	}
	root, err := os.OpenRoot(dir)
	if err != nil {
		return nil, fmt.Errorf("run: --out: %w: %w", err, moat.ErrInvalid)
	}
	defer root.Close()
	var clash []string
	for _, fi := range todo {
		st, err := root.Lstat(filepath.FromSlash(fi.Name))
		switch {
		case err == nil && st.IsDir():
			return nil, fmt.Errorf("run: --out: %s is a directory in %s, and the run wrote a file of that name: nothing copied: %w", fi.Name, dir, moat.ErrInvalid)
		case err == nil:
			clash = append(clash, fi.Name)
		case !errors.Is(err, fs.ErrNotExist):
			// A parent that is a file or a link out of dir: the copy
			// would fail; say so before writing anything.
			return nil, fmt.Errorf("run: --out: %s: %w: nothing copied: %w", fi.Name, err, moat.ErrInvalid)
		}
	}
	if len(clash) > 0 && !force {
		more := ""
		if len(clash) > 3 {
			more, clash = fmt.Sprintf(" and %d more", len(clash)-3), clash[:3]
		}
		return nil, fmt.Errorf("run: --out: %s%s already in %s: nothing copied (--force replaces them): %w", strings.Join(clash, ", "), more, dir, moat.ErrInvalid)
	}
	var copied []string
	remaining := int64(lim.Disk)
	for _, fi := range todo {
		n, err := copyOne(ctx, sess, root, fi, remaining)
		if err != nil {
			return copied, fmt.Errorf("run: --out: %s: %w", fi.Name, err)
		}
		remaining -= n
		copied = append(copied, fi.Name)
	}
	return copied, nil
}

// copyOne copies one file of the session to the same name under root,
// replacing what is there (a link itself, never its target), reading at
// most limit bytes.
func copyOne(ctx context.Context, sess moat.Session, root *os.Root, fi moat.FileInfo, limit int64) (int64, error) {
	name := filepath.FromSlash(fi.Name)
	if d := filepath.Dir(name); d != "." {
		if err := root.MkdirAll(d, 0o755); err != nil {
			return 0, fmt.Errorf("%w: %w", err, moat.ErrInvalid)
		}
	}
	if err := root.Remove(name); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return 0, fmt.Errorf("%w: %w", err, moat.ErrInvalid)
	}
	r, err := sess.ReadFile(ctx, fi.Name)
	if err != nil {
		return 0, err
	}
	defer r.Close()
	perm := os.FileMode(0o644)
	if fi.Mode&0o111 != 0 {
		perm = 0o755
	}
	w, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", err, moat.ErrInvalid)
	}
	n, err := io.Copy(w, io.LimitReader(r, limit+1))
	if cerr := w.Close(); err == nil {
		err = cerr
	}
	if err == nil && n > limit {
		err = fmt.Errorf("the run's files grew past the disk limit while copied: %w", moat.ErrInvalid)
	}
	if err != nil {
		root.Remove(name)
		return n, err
	}
	return n, nil
}

// wrapCode wraps the user's code src in moat run's prologue. The prologue
// sets sys.argv to argv, when stdinName is not empty opens that file of
// the working directory, removes it and makes it fd 0 and sys.stdin, then
// compiles src under name (so that tracebacks, warnings and linecache name
// the user's file, not the level's own file for the code) and runs it as
// __main__. An uncaught exception's traceback leaves out the prologue's
// own frames, and the code exits with status 1 as python3 FILE does.
func wrapCode(src []byte, name string, argv []string, stdinName string) []byte {
	var b strings.Builder
	b.WriteString(prologue)
	b.WriteString("_moat_run(")
	b.WriteString(pyBytes([]byte(name)))
	b.WriteString(", [")
	for i, a := range argv {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(pyBytes([]byte(a)))
	}
	b.WriteString("], ")
	if stdinName == "" {
		b.WriteString("None")
	} else {
		b.WriteString(pyBytes([]byte(stdinName)))
	}
	b.WriteString(", ")
	b.WriteString(pyBytes(src))
	b.WriteString(")\n")
	return []byte(b.String())
}

// pyBytes is b as a Python bytes literal.
func pyBytes(b []byte) string {
	var s strings.Builder
	s.Grow(len(b) + 3)
	s.WriteString("b'")
	for _, c := range b {
		switch {
		case c == '\\' || c == '\'':
			s.WriteByte('\\')
			s.WriteByte(c)
		case c == '\n':
			s.WriteString(`\n`)
		case c >= 0x20 && c < 0x7f:
			s.WriteByte(c)
		default:
			fmt.Fprintf(&s, `\x%02x`, c)
		}
	}
	s.WriteByte('\'')
	return s.String()
}

// prologue defines _moat_run; wrapCode appends its call. It imports
// nothing the code would not have imported at start-up, but for os when
// there is a standard input file and importlib.util when a traceback
// needs the code's source lines.
const prologue = `def _moat_run(name, argv, stdin, src):
    import sys
    me = (sys._getframe().f_code, sys._getframe(1).f_code)
    name = name.decode("utf-8", "surrogateescape")
    sys.argv = [a.decode("utf-8", "surrogateescape") for a in argv]
    if stdin is not None:
        import os
        fd = os.open(stdin.decode(), os.O_RDONLY)
        os.unlink(stdin.decode())
        if fd != 0:
            os.dup2(fd, 0)
            os.close(fd)
        old = sys.stdin
        sys.stdin = sys.__stdin__ = open(0, "r", closefd=False, encoding=getattr(old, "encoding", None), errors=getattr(old, "errors", None))

    class Loader:
        def get_source(self, _):
            import importlib.util
            return importlib.util.decode_source(src)

    g = sys.modules["__main__"].__dict__
    for k in ("_moat_run", "__file__", "__cached__"):
        g.pop(k, None)
    g["__loader__"] = Loader()
    g["__spec__"] = None
    if not name.startswith("<"):
        g["__file__"] = name
    try:
        code = compile(src, name, "exec", dont_inherit=True)
        exec(code, g)
    except SystemExit:
        raise
    except BaseException as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code in me:
            tb = tb.tb_next
        e = e.with_traceback(tb)
        if sys.excepthook is sys.__excepthook__:
            # The source lines are the code's own, not those of a file
            # of the same name in the working directory.
            import linecache, traceback
            text = Loader().get_source(None)
            linecache.cache[name] = (len(text), None, text.splitlines(True), name)
            traceback.print_exception(type(e), e, tb)
        else:
            sys.excepthook(type(e), e, tb)
        sys.exit(1)
`
