package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/http"

	"github.com/moatsandbox/moat"
)

// The server's own error classes. Errors of the sandboxes (moat.ErrInvalid,
// moat.ErrUnavailable, moat.ErrClosed, fs.ErrNotExist) are mapped too; see
// errorTable.
var (
	errUnauthorized  = errors.New("server: missing or unknown bearer token")
	errNotFound      = errors.New("server: not found")
	errBadRequest    = errors.New("server: malformed request")
	errMediaType     = errors.New("server: unsupported media type")
	errIsDir         = errors.New("server: is a directory")
	errBodyTooLarge  = errors.New("server: request body too large")
	errCodeTooLarge  = errors.New("server: code too large")
	errTooMany       = errors.New("server: too many sessions for this token")
	errBusy          = errors.New("server: too many runs waiting")
	errTokenBusy     = errors.New("server: too many runs of this token running and waiting")
	errQueueTimeout  = errors.New("server: no run slot freed in time")
	errNoSessions    = errors.New("server: this level does not support sessions")
	errUnknownLevel  = errors.New("server: level not served")
	errMethod        = errors.New("server: method not allowed")
	errShuttingDown  = errors.New("server: shutting down")
	errSessionClosed = errors.New("server: session ended")
	errSessionBusy   = errors.New("server: session busy")
	errSessionBroken = errors.New("server: session broken")
	errNoSuspend     = errors.New("server: this level does not suspend sessions")
	errSnapshotQuota = errors.New("server: the token's snapshots are over their disk quota")
	// errProfileForbidden is both a profile the token may not use and
	// one that does not exist: the answer does not tell which, so that a
	// token cannot learn the names of profiles granted to others.
	errProfileForbidden = errors.New("server: network profile not granted to this token")
)

// errorTable maps error classes to HTTP statuses and stable codes, first
// match wins. It is the only place where statuses are chosen for errors.
var errorTable = []struct {
	target error
	status int
	code   string
}{
	{errUnauthorized, http.StatusUnauthorized, "unauthorized"},
	{errNotFound, http.StatusNotFound, "not_found"},
	{errSessionClosed, http.StatusNotFound, "not_found"},
	{fs.ErrNotExist, http.StatusNotFound, "not_found"},
	{errMethod, http.StatusMethodNotAllowed, "method_not_allowed"},
	{errProfileForbidden, http.StatusForbidden, "network_profile_forbidden"},
	{errBodyTooLarge, http.StatusRequestEntityTooLarge, "body_too_large"},
	{errCodeTooLarge, http.StatusRequestEntityTooLarge, "code_too_large"},
	{errMediaType, http.StatusUnsupportedMediaType, "unsupported_media_type"},
	{errIsDir, http.StatusConflict, "is_a_directory"},
	{errBadRequest, http.StatusBadRequest, "bad_request"},
	{errUnknownLevel, http.StatusBadRequest, "unknown_level"},
	{errSessionBroken, http.StatusConflict, "session_broken"},
	{errSessionBusy, http.StatusConflict, "session_busy"},
	{moat.ErrInvalid, http.StatusBadRequest, "invalid"},
	{errTooMany, http.StatusTooManyRequests, "too_many_sessions"},
	{errSnapshotQuota, http.StatusInsufficientStorage, "snapshot_quota"},
	{errTokenBusy, http.StatusTooManyRequests, "token_busy"},
	{errBusy, http.StatusTooManyRequests, "busy"},
	{errQueueTimeout, http.StatusServiceUnavailable, "queue_timeout"},
	{errNoSessions, http.StatusNotImplemented, "sessions_unsupported"},
	{errNoSuspend, http.StatusNotImplemented, "suspend_unsupported"},
	{errShuttingDown, http.StatusServiceUnavailable, "shutting_down"},
	{moat.ErrSpent, http.StatusConflict, "session_spent"},
	{moat.ErrClosed, http.StatusServiceUnavailable, "shutting_down"},
	{moat.ErrUnavailable, http.StatusServiceUnavailable, "unavailable"},
	{context.Canceled, 499, "canceled"}, // the client went away
	{context.DeadlineExceeded, http.StatusServiceUnavailable, "timeout"},
}

// retryAfter is the Retry-After, in seconds, sent with each status that
// invites a retry.
var retryAfter = map[int]string{
	http.StatusTooManyRequests:    "1",
	http.StatusServiceUnavailable: "2",
}

// errorBody is every error's JSON body.
type errorBody struct {
	Error struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	} `json:"error"`
}

// classify returns the status and code of err.
func classify(err error) (int, string) {
	for _, e := range errorTable {
		if errors.Is(err, e.target) {
			return e.status, e.code
		}
	}
	return http.StatusInternalServerError, "internal"
}

// writeError writes err as JSON with its status.
func (s *Server) writeError(w http.ResponseWriter, r *http.Request, err error) {
	status, code := classify(err)
	if status == http.StatusInternalServerError {
		s.log.Error("server: internal error", "method", r.Method, "path", r.URL.Path, "err", err)
	}
	var body errorBody
	body.Error.Code = code
	body.Error.Message = message(err)
	if ra, ok := retryAfter[status]; ok {
		w.Header().Set("Retry-After", ra)
	}
	writeJSON(w, status, body)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.Encode(v)
}

func badRequest(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), errBadRequest)
}
