package server

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"
)

// slots hands out run slots: at most total runs execute at once, and at most
// perToken of one token. A run that cannot start waits in one queue of at
// most queueLen runs, at most perTokenQueue of one token, until a slot is
// free and its token is under its cap; waiting runs start in the order they
// came, skipping those whose token is at its cap, so one token's backlog
// never holds up another token's runs. It is safe for concurrent use.
type slots struct {
	total, perToken, queueLen, perTokenQueue int
	// changed is called, with mu held, after every change of the counts.
	changed func(running, waiting int)

	mu      sync.Mutex
	running int
	tokens  map[string]*tokenRuns // only tokens with a run running or waiting
	waiting []*waiter             // in arrival order
}

type tokenRuns struct{ running, waiting int }

// waiter is a run in the queue; ready is closed once it holds a slot.
type waiter struct {
	owner   string
	ready   chan struct{}
	granted bool
}

func newSlots(total, perToken, queueLen, perTokenQueue int, changed func(running, waiting int)) *slots {
	return &slots{
		total: total, perToken: perToken, queueLen: queueLen, perTokenQueue: perTokenQueue,
		changed: changed, tokens: map[string]*tokenRuns{},
	}
}

// acquire takes a slot for a run of owner, waiting at most wait in the
// queue. The error wraps errTokenBusy when owner has perTokenQueue runs
// waiting already, errBusy when the queue is full, errQueueTimeout when no
// slot came in time, or is ctx's error. release gives the slot back; call it
// once.
func (s *slots) acquire(ctx context.Context, owner string, wait time.Duration) (release func(), err error) {
	s.mu.Lock()
	t := s.tokens[owner]
	if t == nil {
		t = &tokenRuns{}
		s.tokens[owner] = t
	}
	// Every waiter that could start has started (dispatch runs after each
	// change): a run that can start now passes no one.
	if s.running < s.total && t.running < s.perToken {
		s.running++
		t.running++
		s.changed(s.running, len(s.waiting))
		s.mu.Unlock()
		return s.releaser(owner), nil
	}
	if t.waiting >= s.perTokenQueue {
		s.forget(owner, t)
		s.mu.Unlock()
		return nil, fmt.Errorf("this token has %d runs running and %d waiting already: %w", t.running, t.waiting, errTokenBusy)
	}
	if len(s.waiting) >= s.queueLen {
		s.forget(owner, t)
		s.mu.Unlock()
		return nil, fmt.Errorf("%d runs are waiting already: %w", s.queueLen, errBusy)
	}
	w := &waiter{owner: owner, ready: make(chan struct{})}
	s.waiting = append(s.waiting, w)
	t.waiting++
	s.changed(s.running, len(s.waiting))
	s.mu.Unlock()

	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-w.ready:
		return s.releaser(owner), nil
	case <-timer.C:
		err = fmt.Errorf("waited %v: %w", wait, errQueueTimeout)
	case <-ctx.Done():
		err = ctx.Err()
	}
	s.mu.Lock()
	if w.granted {
		// The slot came as the wait ended: give it on.
		s.mu.Unlock()
		s.releaser(owner)()
		return nil, err
	}
	s.waiting = slices.DeleteFunc(s.waiting, func(x *waiter) bool { return x == w })
	t.waiting--
	s.forget(owner, t)
	s.changed(s.running, len(s.waiting))
	s.mu.Unlock()
	return nil, err
}

// releaser returns the release of a slot held by owner.
func (s *slots) releaser(owner string) func() {
	var once sync.Once
	return func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			t := s.tokens[owner]
			s.running--
			t.running--
			s.forget(owner, t)
			s.dispatch()
			s.changed(s.running, len(s.waiting))
		})
	}
}

// dispatch starts the waiters that can start, in arrival order. s.mu is
// held.
func (s *slots) dispatch() {
	for i := 0; i < len(s.waiting) && s.running < s.total; {
		w := s.waiting[i]
		t := s.tokens[w.owner]
		if t.running >= s.perToken {
			i++
			continue
		}
		s.waiting = slices.Delete(s.waiting, i, i+1)
		t.waiting--
		t.running++
		s.running++
		w.granted = true
		close(w.ready)
	}
}

// forget drops owner's entry once it has nothing running or waiting. s.mu
// is held.
func (s *slots) forget(owner string, t *tokenRuns) {
	if t.running == 0 && t.waiting == 0 {
		delete(s.tokens, owner)
	}
}
