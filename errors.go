package moat

import (
	"errors"
	"fmt"
)

// Sentinel errors. Compare with errors.Is; the errors moat returns wrap them
// with context.
var (
	// ErrUnavailable means a level cannot run here with the protections it
	// promises (a missing binary, kernel feature or privilege). moat never
	// runs code with weaker protection instead.
	ErrUnavailable = errors.New("sandbox unavailable")

	// ErrInvalid means a request or a configuration was malformed: empty
	// code, an unknown level, a limit that does not parse.
	ErrInvalid = errors.New("invalid input")

	// ErrClosed means the sandbox was closed.
	ErrClosed = errors.New("sandbox closed")

	// ErrSpent means a session used up a budget that lasts its whole life
	// (its CPU time): it runs no more code, though its files can still be
	// read until it is closed. Retrying does not help.
	ErrSpent = errors.New("session budget spent")
)

// Invalid returns err classed as [ErrInvalid], for a caller that turns an
// error of its own (a file that does not open, a value that does not
// parse) into bad input. An err that matches ErrInvalid already is
// returned as it is, so that a message ends in ErrInvalid's text once
// however many callers class it on the way up. Invalid(nil) is nil.
func Invalid(err error) error {
	if err == nil || errors.Is(err, ErrInvalid) {
		return err
	}
	return fmt.Errorf("%w: %w", err, ErrInvalid)
}

// UnavailableError says why a level cannot run and what to do about it. It
// matches [ErrUnavailable] under errors.Is.
type UnavailableError struct {
	Level  Level
	Reason string // what is missing, e.g. "landlock is not enabled in this kernel"
	Remedy string // what the operator can do, e.g. "boot with lsm=landlock,..."
	Err    error  // the underlying error, if any
}

func (e *UnavailableError) Error() string {
	msg := fmt.Sprintf("%s: unavailable: %s", e.Level, e.Reason)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	if e.Remedy != "" {
		msg += " (" + e.Remedy + ")"
	}
	return msg
}

// Is reports whether target is ErrUnavailable.
func (e *UnavailableError) Is(target error) bool { return target == ErrUnavailable }

// Unwrap returns the underlying error.
func (e *UnavailableError) Unwrap() error { return e.Err }
