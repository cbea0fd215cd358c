package subprocess

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
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
// path stays alive between runs, driven by a small driver
// (interpreter_driver.py) that reads code on a socket and runs it with
// exec() in one persistent globals dictionary (see interpreter.go). Its
// specifics:
//
//   - The interpreter has one cgroup for its life: the memory and process
//     limits cover all it holds; the CPU limit applies per run, to the
//     cgroup's usage since the run began.
//   - Between runs its cgroup is frozen: no thread or process the code left
//     behind runs while no run is going on, whatever it armed to wake itself
//     (a SIGCONT from a timer wakes a process stopped by SIGSTOP, not a frozen
//     one). Without a cgroup freezer, NewSession refuses an interpreter with
//     an error wrapping moat.ErrUnavailable.
//   - The session's interpreters together may use Config.SessionCPUTime of
//     CPU over the session's life, counted from their cgroups, runs and the
//     time between them alike. The run that reaches it ends with
//     moat.ReasonTimeout, like one that reaches its own CPU limit; then the
//     session is spent: later Runs fail with an error wrapping
//     moat.ErrSpent, while its files can still be read, until Close.
//   - A run that times out, is cancelled, hits the CPU, memory or process
//     limit, or writes past the output cap ends the interpreter (the wall
//     timeout and the output cap kill its whole PID namespace); the next run
//     starts a fresh one, with the files still there and the variables gone.
//     Both runs say so in their Result.Notes: the one that ended the
//     interpreter ("interpreter ended by this run's timeout: ...") and the
//     one that started the next ("interpreter restarted: the previous one
//     was ended by its run's timeout; variables from earlier runs are
//     gone").
//   - What the code writes to file descriptors 1 and 2 is the run's stdout and
//     stderr; what processes it left behind write between runs is dropped.
//   - The end of a run and its exit status are taken from the driver, only
//     when marked with that run's nonce, so that nothing from an earlier run
//     becomes a later run's result; but the code shares the driver's process
//     and can change what later runs do and report. See interpreter.go.

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
	if opts.Interpreter && s.strict {
		if err := s.cg.Freezer(); err != nil {
			return nil, errNoFreezer(err)
		}
	}
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
	// cpuUsed is the CPU time of the session's interpreters that have
	// ended; cpuSpent is set once they have used the session's budget.
	cpuUsed  time.Duration
	cpuSpent bool
	// ended says why the last interpreter ended, as a format with one %s
	// for whose run ("its run's timeout"), until the run that starts the
	// next one has said so in its notes.
	ended string

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
	// What the directory holds at the size limit now, the code file
	// included, is not this run's doing (see run.fileAtLimit).
	r.atStart = filesAtLimit(ss.dir, int64(lim.FileSize))
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
	ss.endInterpreter("")
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

// Stat describes name without following a symbolic link; see moat.Files.
func (ss *Session) Stat(ctx context.Context, name string) (moat.FileInfo, error) {
	if err := checkName(name); err != nil {
		return moat.FileInfo{}, err
	}
	if err := ss.acquire(ctx); err != nil {
		return moat.FileInfo{}, err
	}
	defer ss.release()
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
func (ss *Session) Mkdir(ctx context.Context, name string) error {
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
	return fileError("mkdir", name, mkdirAllOwned(root, name, uid, gid))
}

// Rename moves from to to inside the session's directory; see moat.Files.
func (ss *Session) Rename(ctx context.Context, from, to string) error {
	if err := checkName(from); err != nil {
		return err
	}
	if err := checkName(to); err != nil {
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
	return fileError("rename", from, root.Rename(from, to))
}
