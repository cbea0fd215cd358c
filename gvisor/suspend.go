package gvisor

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/image"
	"github.com/moatsandbox/moat/internal/engine"
	"github.com/moatsandbox/moat/internal/sessionfiles"
)

// Suspending a session keeps its whole sandbox: memory, processes, files.
//
// A session's sandbox is checkpointed whole (runsc checkpoint, of the
// paused sandbox): the sentry's memory, which holds every process of the
// sandbox that descends from the container's init (what runsc checkpoint
// saves and runsc restore brings back: with a live interpreter, the init,
// the interpreter and whatever its runs left; a process started with
// runsc exec would not come back, so the launcher primed for a plain
// session's next run is ended first and primed again after a resume), the
// sentry's tmpfs mounts (/tmp, /dev/shm, and a plain session's working
// directory), and its kernel's state. An interpreter session's working
// directory is a tmpfs of the host (hostfiles.go), which the checkpoint
// does not hold: it is saved next to the image as a tar archive. The
// engine's directory for it (engine.StateSaver) holds
//
//	sandbox/      runsc's checkpoint image (0700; its file 0600)
//	work.tar      an interpreter session's working directory: directories,
//	              regular files (each once, its other names hard links)
//	              and links, with their modes and times; never more bytes
//	              of files than the directory's size (a tree of sparse
//	              files past it is refused before the checkpoint)
//	sandbox.json  savedSandbox: what made the image, and the session's
//	              host-side state
//
// A resume makes a new sandbox as a fresh session's (a bundle, cgroup,
// runsc root entry and id of its own, and for an interpreter a new host
// tmpfs filled from work.tar), started with runsc restore from the image,
// which runsc only reads: one directory resumes many times, each resume a
// fork sharing nothing writable with another. runsc donates the new
// sandbox's stdio to the restored init, which is all that held host files,
// so moat talks to the interpreter again through it. The image must be of
// this moat's machine: the same runsc (its version and binary), platform
// and flags, root filesystem, limits and launcher and driver programs,
// which the key of sandbox.json covers (stateKey); a state of another one
// is refused with moat.ErrInvalid before anything starts. The session's CPU
// budget keeps counting from what its runs had used.
//
// Time and randomness after a resume (checked with runsc 20240729):
// gVisor's clocks follow the host's (its CLOCK_REALTIME is the host's
// time when restored), and its random numbers (getrandom, /dev/urandom)
// are read from the host's generator, so forks of one state draw
// different ones. Python's string hash seed and the random module's state
// live in the interpreter's memory and cannot change under it: every fork
// of one state has the state's.
//
// A session with a network (Config.Egress) is not checkpointed: its
// code's environment holds its proxy run's CA and secrets' placeholders,
// which a restored sandbox would need its old run for. It is suspended
// through the engine's files path instead (session.go's filesOnly): its
// files are kept, and a live interpreter starts fresh on resume, said in
// the resume's notes.

const (
	savedImageDir = "sandbox"
	savedWorkTar  = "work.tar"
	savedMetaFile = "sandbox.json"
	savedFormat   = 1
)

// checkpointTimeout bounds runsc checkpoint and runsc restore.
const checkpointTimeout = 2 * time.Minute

// savedSandbox is sandbox.json.
type savedSandbox struct {
	Format int `json:"format"`
	// Key is stateKey of the sandbox saved.
	Key      string   `json:"key"`
	Runsc    string   `json:"runsc"`
	Platform Platform `json:"platform"`
	// Interpreter says the session has a live interpreter.
	Interpreter bool `json:"interpreter"`
	// Live says the interpreter was alive; Pid is its PID namespace's
	// init's pid (a resume checks it against what the restored init says
	// it runs), Prev the nonce of its last run, and Ended why the last one
	// ended when none was alive.
	Live  bool   `json:"live"`
	Pid   int    `json:"pid,omitempty"`
	Prev  string `json:"prev,omitempty"`
	Ended string `json:"ended,omitempty"`
	// CPUUsedNS is the CPU time of the session's runs so far, which its
	// budget (Config.SessionCPUTime) keeps counting from.
	CPUUsedNS int64 `json:"cpu_used_ns"`
	SaveMS    int64 `json:"save_ms"`
}

var (
	_ engine.StateSaver    = (*session)(nil)
	_ engine.StateRestorer = (*backend)(nil)
)

// stateSpec is the spec of the sandbox of a session that a state is
// restored into: a new session's, without a network.
func (b *backend) stateSpec(interpreter bool) (*ociSpec, moat.Bytes, error) {
	spec, work := b.sessionSpec(interpreter)
	if !interpreter {
		return spec, work, nil
	}
	raw, err := guestFilterBytes()
	if err != nil {
		return nil, 0, err
	}
	return b.withInit(spec, raw, b.codeEnv(nil)), work, nil
}

// stateKey names what a checkpoint image needs to be restored as it was
// saved: runsc (version and binary), the platform and every flag of
// runsc's, the root filesystem, and the spec of the session's sandbox
// (limits, mounts, the init's, launcher's and driver's programs, the guest
// filter), with or without an interpreter.
func (b *backend) stateKey(interpreter bool) (string, error) {
	b.digestRunsc()
	if b.runscSumErr != nil {
		return "", fmt.Errorf("gvisor: read runsc: %w", b.runscSumErr)
	}
	spec, work, err := b.stateSpec(interpreter)
	if err != nil {
		return "", err
	}
	specJSON, err := json.Marshal(spec)
	if err != nil {
		return "", fmt.Errorf("gvisor: %w", err)
	}
	image := ""
	if r, err := readImageRecord(b.rootfs); err == nil {
		image = r.Key
	}
	flags := (&booted{b: b, bundle: "BUNDLE", id: "ID"}).runscArgs()
	h := sha256.New()
	fmt.Fprintf(h, "moat-gvisor-checkpoint\nformat=%d\ninterpreter=%v\nrunsc=%s %s\nflags=%q\nrootfs=%s %s\nwork=%d\nmemory=%d\nlauncher=%s\nspec=",
		savedFormat, interpreter, b.info.Version, b.runscSum, flags, b.rootfs, image, work, b.limits.Memory, launcherPy)
	h.Write(specJSON)
	return hex.EncodeToString(h.Sum(nil)), nil
}

// SaveState implements engine.StateSaver: the paused sandbox is
// checkpointed into dir/sandbox, then killed, and a host working
// directory archived into dir/work.tar; then the session is closed. A
// session with a network, or whose working directory holds more bytes of
// files than its size (sparse files; see archiveWork), is refused
// (moat.ErrInvalid) and keeps running.
// When the checkpoint fails the sandbox is killed and the error wraps
// moat.ErrClosed.
func (ss *session) SaveState(ctx context.Context, dir string) error {
	b := ss.b
	if ss.bt.net != nil {
		return fmt.Errorf("gvisor: suspend: a session with a network cannot be suspended with its memory yet (its code's environment holds its own proxy run's CA and placeholders): %w", moat.ErrInvalid)
	}
	key, err := b.stateKey(ss.interpreter)
	if err != nil {
		return err
	}
	if !ss.interpreter {
		// The launcher primed for the next run is a process of runsc
		// exec's, holding host files: no restore would bring it back.
		if err := ss.unprime(); err != nil {
			return err
		}
	}
	image := filepath.Join(dir, savedImageDir)
	if err := os.Mkdir(image, 0o700); err != nil {
		return fmt.Errorf("gvisor: suspend: %w", err)
	}
	ss.mu.Lock()
	switch {
	case ss.closed:
		ss.mu.Unlock()
		return fmt.Errorf("gvisor: session: %w", moat.ErrClosed)
	case ss.broken != nil:
		err := ss.broken
		ss.mu.Unlock()
		return err
	case ss.holds != 0 || !ss.paused:
		ss.mu.Unlock()
		return fmt.Errorf("gvisor: suspend: the session's sandbox is in use (%d holds)", ss.holds)
	}
	_, workSize := b.sessionSpec(ss.interpreter)
	if ss.bt.work != "" {
		// Paused: the code cannot change the tree until it is archived.
		if err := checkWork(ss.bt.work, int64(workSize)); err != nil {
			ss.mu.Unlock()
			return fmt.Errorf("gvisor: suspend: %w; the session keeps running: %w", err, moat.ErrInvalid)
		}
	}
	m := savedSandbox{Format: savedFormat, Key: key, Runsc: b.info.Version, Platform: b.platform, Interpreter: ss.interpreter,
		CPUUsedNS: int64(ss.spent), Ended: ss.ended}
	if d := ss.interp; d != nil && !d.dead.Load() && !d.ended() {
		m.Live, m.Pid, m.Prev = true, d.proc.pid, string(d.prev)
	} else if d != nil && m.Ended == "" {
		m.Ended = "it ended between runs"
	}
	start := time.Now()
	// Taken paused: nothing of the sandbox runs between the last run and
	// the checkpoint, which leaves the sandbox paused (it is killed next).
	// Uncompressed: about four times the size of runsc's default (flate),
	// and half its time to save and to restore.
	cctx, cancel := context.WithTimeout(ctx, checkpointTimeout)
	_, err = runQuiet(cctx, b.runsc, "--root="+b.runscRoot, "checkpoint", "--compression=none", "--image-path="+image, ss.bt.id)
	cancel()
	ss.closed = true
	ss.mu.Unlock()
	ss.bt.kill()
	if err != nil {
		ss.Close()
		return fmt.Errorf("gvisor: suspend: runsc checkpoint: %w; the session's sandbox is killed: %w", err, moat.ErrClosed)
	}
	m.SaveMS = time.Since(start).Milliseconds()
	err = sealImage(image)
	if err == nil && ss.bt.work != "" {
		err = archiveWork(ss.bt.work, filepath.Join(dir, savedWorkTar), int64(workSize))
	}
	if err == nil {
		var mb []byte
		mb, err = json.MarshalIndent(m, "", "  ")
		if err == nil {
			err = writeFileSync(filepath.Join(dir, savedMetaFile), append(mb, '\n'))
		}
	}
	ss.Close()
	if err != nil {
		return fmt.Errorf("gvisor: suspend: %w; the session is closed: %w", err, moat.ErrClosed)
	}
	return nil
}

// sealImage makes runsc's image files root's alone (0600) and syncs them.
func sealImage(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	if len(entries) == 0 {
		return errors.New("runsc checkpoint wrote no image")
	}
	for _, e := range entries {
		p := filepath.Join(dir, e.Name())
		if !e.Type().IsRegular() {
			return fmt.Errorf("runsc checkpoint wrote %s, not a regular file", e.Name())
		}
		if err := os.Chmod(p, 0o600); err != nil {
			return err
		}
		f, err := os.Open(p)
		if err != nil {
			return err
		}
		err = f.Sync()
		f.Close()
		if err != nil {
			return err
		}
	}
	return nil
}

// RestoreState implements engine.StateRestorer: a new sandbox restored
// from dir/sandbox, which it only reads, with a host working directory
// made from dir/work.tar where the session has one. With a live
// interpreter, the interpreter answers through the restored init; without,
// the next run's launcher is primed as after a run. The sandbox is then
// paused. A state of another machine than this sandbox's (see stateKey),
// or saved with other options, is refused with moat.ErrInvalid before
// anything starts.
func (b *backend) RestoreState(ctx context.Context, dir string, opts moat.SessionOptions) (engine.SessionInstance, error) {
	mb, err := os.ReadFile(filepath.Join(dir, savedMetaFile))
	if err != nil {
		return nil, fmt.Errorf("gvisor: resume: %w", err)
	}
	var m savedSandbox
	if err := json.Unmarshal(mb, &m); err != nil {
		return nil, fmt.Errorf("gvisor: resume: %s: %v: %w", savedMetaFile, err, moat.ErrInvalid)
	}
	if m.Format != savedFormat {
		return nil, fmt.Errorf("gvisor: resume: a state of format %d, this moat reads %d: %w", m.Format, savedFormat, moat.ErrInvalid)
	}
	if m.Interpreter != opts.Interpreter {
		return nil, fmt.Errorf("gvisor: resume: the state's session has interpreter=%v, the options say %v: %w", m.Interpreter, opts.Interpreter, moat.ErrInvalid)
	}
	if b.cfg.Egress != nil {
		return nil, fmt.Errorf("gvisor: resume: the state was saved without a network, and this sandbox gives each session one: %w", moat.ErrInvalid)
	}
	key, err := b.stateKey(opts.Interpreter)
	if err != nil {
		return nil, err
	}
	if m.Key != key {
		return nil, fmt.Errorf("gvisor: resume: the state is of another sandbox (runsc %s, platform %s, key %s; this one's is runsc %s, platform %s, key %s): runsc, its flags, the root filesystem, the limits or moat's programs changed since: %w",
			m.Runsc, m.Platform, m.Key, b.info.Version, b.platform, key, moat.ErrInvalid)
	}
	if m.Live && (!m.Interpreter || m.Pid <= 1 || len(m.Prev) != nonceLen && m.Prev != "") {
		return nil, fmt.Errorf("gvisor: resume: %s names no interpreter (pid %d): %w", savedMetaFile, m.Pid, moat.ErrInvalid)
	}
	if _, err := hex.DecodeString(m.Prev); err != nil {
		return nil, fmt.Errorf("gvisor: resume: %s holds a nonce %q that is none of moat's: %w", savedMetaFile, m.Prev, moat.ErrInvalid)
	}
	// A negative account would give the session more than its budget.
	if m.CPUUsedNS < 0 {
		return nil, fmt.Errorf("gvisor: resume: %s says the session used %d ns of CPU: %w", savedMetaFile, m.CPUUsedNS, moat.ErrInvalid)
	}
	spec, work, err := b.stateSpec(opts.Interpreter)
	if err != nil {
		return nil, err
	}
	from := &restoreSource{image: filepath.Join(dir, savedImageDir)}
	if opts.Interpreter {
		tarPath := filepath.Join(dir, savedWorkTar)
		from.fill = func(w string) error { return extractWork(tarPath, w) }
	}
	bt, err := b.bootFrom(spec, work, nil, from)
	if err != nil {
		return nil, err
	}
	ss := &session{b: b, bt: bt, budget: b.sessionCPUTime(), execs: map[*exec.Cmd]bool{}, interpreter: opts.Interpreter,
		spent: time.Duration(m.CPUUsedNS), ended: m.Ended}
	if !opts.Interpreter {
		return ss.restorePlain(ctx)
	}
	if err := ss.startInit(ctx, checkpointTimeout, "restore"); err != nil {
		bt.remove()
		return nil, err
	}
	// The restored init says which interpreter it runs: the end of one
	// that ended just before the checkpoint may have been in the old
	// pipe, never read by the host that saved the state.
	switch running := ss.init.running; {
	case m.Live && running == 0:
		ss.ended = "it ended before the suspend"
	case running != m.Pid || !m.Live && running != 0:
		bt.remove()
		return nil, fmt.Errorf("gvisor: resume: %s names the interpreter %d (live %v), the restored sandbox runs %d: %w", savedMetaFile, m.Pid, m.Live, running, moat.ErrInvalid)
	case m.Live:
		p, err := ss.init.attach(running)
		if err != nil {
			bt.remove()
			return nil, err
		}
		d := newDriver(p)
		if m.Prev != "" {
			d.prev = []byte(m.Prev)
		}
		ss.interp = d
	}
	ss.Files = hostFiles{ss}
	ss.holds = 1
	ss.primed = make(chan struct{})
	close(ss.primed)
	ss.release()
	ss.mu.Lock()
	err = ss.broken
	ss.mu.Unlock()
	if err != nil {
		ss.Close()
		return nil, err
	}
	b.log.Debug("gvisor: session restored", "id", bt.id, "live", m.Live)
	return ss, nil
}

// restorePlain waits for the restored sandbox of a session without an
// interpreter to run, and primes its next run's launcher, which pauses it.
func (ss *session) restorePlain(ctx context.Context) (engine.SessionInstance, error) {
	bt := ss.bt
	bt.stdin.Close()
	go io.Copy(io.Discard, bt.stdout)
	go io.Copy(io.MultiWriter(io.Discard, &ss.initErr), bt.stderr)
	if err := ss.waitRunning(ctx); err != nil {
		bt.remove()
		return nil, err
	}
	ss.env = ss.b.codeEnv(nil)
	if err := ss.writeLaunchSpec(); err != nil {
		bt.remove()
		return nil, err
	}
	ss.Files = sessionfiles.New(ss.exec, sessionfiles.Options{Python: image.Python, Dir: image.WorkDir, FileSize: ss.b.limits.FileSize})
	ss.holds = 1
	ss.startPriming()
	ss.b.log.Debug("gvisor: session restored", "id", bt.id)
	return ss, nil
}

// waitRunning waits, at most checkpointTimeout, until runsc says the
// restored container runs.
func (ss *session) waitRunning(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, checkpointTimeout)
	defer cancel()
	for {
		out, err := runQuiet(ctx, ss.b.runsc, "--root="+ss.b.runscRoot, "state", ss.bt.id)
		var st struct {
			Status string `json:"status"`
		}
		if err == nil && json.Unmarshal(out, &st) == nil && st.Status == "running" {
			return nil
		}
		select {
		case <-ss.bt.exited:
			ev := ss.sandboxEvidence()
			return fmt.Errorf("gvisor: resume: the sandbox did not restore (%s): %w", clip(ss.initErr.bytes(), 300), ev.failure())
		case <-ctx.Done():
			if ctx.Err() == context.DeadlineExceeded {
				return fmt.Errorf("gvisor: resume: the sandbox did not restore within %v: %w", checkpointTimeout, moat.ErrUnavailable)
			}
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// unprime ends the launcher primed for the next run of a session without
// an interpreter, and waits for its runsc exec to end; the sandbox is
// paused again after.
func (ss *session) unprime() error {
	<-ss.primed
	ss.mu.Lock()
	r := ss.next
	ss.next = nil
	ss.mu.Unlock()
	if r == nil {
		return nil
	}
	if err := ss.hold(); err != nil {
		r.abandon()
		return err
	}
	defer ss.release()
	r.abandon()
	select {
	case <-r.exited:
		return nil
	case <-time.After(killGrace):
		ss.mu.Lock()
		err := ss.breakLocked(errors.New("the launcher primed for the next run did not end when killed"))
		ss.mu.Unlock()
		return err
	}
}

// writeFileSync writes a new file of root's alone and syncs it.
func writeFileSync(p string, b []byte) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(b)
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

// archiveWork writes the tree under work, a session's host working
// directory, into a new tar file dst: directories, regular files and
// symbolic links, with their modes, owners and times; a file of several
// names is written once, its other names as hard links to the first.
// Nothing else can be there (the code's FIFOs and sockets are the
// sentry's, kept by the checkpoint, never the host's); anything else is an
// error. The files' bytes in all are at most limit, the size of the
// directory's tmpfs: the code can make files that hold more than they use
// (sparse files, which tar would write out whole), and such a tree is
// refused (walkWork), never written out.
func archiveWork(work, dst string, limit int64) error {
	root, err := os.OpenRoot(work)
	if err != nil {
		return err
	}
	defer root.Close()
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	err = walkWork(root, limit, func(p string, info fs.FileInfo, link, first string) error {
		hdr, err := tar.FileInfoHeader(info, link)
		if err != nil {
			return err
		}
		hdr.Name = p
		if info.IsDir() {
			hdr.Name += "/"
		}
		if first != "" {
			hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
		}
		hdr.Uname, hdr.Gname = "", ""
		hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(hdr); err != nil {
			return err
		}
		if !info.Mode().IsRegular() || first != "" {
			return nil
		}
		src, err := root.Open(p)
		if err != nil {
			return err
		}
		_, err = io.CopyN(tw, src, info.Size())
		src.Close()
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if err == nil {
		err = f.Sync()
	}
	return errors.Join(err, f.Close())
}

// checkWork says whether archiveWork would keep the tree under work
// within limit, without writing anything: SaveState asks before it
// checkpoints, so that a tree it cannot keep leaves the session running.
func checkWork(work string, limit int64) error {
	root, err := os.OpenRoot(work)
	if err != nil {
		return err
	}
	defer root.Close()
	return walkWork(root, limit, func(string, fs.FileInfo, string, string) error { return nil })
}

// walkWork calls visit for each name under root, parents first: with
// link, a symbolic link's target, and first, for a regular file of
// several names, the first name of it visited, when this is not that
// one. It fails on what archiveWork cannot keep: kinds of file other than
// directories, regular files and links, and files whose sizes (each file
// counted once, however many names it has) add up to more than limit.
func walkWork(root *os.Root, limit int64, visit func(p string, info fs.FileInfo, link, first string) error) error {
	type fileID struct{ dev, ino uint64 }
	names := map[fileID]string{}
	var total int64
	return fs.WalkDir(root.FS(), ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		info, err := root.Lstat(p)
		if err != nil {
			return err
		}
		link, first := "", ""
		switch {
		case info.Mode()&fs.ModeSymlink != 0:
			if link, err = root.Readlink(p); err != nil {
				return err
			}
		case info.Mode().IsRegular():
			st, ok := info.Sys().(*syscall.Stat_t)
			if !ok {
				return fmt.Errorf("%s in the working directory has no inode", p)
			}
			id := fileID{uint64(st.Dev), uint64(st.Ino)}
			if st.Nlink > 1 {
				if first = names[id]; first == "" {
					names[id] = p
				}
			}
			if first == "" {
				if total += info.Size(); total > limit {
					return fmt.Errorf("the files of the working directory hold more than its %d bytes (sparse files), which a suspend cannot keep", limit)
				}
			}
		case info.IsDir():
		default:
			return fmt.Errorf("%s in the working directory is %v, which a suspend cannot keep", p, info.Mode().Type())
		}
		return visit(p, info, link, first)
	})
}

// extractWork fills work, a new host working directory, from the tar file
// src that archiveWork wrote, through an os.Root: no name leaves work, and
// links are made, never followed; a hard link names a regular file made
// earlier from the same archive. What archiveWork does not write is
// refused with moat.ErrInvalid. Everything made is the sandbox's uid's
// (setAttrs).
func extractWork(src, work string) error {
	f, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("gvisor: resume: %w", err)
	}
	defer f.Close()
	root, err := os.OpenRoot(work)
	if err != nil {
		return fmt.Errorf("gvisor: resume: %w", err)
	}
	defer root.Close()
	type dirTimes struct {
		name string
		hdr  *tar.Header
	}
	var dirs []dirTimes
	files := map[string]bool{} // the regular files made so far
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return fmt.Errorf("gvisor: resume: %s: %v: %w", savedWorkTar, err, moat.ErrInvalid)
		}
		name := strings.TrimSuffix(hdr.Name, "/")
		if name != "." && (!fs.ValidPath(name) || path.Clean(name) != name) {
			return fmt.Errorf("gvisor: resume: %s holds the name %q: %w", savedWorkTar, hdr.Name, moat.ErrInvalid)
		}
		mode := hdr.FileInfo().Mode() & (fs.ModePerm | fs.ModeSetgid | fs.ModeSticky)
		switch hdr.Typeflag {
		case tar.TypeDir:
			if name != "." {
				if err := root.Mkdir(name, 0o700); err != nil {
					return fmt.Errorf("gvisor: resume: %w", err)
				}
			}
			dirs = append(dirs, dirTimes{name, hdr})
		case tar.TypeReg:
			out, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
			if err != nil {
				return fmt.Errorf("gvisor: resume: %w", err)
			}
			_, err = io.Copy(out, tr)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("gvisor: resume: %s: %w", name, err)
			}
			if err := setAttrs(root, name, hdr, mode); err != nil {
				return err
			}
			files[name] = true
		case tar.TypeLink:
			if !files[hdr.Linkname] {
				return fmt.Errorf("gvisor: resume: %s holds %q, a hard link to %q, which is no file made before it: %w", savedWorkTar, hdr.Name, hdr.Linkname, moat.ErrInvalid)
			}
			if err := root.Link(hdr.Linkname, name); err != nil {
				return fmt.Errorf("gvisor: resume: %w", err)
			}
		case tar.TypeSymlink:
			if err := root.Symlink(hdr.Linkname, name); err != nil {
				return fmt.Errorf("gvisor: resume: %w", err)
			}
			if err := root.Lchown(name, sandboxUID, sandboxGID); err != nil {
				return fmt.Errorf("gvisor: resume: %w", err)
			}
		default:
			return fmt.Errorf("gvisor: resume: %s holds %q of type %q: %w", savedWorkTar, hdr.Name, hdr.Typeflag, moat.ErrInvalid)
		}
	}
	// Directories last, deepest first: their times and modes are what was
	// saved once nothing more is made in them.
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		mode := d.hdr.FileInfo().Mode() & (fs.ModePerm | fs.ModeSetgid | fs.ModeSticky)
		if err := setAttrs(root, d.name, d.hdr, mode); err != nil {
			return err
		}
	}
	return nil
}

// setAttrs gives name the sandbox's uid and gid, mode and hdr's times.
// Everything in a working directory is the sandbox's (the code has no
// capability to chown, the file operations chown what they make): the
// archive's owners are not taken, so that no archive makes a file of
// root's, or setgid root's, in it.
func setAttrs(root *os.Root, name string, hdr *tar.Header, mode fs.FileMode) error {
	if err := root.Lchown(name, sandboxUID, sandboxGID); err != nil {
		return fmt.Errorf("gvisor: resume: %w", err)
	}
	if err := root.Chmod(name, mode); err != nil {
		return fmt.Errorf("gvisor: resume: %w", err)
	}
	if err := root.Chtimes(name, hdr.AccessTime, hdr.ModTime); err != nil {
		return fmt.Errorf("gvisor: resume: %w", err)
	}
	return nil
}

// runscDigest caches the digest of the backend's runsc binary.
type runscDigest struct {
	runscSumOnce sync.Once
	runscSum     string
	runscSumErr  error
}

// digestRunsc reads runsc's binary once (about 0.2 s for its 30 MB here);
// New starts it in the background, so that no suspend waits for it.
func (b *backend) digestRunsc() {
	b.runscSumOnce.Do(func() {
		f, err := os.Open(b.runsc)
		if err != nil {
			b.runscSumErr = err
			return
		}
		defer f.Close()
		h := sha256.New()
		if _, err := io.Copy(h, f); err != nil {
			b.runscSumErr = err
			return
		}
		b.runscSum = hex.EncodeToString(h.Sum(nil))
	})
}
