// Bearer tokens: how a request's token is checked and its owner named.

package server

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"strings"
	"time"
)

type tokenHash struct {
	name string
	sum  [32]byte
}

// wrap authenticates and turns a handler's error into the JSON error. The
// handler's writes have a deadline each (Config.WriteTimeout). (net/http
// lifts the read deadline once the request is read, so ReadTimeout bounds
// the reading and not the handling.)
func (s *Server) wrap(rt route) http.Handler {
	return http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		w := newDeadlineWriter(rw, time.Duration(s.cfg.WriteTimeout))
		// The final flush, after the handler, gets a full deadline too.
		defer w.extend()
		owner := ""
		if !rt.public {
			var ok bool
			owner, ok = s.authenticate(r)
			if !ok {
				w.Header().Set("WWW-Authenticate", `Bearer realm="moat"`)
				s.writeError(w, r, errUnauthorized)
				return
			}
		}
		if err := rt.h(w, r, owner); err != nil {
			s.writeError(w, r, err)
		}
	})
}

// authenticate returns the name of the request's token.
func (s *Server) authenticate(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	tok, ok := strings.CutPrefix(h, "Bearer ")
	if !ok || tok == "" {
		return "", false
	}
	sum := sha256.Sum256([]byte(tok))
	name, found := "", 0
	for _, t := range s.tokens {
		if subtle.ConstantTimeCompare(sum[:], t.sum[:]) == 1 {
			name, found = t.name, 1
		}
	}
	return name, found == 1
}
