// Sessions: creating, finding, using, sweeping and ending them, and their routes.

package server

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
)

// The states of a session, as its record and its view show them.
const (
	// stateRunning: the session's processes (or VM) are live.
	stateRunning = "running"
	// stateSuspended: nothing of it runs or holds memory; its state is a
	// directory under <state_dir>/suspended, and its next use resumes it.
	stateSuspended = "suspended"
	// stateBroken: its suspended state was refused on resume (damaged,
	// truncated, of another level); every use fails until it is deleted.
	stateBroken = "broken"
)

// session is a session and its record. A running session has sess; a
// suspended or broken one has none.
type session struct {
	// mu guards everything below, rec included (its ID, Owner, Level
	// and Network never change).
	mu   sync.Mutex
	rec  record
	sess moat.Session
	// creating marks the placeholder that holds a session's place in
	// the token's count while it is being made.
	creating   bool
	lastActive time.Time
	busy       int  // runs and file operations in progress
	ended      bool // set once, by endSession
	// moving is set while a suspend or resume is under way: uses wait
	// for it, and no second one starts.
	moving bool
	// changed is closed (and replaced) whenever busy drops or moving
	// ends, waking those who wait for either.
	changed chan struct{}
}

// signal wakes the waiters on ss.changed. ss.mu is held.
func (ss *session) signal() {
	if ss.changed != nil {
		close(ss.changed)
	}
	ss.changed = make(chan struct{})
}

// wait releases ss.mu until ss changes or ctx ends, and takes it again.
func (ss *session) wait(ctx context.Context) error {
	if ss.changed == nil {
		ss.changed = make(chan struct{})
	}
	ch := ss.changed
	ss.mu.Unlock()
	defer ss.mu.Lock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// state is rec.State, with the records of older servers as running.
func (r record) state() string {
	if r.State == "" {
		return stateRunning
	}
	return r.State
}

// sessionView is a session as the API shows it.
type sessionView struct {
	ID           string        `json:"id"`
	Level        moat.Level    `json:"level"`
	Network      string        `json:"network,omitempty"`
	Interpreter  bool          `json:"interpreter"`
	CreatedAt    time.Time     `json:"created_at"`
	ExpiresAt    time.Time     `json:"expires_at"`
	IdleTimeout  moat.Duration `json:"idle_timeout"`
	LastActiveAt time.Time     `json:"last_active_at"`
	// State is running, suspended or broken.
	State string `json:"state"`
	// Memory, once the session has been suspended, says whether its
	// memory (the live interpreter's variables) was kept with its files:
	// will come back (suspended) or came back (running).
	Memory *bool `json:"memory,omitempty"`
	// SuspendedAt and SuspendedBytes describe the last suspend.
	SuspendedAt    *time.Time `json:"suspended_at,omitempty"`
	SuspendedBytes int64      `json:"suspended_bytes,omitempty"`
	// Broken says why a broken session's state was refused.
	Broken string `json:"broken,omitempty"`
	// FromSnapshot names the snapshot the session was started from.
	FromSnapshot string `json:"from_snapshot,omitempty"`
	// Notes are what the resume that this answer made said (POST .../resume).
	Notes []string `json:"notes,omitempty"`
}

func (ss *session) view() sessionView {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	v := sessionView{
		ID: ss.rec.ID, Level: ss.rec.Level, Network: ss.rec.Network, Interpreter: ss.rec.Interpreter,
		CreatedAt: ss.rec.CreatedAt, ExpiresAt: ss.rec.ExpiresAt,
		IdleTimeout: ss.rec.IdleTimeout, LastActiveAt: ss.lastActive,
		State: ss.rec.state(), Broken: ss.rec.Broken, FromSnapshot: ss.rec.FromSnapshot,
	}
	if si := ss.rec.Suspend; si != nil {
		m, at := si.Memory, ss.rec.SuspendedAt
		v.Memory, v.SuspendedAt, v.SuspendedBytes = &m, &at, si.Bytes
	}
	return v
}

// createRequest is the body of POST /v1/sessions.
type createRequest struct {
	Level moat.Level `json:"level,omitempty"`
	// Network names the session's network profile, for all its life.
	Network     profileRef     `json:"network,omitempty"`
	TTL         *moat.Duration `json:"ttl,omitempty"`
	IdleTimeout *moat.Duration `json:"idle_timeout,omitempty"`
	Interpreter bool           `json:"interpreter,omitempty"`
	// FromSnapshot starts the session from a snapshot of the token's (a
	// fork): its level, network profile and interpreter are the
	// snapshot's, which level and network may only repeat.
	FromSnapshot string `json:"from_snapshot,omitempty"`
	// front is SessionSpec.Front: never from the API's body.
	front []byte
}

func (s *Server) handleCreateSession(w http.ResponseWriter, r *http.Request, owner string) error {
	var req createRequest
	if r.ContentLength != 0 { // no body: every default
		if err := s.decode(w, r, &req); err != nil {
			return err
		}
	}
	ss, err := s.createSession(r.Context(), owner, req)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusCreated, ss.view())
	return nil
}

// createSession makes owner's session as req asks, within the token's
// caps and grants.
func (s *Server) createSession(ctx context.Context, owner string, req createRequest) (*session, error) {
	var snap snapshotRecord
	if req.FromSnapshot != "" {
		s.snapMu.RLock()
		snap = s.snapshots[req.FromSnapshot]
		s.snapMu.RUnlock()
		if snap.Owner != owner {
			return nil, fmt.Errorf("snapshot %q: %w", req.FromSnapshot, errNotFound)
		}
		if (req.Level != "" && req.Level != snap.Level) || (req.Network != "" && string(req.Network) != snap.Network) {
			return nil, fmt.Errorf("snapshot %s is of level %s and network profile %q: a session started from it keeps them: %w", snap.ID, snap.Level, snap.Network, moat.ErrInvalid)
		}
		req.Level, req.Network, req.Interpreter = snap.Level, profileRef(snap.Network), snap.Interpreter
	}
	level, sb, err := s.sandbox(owner, req.Level, req.Network)
	if err != nil {
		return nil, err
	}
	sr, ok := sb.(moat.Sessioner)
	if !ok {
		return nil, fmt.Errorf("level %s: %w", level, errNoSessions)
	}
	ttl, idle := s.cfg.SessionTTL, s.cfg.IdleTimeout
	if req.TTL != nil {
		ttl = *req.TTL
	}
	if req.IdleTimeout != nil {
		idle = *req.IdleTimeout
	}
	if ttl <= 0 || ttl > s.cfg.MaxSessionTTL {
		return nil, fmt.Errorf("ttl %v must be above zero and at most %v: %w", ttl, s.cfg.MaxSessionTTL, moat.ErrInvalid)
	}
	if idle <= 0 {
		return nil, fmt.Errorf("idle_timeout %v must be above zero: %w", idle, moat.ErrInvalid)
	}
	if idle > ttl {
		idle = ttl
	}

	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return nil, errShuttingDown
	}
	n := 0
	for _, ss := range s.sessions {
		if ss.rec.Owner == owner {
			n++
		}
	}
	// Count the session being made now, so that concurrent creations
	// cannot pass the cap together.
	id := newID("s")
	placeholder := &session{rec: record{ID: id, Owner: owner}, ended: true, creating: true}
	if n >= s.cfg.MaxSessionsPerToken {
		s.mu.Unlock()
		return nil, fmt.Errorf("%d sessions already: %w", n, errTooMany)
	}
	s.sessions[id] = placeholder
	s.mu.Unlock()
	fail := func(err error) (*session, error) {
		s.mu.Lock()
		delete(s.sessions, id)
		s.mu.Unlock()
		return nil, err
	}

	var sess moat.Session
	var forked *moat.SuspendInfo
	var forkedAt time.Time
	if req.FromSnapshot != "" {
		var info moat.SuspendInfo
		sess, info, snap, err = s.fork(ctx, owner, req.FromSnapshot)
		forked, forkedAt = &info, snap.CreatedAt
	} else {
		sess, err = sr.NewSession(ctx, moat.SessionOptions{Interpreter: req.Interpreter})
	}
	if err != nil {
		return fail(err)
	}
	now := time.Now().UTC()
	ss := &session{
		rec: record{
			ID: id, Owner: owner, Level: level, Network: string(req.Network), Interpreter: req.Interpreter,
			CreatedAt: now, ExpiresAt: now.Add(time.Duration(ttl)), IdleTimeout: idle, PID: os.Getpid(),
			State: stateRunning, FromSnapshot: req.FromSnapshot, Suspend: forked, SuspendedAt: forkedAt,
			Front: bytes.Clone(req.front),
		},
		sess:       sess,
		lastActive: now,
	}
	if b, ok := sess.(interface{ ID() string }); ok {
		ss.rec.Backend = b.ID()
	}
	if err := s.store.put(ss.rec); err != nil {
		sess.Close()
		return fail(err)
	}
	s.mu.Lock()
	if s.closing {
		delete(s.sessions, id)
		s.mu.Unlock()
		sess.Close()
		s.store.delete(id)
		return nil, errShuttingDown
	}
	s.sessions[id] = ss
	s.mu.Unlock()
	s.metrics.sessions.WithLabelValues(string(level)).Inc()
	if req.Network != "" {
		s.metrics.profileSessions.WithLabelValues(string(req.Network)).Inc()
	}
	s.log.Info("session created", "session", id, "owner", owner, "level", level, "network", string(req.Network), "interpreter", req.Interpreter, "ttl", ttl, "idle_timeout", idle, "backend", ss.rec.Backend)
	return ss, nil
}

// lookup returns owner's session id, in whatever state; any other is not
// found.
func (s *Server) lookup(r *http.Request, owner string) (*session, error) {
	id := r.PathValue("id")
	s.mu.Lock()
	ss, ok := s.sessions[id]
	s.mu.Unlock()
	if !ok || ss.rec.Owner != owner || ss.creating {
		return nil, fmt.Errorf("session %q: %w", id, errNotFound)
	}
	return ss, nil
}

// useSession looks up owner's session named in the path and marks it busy
// for an operation (resuming it first if it is suspended, which the
// X-Moat-Resumed header then says); done marks it idle again. sess is the
// session's live moat.Session, the same until done; notes are what the
// resume said, if it resumed.
func (s *Server) useSession(w http.ResponseWriter, r *http.Request, owner string) (sess moat.Session, notes []string, done func(), err error) {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return nil, nil, nil, err
	}
	sess, notes, done, err = s.use(r.Context(), ss)
	if err != nil {
		return nil, nil, nil, err
	}
	if notes != nil {
		w.Header().Set("X-Moat-Resumed", "true")
	}
	return sess, notes, done, nil
}

// use marks ss busy for an operation and returns its live session; done
// marks it idle again. A suspended session is resumed first (notes, then
// not nil, are what the resume said); a suspend or resume under way is
// waited for, bounded by ctx. It fails when the session has ended or is
// broken.
func (s *Server) use(ctx context.Context, ss *session) (sess moat.Session, notes []string, done func(), err error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for {
		switch {
		case ss.ended:
			return nil, nil, nil, fmt.Errorf("session %s: %w", ss.rec.ID, errSessionClosed)
		case ss.moving:
			if err := ss.wait(ctx); err != nil {
				return nil, nil, nil, err
			}
			continue
		case ss.rec.state() == stateBroken:
			return nil, nil, nil, fmt.Errorf("session %s: its suspended state was refused on resume (%s): delete it: %w", ss.rec.ID, ss.rec.Broken, errSessionBroken)
		case ss.rec.state() == stateSuspended:
			ss.moving = true
			ss.mu.Unlock()
			n, err := s.resume(ctx, ss)
			ss.mu.Lock()
			ss.moving = false
			ss.signal()
			if err != nil {
				return nil, nil, nil, err
			}
			notes = append(notes, n...)
			continue
		}
		break
	}
	ss.busy++
	ss.lastActive = time.Now().UTC()
	return ss.sess, notes, func() {
		ss.mu.Lock()
		ss.busy--
		ss.lastActive = time.Now().UTC()
		ss.signal()
		ss.mu.Unlock()
	}, nil
}

// endSession closes ss, removes its suspended state and forgets it. It is
// safe to call more than once, and during a suspend or resume (which then
// undoes its own work).
func (s *Server) endSession(ss *session, cause string) {
	ss.mu.Lock()
	if ss.ended {
		ss.mu.Unlock()
		return
	}
	ss.ended = true
	sess := ss.sess
	ss.signal()
	ss.mu.Unlock()
	s.mu.Lock()
	delete(s.sessions, ss.rec.ID)
	s.mu.Unlock()
	if sess != nil {
		if err := sess.Close(); err != nil {
			s.log.Warn("server: closing a session", "session", ss.rec.ID, "err", err)
		}
	}
	if err := s.removeState(ss.rec.ID); err != nil {
		s.log.Warn("server: removing a session's suspended state", "session", ss.rec.ID, "err", err)
	}
	if err := s.store.delete(ss.rec.ID); err != nil {
		s.log.Warn("server: forgetting a session", "session", ss.rec.ID, "err", err)
	}
	s.metrics.sessions.WithLabelValues(string(ss.rec.Level)).Dec()
	if ss.rec.Network != "" {
		s.metrics.profileSessions.WithLabelValues(ss.rec.Network).Dec()
	}
	s.metrics.sessionEnd.WithLabelValues(cause).Inc()
	s.log.Info("session ended", "session", ss.rec.ID, "owner", ss.rec.Owner, "level", ss.rec.Level, "network", ss.rec.Network, "cause", cause)
}

// sweep ends expired sessions, whatever their state, and ends or (with
// on_idle suspend) suspends running sessions idle past their idle
// timeout, until Shutdown.
func (s *Server) sweep() {
	defer close(s.sweepDone)
	t := time.NewTicker(time.Duration(s.cfg.SweepInterval))
	defer t.Stop()
	for {
		select {
		case <-s.stopSweep:
			return
		case <-t.C:
		}
		now := time.Now()
		var ends, idle []*session
		var causes []string
		s.mu.Lock()
		for _, ss := range s.sessions {
			if ss.creating {
				continue
			}
			ss.mu.Lock()
			switch {
			case now.After(ss.rec.ExpiresAt):
				ends, causes = append(ends, ss), append(causes, "expired")
			case ss.rec.state() == stateRunning && !ss.moving && ss.busy == 0 && now.Sub(ss.lastActive) > time.Duration(ss.rec.IdleTimeout):
				if s.cfg.OnIdle == OnIdleSuspend {
					idle = append(idle, ss)
				} else {
					ends, causes = append(ends, ss), append(causes, "idle")
				}
			}
			ss.mu.Unlock()
		}
		s.mu.Unlock()
		for i, ss := range ends {
			s.endSession(ss, causes[i])
		}
		for _, ss := range idle {
			ctx, cancel := context.WithTimeout(context.Background(), suspendBound)
			err := s.suspend(ctx, ss, "idle", time.Duration(ss.rec.IdleTimeout))
			cancel()
			if err != nil && !errors.Is(err, errNotIdle) {
				// An idle session is never left holding its processes
				// because it could not be suspended.
				s.log.Warn("server: an idle session could not be suspended: ending it", "session", ss.rec.ID, "err", err)
				s.endSession(ss, "idle")
			}
		}
	}
}

func (s *Server) handleListSessions(w http.ResponseWriter, r *http.Request, owner string) error {
	s.mu.Lock()
	var mine []*session
	for _, ss := range s.sessions {
		if ss.rec.Owner == owner && !ss.creating {
			mine = append(mine, ss)
		}
	}
	s.mu.Unlock()
	out := make([]sessionView, 0, len(mine))
	for _, ss := range mine {
		out = append(out, ss.view())
	}
	slices.SortFunc(out, func(a, b sessionView) int { return a.CreatedAt.Compare(b.CreatedAt) })
	writeJSON(w, http.StatusOK, map[string]any{"sessions": out})
	return nil
}

func (s *Server) handleGetSession(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, ss.view())
	return nil
}

func (s *Server) handleDeleteSession(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	s.endSession(ss, "deleted")
	w.WriteHeader(http.StatusNoContent)
	return nil
}

func (s *Server) handleSessionRun(w http.ResponseWriter, r *http.Request, owner string) error {
	ss, err := s.lookup(r, owner)
	if err != nil {
		return err
	}
	sess, notes, done, err := s.use(r.Context(), ss)
	if err != nil {
		return err
	}
	defer done()
	if notes != nil {
		w.Header().Set("X-Moat-Resumed", "true")
	}
	req, err := s.readRun(w, r)
	if err != nil {
		return err
	}
	if req.Level != "" && req.Level != ss.rec.Level {
		return fmt.Errorf("the session's level is %s, not %s: %w", ss.rec.Level, req.Level, moat.ErrInvalid)
	}
	// The session's network profile was chosen, and checked against the
	// token, when it was made; a run can name only that one.
	if req.Network != "" && string(req.Network) != ss.rec.Network {
		return fmt.Errorf("the session's network profile is %q, not %q: a session keeps the profile it was created with: %w", ss.rec.Network, req.Network, moat.ErrInvalid)
	}
	run := sess.Run
	if notes != nil {
		// The resume this run caused is said in its result.
		run = func(ctx context.Context, req moat.Request) (*moat.Result, error) {
			res, err := sess.Run(ctx, req)
			if res != nil {
				res.Notes = append(append([]string{}, notes...), res.Notes...)
			}
			return res, err
		}
	}
	return s.execute(w, r, owner, ss.rec.Level, ss.rec.Network, ss.rec.ID, run, req)
}
