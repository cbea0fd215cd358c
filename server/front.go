// Front: the small exported seam through which another API in the same
// process (package e2b) uses the server's sessions, with the same owners,
// caps, run slots, suspend and resume as the server's own routes.

package server

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/moatsandbox/moat"
)

// SessionSpec is what a front end asks of a new session. Zero values are
// the server's defaults, as in POST /v1/sessions.
type SessionSpec struct {
	Level moat.Level
	// Network names a network profile the owner's token may use; empty
	// for none.
	Network     string
	TTL         moat.Duration
	IdleTimeout moat.Duration
	Interpreter bool
	// Front is the front end's own record of the session (what package
	// e2b keeps of a sandbox), opaque to the server, at most MaxFrontBytes.
	// It is kept in the session's record in the state directory's
	// database: it lasts exactly as long as the session, through a
	// suspend and a restart, and is removed with it (ended, expired, or
	// removed at startup as a running session a crashed server left).
	Front []byte
}

// MaxFrontBytes caps SessionSpec.Front and SetFront's record.
const MaxFrontBytes = 64 << 10

// SessionInfo is a session as a front end sees it.
type SessionInfo struct {
	ID        string
	Owner     string
	Level     moat.Level
	Network   string
	CreatedAt time.Time
	ExpiresAt time.Time
	// State is "running", "suspended" or "broken".
	State string
	// Front is the front end's record (SessionSpec.Front, SetFront).
	Front []byte
}

func (ss *session) info() SessionInfo {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return SessionInfo{ID: ss.rec.ID, Owner: ss.rec.Owner, Level: ss.rec.Level, Network: ss.rec.Network,
		CreatedAt: ss.rec.CreatedAt, ExpiresAt: ss.rec.ExpiresAt, State: ss.rec.state(), Front: bytes.Clone(ss.rec.Front)}
}

// Granted reports whether owner's token may use the network profile name
// (Token.NetworkProfiles), as the server's own routes judge it.
func (s *Server) Granted(owner, name string) bool { return s.grants[owner][name] }

// ProfilePolicy returns the egress policy of the network profile name
// (Config.ProfilePolicies), and false when the server has none for it.
func (s *Server) ProfilePolicy(name string) (moat.Egress, bool) {
	e, ok := s.cfg.ProfilePolicies[name]
	return e, ok
}

// Owner returns the name of the token tok, as a request's bearer token is
// checked.
func (s *Server) Owner(tok string) (string, bool) {
	r := &http.Request{Header: http.Header{"Authorization": {"Bearer " + tok}}}
	return s.authenticate(r)
}

// MaxSessionTTL is the longest time to live a session may be given.
func (s *Server) MaxSessionTTL() time.Duration { return time.Duration(s.cfg.MaxSessionTTL) }

// CreateSession makes a session of owner's, within the token's caps and
// network grants, as POST /v1/sessions does.
func (s *Server) CreateSession(ctx context.Context, owner string, spec SessionSpec) (SessionInfo, error) {
	if len(spec.Front) > MaxFrontBytes {
		return SessionInfo{}, fmt.Errorf("front record of %d bytes is over %d: %w", len(spec.Front), MaxFrontBytes, moat.ErrInvalid)
	}
	req := createRequest{Level: spec.Level, Network: profileRef(spec.Network), Interpreter: spec.Interpreter, front: spec.Front}
	if spec.TTL != 0 {
		req.TTL = &spec.TTL
	}
	if spec.IdleTimeout != 0 {
		req.IdleTimeout = &spec.IdleTimeout
	}
	ss, err := s.createSession(ctx, owner, req)
	if err != nil {
		return SessionInfo{}, err
	}
	return ss.info(), nil
}

// find returns owner's session id; any other is not found.
func (s *Server) find(owner, id string) (*session, error) {
	s.mu.Lock()
	ss, ok := s.sessions[id]
	s.mu.Unlock()
	if !ok || ss.rec.Owner != owner || ss.creating {
		return nil, fmt.Errorf("session %q: %w", id, errNotFound)
	}
	return ss, nil
}

// FrontSessions lists every session that has a front end's record
// (SessionSpec.Front), whatever its owner and state, in no particular
// order: what a front end reads once at its start to know the sessions it
// made before a restart. The front end checks its own credentials.
func (s *Server) FrontSessions() []SessionInfo {
	s.mu.Lock()
	var all []*session
	for _, ss := range s.sessions {
		if !ss.creating {
			all = append(all, ss)
		}
	}
	s.mu.Unlock()
	var out []SessionInfo
	for _, ss := range all {
		if info := ss.info(); len(info.Front) > 0 {
			out = append(out, info)
		}
	}
	return out
}

// SetFront replaces the front end's record of owner's session id, in the
// database before it returns.
func (s *Server) SetFront(owner, id string, front []byte) error {
	if len(front) > MaxFrontBytes {
		return fmt.Errorf("front record of %d bytes is over %d: %w", len(front), MaxFrontBytes, moat.ErrInvalid)
	}
	ss, err := s.find(owner, id)
	if err != nil {
		return err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.ended {
		return fmt.Errorf("session %s: %w", id, errSessionClosed)
	}
	rec := ss.rec
	rec.Front = bytes.Clone(front)
	// Recorded under the lock, as ExtendSession's.
	if err := s.store.put(rec); err != nil {
		return err
	}
	ss.rec = rec
	return nil
}

// Session describes owner's session id.
func (s *Server) Session(owner, id string) (SessionInfo, error) {
	ss, err := s.find(owner, id)
	if err != nil {
		return SessionInfo{}, err
	}
	return ss.info(), nil
}

// Sessions lists owner's sessions, in no particular order.
func (s *Server) Sessions(owner string) []SessionInfo {
	s.mu.Lock()
	var mine []*session
	for _, ss := range s.sessions {
		if ss.rec.Owner == owner && !ss.creating {
			mine = append(mine, ss)
		}
	}
	s.mu.Unlock()
	out := make([]SessionInfo, 0, len(mine))
	for _, ss := range mine {
		out = append(out, ss.info())
	}
	return out
}

// UseSession marks owner's session busy for a file operation, resuming it
// if it is suspended, and returns its live session; done marks it idle
// again. Runs go through RunSession, which takes a run slot.
func (s *Server) UseSession(ctx context.Context, owner, id string) (sess moat.Session, done func(), err error) {
	ss, err := s.find(owner, id)
	if err != nil {
		return nil, nil, err
	}
	sess, _, done, err = s.use(ctx, ss)
	return sess, done, err
}

// RunSession runs req in owner's session, resuming it if it is suspended,
// in one of the owner's run slots, as POST /v1/sessions/{id}/runs does.
func (s *Server) RunSession(ctx context.Context, owner, id string, req moat.Request) (*moat.Result, error) {
	ss, err := s.find(owner, id)
	if err != nil {
		return nil, err
	}
	sess, _, done, err := s.use(ctx, ss)
	if err != nil {
		return nil, err
	}
	defer done()
	if len(req.Code) > int(s.cfg.MaxCodeBytes) {
		return nil, fmt.Errorf("code of %d bytes is over the %v cap: %w", len(req.Code), s.cfg.MaxCodeBytes, errCodeTooLarge)
	}
	release, err := s.acquireSlot(ctx, owner)
	if err != nil {
		return nil, err
	}
	defer release()
	start := time.Now()
	res, err := sess.Run(ctx, req)
	s.metrics.latency.WithLabelValues(string(ss.rec.Level)).Observe(time.Since(start).Seconds())
	reason := "none"
	if err != nil {
		reason = "error"
	} else if res.Reason != "" {
		reason = string(res.Reason)
	}
	s.metrics.runs.WithLabelValues(string(ss.rec.Level), reason).Inc()
	return res, err
}

// EndSession ends owner's session id, whatever its state.
func (s *Server) EndSession(owner, id string) error {
	ss, err := s.find(owner, id)
	if err != nil {
		return err
	}
	s.endSession(ss, "deleted")
	return nil
}

// SuspendSession suspends owner's running session id, waiting for the
// operations in progress (bounded by ctx and the queue wait). A suspended
// session stays as it is.
func (s *Server) SuspendSession(ctx context.Context, owner, id string) error {
	ss, err := s.find(owner, id)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Duration(s.cfg.QueueWait))
	defer cancel()
	return s.suspend(ctx, ss, "api", 0)
}

// ResumeSession resumes owner's session id if it is suspended.
func (s *Server) ResumeSession(ctx context.Context, owner, id string) error {
	_, done, err := s.UseSession(ctx, owner, id)
	if err != nil {
		return err
	}
	done()
	return nil
}

// ExtendSession makes owner's session id end ttl from now, and raises its
// idle timeout to ttl so that the new end is the one that holds. No session
// lives past its creation plus MaxSessionTTL, as one of the server's own
// API cannot: a ttl that would end it later is refused with an error
// wrapping moat.ErrInvalid, and the session is left as it was.
func (s *Server) ExtendSession(owner, id string, ttl time.Duration) (SessionInfo, error) {
	if ttl <= 0 || ttl > time.Duration(s.cfg.MaxSessionTTL) {
		return SessionInfo{}, fmt.Errorf("timeout %v must be above zero and at most %v: %w", ttl, s.cfg.MaxSessionTTL, moat.ErrInvalid)
	}
	ss, err := s.find(owner, id)
	if err != nil {
		return SessionInfo{}, err
	}
	ss.mu.Lock()
	if ss.ended {
		ss.mu.Unlock()
		return SessionInfo{}, fmt.Errorf("session %s: %w", id, errSessionClosed)
	}
	end, last := time.Now().UTC().Add(ttl), ss.rec.CreatedAt.Add(time.Duration(s.cfg.MaxSessionTTL))
	if end.After(last) {
		ss.mu.Unlock()
		return SessionInfo{}, fmt.Errorf("timeout %v would end session %s after its creation plus the maximum ttl %v (at most %v from now): %w",
			ttl, id, s.cfg.MaxSessionTTL, time.Until(last).Truncate(time.Second), moat.ErrInvalid)
	}
	ss.rec.ExpiresAt = end
	if time.Duration(ss.rec.IdleTimeout) < ttl {
		ss.rec.IdleTimeout = moat.Duration(ttl)
	}
	// Recorded under the lock: an endSession that begins meanwhile
	// deletes the record after this, never before.
	err = s.store.put(ss.rec)
	ss.mu.Unlock()
	if err != nil {
		return SessionInfo{}, err
	}
	return ss.info(), nil
}

// ErrorStatus returns the HTTP status and stable code the server's own
// routes answer err with.
func ErrorStatus(err error) (status int, code string) { return classify(err) }

// PeekSession is UseSession for a look that must not wake a session:
// running is false, and nothing is marked, when owner's session id is
// suspended, broken, or being suspended or resumed. A running session is
// marked busy until done, without counting as activity (its idle timeout
// runs on). err is for a session that is not there, or has ended.
func (s *Server) PeekSession(owner, id string) (sess moat.Session, done func(), running bool, err error) {
	ss, err := s.find(owner, id)
	if err != nil {
		return nil, nil, false, err
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.ended {
		return nil, nil, false, fmt.Errorf("session %s: %w", id, errSessionClosed)
	}
	if ss.moving || ss.rec.state() != stateRunning {
		return nil, nil, false, nil
	}
	ss.busy++
	return ss.sess, func() {
		ss.mu.Lock()
		ss.busy--
		ss.signal()
		ss.mu.Unlock()
	}, true, nil
}
