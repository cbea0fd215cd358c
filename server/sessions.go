// Sessions: creating, finding, using, sweeping and ending them, and their routes.

package server

import (
	"fmt"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/moatsandbox/moat"
)

// session is a live session and its record.
type session struct {
	rec  record
	sess moat.Session

	mu         sync.Mutex
	lastActive time.Time
	busy       int  // runs and file operations in progress
	ended      bool // set once, by endSession
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
}

func (ss *session) view() sessionView {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return sessionView{
		ID: ss.rec.ID, Level: ss.rec.Level, Network: ss.rec.Network, Interpreter: ss.rec.Interpreter,
		CreatedAt: ss.rec.CreatedAt, ExpiresAt: ss.rec.ExpiresAt,
		IdleTimeout: ss.rec.IdleTimeout, LastActiveAt: ss.lastActive,
	}
}

// createRequest is the body of POST /v1/sessions.
type createRequest struct {
	Level moat.Level `json:"level,omitempty"`
	// Network names the session's network profile, for all its life.
	Network     profileRef     `json:"network,omitempty"`
	TTL         *moat.Duration `json:"ttl,omitempty"`
	IdleTimeout *moat.Duration `json:"idle_timeout,omitempty"`
	Interpreter bool           `json:"interpreter,omitempty"`
}

func (s *Server) handleCreateSession(w http.ResponseWriter, r *http.Request, owner string) error {
	var req createRequest
	if r.ContentLength != 0 { // no body: every default
		if err := s.decode(w, r, &req); err != nil {
			return err
		}
	}
	level, sb, err := s.sandbox(owner, req.Level, req.Network)
	if err != nil {
		return err
	}
	sr, ok := sb.(moat.Sessioner)
	if !ok {
		return fmt.Errorf("level %s: %w", level, errNoSessions)
	}
	ttl, idle := s.cfg.SessionTTL, s.cfg.IdleTimeout
	if req.TTL != nil {
		ttl = *req.TTL
	}
	if req.IdleTimeout != nil {
		idle = *req.IdleTimeout
	}
	if ttl <= 0 || ttl > s.cfg.MaxSessionTTL {
		return fmt.Errorf("ttl %v must be above zero and at most %v: %w", ttl, s.cfg.MaxSessionTTL, moat.ErrInvalid)
	}
	if idle <= 0 {
		return fmt.Errorf("idle_timeout %v must be above zero: %w", idle, moat.ErrInvalid)
	}
	if idle > ttl {
		idle = ttl
	}

	s.mu.Lock()
	if s.closing {
		s.mu.Unlock()
		return errShuttingDown
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
	placeholder := &session{rec: record{ID: id, Owner: owner}, ended: true}
	if n >= s.cfg.MaxSessionsPerToken {
		s.mu.Unlock()
		return fmt.Errorf("%d sessions already: %w", n, errTooMany)
	}
	s.sessions[id] = placeholder
	s.mu.Unlock()
	fail := func(err error) error {
		s.mu.Lock()
		delete(s.sessions, id)
		s.mu.Unlock()
		return err
	}

	sess, err := sr.NewSession(r.Context(), moat.SessionOptions{Interpreter: req.Interpreter})
	if err != nil {
		return fail(err)
	}
	now := time.Now().UTC()
	ss := &session{
		rec: record{
			ID: id, Owner: owner, Level: level, Network: string(req.Network), Interpreter: req.Interpreter,
			CreatedAt: now, ExpiresAt: now.Add(time.Duration(ttl)), IdleTimeout: idle, PID: os.Getpid(),
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
		return errShuttingDown
	}
	s.sessions[id] = ss
	s.mu.Unlock()
	s.metrics.sessions.WithLabelValues(string(level)).Inc()
	if req.Network != "" {
		s.metrics.profileSessions.WithLabelValues(string(req.Network)).Inc()
	}
	s.log.Info("session created", "session", id, "owner", owner, "level", level, "network", string(req.Network), "interpreter", req.Interpreter, "ttl", ttl, "idle_timeout", idle, "backend", ss.rec.Backend)
	writeJSON(w, http.StatusCreated, ss.view())
	return nil
}

// lookup returns owner's live session id; any other is not found.
func (s *Server) lookup(r *http.Request, owner string) (*session, error) {
	id := r.PathValue("id")
	s.mu.Lock()
	ss, ok := s.sessions[id]
	s.mu.Unlock()
	if !ok || ss.rec.Owner != owner || ss.sess == nil {
		return nil, fmt.Errorf("session %q: %w", id, errNotFound)
	}
	return ss, nil
}

// useSession looks up owner's session named in the path and marks it busy
// for an operation; done marks it idle again.
func (s *Server) useSession(r *http.Request, owner string) (ss *session, done func(), err error) {
	ss, err = s.lookup(r, owner)
	if err != nil {
		return nil, nil, err
	}
	done, err = ss.use()
	if err != nil {
		return nil, nil, err
	}
	return ss, done, nil
}

// use marks ss busy for an operation; done marks it idle again. It fails
// when the session has ended.
func (ss *session) use() (done func(), err error) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.ended {
		return nil, fmt.Errorf("session %s: %w", ss.rec.ID, errSessionClosed)
	}
	ss.busy++
	ss.lastActive = time.Now().UTC()
	return func() {
		ss.mu.Lock()
		ss.busy--
		ss.lastActive = time.Now().UTC()
		ss.mu.Unlock()
	}, nil
}

// endSession closes ss and forgets it. It is safe to call more than once.
func (s *Server) endSession(ss *session, cause string) {
	ss.mu.Lock()
	if ss.ended {
		ss.mu.Unlock()
		return
	}
	ss.ended = true
	ss.mu.Unlock()
	s.mu.Lock()
	delete(s.sessions, ss.rec.ID)
	s.mu.Unlock()
	if err := ss.sess.Close(); err != nil {
		s.log.Warn("server: closing a session", "session", ss.rec.ID, "err", err)
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

// sweep ends expired and idle sessions until Shutdown.
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
		var ends []*session
		var causes []string
		s.mu.Lock()
		for _, ss := range s.sessions {
			if ss.sess == nil {
				continue // being created
			}
			ss.mu.Lock()
			switch {
			case now.After(ss.rec.ExpiresAt):
				ends, causes = append(ends, ss), append(causes, "expired")
			case ss.busy == 0 && now.Sub(ss.lastActive) > time.Duration(ss.rec.IdleTimeout):
				ends, causes = append(ends, ss), append(causes, "idle")
			}
			ss.mu.Unlock()
		}
		s.mu.Unlock()
		for i, ss := range ends {
			s.endSession(ss, causes[i])
		}
	}
}

func (s *Server) handleListSessions(w http.ResponseWriter, r *http.Request, owner string) error {
	s.mu.Lock()
	var mine []*session
	for _, ss := range s.sessions {
		if ss.rec.Owner == owner && ss.sess != nil {
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
	ss, done, err := s.useSession(r, owner)
	if err != nil {
		return err
	}
	defer done()
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
	return s.execute(w, r, owner, ss.rec.Level, ss.rec.Network, ss.rec.ID, ss.sess.Run, req)
}
