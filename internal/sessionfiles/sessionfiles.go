// Package sessionfiles performs a session's file operations ([moat.Files])
// inside the session's sandbox instance: each operation is one run of a
// small embedded Python program (sessionfiles.py) that the level starts in
// its instance, as the session's uid, through an [Exec] it provides (docker
// exec, runsc exec, a command over the guest's channel).
//
// The program resolves every name one component at a time from a descriptor
// of the working directory, with O_NOFOLLOW: it never follows a symbolic
// link, wherever the code pointed it, so a planted link gives an error
// wrapping moat.ErrInvalid. It reads only regular files (a FIFO is opened
// without blocking and refused), writes through a temporary file renamed
// over the name in the same directory (a write past the file size limit or
// the disk leaves the old file as it was), and streams contents through the
// program's stdin and stdout as they are, never encoded.
//
// The Go side does not trust the instance: it checks names before sending
// them, reads at most what an honest answer can hold (a file up to the file
// size limit, a listing up to its cap, answer lines up to a fixed size),
// checks every name a listing returns, and maps only the error names it
// knows.
package sessionfiles

import (
	"bufio"
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"path"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
)

//go:embed sessionfiles.py
var program string

// Exec runs argv inside the instance as the session's uid, with stdin as its
// standard input (nil: empty) and its standard output written to stdout, and
// returns once the program has exited and its output has been written. An
// error means the program could not be run or did not exit with status 0.
//
// Exec must end the program when ctx is done, and must return soon after the
// program exits, or after a write to stdout fails, even if stdin has not
// been read to its end (as exec.Cmd does with WaitDelay). What the program
// writes to its standard error may be dropped.
type Exec func(ctx context.Context, argv []string, stdin io.Reader, stdout io.Writer) error

// Options describe the instance to New.
type Options struct {
	// Python is the path of python3 inside the instance. Empty means
	// "python3", looked up in the PATH Exec gives.
	Python string
	// Dir is the session's working directory: an absolute path inside the
	// instance. It is opened from "/" one component at a time, never
	// through a symbolic link.
	Dir string
	// FileSize is the session's file size limit: WriteFile refuses more,
	// and ReadFile refuses a larger file and reads no more than that. Zero
	// means moat's default.
	FileSize moat.Bytes
	// MaxList caps the entries ListFiles returns; a working directory that
	// holds more is refused with an error wrapping moat.ErrInvalid. Zero
	// means 100000.
	MaxList int
}

// Caps on what the Go side reads from the instance besides file contents.
const (
	maxLine      = 64 << 10 // one answer line: an entry's name is at most 4096 bytes
	maxListBytes = 64 << 20 // all the lines of one listing
	maxName      = 4096
)

// New returns the file operations of the session whose working directory is
// o.Dir inside the instance that exec runs in. They are safe for concurrent
// use; each is one run of the program. It panics if exec is nil or o.Dir is
// not absolute, both mistakes of the level.
func New(exec Exec, o Options) moat.Files {
	if exec == nil {
		panic("sessionfiles: New with a nil Exec")
	}
	if !path.IsAbs(o.Dir) || path.Clean(o.Dir) != o.Dir {
		panic(fmt.Sprintf("sessionfiles: the working directory %q is not a clean absolute path", o.Dir))
	}
	if o.Python == "" {
		o.Python = "python3"
	}
	if o.FileSize <= 0 {
		o.FileSize = moat.DefaultLimits().FileSize
	}
	if o.MaxList <= 0 {
		o.MaxList = 100000
	}
	return &files{exec: exec, o: o}
}

type files struct {
	exec Exec
	o    Options
}

// checkName refuses what is not a relative slash-separated path without
// empty, "." or ".." elements, as engine.CleanName does.
func checkName(op, name string) error {
	if name == "" || name == "." || len(name) > maxName || !fs.ValidPath(name) || strings.ContainsAny(name, "\x00\\") {
		return fmt.Errorf("sessionfiles: %s %q: not a relative slash-separated path without \".\" or \"..\" elements: %w", op, name, moat.ErrInvalid)
	}
	return nil
}

// answer is one line of the program's output.
type answer struct {
	K    string `json:"k"`              // ok, err, file, entry
	E    string `json:"e,omitempty"`    // err: an errno name or one of the program's own
	Size *int64 `json:"size,omitempty"` // file
	N    string `json:"n"`              // entry: the name, relative to the working directory
	S    int64  `json:"s"`              // entry: size
	M    uint32 `json:"m"`              // entry: st_mode
	T    int64  `json:"t"`              // entry: modification time, ns since the epoch
}

// call is one run of the program, its output read as it comes.
type call struct {
	ctxErr func() error // the caller's context's Err, to tell its end from the instance's failures
	r      *bufio.Reader
	pr     *io.PipeReader
	stdin  *stdinReader
	cancel context.CancelFunc
	done   chan error // the Exec's error, once it has returned
	once   sync.Once
	err    error
}

// start runs op in the instance.
func (f *files) start(ctx context.Context, stdin io.Reader, op string, args ...string) *call {
	argv := append([]string{f.o.Python, "-I", "-S", "-B", "-c", program, op, f.o.Dir}, args...)
	ectx, cancel := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	c := &call{ctxErr: ctx.Err, r: bufio.NewReaderSize(pr, maxLine), pr: pr, cancel: cancel, done: make(chan error, 1)}
	var in io.Reader
	if stdin != nil {
		c.stdin = &stdinReader{r: stdin}
		in = c.stdin
	}
	go func() {
		err := f.exec(ectx, argv, in, pw)
		pw.CloseWithError(errExited)
		c.done <- err
	}()
	return c
}

var (
	errExited = errors.New("sessionfiles: the program exited")
	errClosed = errors.New("sessionfiles: reader closed")
	errNoExit = errors.New("the program did not exit after its last answer")
)

// exitGrace is how long a run may take to end after its last answer, or
// after its output ended, before it is ended.
const exitGrace = 10 * time.Second

// line reads one answer line.
func (c *call) line() (answer, error) {
	b, err := c.r.ReadSlice('\n')
	switch {
	case errors.Is(err, bufio.ErrBufferFull):
		return answer{}, fmt.Errorf("an answer line longer than %d bytes", maxLine)
	case errors.Is(err, errExited) || errors.Is(err, io.EOF):
		return answer{}, errors.New("no answer")
	case err != nil:
		return answer{}, err
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	var a answer
	if err := dec.Decode(&a); err != nil || dec.More() {
		return answer{}, fmt.Errorf("an answer that is not the protocol's: %q", shorten(b))
	}
	return a, nil
}

// end stops reading the run's output and waits for the run to end: with
// grace, up to exitGrace for it to end by itself (it has nothing more to
// say), else at once. It returns the Exec's error, and stops handing the
// caller's stdin to the Exec.
func (c *call) end(grace bool) error {
	c.once.Do(func() {
		c.pr.CloseWithError(errClosed)
		if grace {
			t := time.NewTimer(exitGrace)
			select {
			case c.err = <-c.done:
			case <-t.C:
				c.cancel()
				<-c.done
				c.err = errNoExit
			}
			t.Stop()
		} else {
			c.cancel()
			c.err = <-c.done
		}
		c.cancel()
		if c.stdin != nil {
			c.stdin.close()
		}
	})
	return c.err
}

// stdinReader hands the caller's reader to the Exec until the call ends.
type stdinReader struct {
	r      io.Reader
	n      atomic.Int64 // bytes handed on
	closed atomic.Bool
	mu     sync.Mutex
	err    error // the caller's reader's, other than io.EOF
}

func (s *stdinReader) Read(p []byte) (int, error) {
	if s.closed.Load() {
		return 0, errClosed
	}
	n, err := s.r.Read(p)
	s.n.Add(int64(n))
	if err != nil && err != io.EOF {
		s.mu.Lock()
		s.err = err
		s.mu.Unlock()
	}
	return n, err
}

func (s *stdinReader) close() { s.closed.Store(true) }

func (s *stdinReader) readErr() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

func shorten(b []byte) []byte {
	if len(b) > 200 {
		return b[:200]
	}
	return b
}

// failed is the error of a run that gave no usable answer: it names the
// problem and wraps the caller's context error, or else the Exec's error.
func failed(op, name string, c *call, problem error) error {
	err := c.end(true)
	if cerr := c.ctxErr(); cerr != nil {
		return fmt.Errorf("sessionfiles: %s%s: %w", op, quoted(name), cerr)
	}
	if err != nil {
		return fmt.Errorf("sessionfiles: %s%s: the instance gave %v: %w", op, quoted(name), problem, execErr(err))
	}
	return fmt.Errorf("sessionfiles: %s%s: the instance gave %v", op, quoted(name), problem)
}

// execErr keeps of an Exec's error only the classes that mean something to
// a caller of Files (the level unavailable or closed); any other is text,
// so that a missing python3 ("no such file") never reads as a missing file.
func execErr(err error) error {
	if errors.Is(err, moat.ErrUnavailable) || errors.Is(err, moat.ErrClosed) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	return errors.New(err.Error())
}

// finished is the error of a run after its last answer, which was a
// success: nil if the program then exited cleanly.
func finished(op, name string, c *call) error {
	if err := c.end(true); err != nil {
		if cerr := c.ctxErr(); cerr != nil {
			err = cerr
		}
		return fmt.Errorf("sessionfiles: %s%s: after its answer: %w", op, quoted(name), execErr(err))
	}
	return nil
}

func quoted(name string) string {
	if name == "" {
		return ""
	}
	return " " + strconv.Quote(name)
}

// The errno names the program may answer, by how they map.
var (
	errnos = map[string]syscall.Errno{
		"ENOENT": syscall.ENOENT, "ELOOP": syscall.ELOOP, "ENOTDIR": syscall.ENOTDIR, "EISDIR": syscall.EISDIR,
		"EEXIST": syscall.EEXIST, "ENOTEMPTY": syscall.ENOTEMPTY, "EINVAL": syscall.EINVAL, "EXDEV": syscall.EXDEV,
		"ENAMETOOLONG": syscall.ENAMETOOLONG, "EACCES": syscall.EACCES, "EPERM": syscall.EPERM, "EBUSY": syscall.EBUSY,
		"ETXTBSY": syscall.ETXTBSY, "EMLINK": syscall.EMLINK, "ENOSPC": syscall.ENOSPC, "EDQUOT": syscall.EDQUOT,
		"EFBIG": syscall.EFBIG, "EIO": syscall.EIO, "ENOMEM": syscall.ENOMEM, "EMFILE": syscall.EMFILE,
		"ENFILE": syscall.ENFILE, "EROFS": syscall.EROFS, "EAGAIN": syscall.EAGAIN, "EINTR": syscall.EINTR,
		"ENXIO": syscall.ENXIO, "EOVERFLOW": syscall.EOVERFLOW,
	}
	// The caller's name is at fault: a link on the way, a file where a
	// directory is wanted, a directory where a file is, and the like.
	invalid = map[string]bool{
		"ELOOP": true, "ENOTDIR": true, "EISDIR": true, "EEXIST": true, "ENOTEMPTY": true, "EINVAL": true,
		"EXDEV": true, "ENAMETOOLONG": true, "EACCES": true, "EPERM": true, "EBUSY": true, "ETXTBSY": true,
		"EMLINK": true, "ENXIO": true,
	}
	errName = regexp.MustCompile(`^[A-Z0-9]{1,16}$`)
)

// refused maps the program's error answer e to moat's classes.
func (f *files) refused(op, name, e string) error {
	n := quoted(name)
	switch e {
	case "ENOENT":
		return fmt.Errorf("sessionfiles: %s%s: %w", op, n, fs.ErrNotExist)
	case "ENOSPC", "EDQUOT":
		return fmt.Errorf("sessionfiles: %s%s: the session's disk limit is reached: %w", op, n, moat.ErrInvalid)
	case "EFBIG", "TOOBIG":
		return fmt.Errorf("sessionfiles: %s%s: larger than the file size limit %v: %w", op, n, f.o.FileSize, moat.ErrInvalid)
	case "NOTREG":
		return fmt.Errorf("sessionfiles: %s%s: not a regular file: %w", op, n, moat.ErrInvalid)
	case "TOOMANY":
		return fmt.Errorf("sessionfiles: %s: the working directory holds more than %d files: %w", op, f.o.MaxList, moat.ErrInvalid)
	case "BADNAME":
		return fmt.Errorf("sessionfiles: %s%s: not a name inside the working directory: %w", op, n, moat.ErrInvalid)
	case "SHRANK":
		return fmt.Errorf("sessionfiles: %s%s: the file shrank while it was read", op, n)
	case "USAGE":
		return fmt.Errorf("sessionfiles: %s%s: the program refused its arguments", op, n)
	}
	if errno, ok := errnos[e]; ok {
		if e == "ELOOP" {
			return fmt.Errorf("sessionfiles: %s%s: a symbolic link on the way (links are never followed): %w", op, n, moat.ErrInvalid)
		}
		if invalid[e] {
			return fmt.Errorf("sessionfiles: %s%s: %v: %w", op, n, errno, moat.ErrInvalid)
		}
		return fmt.Errorf("sessionfiles: %s%s: %w", op, n, errno)
	}
	if errName.MatchString(e) {
		return fmt.Errorf("sessionfiles: %s%s: error %s in the instance", op, n, e)
	}
	return fmt.Errorf("sessionfiles: %s%s: the instance gave an error answer that is not the protocol's", op, n)
}

// do runs op to its one answer line; it returns the answer when its kind is
// want, and the mapped error when it is an error.
func (f *files) do(ctx context.Context, stdin io.Reader, want, op, name string, args ...string) (answer, error) {
	c := f.start(ctx, stdin, op, args...)
	a, err := c.line()
	if err != nil {
		return answer{}, failed(op, name, c, err)
	}
	switch a.K {
	case "err":
		c.end(true)
		return answer{}, f.refused(op, name, a.E)
	case want:
		return a, finished(op, name, c)
	}
	return answer{}, failed(op, name, c, fmt.Errorf("an answer of kind %q", a.K))
}

// WriteFile: see moat.Files. It sends at most one byte past the file size
// limit, and refuses the write when r holds more, whatever the instance
// answers.
func (f *files) WriteFile(ctx context.Context, name string, r io.Reader) error {
	if err := checkName("write", name); err != nil {
		return err
	}
	if r == nil {
		r = strings.NewReader("")
	}
	limit := int64(f.o.FileSize)
	c := f.start(ctx, io.LimitReader(r, limit+1), "write", name, strconv.FormatInt(limit, 10))
	a, err := c.line()
	if err != nil {
		return failed("write", name, c, err)
	}
	switch a.K {
	case "err":
		c.end(true)
		return f.refused("write", name, a.E)
	case "ok":
		if err := finished("write", name, c); err != nil {
			return err
		}
	default:
		return failed("write", name, c, fmt.Errorf("an answer of kind %q", a.K))
	}
	// The Go side's own word on the contents, whatever the instance said.
	if c.stdin.n.Load() > limit {
		return f.refused("write", name, "TOOBIG")
	}
	if err := c.stdin.readErr(); err != nil {
		return fmt.Errorf("sessionfiles: write %q: reading the contents: %w", name, err)
	}
	return nil
}

// ReadFile: see moat.Files. The contents stream from the instance until the
// reader is closed or ctx ends; the reader gives at most the file's size at
// the moment the program opened it, and no more than the file size limit,
// and ends with an error, not io.EOF, if the contents were not all there.
func (f *files) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	if err := checkName("read", name); err != nil {
		return nil, err
	}
	limit := int64(f.o.FileSize)
	c := f.start(ctx, nil, "read", name, strconv.FormatInt(limit, 10))
	a, err := c.line()
	if err != nil {
		return nil, failed("read", name, c, err)
	}
	switch {
	case a.K == "err":
		c.end(true)
		return nil, f.refused("read", name, a.E)
	case a.K != "file" || a.Size == nil || *a.Size < 0:
		return nil, failed("read", name, c, fmt.Errorf("an answer of kind %q without a size", a.K))
	case *a.Size > limit:
		c.end(false)
		return nil, fmt.Errorf("sessionfiles: read %q: the instance announced %d bytes, over the file size limit %v: %w", name, *a.Size, f.o.FileSize, moat.ErrInvalid)
	}
	return &reader{f: f, c: c, name: name, left: *a.Size}, nil
}

// reader streams one file's contents, then checks the trailer.
type reader struct {
	f    *files
	c    *call
	name string
	left int64
	end  error // io.EOF or why the contents are not to be trusted
}

func (r *reader) Read(p []byte) (int, error) {
	if r.end != nil {
		return 0, r.end
	}
	if r.left == 0 {
		r.end = r.trailer()
		return 0, r.end
	}
	if int64(len(p)) > r.left {
		p = p[:r.left]
	}
	n, err := r.c.r.Read(p)
	r.left -= int64(n)
	if err != nil {
		r.end = failed("read", r.name, r.c, fmt.Errorf("%d bytes fewer than it announced", r.left))
		if n > 0 {
			return n, nil
		}
		return 0, r.end
	}
	return n, nil
}

// trailer reads the answer after the contents and waits for the run.
func (r *reader) trailer() error {
	a, err := r.c.line()
	if err != nil {
		return failed("read", r.name, r.c, err)
	}
	switch a.K {
	case "ok":
		if err := finished("read", r.name, r.c); err != nil {
			return err
		}
		return io.EOF
	case "err":
		r.c.end(true)
		return r.f.refused("read", r.name, a.E)
	}
	return failed("read", r.name, r.c, fmt.Errorf("an answer of kind %q after the contents", a.K))
}

// Close ends the run if it still goes on.
func (r *reader) Close() error {
	if r.end == nil {
		r.end = fmt.Errorf("sessionfiles: read %q: %w", r.name, fs.ErrClosed)
	}
	r.c.end(false)
	return nil
}

// ListFiles: see moat.Files. Names that are not UTF-8 are left out, as no
// other operation could name them.
func (f *files) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	c := f.start(ctx, nil, "list", strconv.Itoa(f.o.MaxList))
	defer c.end(false)
	out := []moat.FileInfo{}
	total := 0
	for {
		a, err := c.line()
		if err != nil {
			return nil, failed("list", "", c, err)
		}
		switch a.K {
		case "ok":
			if err := finished("list", "", c); err != nil {
				return nil, err
			}
			return out, nil
		case "err":
			return nil, f.refused("list", "", a.E)
		case "entry":
		default:
			return nil, failed("list", "", c, fmt.Errorf("an answer of kind %q", a.K))
		}
		total += len(a.N) + 64
		if len(out) >= f.o.MaxList || total > maxListBytes {
			return nil, fmt.Errorf("sessionfiles: list: the instance listed more than %d files or %d bytes: %w", f.o.MaxList, maxListBytes, moat.ErrInvalid)
		}
		if a.N == "." || len(a.N) > maxName || !fs.ValidPath(a.N) {
			return nil, failed("list", "", c, fmt.Errorf("the name %q, not one inside the working directory", shorten([]byte(a.N))))
		}
		fi, err := info(a.N, a)
		if err != nil {
			return nil, failed("list", "", c, err)
		}
		out = append(out, fi)
	}
}

// Stat: see moat.Files.
func (f *files) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	if err := checkName("stat", name); err != nil {
		return moat.FileInfo{}, err
	}
	a, err := f.do(ctx, nil, "entry", "stat", name, name)
	if err != nil {
		return moat.FileInfo{}, err
	}
	fi, err := info(name, a)
	if err != nil {
		return moat.FileInfo{}, fmt.Errorf("sessionfiles: stat %q: the instance gave %v", name, err)
	}
	return fi, nil
}

// Mkdir: see moat.Files.
func (f *files) Mkdir(ctx context.Context, name string) error {
	if err := checkName("mkdir", name); err != nil {
		return err
	}
	_, err := f.do(ctx, nil, "ok", "mkdir", name, name)
	return err
}

// Rename: see moat.Files.
func (f *files) Rename(ctx context.Context, from, to string) error {
	if err := checkName("rename", from); err != nil {
		return err
	}
	if err := checkName("rename", to); err != nil {
		return err
	}
	_, err := f.do(ctx, nil, "ok", "rename", from, from, to)
	return err
}

// RemoveFile: see moat.Files.
func (f *files) RemoveFile(ctx context.Context, name string) error {
	if err := checkName("remove", name); err != nil {
		return err
	}
	_, err := f.do(ctx, nil, "ok", "remove", name, name)
	return err
}

// info turns an entry into a FileInfo named name.
func info(name string, a answer) (moat.FileInfo, error) {
	if a.S < 0 {
		return moat.FileInfo{}, fmt.Errorf("a negative size for %q", name)
	}
	m := fileMode(a.M)
	return moat.FileInfo{Name: name, Size: a.S, Mode: m, ModTime: time.Unix(0, a.T), IsDir: m.IsDir()}, nil
}

// fileMode converts a Unix st_mode as package os does.
func fileMode(m uint32) fs.FileMode {
	mode := fs.FileMode(m & 0o777)
	switch m & syscall.S_IFMT {
	case syscall.S_IFREG:
	case syscall.S_IFDIR:
		mode |= fs.ModeDir
	case syscall.S_IFLNK:
		mode |= fs.ModeSymlink
	case syscall.S_IFIFO:
		mode |= fs.ModeNamedPipe
	case syscall.S_IFSOCK:
		mode |= fs.ModeSocket
	case syscall.S_IFCHR:
		mode |= fs.ModeDevice | fs.ModeCharDevice
	case syscall.S_IFBLK:
		mode |= fs.ModeDevice
	default:
		mode |= fs.ModeIrregular
	}
	if m&syscall.S_ISUID != 0 {
		mode |= fs.ModeSetuid
	}
	if m&syscall.S_ISGID != 0 {
		mode |= fs.ModeSetgid
	}
	if m&syscall.S_ISVTX != 0 {
		mode |= fs.ModeSticky
	}
	return mode
}
