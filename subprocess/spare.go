package subprocess

import "sync"

// A spare helper for sessions' runs.
//
// The engine's pooled instances are one-shot runs set up whole (prestart.go),
// of no use to a run of a session, whose directory, uid and interpreter are
// the session's. What a plain session's run can still have ready is its
// helper: a process of moat's own binary in fresh namespaces, waiting,
// unconfined and doing nothing, for the spec of one run (helperproc.go),
// which costs about a fifth of Python's start to make. The backend keeps
// one, made the first time a session's run asks and again each time one
// is taken; Close ends it. Nothing of a run exists in it before the run:
// the helper takes the run's restrictions from its spec.
type spare struct {
	mu      sync.Mutex
	h       *helperProc
	filling bool
	closed  bool
}

// sessionHelper returns the spare helper, or starts one now, and has the
// next one made in the background.
func (b *backend) sessionHelper() (*helperProc, error) {
	b.spare.mu.Lock()
	h := b.spare.h
	b.spare.h = nil
	refill := !b.spare.closed && !b.spare.filling
	b.spare.filling = b.spare.filling || refill
	b.spare.mu.Unlock()
	if refill {
		go b.fillSpare()
	}
	if h != nil {
		return h, nil
	}
	return b.startHelper()
}

// fillSpare makes the spare helper; one made after closeSpare is ended.
func (b *backend) fillSpare() {
	h, err := b.startHelper()
	b.spare.mu.Lock()
	defer b.spare.mu.Unlock()
	b.spare.filling = false
	if err != nil {
		return // the next session run starts its own, and says why
	}
	if b.spare.closed || b.spare.h != nil {
		go h.discard()
		return
	}
	b.spare.h = h
}

// closeSpare ends the spare helper; sessions' runs after it start their
// own.
func (b *backend) closeSpare() {
	b.spare.mu.Lock()
	h := b.spare.h
	b.spare.h, b.spare.closed = nil, true
	b.spare.mu.Unlock()
	if h != nil {
		h.discard()
	}
}
