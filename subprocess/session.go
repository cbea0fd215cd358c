package subprocess

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/internal/capture"
	"github.com/moatsandbox/moat/internal/cgroup"
	"github.com/moatsandbox/moat/internal/uidpool"
)

// Sessions.
//
// A session keeps, for its whole life, a working directory under the runs
// directory named "<owner pid>-s<id>" (so that New's reaper removes it once
// its owner is dead), mounted as a tmpfs of the disk limit, and the lease of
// one sandbox uid. Each Run goes through the same hardened path as a one-shot
// run — helper as PID 1 of a fresh PID namespace, a fresh cgroup, rlimits,
// no_new_privs, Landlock granting read-write only to the session's directory,
// seccomp — with that directory as working directory and HOME.
//
// With SessionOptions.Interpreter, a python3 started through the same helper
// path stays alive between runs, driven by a small driver (interpreterDriver)
// that reads code in frames on a socket and runs it with exec() in one
// persistent globals dictionary. Its specifics:
//
//   - The interpreter has one cgroup for its life: the memory and process
//     limits cover all it holds; the CPU limit applies per run, to the
//     cgroup's usage since the run began.
//   - Between runs its processes are stopped (SIGSTOP), so threads or children
//     the code left behind use no CPU while no run is going on.
//   - A run that times out, is cancelled, hits the CPU, memory or process
//     limit, or writes past the output cap ends the interpreter (the wall
//     timeout and the output cap kill its whole PID namespace); the next run
//     starts a fresh one, with the files still there and the variables gone.
//   - What the code writes to file descriptors 1 and 2 is the run's stdout and
//     stderr; what processes it left behind write between runs is dropped.

// NewSession returns a session with a private working directory that lives
// until Close; see moat.Session. ctx bounds only the creation.
func (s *Sandbox) NewSession(ctx context.Context, opts moat.SessionOptions) (moat.Session, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, fmt.Errorf("subprocess: %w", moat.ErrClosed)
	}
	s.mu.Unlock()
	var rnd [8]byte
	rand.Read(rnd[:])
	ss := &Session{
		s:    s,
		id:   s.owner + "-s" + hex.EncodeToString(rnd[:]),
		opts: opts,
		sem:  make(chan struct{}, 1),
		done: make(chan struct{}),
	}
	ss.dir = s.runsDir + "/" + ss.id
	if err := ss.create(); err != nil {
		ss.remove()
		return nil, err
	}
	s.log.Debug("subprocess: session created", "session", ss.id, "interpreter", opts.Interpreter)
	return ss, nil
}

var _ moat.Sessioner = (*Sandbox)(nil)

// Session is a subprocess session; see moat.Session for the contract. Its
// methods are safe for concurrent use: runs and file operations take turns.
type Session struct {
	s    *Sandbox
	id   string
	dir  string
	opts moat.SessionOptions

	// sem is held by the run or file operation in progress.
	sem chan struct{}
	// done is closed by Close.
	done chan struct{}

	// Guarded by sem.
	lease   *uidpool.Lease
	mounted bool
	interp  *interpreter

	mu        sync.Mutex
	closed    bool
	cancelRun context.CancelFunc // of the run in progress, if any
}

var _ moat.Session = (*Session)(nil)

// ID names the session. It is also the name of its working directory.
func (ss *Session) ID() string { return ss.id }

// Dir is the session's working directory on the host.
func (ss *Session) Dir() string { return ss.dir }

func (ss *Session) create() error {
	s := ss.s
	if err := os.Mkdir(ss.dir, 0o700); err != nil {
		return fmt.Errorf("subprocess: session: %w", err)
	}
	if !s.strict {
		return nil
	}
	lease, err := s.uids.Acquire()
	if err != nil {
		return fmt.Errorf("subprocess: session: %w", err)
	}
	ss.lease = lease
	if err := mountWorkDir(ss.dir, s.limits.Disk, lease.UID, lease.UID); err != nil {
		return err
	}
	ss.mounted = true
	return nil
}

// remove releases the directory and the lease.
func (ss *Session) remove() {
	if ss.mounted {
		if err := unix.Unmount(ss.dir, unix.MNT_DETACH); err != nil {
			ss.s.log.Warn("subprocess: session cleanup", "session", ss.id, "err", err)
		}
		ss.mounted = false
	}
	if err := os.RemoveAll(ss.dir); err != nil {
		ss.s.log.Warn("subprocess: session cleanup", "session", ss.id, "err", err)
	}
	if ss.lease != nil {
		ss.lease.Release()
		ss.lease = nil
	}
}

// acquire takes the session's turn, or fails when ctx ends first or the
// session is closed.
func (ss *Session) acquire(ctx context.Context) error {
	closedErr := fmt.Errorf("subprocess: session %s: %w", ss.id, moat.ErrClosed)
	select {
	case <-ss.done:
		return closedErr
	default:
	}
	select {
	case ss.sem <- struct{}{}:
	case <-ss.done:
		return closedErr
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-ss.done:
		<-ss.sem
		return closedErr
	default:
	}
	return nil
}

func (ss *Session) release() { <-ss.sem }

func (ss *Session) uid() (int, int) {
	if ss.lease == nil {
		return -1, -1
	}
	return ss.lease.UID, ss.lease.UID
}

// Run runs req.Code in the session; see moat.Session.
func (ss *Session) Run(ctx context.Context, req moat.Request) (*moat.Result, error) {
	s := ss.s
	if err := s.begin(req); err != nil {
		return nil, err
	}
	defer s.runs.Done()
	if err := ss.acquire(ctx); err != nil {
		return nil, err
	}
	defer ss.release()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ss.mu.Lock()
	ss.cancelRun = cancel
	ss.mu.Unlock()
	defer func() {
		ss.mu.Lock()
		ss.cancelRun = nil
		ss.mu.Unlock()
	}()

	if ss.opts.Interpreter {
		res, err := ss.runInterpreter(ctx, req)
		if err == nil {
			s.log.Debug("subprocess: session run", "session", ss.id, "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason)
		}
		return res, err
	}
	r := &run{s: s, req: req, dir: ss.dir, mounted: ss.mounted}
	res, err := ss.runOnce(ctx, r)
	if err == nil {
		s.log.Debug("subprocess: session run", "session", ss.id, "id", r.id, "duration", res.Duration, "exit", res.ExitCode, "reason", res.Reason)
	}
	return res, err
}

// runOnce runs r's code under a fresh python3 through the same path as a
// one-shot run (run.exec), in the session's directory and under its uid. It
// leaves the directory and the lease to the session.
func (ss *Session) runOnce(ctx context.Context, r *run) (*moat.Result, error) {
	s, lim := ss.s, ss.s.limits
	r.start = time.Now()
	var rnd [8]byte
	rand.Read(rnd[:])
	r.id = s.owner + "-" + hex.EncodeToString(rnd[:])
	uid, gid := ss.uid()
	// The directory holds whatever the code planted: the code file is
	// created anew under a fresh name, never through a link.
	codeName := ".moat-run-" + hex.EncodeToString(rnd[:4]) + ".py"
	if err := writeNewFile(ss.dir, codeName, r.req.Code, uid, gid); err != nil {
		if errors.Is(err, syscall.ENOSPC) || errors.Is(err, syscall.EFBIG) {
			return nil, fmt.Errorf("subprocess: code of %d bytes does not fit in the session's working directory: %w", len(r.req.Code), moat.ErrInvalid)
		}
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer func() {
		if root, err := os.OpenRoot(ss.dir); err == nil {
			root.Remove(codeName)
			root.Close()
		}
	}()
	if s.strict {
		g, err := s.cg.New(r.id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids)})
		if err != nil {
			return nil, unavailable("cannot create the run's cgroup", "", err)
		}
		r.group = g
		defer func() {
			if err := g.Kill(); err != nil {
				s.log.Warn("subprocess: cleanup", "id", r.id, "err", err)
			}
			if err := g.Remove(); err != nil {
				s.log.Warn("subprocess: cleanup", "id", r.id, "err", err)
			}
		}()
	}
	arg, err := json.Marshal(ss.spec(r.group, []string{"python3", ss.dir + "/" + codeName}))
	if err != nil {
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	return r.exec(ctx, arg)
}

// spec returns the helper's spec for python3 with args in the session's
// directory, under its uid, in group when strict: the same protections as
// run.do gives a one-shot run.
func (ss *Session) spec(group *cgroup.Group, args []string) spec {
	uid, gid := ss.uid()
	return ss.s.runSpec(ss.dir, uid, gid, group, args)
}

// writeNewFile creates name in dir with data, read-only, owned by uid and
// gid (-1: moat's). It fails rather than follow or replace anything there.
func writeNewFile(dir, name string, data []byte, uid, gid int) error {
	root, err := os.OpenRoot(dir)
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o400)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil && uid >= 0 {
		err = f.Chown(uid, gid)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		root.Remove(name)
	}
	return err
}

// Close kills what runs in the session and removes its directory. It is
// safe to call more than once.
func (ss *Session) Close() error {
	ss.mu.Lock()
	if ss.closed {
		ss.mu.Unlock()
		return nil
	}
	ss.closed = true
	close(ss.done)
	if ss.cancelRun != nil {
		ss.cancelRun()
	}
	ss.mu.Unlock()
	ss.sem <- struct{}{} // wait for the run in progress; nothing takes it after
	if ss.interp != nil {
		ss.interp.kill()
		ss.interp.close()
		ss.interp = nil
	}
	ss.remove()
	ss.s.log.Debug("subprocess: session closed", "session", ss.id)
	return nil
}

// Files.
//
// Every file operation goes through an os.Root opened on the session's
// directory, so that no path — "..", absolute, or through a symbolic link the
// code planted — reaches outside it. Names are checked first and refused
// with an error wrapping moat.ErrInvalid.

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

// WriteFile creates or replaces name; see moat.Session. The file belongs to
// the session's uid. A file larger than the file size limit, or one that
// would pass the disk limit, is refused and nothing changes.
func (ss *Session) WriteFile(ctx context.Context, name string, r io.Reader) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := ss.acquire(ctx); err != nil {
		return err
	}
	defer ss.release()
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
	limit := int64(ss.s.limits.FileSize)
	n, err := io.Copy(f, io.LimitReader(readerCtx{ctx, r}, limit+1))
	if err == nil && n > limit {
		err = fmt.Errorf("subprocess: write %q: larger than the file size limit %v: %w", name, ss.s.limits.FileSize, moat.ErrInvalid)
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

// ReadFile opens name for reading; see moat.Session. Only regular files can
// be read: a directory, a FIFO or a socket the code made is refused.
func (ss *Session) ReadFile(ctx context.Context, name string) (io.ReadCloser, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	if err := ss.acquire(ctx); err != nil {
		return nil, err
	}
	defer ss.release()
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
	return f, nil
}

// ListFiles lists the session's files, recursively, without following
// symbolic links.
func (ss *Session) ListFiles(ctx context.Context) ([]moat.FileInfo, error) {
	if err := ss.acquire(ctx); err != nil {
		return nil, err
	}
	defer ss.release()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	out := []moat.FileInfo{}
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
func (ss *Session) RemoveFile(ctx context.Context, name string) error {
	if err := checkName(name); err != nil {
		return err
	}
	if err := ss.acquire(ctx); err != nil {
		return err
	}
	defer ss.release()
	root, err := os.OpenRoot(ss.dir)
	if err != nil {
		return fmt.Errorf("subprocess: %w", err)
	}
	defer root.Close()
	return fileError("remove", name, root.Remove(name))
}

// The live interpreter.

// interpreterDriver is the Python program that keeps the interpreter alive.
// It takes the socket on fd 0 as its control channel and puts /dev/null in
// its place. Frames from moat: 'R', a 32-byte nonce, a 4-byte big-endian
// length, the code. Frames to moat: a kind byte, a 4-byte big-endian length,
// the payload: 'H' once ready, 'X' after each run with "<exit status>
// <streams marked>". After a run it writes the nonce on fds 1 and 2, so that
// moat knows where the run's output ends.
const interpreterDriver = `import os, sys, struct, traceback, linecache
def _moat_driver():
    ctl = os.dup(0)
    nul = os.open('/dev/null', os.O_RDONLY)
    os.dup2(nul, 0)
    os.close(nul)
    sys.stdout.reconfigure(line_buffering=True)
    sys.path.insert(0, os.getcwd())
    out, err = sys.stdout, sys.stderr
    def send(kind, payload):
        os.write(ctl, kind + struct.pack('>I', len(payload)) + payload)
    def readn(n):
        buf = b''
        while len(buf) < n:
            b = os.read(ctl, n - len(buf))
            if not b:
                os._exit(0)
            buf += b
        return buf
    def status_of(code):
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xff
        try:
            print(code, file=sys.stderr)
        except Exception:
            pass
        return 1
    g = {'__name__': '__main__', '__builtins__': __builtins__}
    send(b'H', b'')
    n = 0
    while True:
        hdr = readn(37)
        nonce, size = hdr[1:33], struct.unpack('>I', hdr[33:])[0]
        src = readn(size)
        n += 1
        name = '<run %d>' % n
        status = 0
        try:
            try:
                text = src.decode('utf-8')
                linecache.cache[name] = (len(text), None, text.splitlines(True), name)
            except UnicodeDecodeError:
                pass
            exec(compile(src, name, 'exec'), g)
        except SystemExit as e:
            status = status_of(e.code)
        except BaseException:
            t, v, tb = sys.exc_info()
            try:
                traceback.print_exception(t, v, tb.tb_next)
            except BaseException:
                pass
            status = 1
        marked = ''
        for f in (sys.stdout, sys.stderr, out, err):
            try:
                f.flush()
            except BaseException:
                pass
        sys.stdout, sys.stderr = out, err
        for fd, c in ((1, 'o'), (2, 'e')):
            try:
                os.write(fd, nonce)
                marked += c
            except OSError:
                pass
        send(b'X', ('%d %s' % (status, marked)).encode())
_moat_driver()
`

// nonceLen is the length of the end-of-run marker.
const nonceLen = 32

// frame is one message from the driver.
type frame struct {
	kind    byte
	payload []byte
}

// interpreter is a live python3 under the helper.
type interpreter struct {
	s      *Sandbox
	cmd    *exec.Cmd
	ctl    *os.File // moat's end of the control socket
	status *os.File // the helper's status pipe
	group  *cgroup.Group
	frames chan frame    // closed when the control socket ends
	exited chan struct{} // closed when the helper has exited
	outs   [2]*streamRouter
	frozen bool
	dead   bool // killed or ended: the next run starts a new one
}

// streamRouter passes what the interpreter writes on one stream to the
// current run's sink, and drops it between runs.
type streamRouter struct {
	mu   sync.Mutex
	sink *markSink
	eof  chan struct{}
}

func (sr *streamRouter) pump(r io.ReadCloser) {
	defer close(sr.eof)
	defer r.Close()
	buf := make([]byte, 64*1024)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			sr.mu.Lock()
			if sr.sink != nil {
				sr.sink.feed(buf[:n])
			}
			sr.mu.Unlock()
		}
		if err != nil {
			return
		}
	}
}

func (sr *streamRouter) set(m *markSink) {
	sr.mu.Lock()
	sr.sink = m
	sr.mu.Unlock()
}

// markSink feeds a run's capture buffer until the run's end marker.
type markSink struct {
	marker  []byte
	buf     *capture.Buffer
	pending []byte // a tail that may be the start of the marker
	seen    chan struct{}
	done    bool
}

func newMarkSink(marker []byte, buf *capture.Buffer) *markSink {
	return &markSink{marker: marker, buf: buf, seen: make(chan struct{})}
}

func (m *markSink) feed(p []byte) {
	if m.done {
		return // after the marker: output of processes left behind
	}
	data := append(m.pending, p...)
	m.pending = nil
	if i := bytes.Index(data, m.marker); i >= 0 {
		m.buf.Write(data[:i])
		m.done = true
		close(m.seen)
		return
	}
	keep := 0
	for k := min(len(m.marker)-1, len(data)); k > 0; k-- {
		if bytes.HasSuffix(data, m.marker[:k]) {
			keep = k
			break
		}
	}
	m.buf.Write(data[:len(data)-keep])
	m.pending = append([]byte(nil), data[len(data)-keep:]...)
}

// flush passes on a held-back tail when the marker never came.
func (m *markSink) flush() {
	if !m.done && len(m.pending) > 0 {
		m.buf.Write(m.pending)
		m.pending = nil
	}
}

// startInterpreter starts python3 and the driver under the helper. The
// caller waits for the driver's 'H' frame.
func (ss *Session) startInterpreter() (*interpreter, error) {
	s := ss.s
	in := &interpreter{s: s, frames: make(chan frame, 4), exited: make(chan struct{})}
	var rnd [8]byte
	rand.Read(rnd[:])
	id := s.owner + "-" + hex.EncodeToString(rnd[:])
	lim := s.limits
	if s.strict {
		g, err := s.cg.New(id, cgroup.Limits{Memory: int64(lim.Memory), Pids: int64(lim.Pids)})
		if err != nil {
			return nil, unavailable("cannot create the interpreter's cgroup", "", err)
		}
		in.group = g
	}
	// -I: no environment variables, no user site; the driver puts the
	// working directory on sys.path itself.
	sp := ss.spec(in.group, []string{"python3", "-I", "-c", interpreterDriver})
	if s.strict {
		// RLIMIT_CPU counts a process's whole life, and the interpreter
		// lives across runs: the cgroup's account bounds each run instead.
		for i := range sp.Rlimits {
			if sp.Rlimits[i].Resource == unix.RLIMIT_CPU {
				sp.Rlimits[i].Cur, sp.Rlimits[i].Max = unix.RLIM_INFINITY, unix.RLIM_INFINITY
			}
		}
	}
	arg, err := json.Marshal(sp)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	in.ctl = os.NewFile(uintptr(fds[0]), "interpreter-control")
	child := os.NewFile(uintptr(fds[1]), "interpreter-control-child")
	defer child.Close()
	statusR, statusW, err := os.Pipe()
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer statusW.Close()
	in.status = statusR
	specR, specW, err := os.Pipe()
	if err != nil {
		in.close()
		return nil, fmt.Errorf("subprocess: %w", err)
	}
	defer specR.Close()
	defer specW.Close()
	var childEnds []*os.File
	defer func() {
		for _, f := range childEnds {
			f.Close()
		}
	}()
	var readers [2]*os.File
	for i := range readers {
		r, w, err := os.Pipe()
		if err != nil {
			for _, f := range readers {
				if f != nil {
					f.Close()
				}
			}
			in.close()
			return nil, fmt.Errorf("subprocess: %w", err)
		}
		readers[i] = r
		childEnds = append(childEnds, w)
	}

	// The same helper as a one-shot run's (see warm.go), with the control
	// socket as its stdin, which python3 inherits.
	cmd := s.helperCmd()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = child, childEnds[0], childEnds[1]
	cmd.ExtraFiles = []*os.File{statusW, specR} // fds 3 and 4
	if err := cmd.Start(); err != nil {
		readers[0].Close()
		readers[1].Close()
		in.close()
		return nil, unavailable("cannot start the sandbox helper", "", err)
	}
	in.cmd = cmd
	specR.Close()
	if _, err := specW.Write(arg); err != nil {
		in.s.log.Warn("subprocess: interpreter spec", "err", err)
	}
	specW.Close()
	for i := range in.outs {
		in.outs[i] = &streamRouter{eof: make(chan struct{})}
		go in.outs[i].pump(readers[i])
	}
	go func() {
		cmd.Wait()
		close(in.exited)
	}()
	go in.readFrames()
	return in, nil
}

// readFrames reads the driver's frames until the socket ends or breaks.
func (in *interpreter) readFrames() {
	defer close(in.frames)
	var hdr [5]byte
	for {
		if _, err := io.ReadFull(in.ctl, hdr[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint32(hdr[1:])
		if n > 4096 {
			return // not the driver speaking: treat as the end
		}
		p := make([]byte, n)
		if _, err := io.ReadFull(in.ctl, p); err != nil {
			return
		}
		in.frames <- frame{hdr[0], p}
	}
}

// kill ends the interpreter and everything it started.
func (in *interpreter) kill() {
	in.dead = true
	if in.cmd != nil && in.cmd.Process != nil {
		in.cmd.Process.Kill()
	}
	if in.group != nil {
		in.group.Kill()
	}
}

// close releases what the interpreter held, after it has ended.
func (in *interpreter) close() {
	in.dead = true
	if in.cmd != nil {
		select {
		case <-in.exited:
		case <-time.After(5 * time.Second):
			in.s.log.Warn("subprocess: interpreter helper did not exit")
		}
	}
	if in.ctl != nil {
		in.ctl.Close()
		go func() {
			for range in.frames {
			}
		}()
	}
	if in.status != nil {
		in.status.Close()
	}
	if in.group != nil {
		if err := in.group.Kill(); err != nil {
			in.s.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
		if err := in.group.Remove(); err != nil {
			in.s.log.Warn("subprocess: interpreter cleanup", "err", err)
		}
	}
}

// signalAll sends sig to every process of the interpreter but the helper
// until each is in the wanted state (stopped or not), a bounded number of
// times. It reports whether it got there.
func (in *interpreter) signalAll(sig syscall.Signal, stopped bool) bool {
	if in.group == nil {
		return true
	}
	helper := in.cmd.Process.Pid
	for range 50 {
		all := true
		for _, pid := range in.group.Pids() {
			if pid == helper {
				continue
			}
			if processStopped(pid) == stopped {
				continue
			}
			all = false
			syscall.Kill(pid, sig)
		}
		if all {
			return true
		}
		time.Sleep(time.Millisecond)
	}
	return false
}

// processStopped reports whether every thread of pid is stopped (or pid is
// gone or a zombie, which can run no more).
func processStopped(pid int) bool {
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return true
	}
	for _, t := range tasks {
		data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + t.Name() + "/stat")
		if err != nil {
			continue
		}
		// The state follows the command name in parentheses, which may
		// itself hold parentheses.
		i := bytes.LastIndexByte(data, ')')
		if i < 0 || i+2 >= len(data) {
			continue
		}
		switch data[i+2] {
		case 'T', 't', 'Z', 'X':
		default:
			return false
		}
	}
	return true
}

// runInterpreter runs req in the live interpreter, starting one if needed.
// The caller holds the session's turn.
func (ss *Session) runInterpreter(ctx context.Context, req moat.Request) (*moat.Result, error) {
	s, lim := ss.s, ss.s.limits
	start := time.Now()
	runCtx, cancel := context.WithTimeout(ctx, time.Duration(lim.WallTime))
	defer cancel()

	in := ss.interp
	if in != nil && in.dead {
		in.close()
		in, ss.interp = nil, nil
	}
	if in == nil {
		var err error
		in, err = ss.startInterpreter()
		if err != nil {
			return nil, err
		}
		ss.interp = in
		// Wait for the driver to be ready, within the run's time; keep
		// what it says on stderr meanwhile, for the error.
		startErr := capture.New(4096, nil, nil)
		in.outs[1].set(newMarkSink([]byte("\x00"), startErr))
		defer in.outs[1].set(nil)
		select {
		case f, ok := <-in.frames:
			if !ok || f.kind != 'H' {
				in.kill()
				<-in.exited
				st, _ := parseStatus(readStatus(in.status))
				in.close()
				ss.interp = nil
				if st.err != "" {
					return nil, fmt.Errorf("subprocess: sandbox set-up failed, nothing ran: %s: %w", st.err, moat.ErrUnavailable)
				}
				return nil, fmt.Errorf("subprocess: the interpreter did not start: %s: %w", tail(startErr.Bytes(), 512), moat.ErrUnavailable)
			}
		case <-runCtx.Done():
			in.kill()
			in.close()
			ss.interp = nil
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			return nil, fmt.Errorf("subprocess: the interpreter did not start within the wall time %v: %s: %w", lim.WallTime, tail(startErr.Bytes(), 512), moat.ErrUnavailable)
		}
	}
	if in.frozen {
		if !in.signalAll(syscall.SIGCONT, false) {
			s.log.Warn("subprocess: could not resume every process of the interpreter", "session", ss.id)
		}
		in.frozen = false
	}

	var rnd [nonceLen / 2]byte
	rand.Read(rnd[:])
	nonce := []byte(hex.EncodeToString(rnd[:]))
	// The first byte past the output cap kills the interpreter's helper, the
	// init of its PID namespace, as the wall timeout does; the run marks the
	// interpreter dead below (in.kill is not for the streams' goroutines).
	over := func() { in.cmd.Process.Kill() }
	bufs := [2]*capture.Buffer{capture.New(int64(lim.Output), req.Stdout, over), capture.New(int64(lim.Output), req.Stderr, over)}
	sinks := [2]*markSink{newMarkSink(nonce, bufs[0]), newMarkSink(nonce, bufs[1])}
	for i := range sinks {
		in.outs[i].set(sinks[i])
	}
	unset := func() {
		for i := range sinks {
			in.outs[i].set(nil)
		}
	}
	defer unset()

	var baseCPU time.Duration
	if in.group != nil {
		baseCPU, _ = in.group.CPUUsage()
	}
	var killedByUs, cpuOver atomic.Bool
	finished := make(chan struct{})
	var watchers sync.WaitGroup
	watchers.Add(1)
	go func() {
		defer watchers.Done()
		select {
		case <-finished:
		case <-runCtx.Done():
			killedByUs.Store(true)
			in.kill()
		}
	}()
	stopCPU := func() {}
	if in.group != nil {
		stopCPU = in.group.WatchCPU(baseCPU, time.Duration(lim.CPUTime), in.kill, &cpuOver)
	}

	msg := make([]byte, 0, 1+nonceLen+4+len(req.Code))
	msg = append(msg, 'R')
	msg = append(msg, nonce...)
	msg = binary.BigEndian.AppendUint32(msg, uint32(len(req.Code)))
	msg = append(msg, req.Code...)
	// A write that fails means the interpreter ended; the frames say how.
	in.ctl.Write(msg)

	exitCode, marked, gotExit := 0, "", false
	for f := range in.frames {
		if f.kind != 'X' {
			continue
		}
		code, m, _ := strings.Cut(string(f.payload), " ")
		n, err := strconv.Atoi(code)
		if err != nil {
			break // not the driver speaking
		}
		exitCode, marked, gotExit = n, m, true
		break
	}
	if gotExit {
		// Wait for the end markers of the streams the driver marked, so
		// that all the run's output is in.
		wait := time.NewTimer(2 * time.Second)
		for i, c := range []string{"o", "e"} {
			if !strings.Contains(marked, c) {
				continue
			}
			select {
			case <-sinks[i].seen:
			case <-in.outs[i].eof:
			case <-wait.C:
			case <-runCtx.Done():
			}
		}
		wait.Stop()
		for i := range sinks {
			select {
			case <-sinks[i].seen:
			default:
				// The code redirected or closed its stdout or stderr: the
				// next run could not be told apart. Start afresh.
				in.kill()
			}
		}
	}
	close(finished)
	watchers.Wait()
	stopCPU()
	end := time.Now()

	var events cgroup.Events
	if in.group != nil {
		events = in.group.Events()
	}
	if !gotExit || events.OOMKill || events.PidsMax {
		in.kill()
	}
	res := &moat.Result{Level: moat.LevelSubprocess, Notes: s.notes}
	signaled := false
	if gotExit {
		res.ExitCode = exitCode
	} else {
		// The interpreter ended during the run: the helper says how.
		select {
		case <-in.exited:
		case <-time.After(5 * time.Second):
		}
		st, reported := parseStatus(readStatus(in.status))
		switch {
		case reported && st.err != "":
			unset()
			in.close()
			ss.interp = nil
			return nil, fmt.Errorf("subprocess: sandbox set-up failed: %s: %w", st.err, moat.ErrUnavailable)
		case reported && st.exited:
			res.ExitCode = st.code
		case reported && st.signaled:
			res.ExitCode = 128 + int(st.signal)
			res.Signal = unix.SignalName(st.signal)
			signaled = true
		default:
			// Killed by moat, or the helper itself was killed.
			res.ExitCode = 128 + int(syscall.SIGKILL)
			res.Signal = unix.SignalName(syscall.SIGKILL)
			signaled = true
		}
	}
	unset()
	for i := range sinks {
		sinks[i].flush()
	}
	res.Stdout, res.Stderr = bufs[0].Bytes(), bufs[1].Bytes()
	res.Truncated = bufs[0].Truncated() || bufs[1].Truncated()
	if res.Truncated {
		// Killed for its output, even if the code had ended first; the
		// next run starts a fresh interpreter.
		in.kill()
		res.ExitCode, res.Signal, signaled = 128+int(syscall.SIGKILL), unix.SignalName(syscall.SIGKILL), true
	}
	probe := &run{dir: ss.dir, mounted: ss.mounted}
	switch {
	case !gotExit && killedByUs.Load() && ctx.Err() != nil:
		res.Reason = moat.ReasonCanceled
	case !gotExit && (killedByUs.Load() || cpuOver.Load()):
		res.Reason = moat.ReasonTimeout
	case events.OOMKill:
		res.Reason = moat.ReasonMemory
	case events.PidsMax:
		res.Reason = moat.ReasonPids
	case probe.fileAtLimit(int64(lim.FileSize)):
		res.Reason = moat.ReasonFileSize
	case ss.mounted && probe.diskFull():
		res.Reason = moat.ReasonDisk
	case res.Truncated:
		res.Reason = moat.ReasonOutput
	case signaled:
		res.Reason = moat.ReasonSignal
	}
	res.Duration = end.Sub(start)

	if in.dead {
		in.close()
		ss.interp = nil
	} else {
		if in.signalAll(syscall.SIGSTOP, true) {
			in.frozen = true
		} else {
			in.kill()
			in.close()
			ss.interp = nil
		}
	}
	return res, nil
}

// readStatus reads what the helper reported, once it has exited.
func readStatus(f *os.File) []byte {
	if f == nil {
		return nil
	}
	f.SetReadDeadline(time.Now().Add(time.Second))
	b, _ := io.ReadAll(io.LimitReader(f, 4096))
	return b
}
