// Snapshots: a session's state kept under a name, that new sessions start
// from (forks), owned by a token and counted against its disk quota.

package server

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/moatsandbox/moat"
)

// snapshotRecord is what the database keeps of a snapshot. Its state is
// the directory <state_dir>/snapshots/<id>, as a suspend writes it.
type snapshotRecord struct {
	ID          string           `json:"id"`
	Name        string           `json:"name"`
	Owner       string           `json:"owner"`
	Level       moat.Level       `json:"level"`
	Network     string           `json:"network,omitempty"`
	Session     string           `json:"session"` // the session it was taken of
	CreatedAt   time.Time        `json:"created_at"`
	Info        moat.SuspendInfo `json:"info"`
	Interpreter bool             `json:"interpreter"`
}

// snapshotView is a snapshot as the API shows it.
type snapshotView struct {
	ID          string     `json:"id"`
	Name        string     `json:"name"`
	Level       moat.Level `json:"level"`
	Network     string     `json:"network,omitempty"`
	Session     string     `json:"session"`
	CreatedAt   time.Time  `json:"created_at"`
	Interpreter bool       `json:"interpreter"`
	// Memory says a session started from it gets the variables back.
	Memory bool  `json:"memory"`
	Files  int   `json:"files"`
	Bytes  int64 `json:"bytes"`
}

func (r snapshotRecord) view() snapshotView {
	return snapshotView{ID: r.ID, Name: r.Name, Level: r.Level, Network: r.Network, Session: r.Session,
		CreatedAt: r.CreatedAt, Interpreter: r.Interpreter, Memory: r.Info.Memory, Files: r.Info.Files, Bytes: r.Info.Bytes}
}

var snapshotsBucket = []byte("snapshots")

// snapshotID is what newID("n") makes.
var snapshotID = regexp.MustCompile(`^n_[0-9a-f]{24}$`)

// snapshotName is what a snapshot may be called.
var snapshotName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

func (s *Server) snapshotsRoot() string         { return filepath.Join(s.cfg.StateDir, "snapshots") }
func (s *Server) snapshotPath(id string) string { return filepath.Join(s.snapshotsRoot(), id) }

// snapshotUse returns owner's snapshots and the bytes they hold. s.snapMu
// is held.
func (s *Server) snapshotUse(owner string) ([]snapshotRecord, int64) {
	var mine []snapshotRecord
	var used int64
	for _, r := range s.snapshots {
		if r.Owner == owner {
			mine = append(mine, r)
			used += r.Info.Bytes
		}
	}
	return mine, used
}

// snapshotRequest is the body of POST /v1/sessions/{id}/snapshots.
type snapshotRequest struct {
	Name string `json:"name"`
}

// handleSnapshot takes a snapshot of the session: a running one is
// suspended into the snapshot's directory and resumed from it at once (a
// run in progress is waited for, as by suspend); a suspended one has its
// state copied. The snapshot is the token's, and counts against its quota.
func (s *Server) handleSnapshot(w http.ResponseWriter, r *http.Request, owner string) error {
	var req snapshotRequest
	if err := s.decode(w, r, &req); err != nil {
		return err
	}
	if !snapshotName.MatchString(req.Name) {
		return fmt.Errorf("snapshot name %q: letters, digits, '.', '-' and '_', at most 128: %w", req.Name, moat.ErrInvalid)
	}
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	s.snapMu.Lock()
	mine, used := s.snapshotUse(owner)
	s.snapMu.Unlock()
	if slices.ContainsFunc(mine, func(x snapshotRecord) bool { return x.Name == req.Name }) {
		return fmt.Errorf("a snapshot named %q exists already: %w", req.Name, moat.ErrInvalid)
	}
	if max := int64(s.cfg.MaxSnapshotBytesPerToken); used >= max {
		return fmt.Errorf("the token's snapshots hold %d bytes, the quota is %v: delete some: %w", used, s.cfg.MaxSnapshotBytesPerToken, errSnapshotQuota)
	}
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(s.cfg.QueueWait))
	defer cancel()
	sp, err := s.acquire(ctx, ss, 0)
	if err != nil {
		return err
	}
	id := newID("n")
	dir := s.snapshotPath(id)
	var info moat.SuspendInfo
	if sp == nil { // suspended: its state is copied
		ss.mu.Lock()
		if ss.rec.Suspend != nil {
			info = *ss.rec.Suspend
		}
		ss.mu.Unlock()
		var n int64
		n, err = copyState(s.statePath(ss.rec.ID), dir)
		// A state recovered without its record's SuspendInfo counts
		// for what it holds.
		info.Bytes = max(info.Bytes, n)
	} else {
		info, err = s.snapshotRunning(r.Context(), ss, sp, dir)
		s.release(ss)
	}
	if err != nil {
		return err
	}
	rec := snapshotRecord{ID: id, Name: req.Name, Owner: owner, Level: ss.rec.Level, Network: ss.rec.Network,
		Session: ss.rec.ID, CreatedAt: time.Now().UTC(), Info: info, Interpreter: info.Interpreter}
	s.snapMu.Lock()
	mine, used = s.snapshotUse(owner)
	if slices.ContainsFunc(mine, func(x snapshotRecord) bool { return x.Name == req.Name }) {
		s.snapMu.Unlock()
		os.RemoveAll(dir)
		return fmt.Errorf("a snapshot named %q exists already: %w", req.Name, moat.ErrInvalid)
	}
	if max := int64(s.cfg.MaxSnapshotBytesPerToken); used+info.Bytes > max {
		s.snapMu.Unlock()
		os.RemoveAll(dir)
		return fmt.Errorf("a snapshot of %d bytes would take the token's snapshots to %d bytes, over the quota of %v: %w", info.Bytes, used+info.Bytes, s.cfg.MaxSnapshotBytesPerToken, errSnapshotQuota)
	}
	if err := s.putSnapshot(rec); err != nil {
		s.snapMu.Unlock()
		os.RemoveAll(dir)
		return err
	}
	s.snapshots[id] = rec
	s.snapMu.Unlock()
	s.log.Info("snapshot taken", "snapshot", id, "name", req.Name, "session", ss.rec.ID, "owner", owner, "memory", info.Memory, "bytes", info.Bytes)
	writeJSON(w, http.StatusCreated, rec.view())
	return nil
}

// snapshotRunning suspends running ss (acquired) into dir and resumes it
// from there. Should the resume fail, the session keeps the snapshot's
// state as its own suspended state, and its next use tries again.
func (s *Server) snapshotRunning(ctx context.Context, ss *session, sp moat.Suspender, dir string) (moat.SuspendInfo, error) {
	info, err := sp.Suspend(ctx, dir)
	if err != nil {
		if errors.Is(err, moat.ErrClosed) {
			s.endSession(ss, "suspend_failed")
		}
		return info, err
	}
	ss.mu.Lock()
	ss.sess = nil
	ss.rec.State, ss.rec.StateDir, ss.rec.Suspend, ss.rec.SuspendedAt = stateSuspended, s.statePath(ss.rec.ID), &info, time.Now().UTC()
	ss.mu.Unlock()
	if _, err := s.resumeFrom(ctx, ss, dir); err != nil {
		s.log.Warn("server: a session could not be resumed from its snapshot", "session", ss.rec.ID, "err", err)
		if !errors.Is(err, errSessionBroken) {
			// It stays suspended, with the snapshot's state as its own.
			if _, err := copyState(dir, s.statePath(ss.rec.ID)); err != nil {
				s.endSession(ss, "suspend_failed")
			} else {
				ss.mu.Lock()
				if !ss.ended {
					s.store.put(ss.rec) // under the lock, as suspend's
				}
				ss.mu.Unlock()
			}
		}
	}
	return info, nil
}

// copyState copies a suspended state src (directories and regular files
// only, as a suspend writes them) to dst, under a temporary name next to it
// that is renamed into place once whole.
func copyState(src, dst string) (bytes int64, err error) {
	tmp := filepath.Join(filepath.Dir(dst), "."+filepath.Base(dst)+".partial-"+rand.Text())
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		to := filepath.Join(tmp, rel)
		switch {
		case d.IsDir():
			return os.Mkdir(to, 0o700)
		case d.Type().IsRegular():
			in, err := os.Open(p)
			if err != nil {
				return err
			}
			defer in.Close()
			fi, err := in.Stat()
			if err != nil {
				return err
			}
			// The mode is the saved one's (a memory file a VM's uid maps
			// is 0444), never more than 0644.
			out, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, fi.Mode().Perm()&0o644)
			if err != nil {
				return err
			}
			n, err := copySparse(out, in, fi.Size())
			bytes += n
			if err != nil {
				out.Close()
				return err
			}
			if err := out.Sync(); err != nil {
				out.Close()
				return err
			}
			return out.Close()
		}
		return fmt.Errorf("%s is neither a file nor a directory", rel)
	})
	if err == nil {
		err = os.Rename(tmp, dst)
	}
	if err != nil {
		os.RemoveAll(tmp)
		return 0, fmt.Errorf("server: copy a suspended state: %w", err)
	}
	return bytes, nil
}

// copySparse copies in's size bytes to out, the holes as holes: only the
// data extents are read and written (a VM's memory file is mostly holes).
// It returns the bytes of data copied.
func copySparse(out, in *os.File, size int64) (int64, error) {
	var copied int64
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // holes to the end
		}
		if err != nil {
			// No SEEK_DATA here: all of it is data.
			if _, err := out.Seek(0, io.SeekStart); err != nil {
				return 0, err
			}
			return io.Copy(out, io.NewSectionReader(in, 0, size))
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return copied, err
		}
		hole = min(hole, size)
		if _, err := out.Seek(data, io.SeekStart); err != nil {
			return copied, err
		}
		n, err := io.Copy(out, io.NewSectionReader(in, data, hole-data))
		copied += n
		if err != nil {
			return copied, err
		}
		off = hole
	}
	return copied, out.Truncate(size)
}

// fork starts a session of owner from snapshot id: a new session, with
// the snapshot's files (and memory where the level kept it), sharing
// nothing writable with the snapshot or other forks. It returns the
// snapshot's record for the session's.
func (s *Server) fork(ctx context.Context, owner, id string) (moat.Session, moat.SuspendInfo, snapshotRecord, error) {
	s.snapMu.RLock()
	defer s.snapMu.RUnlock() // a DELETE waits until the fork has read the state
	rec, ok := s.snapshots[id]
	if !ok || rec.Owner != owner {
		return nil, moat.SuspendInfo{}, rec, fmt.Errorf("snapshot %q: %w", id, errNotFound)
	}
	_, sb, err := s.sandbox(owner, rec.Level, profileRef(rec.Network))
	if err != nil {
		return nil, moat.SuspendInfo{}, rec, err
	}
	rs, ok := sb.(moat.Resumer)
	if !ok {
		return nil, moat.SuspendInfo{}, rec, fmt.Errorf("level %s: %w", rec.Level, errNoSuspend)
	}
	sess, info, err := rs.ResumeSession(ctx, s.snapshotPath(id))
	if err != nil {
		return nil, info, rec, fmt.Errorf("snapshot %s: %w", id, err)
	}
	return sess, info, rec, nil
}

func (s *Server) handleListSnapshots(w http.ResponseWriter, r *http.Request, owner string) error {
	s.snapMu.RLock()
	mine, used := s.snapshotUse(owner)
	s.snapMu.RUnlock()
	out := make([]snapshotView, 0, len(mine))
	for _, r := range mine {
		out = append(out, r.view())
	}
	slices.SortFunc(out, func(a, b snapshotView) int { return a.CreatedAt.Compare(b.CreatedAt) })
	writeJSON(w, http.StatusOK, map[string]any{"snapshots": out, "bytes": used, "quota_bytes": int64(s.cfg.MaxSnapshotBytesPerToken)})
	return nil
}

func (s *Server) handleDeleteSnapshot(w http.ResponseWriter, r *http.Request, owner string) error {
	id := r.PathValue("id")
	s.snapMu.Lock()
	defer s.snapMu.Unlock()
	rec, ok := s.snapshots[id]
	if !ok || rec.Owner != owner {
		return fmt.Errorf("snapshot %q: %w", id, errNotFound)
	}
	delete(s.snapshots, id)
	if err := s.deleteSnapshot(id); err != nil {
		s.log.Warn("server: forgetting a snapshot", "snapshot", id, "err", err)
	}
	if err := os.RemoveAll(s.snapshotPath(id)); err != nil {
		s.log.Warn("server: removing a snapshot", "snapshot", id, "err", err)
	}
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) putSnapshot(r snapshotRecord) error {
	data, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	return s.store.putIn(snapshotsBucket, r.ID, data)
}

func (s *Server) deleteSnapshot(id string) error { return s.store.deleteIn(snapshotsBucket, id) }

// recoverSnapshots reads the snapshots' records, keeping those whose
// directory is there, and removes partial and unrecorded directories.
func (s *Server) recoverSnapshots() error {
	if err := privateDir(s.snapshotsRoot()); err != nil {
		return err
	}
	raw, err := s.store.allIn(snapshotsBucket)
	if err != nil {
		return fmt.Errorf("server: read snapshots: %w", err)
	}
	for id, data := range raw {
		var r snapshotRecord
		err := json.Unmarshal(data, &r)
		fi, serr := os.Lstat(s.snapshotPath(id))
		if err != nil || r.ID != id || !snapshotID.MatchString(id) || serr != nil || !fi.IsDir() {
			s.log.Warn("server: removing a snapshot record without its state", "snapshot", id)
			if err := s.deleteSnapshot(id); err != nil {
				return err
			}
			continue
		}
		s.snapshots[id] = r
	}
	entries, err := os.ReadDir(s.snapshotsRoot())
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	for _, e := range entries {
		if _, ok := s.snapshots[e.Name()]; ok {
			continue
		}
		if !strings.Contains(e.Name(), ".partial-") {
			s.log.Warn("server: removing a snapshot no record names", "dir", filepath.Join(s.snapshotsRoot(), e.Name()))
		}
		if err := os.RemoveAll(filepath.Join(s.snapshotsRoot(), e.Name())); err != nil {
			return fmt.Errorf("server: %w", err)
		}
	}
	return nil
}
