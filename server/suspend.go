// Suspended sessions: suspending and resuming them (moat.Suspender,
// moat.Resumer), where their state lives, their routes, and finding them
// again after a restart.

package server

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/moatsandbox/moat"
)

// suspendBound bounds a suspend that the server makes on its own: of an
// idle session, and of each session at Shutdown.
const suspendBound = time.Minute

// errNotIdle is suspend's answer, when asked to suspend only an idle
// session, for one that is in use or was used lately. It never reaches a
// client.
var errNotIdle = errors.New("server: the session is not idle")

// suspendedRoot is the directory of the suspended sessions' states.
func (s *Server) suspendedRoot() string { return filepath.Join(s.cfg.StateDir, "suspended") }

// statePath is where session id's suspended state lives. It is never read
// from the record: recover and resume check this path, whatever the
// database says.
func (s *Server) statePath(id string) string { return filepath.Join(s.suspendedRoot(), id) }

// sessionID is what newID("s") makes; recover ignores any other name.
var sessionID = regexp.MustCompile(`^s_[0-9a-f]{24}$`)

// privateDir makes dir (mode 0700) if it is missing and checks that it is
// a directory of this user's that no one else may enter; it fixes a wider
// mode. The suspended states hold the sessions' files, readable by moat
// alone.
func privateDir(dir string) error {
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("server: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !fi.IsDir() || !ok || int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("server: %s must be a directory owned by uid %d (not a link, not another user's): the suspended sessions' files would not be moat's alone: %w", dir, os.Geteuid(), moat.ErrUnavailable)
	}
	if fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return fmt.Errorf("server: %w", err)
		}
	}
	return nil
}

// removeState removes session id's suspended state, if any. It is renamed
// aside first, so that a crash midway leaves a partial directory (which
// recover removes), never a damaged state under the session's name.
func (s *Server) removeState(id string) error {
	p := s.statePath(id)
	if _, err := os.Lstat(p); errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	tmp := filepath.Join(s.suspendedRoot(), "."+id+".partial-"+rand.Text())
	if err := os.Rename(p, tmp); err != nil {
		return fmt.Errorf("server: %w", err)
	}
	return os.RemoveAll(tmp)
}

// suspend suspends ss into its state directory: its processes and memory
// are gone, its record says suspended, and its next use resumes it.
//
// With idleFor zero it first waits for the operations in progress, bounded
// by ctx; a session still in use then is errSessionBusy (409). With idleFor
// above zero it suspends only a session that nothing has used for that
// long, and returns errNotIdle at once for any other. Suspending a
// suspended session does nothing. cause is for the logs and metrics (api,
// idle, shutdown).
func (s *Server) suspend(ctx context.Context, ss *session, cause string, idleFor time.Duration) error {
	sp, err := s.acquire(ctx, ss, idleFor)
	if err != nil || sp == nil {
		return err
	}
	defer s.release(ss)
	id := ss.rec.ID
	// A running session has no state on disk: anything under its name is
	// what a failed removal left.
	if err := s.removeState(id); err != nil {
		return err
	}
	dir := s.statePath(id)
	start := time.Now()
	info, err := sp.Suspend(ctx, dir)
	if err != nil {
		s.metrics.suspends.WithLabelValues(cause, "error").Inc()
		s.log.Warn("server: suspending a session", "session", id, "cause", cause, "err", err)
		if errors.Is(err, moat.ErrClosed) {
			// The session ended in the attempt: nothing is left to keep.
			s.endSession(ss, "suspend_failed")
		}
		return err
	}
	ss.mu.Lock()
	if ss.ended { // deleted meanwhile
		ss.mu.Unlock()
		s.removeState(id)
		return fmt.Errorf("session %s: %w", id, errSessionClosed)
	}
	ss.sess = nil
	ss.rec.State, ss.rec.StateDir, ss.rec.Suspend, ss.rec.SuspendedAt = stateSuspended, dir, &info, time.Now().UTC()
	rec := ss.rec
	// Recorded under the lock, so that a later change of the record
	// (ExtendSession, SetFront) is never overwritten by this older copy.
	if err := s.store.put(rec); err != nil {
		// The state is in place and whole: recover takes a record that
		// still says running, with its state there, for suspended.
		s.log.Warn("server: recording a suspended session", "session", id, "err", err)
	}
	ss.mu.Unlock()
	s.metrics.suspends.WithLabelValues(cause, "ok").Inc()
	s.log.Info("session suspended", "session", id, "owner", rec.Owner, "level", rec.Level, "cause", cause,
		"memory", info.Memory, "files", info.Files, "bytes", info.Bytes, "duration", time.Since(start))
	return nil
}

// acquire waits until nothing uses ss, bounded by ctx (then
// errSessionBusy), and sets ss.moving, which release clears: no use and no
// other suspend starts meanwhile. With idleFor above zero it does not wait:
// a session in use, or used within idleFor, is errNotIdle. It returns the
// running session's Suspender, or nil (and ss.moving unset) when ss is
// suspended already.
func (s *Server) acquire(ctx context.Context, ss *session, idleFor time.Duration) (moat.Suspender, error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for {
		if ss.ended {
			return nil, fmt.Errorf("session %s: %w", ss.rec.ID, errSessionClosed)
		}
		if idleFor > 0 && (ss.moving || ss.busy > 0 || ss.rec.state() != stateRunning || time.Since(ss.lastActive) < idleFor) {
			return nil, errNotIdle
		}
		if !ss.moving && ss.busy == 0 {
			break
		}
		if err := ss.wait(ctx); err != nil {
			return nil, fmt.Errorf("session %s: still in use when the wait ended (%v): %w", ss.rec.ID, err, errSessionBusy)
		}
	}
	switch ss.rec.state() {
	case stateSuspended:
		return nil, nil
	case stateBroken:
		return nil, fmt.Errorf("session %s: %s: %w", ss.rec.ID, ss.rec.Broken, errSessionBroken)
	}
	sp, ok := ss.sess.(moat.Suspender)
	if !ok {
		return nil, fmt.Errorf("level %s: %w", ss.rec.Level, errNoSuspend)
	}
	ss.moving = true
	return sp, nil
}

// release ends what acquire began.
func (s *Server) release(ss *session) {
	ss.mu.Lock()
	ss.moving = false
	ss.signal()
	ss.mu.Unlock()
}

// resume brings suspended ss back from its state directory, which is then
// removed: the session has moved on from it. A state the level refuses
// (moat.ErrInvalid: damaged, truncated, missing, of another level) makes
// the session broken, never half-restored; any other error (the level
// unavailable, ctx ended) leaves it suspended. The caller has set
// ss.moving. notes say what was resumed, and what was not kept.
func (s *Server) resume(ctx context.Context, ss *session) (notes []string, err error) {
	return s.resumeFrom(ctx, ss, s.statePath(ss.rec.ID))
}

// resumeFrom is resume from the state in dir, which is removed afterwards
// only if it is ss's own.
func (s *Server) resumeFrom(ctx context.Context, ss *session, dir string) (notes []string, err error) {
	ss.mu.Lock()
	rec := ss.rec
	ss.mu.Unlock()
	_, sb, err := s.sandbox(rec.Owner, rec.Level, profileRef(rec.Network))
	if err != nil {
		s.metrics.resumes.WithLabelValues("error").Inc()
		return nil, fmt.Errorf("session %s: resume: %w", rec.ID, err)
	}
	rs, ok := sb.(moat.Resumer)
	if !ok {
		s.metrics.resumes.WithLabelValues("error").Inc()
		return nil, fmt.Errorf("session %s: level %s: %w", rec.ID, rec.Level, errNoSuspend)
	}
	start := time.Now()
	sess, info, err := rs.ResumeSession(ctx, dir)
	if err != nil {
		if errors.Is(err, moat.ErrInvalid) {
			s.breakSession(ss, err)
			return nil, fmt.Errorf("session %s: its suspended state was refused, and the session is broken (delete it): %w: %w", rec.ID, err, errSessionBroken)
		}
		s.metrics.resumes.WithLabelValues("error").Inc()
		return nil, fmt.Errorf("session %s: resume: %w", rec.ID, err)
	}
	if dir == s.statePath(rec.ID) {
		if err := s.removeState(rec.ID); err != nil {
			s.log.Warn("server: removing a resumed session's state", "session", rec.ID, "err", err)
		}
	}
	ss.mu.Lock()
	if ss.ended { // deleted meanwhile
		ss.mu.Unlock()
		sess.Close()
		return nil, fmt.Errorf("session %s: %w", rec.ID, errSessionClosed)
	}
	ss.sess = sess
	ss.rec.State, ss.rec.StateDir = stateRunning, ""
	if ss.rec.Suspend != nil {
		// What the level says it brought back, over what the suspend
		// wrote (the two agree but for a level's own notes).
		ss.rec.Suspend.Memory = info.Memory
	}
	if b, ok := sess.(interface{ ID() string }); ok {
		ss.rec.Backend = b.ID()
	}
	ss.lastActive = time.Now().UTC()
	rec = ss.rec
	if err := s.store.put(rec); err != nil { // under the lock, as suspend's
		s.log.Warn("server: recording a resumed session", "session", rec.ID, "err", err)
	}
	ss.mu.Unlock()
	s.metrics.resumes.WithLabelValues("ok").Inc()
	s.log.Info("session resumed", "session", rec.ID, "owner", rec.Owner, "level", rec.Level, "memory", info.Memory, "duration", time.Since(start))
	kept := "its files"
	if info.Memory {
		kept = "its files and memory"
	}
	return append([]string{"the session was suspended and has been resumed with " + kept}, info.Notes...), nil
}

// breakSession marks ss broken for err, the level's refusal of its state.
func (s *Server) breakSession(ss *session, err error) {
	ss.mu.Lock()
	ss.rec.State, ss.rec.Broken = stateBroken, err.Error()
	rec := ss.rec
	if err := s.store.put(rec); err != nil { // under the lock, as suspend's
		s.log.Warn("server: recording a broken session", "session", rec.ID, "err", err)
	}
	ss.mu.Unlock()
	s.metrics.resumes.WithLabelValues("broken").Inc()
	s.log.Warn("server: a suspended session's state was refused: the session is broken", "session", rec.ID, "owner", rec.Owner, "level", rec.Level, "err", err)
}

func (s *Server) handleSuspend(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	// A run in progress is waited for, as long as the client waits and
	// at most queue_wait; then 409 session_busy, and the run goes on.
	ctx, cancel := context.WithTimeout(r.Context(), time.Duration(s.cfg.QueueWait))
	defer cancel()
	if err := s.suspend(ctx, ss, "api", 0); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, ss.view())
	return nil
}

func (s *Server) handleResume(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	_, notes, done, err := s.use(r.Context(), ss)
	if err != nil {
		return err
	}
	done()
	v := ss.view()
	v.Notes = notes
	writeJSON(w, http.StatusOK, v)
	return nil
}

// recover reads the sessions a previous server left. A suspended (or
// broken) session whose state directory is there, under its own name, and
// whose time to live has not passed is kept as it was: its state is checked
// when it is resumed, not now. A record that says running, with a whole
// state in place, is a server that stopped between a suspend and its
// record: it is kept as suspended. Any other record is removed, with its
// state: its processes were reaped when the levels were opened. Partial
// directories (a suspend or a removal cut short) and states no record
// names are removed. A session's network profile is only named in the log:
// a removed session is gone whichever profile it had.
func (s *Server) recover() error {
	if err := privateDir(s.suspendedRoot()); err != nil {
		return err
	}
	recs, err := s.store.all()
	if err != nil {
		return fmt.Errorf("server: read sessions: %w", err)
	}
	now := time.Now()
	kept := map[string]bool{}
	for _, r := range recs {
		whole := false
		if sessionID.MatchString(r.ID) {
			fi, err := os.Lstat(s.statePath(r.ID))
			whole = err == nil && fi.IsDir()
		}
		if whole && r.Owner != "" && now.Before(r.ExpiresAt) {
			if r.state() == stateRunning {
				s.log.Warn("server: a session was suspended but not recorded so: keeping it as suspended", "session", r.ID)
				r.State = stateSuspended
			}
			r.StateDir = s.statePath(r.ID)
			if err := s.store.put(r); err != nil {
				return fmt.Errorf("server: %w", err)
			}
			s.sessions[r.ID] = &session{rec: r, lastActive: now.UTC()}
			s.metrics.sessions.WithLabelValues(string(r.Level)).Inc()
			if r.Network != "" {
				s.metrics.profileSessions.WithLabelValues(r.Network).Inc()
			}
			kept[r.ID] = true
			s.log.Info("server: a suspended session kept from the previous server", "session", r.ID, "owner", r.Owner, "level", r.Level, "state", r.state(), "expires_at", r.ExpiresAt)
			continue
		}
		if r.state() == stateRunning {
			s.log.Warn("server: removing a session left by a server that did not shut down cleanly",
				"session", r.ID, "owner", r.Owner, "level", r.Level, "network", r.Network, "backend", r.Backend, "created_at", r.CreatedAt, "pid", r.PID)
			s.metrics.recovered.Inc()
		} else {
			s.log.Info("server: removing a suspended session, expired or without its state", "session", r.ID, "owner", r.Owner, "level", r.Level, "state", r.state(), "expires_at", r.ExpiresAt)
		}
		if err := s.store.delete(r.ID); err != nil {
			return fmt.Errorf("server: %w", err)
		}
	}
	entries, err := os.ReadDir(s.suspendedRoot())
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	for _, e := range entries {
		name := e.Name()
		if kept[name] {
			continue
		}
		if !strings.Contains(name, ".partial-") {
			s.log.Warn("server: removing a suspended state no session names", "dir", filepath.Join(s.suspendedRoot(), name))
		}
		if err := os.RemoveAll(filepath.Join(s.suspendedRoot(), name)); err != nil {
			return fmt.Errorf("server: %w", err)
		}
	}
	return nil
}
