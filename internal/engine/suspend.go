package engine

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/moatsandbox/moat"
)

// StateSaver is implemented by SessionInstances whose level saves more than
// the files: the memory of the session (a VM's RAM and devices), so that a
// live interpreter's variables come back.
//
// SaveState saves everything of the instance into dir, which exists and is
// empty, and then ends the instance as Close would: the engine calls
// nothing of it afterwards, Close included. The engine calls it with no run
// or file operation in progress. On an error the instance must be as it
// was (still serving runs), or gone with an error wrapping moat.ErrClosed.
type StateSaver interface {
	SaveState(ctx context.Context, dir string) error
}

// StateRestorer is implemented by SessionBackends whose instances are
// StateSavers. RestoreState makes a live instance from what SaveState
// wrote in dir, which the engine has checked against its manifest; it only
// reads dir, and may be called many times on one dir (forks), each
// instance sharing nothing writable with another.
type StateRestorer interface {
	RestoreState(ctx context.Context, dir string, opts moat.SessionOptions) (SessionInstance, error)
}

// The layout of a suspended session's directory.
const (
	stateFormat  = 1
	infoFile     = "session.json"  // the SuspendInfo and the format
	manifestName = "manifest.json" // every other file's size and digest
	filesDir     = "files"         // the working directory's files (without memory)
	stateDir     = "state"         // what a StateSaver saved (with memory)
)

// savedInfo is session.json.
type savedInfo struct {
	Format int                 `json:"format"`
	Saved  time.Time           `json:"saved"`
	Opts   moat.SessionOptions `json:"options"`
	Info   moat.SuspendInfo    `json:"info"`
}

// manifest is manifest.json: every directory and regular file of the
// state but the manifest, with its size and SHA-256.
type manifest struct {
	// Digest names the files' digests: digestChunked, or "" for states
	// saved before it, whose digests are of the whole file (digestWhole).
	Digest string          `json:"digest,omitempty"`
	Dirs   []string        `json:"dirs"`
	Files  []manifestEntry `json:"files"`
}

type manifestEntry struct {
	Path   string `json:"path"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"`
}

// maxNotes bounds the notes of what was not kept.
const maxNotes = 10

// Suspend implements moat.Suspender: it waits for the run in progress,
// saves the session into dir (its memory too when the level can), and
// closes the session. The directory is written under a temporary name next
// to it and renamed into place once complete and synced, so that it
// appears whole or not at all.
func (ss *Session) Suspend(ctx context.Context, dir string) (moat.SuspendInfo, error) {
	level := ss.s.cfg.Level
	info := moat.SuspendInfo{Level: level, Interpreter: ss.opts.Interpreter}
	if _, err := os.Lstat(dir); !errors.Is(err, fs.ErrNotExist) {
		return info, fmt.Errorf("%s: suspend: %s exists already, or cannot be checked (%v): %w", level, dir, err, moat.ErrInvalid)
	}
	select {
	case ss.sem <- struct{}{}:
	case <-ctx.Done():
		return info, ctx.Err()
	}
	defer func() { <-ss.sem }()
	opCtx, o, err := ss.enter(ctx)
	if err != nil {
		return info, err
	}
	tmp := filepath.Join(filepath.Dir(dir), "."+filepath.Base(dir)+".partial-"+rand.Text())
	done := false
	defer func() {
		if !done {
			os.RemoveAll(tmp)
		}
	}()
	if err := os.Mkdir(tmp, 0o700); err != nil {
		ss.leave(o)
		return info, fmt.Errorf("%s: suspend: %w", level, err)
	}
	saver, canSave := ss.inst.(StateSaver)
	_, canRestore := ss.s.b.(StateRestorer)
	if canSave && canRestore {
		if err := os.Mkdir(filepath.Join(tmp, stateDir), 0o700); err != nil {
			ss.leave(o)
			return info, fmt.Errorf("%s: suspend: %w", level, err)
		}
		err := saver.SaveState(opCtx, filepath.Join(tmp, stateDir))
		if err != nil {
			ss.leave(o)
			if errors.Is(err, moat.ErrClosed) {
				ss.markSaved()
				ss.Close()
			}
			return info, fmt.Errorf("%s: suspend: %w", level, err)
		}
		ss.markSaved() // the instance is gone: Close must not close it again
		info.Memory = true
	} else if err := ss.copyFiles(opCtx, filepath.Join(tmp, filesDir), &info); err != nil {
		ss.leave(o)
		return info, fmt.Errorf("%s: suspend: %w", level, err)
	}
	ss.leave(o)
	if err := seal(tmp, ss.opts, &info); err != nil {
		if info.Memory {
			ss.Close()
		}
		return info, fmt.Errorf("%s: suspend: %w", level, err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		if info.Memory {
			ss.Close()
		}
		return info, fmt.Errorf("%s: suspend: %w", level, err)
	}
	done = true
	syncDir(filepath.Dir(dir))
	ss.Close()
	return info, nil
}

// markSaved records that the instance ended in SaveState.
func (ss *Session) markSaved() {
	ss.mu.Lock()
	ss.saved = true
	ss.mu.Unlock()
}

// copyFiles copies the session's directories and regular files into dst,
// through the instance's own file operations (which cannot leave the
// working directory) and an os.Root on the host side (which cannot either,
// whatever names the code chose).
func (ss *Session) copyFiles(ctx context.Context, dst string, info *moat.SuspendInfo) error {
	if err := os.Mkdir(dst, 0o700); err != nil {
		return err
	}
	root, err := os.OpenRoot(dst)
	if err != nil {
		return err
	}
	defer root.Close()
	list, err := ss.inst.ListFiles(ctx)
	if err != nil {
		return fmt.Errorf("list the session's files: %w", err)
	}
	var skipped []string
	for _, fi := range list {
		name, err := CleanName(ss.s.cfg.Level, fi.Name)
		if err != nil {
			skipped = append(skipped, fmt.Sprintf("%q (not a usable name)", fi.Name))
			continue
		}
		switch {
		case fi.IsDir:
			if err := root.MkdirAll(name, 0o700); err != nil {
				return fmt.Errorf("save %q: %w", name, err)
			}
			info.Files++
		case fi.Mode.IsRegular():
			if err := ss.copyOne(ctx, root, name); err != nil {
				return err
			}
			info.Files++
		default:
			skipped = append(skipped, fmt.Sprintf("%q (%s)", name, kind(fi.Mode)))
		}
	}
	if len(skipped) > 0 {
		more := ""
		if len(skipped) > maxNotes {
			more = fmt.Sprintf(" and %d more", len(skipped)-maxNotes)
			skipped = skipped[:maxNotes]
		}
		info.Notes = append(info.Notes, "not kept: "+strings.Join(skipped, ", ")+more)
	}
	return nil
}

func (ss *Session) copyOne(ctx context.Context, root *os.Root, name string) error {
	if d := path.Dir(name); d != "." {
		if err := root.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("save %q: %w", name, err)
		}
	}
	r, err := ss.inst.ReadFile(ctx, name)
	if err != nil {
		return fmt.Errorf("read %q: %w", name, err)
	}
	defer r.Close()
	f, err := root.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("save %q: %w", name, err)
	}
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return fmt.Errorf("save %q: %w", name, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("save %q: %w", name, err)
	}
	return f.Close()
}

func kind(m fs.FileMode) string {
	switch {
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	case m&fs.ModeNamedPipe != 0:
		return "a named pipe"
	case m&fs.ModeSocket != 0:
		return "a socket"
	case m&fs.ModeDevice != 0:
		return "a device"
	}
	return "not a regular file"
}

// seal writes session.json and the manifest of everything in dir, and
// syncs them.
func seal(dir string, opts moat.SessionOptions, info *moat.SuspendInfo) error {
	m := manifest{Digest: digestChunked}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		switch {
		case rel == ".":
			return nil
		case d.IsDir():
			m.Dirs = append(m.Dirs, rel)
			return syncDir(p)
		case d.Type().IsRegular():
			size, sum, disk, err := digest(p)
			if err != nil {
				return err
			}
			m.Files = append(m.Files, manifestEntry{Path: rel, Size: size, SHA256: sum})
			info.Bytes += disk
			return nil
		}
		return fmt.Errorf("%s is neither a file nor a directory", rel)
	})
	if err != nil {
		return err
	}
	b, err := json.Marshal(savedInfo{Format: stateFormat, Saved: time.Now().UTC(), Opts: opts, Info: *info})
	if err != nil {
		return err
	}
	if err := writeSynced(filepath.Join(dir, infoFile), b); err != nil {
		return err
	}
	size, sum, _, err := digest(filepath.Join(dir, infoFile))
	if err != nil {
		return err
	}
	m.Files = append(m.Files, manifestEntry{Path: infoFile, Size: size, SHA256: sum})
	mb, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if err := writeSynced(filepath.Join(dir, manifestName), mb); err != nil {
		return err
	}
	return syncDir(dir)
}

func writeSynced(p string, b []byte) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func syncDir(p string) error {
	d, err := os.Open(p)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// SuspendKeepsMemory implements moat.MemoryKeeper: the level's whole state
// is saved when its backend restores it.
func (s *Sandbox) SuspendKeepsMemory() bool {
	_, ok := s.b.(StateRestorer)
	return ok
}

// ResumeSession implements moat.Resumer: it checks dir against its
// manifest (every file there, none else, sizes and digests equal, nothing
// but directories and regular files), then makes a session with the
// saved files or, when the memory was saved, restores the level's state.
func (s *Sandbox) ResumeSession(ctx context.Context, dir string) (moat.Session, moat.SuspendInfo, error) {
	level := s.cfg.Level
	saved, err := check(dir)
	if err != nil {
		return nil, moat.SuspendInfo{Level: level}, fmt.Errorf("%s: resume %s: the state is damaged, and was not used: %v: %w", level, dir, err, moat.ErrInvalid)
	}
	info := saved.Info
	if info.Level != level {
		return nil, info, fmt.Errorf("%s: resume %s: the state is of the %s level: %w", level, dir, info.Level, moat.ErrInvalid)
	}
	if !info.Memory {
		sess, err := s.NewSession(ctx, saved.Opts)
		if err != nil {
			return nil, info, err
		}
		if err := restoreFiles(ctx, sess, filepath.Join(dir, filesDir)); err != nil {
			sess.Close()
			return nil, info, fmt.Errorf("%s: resume %s: %w", level, dir, err)
		}
		if info.Interpreter {
			info.Notes = append(info.Notes, "the interpreter starts fresh: this level keeps the files of a suspended session, not its memory")
		}
		return sess, info, nil
	}
	rb, ok := s.b.(StateRestorer)
	if !ok {
		return nil, info, fmt.Errorf("%s: resume %s: the state holds memory, which this level cannot restore: %w", level, dir, moat.ErrInvalid)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, info, fmt.Errorf("%s: %w", level, moat.ErrClosed)
	}
	s.runs.Add(1)
	s.mu.Unlock()
	defer s.runs.Done()
	inst, err := rb.RestoreState(ctx, filepath.Join(dir, stateDir), saved.Opts)
	if err != nil {
		return nil, info, s.setupError(ctx, err)
	}
	return &Session{s: s, inst: inst, opts: saved.Opts, sem: make(chan struct{}, 1)}, info, nil
}

// check reads dir's session.json after checking every file against the
// manifest.
func check(dir string) (*savedInfo, error) {
	mb, err := os.ReadFile(filepath.Join(dir, manifestName))
	if err != nil {
		return nil, err
	}
	var m manifest
	dec := json.NewDecoder(strings.NewReader(string(mb)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("manifest: %v", err)
	}
	sumOf := func(p string) (int64, string, error) {
		size, sum, _, err := digest(p)
		return size, sum, err
	}
	switch m.Digest {
	case digestChunked:
	case "":
		sumOf = digestWhole
	default:
		return nil, fmt.Errorf("manifest: digests of an unknown kind %q", m.Digest)
	}
	want := map[string]manifestEntry{}
	for _, f := range m.Files {
		want[f.Path] = f
	}
	dirs := map[string]bool{}
	for _, d := range m.Dirs {
		dirs[d] = true
	}
	seen := 0
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		rel = filepath.ToSlash(rel)
		switch {
		case rel == "." || rel == manifestName:
			return nil
		case d.IsDir():
			if !dirs[rel] {
				return fmt.Errorf("%s is not in the manifest", rel)
			}
			seen++
			return nil
		case d.Type().IsRegular():
			f, ok := want[rel]
			if !ok {
				return fmt.Errorf("%s is not in the manifest", rel)
			}
			size, sum, err := sumOf(p)
			if err != nil {
				return err
			}
			if size != f.Size || sum != f.SHA256 {
				return fmt.Errorf("%s is not what was saved (%d bytes, want %d)", rel, size, f.Size)
			}
			seen++
			return nil
		}
		return fmt.Errorf("%s is neither a file nor a directory", rel)
	})
	if err != nil {
		return nil, err
	}
	if seen != len(m.Files)+len(m.Dirs) {
		return nil, fmt.Errorf("%d of the manifest's %d entries are missing", len(m.Files)+len(m.Dirs)-seen, len(m.Files)+len(m.Dirs))
	}
	b, err := os.ReadFile(filepath.Join(dir, infoFile))
	if err != nil {
		return nil, err
	}
	var si savedInfo
	if err := json.Unmarshal(b, &si); err != nil {
		return nil, fmt.Errorf("%s: %v", infoFile, err)
	}
	if si.Format != stateFormat {
		return nil, fmt.Errorf("format %d, this moat reads %d", si.Format, stateFormat)
	}
	return &si, nil
}

// restoreFiles writes the saved files under src into sess, directories
// first, through the session's own checked file operations.
func restoreFiles(ctx context.Context, sess moat.Session, src string) error {
	var dirs, files []string
	err := filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		if rel == "." {
			return nil
		}
		if d.IsDir() {
			dirs = append(dirs, filepath.ToSlash(rel))
		} else {
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		return err
	}
	sort.Strings(dirs)
	for _, d := range dirs {
		if err := sess.Mkdir(ctx, d); err != nil {
			return fmt.Errorf("restore %q: %w", d, err)
		}
	}
	for _, name := range files {
		f, err := os.Open(filepath.Join(src, filepath.FromSlash(name)))
		if err != nil {
			return err
		}
		err = sess.WriteFile(ctx, name, f)
		f.Close()
		if err != nil {
			return fmt.Errorf("restore %q: %w", name, err)
		}
	}
	return nil
}
