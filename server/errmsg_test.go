package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/moatsandbox/moat"
)

// An error body's message does not end in the words of its class, which
// its code says already, nor say them twice.
func TestErrorMessageSaysItsClassOnce(t *testing.T) {
	for _, tt := range []struct {
		err  error
		code string
		want string
	}{
		{badRequest("content type %q: send application/json", "text/plain"), "bad_request", `content type "text/plain": send application/json`},
		{fmt.Errorf("ttl 0s must be above zero: %w", moat.ErrInvalid), "invalid", "ttl 0s must be above zero"},
		{fmt.Errorf("session x: %w", moat.Invalid(fmt.Errorf("bad: %w", moat.ErrInvalid))), "invalid", "session x: bad"},
		{fmt.Errorf("session %s: %w", "s_1", errNotFound), "not_found", "session s_1"},
		{fmt.Errorf("run: %w", context.Canceled), "canceled", "run"},
		{errNotFound, "not_found", errNotFound.Error()},
		{moat.ErrInvalid, "invalid", moat.ErrInvalid.Error()},
		// Words that only look like a class's stay: the error is not of it.
		{errors.New("the file said: invalid input"), "internal", "the file said: invalid input"},
	} {
		_, code := classify(tt.err)
		got := message(tt.err)
		if code != "internal" {
			// What a client reads is the same.
			rec := httptest.NewRecorder()
			(&Server{}).writeError(rec, httptest.NewRequest("GET", "/v1/x", nil), tt.err)
			var body errorBody
			if err := json.Unmarshal(rec.Body.Bytes(), &body); err != nil || body.Error.Message != got {
				t.Errorf("%q: the body says %q (%v), message() %q", tt.err, body.Error.Message, err, got)
			}
		}
		if code != tt.code || got != tt.want {
			t.Errorf("%q: code %q, message %q; want %q, %q", tt.err, code, got, tt.code, tt.want)
		}
		for _, e := range errorTable {
			if n := strings.Count(got, e.target.Error()); n > 1 {
				t.Errorf("%q says %q %d times", got, e.target, n)
			}
		}
	}
}
