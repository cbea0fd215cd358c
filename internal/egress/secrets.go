package egress

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"

	"github.com/moatsandbox/moat"
)

// placeholderPrefix starts every placeholder a sandbox sees in place of a
// secret's value; 32 hex digits of crypto/rand follow.
const placeholderPrefix = "moat-secret-"

// secret is one operator secret with its real value. The value stays in
// moat's process: it goes into requests to hosts only, never into an
// error, a log line or the sandbox.
type secret struct {
	name  string // the variable the code sees
	value string // the real value, from moat's environment
	hosts []moat.HostPattern
	inURL bool
}

// matches reports whether host:port is one of s's hosts.
func (s *secret) matches(host string, port int) bool {
	for _, p := range s.hosts {
		if p.Match(host, port) {
			return true
		}
	}
	return false
}

// secretSet is a sandbox's secrets with their real values, looked up once
// when the proxy is made. It is read-only after newSecretSet and safe for
// concurrent use.
type secretSet struct {
	secrets []secret // sorted by name
}

// newSecretSet looks up each secret's FromEnv with getenv (nil means
// os.Getenv). A variable that is unset or empty, a value holding a control
// character (it could not go into a header as it is) or a host that does
// not parse makes it fail with an error wrapping moat.ErrInvalid that names
// the secret and the variable, never the value.
func newSecretSet(e moat.Egress, getenv func(string) string) (*secretSet, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	names := make([]string, 0, len(e.Secrets))
	for name := range e.Secrets {
		names = append(names, name)
	}
	sort.Strings(names)
	set := &secretSet{}
	for _, name := range names {
		cfg := e.Secrets[name]
		s := secret{name: name, inURL: cfg.InURL}
		if len(cfg.Hosts) == 0 {
			return nil, fmt.Errorf("egress: secret %s: no hosts: %w", name, moat.ErrInvalid)
		}
		for _, h := range cfg.Hosts {
			p, err := moat.ParseHostPattern(h)
			if err != nil {
				return nil, fmt.Errorf("egress: secret %s: hosts: %w", name, err)
			}
			s.hosts = append(s.hosts, p)
		}
		if cfg.FromEnv == "" {
			return nil, fmt.Errorf("egress: secret %s: from_env is empty: %w", name, moat.ErrInvalid)
		}
		s.value = getenv(cfg.FromEnv)
		if s.value == "" {
			return nil, fmt.Errorf("egress: secret %s: the variable %s (from_env) is unset or empty in moat's environment: %w", name, cfg.FromEnv, moat.ErrInvalid)
		}
		if strings.ContainsFunc(s.value, func(c rune) bool { return c < ' ' || c == 0x7f }) {
			return nil, fmt.Errorf("egress: secret %s: the value of %s holds a control character (a newline?), which cannot go into a header: %w", name, cfg.FromEnv, moat.ErrInvalid)
		}
		if strings.Contains(s.value, placeholderPrefix) {
			return nil, fmt.Errorf("egress: secret %s: the value of %s holds %q, which moat's placeholders start with: %w", name, cfg.FromEnv, placeholderPrefix, moat.ErrInvalid)
		}
		set.secrets = append(set.secrets, s)
	}
	return set, nil
}

// forRun returns fresh placeholders for one run or session: each secret
// gets "moat-secret-" and 32 hex digits of crypto/rand, unique to the run,
// so a placeholder seen in one run means nothing in another.
func (s *secretSet) forRun() *runSecrets {
	r := &runSecrets{set: s, placeholders: make([]string, len(s.secrets))}
	for i := range s.secrets {
		var b [16]byte
		rand.Read(b[:]) // never fails (crypto/rand panics rather)
		r.placeholders[i] = placeholderPrefix + hex.EncodeToString(b[:])
	}
	return r
}

// runSecrets is one run's placeholders of a secretSet. It is read-only and
// safe for concurrent use.
type runSecrets struct {
	set          *secretSet
	placeholders []string // placeholders[i] stands for set.secrets[i]
}

// env is the secrets' part of the sandbox's environment: NAME=placeholder
// for each secret, sorted. It holds no real value.
func (r *runSecrets) env() []string {
	env := make([]string, 0, len(r.placeholders))
	for i, s := range r.set.secrets {
		env = append(env, s.name+"="+r.placeholders[i])
	}
	sort.Strings(env)
	return env
}

// intercepts reports whether host:port is a host of one of the secrets:
// its HTTPS the proxy terminates (serveMITM) rather than tunnels.
func (r *runSecrets) intercepts(host string, port int) bool {
	for i := range r.set.secrets {
		if r.set.secrets[i].matches(host, port) {
			return true
		}
	}
	return false
}

// sent reports whether req carries the placeholder ph where the proxy
// looks: a header name or value, the Host or the request target.
func sent(req *http.Request, ph string) bool {
	if strings.Contains(req.RequestURI+"\n"+req.Host+"\n"+req.URL.String()+"\n"+req.URL.Path, ph) {
		return true
	}
	for k, vs := range req.Header {
		if strings.Contains(k, ph) {
			return true
		}
		for _, v := range vs {
			if strings.Contains(v, ph) {
				return true
			}
		}
	}
	return false
}

// misplaced is the refusal of a request to host:port that carries the
// placeholder of a secret whose Hosts do not match it, "" if none does.
func (r *runSecrets) misplaced(req *http.Request, host string, port int) string {
	for i, ph := range r.placeholders {
		if !r.set.secrets[i].matches(host, port) && sent(req, ph) {
			return fmt.Sprintf("the placeholder of secret %s was sent to %s, which is not one of its hosts",
				r.set.secrets[i].name, hostPort(host, port))
		}
	}
	return ""
}

// rewrite puts the real values in req, bound for host:port over TLS (the
// address the proxy connects to, not anything req says), in place of the
// placeholders of the secrets whose Hosts match it: in every header value
// and, for a secret with InURL, in the URL's path and query (escaped as
// each needs). Placeholders in header names, the body and trailers are
// left as sent. Only the intercepted tunnel calls it: a plain http://
// request gets checkPlain instead.
//
// A placeholder of a secret whose Hosts do not match host:port, found in a
// header name or value, the Host or the request target, makes rewrite
// return a non-empty refusal naming the secret and host:port (never a
// value) and leave req as it was; the caller refuses the request.
func (r *runSecrets) rewrite(req *http.Request, host string, port int) (refusal string) {
	if len(r.placeholders) == 0 {
		return ""
	}
	if refusal := r.misplaced(req, host, port); refusal != "" {
		return refusal
	}
	for i, ph := range r.placeholders {
		s := &r.set.secrets[i]
		if !s.matches(host, port) {
			continue
		}
		for _, vs := range req.Header {
			for j, v := range vs {
				vs[j] = strings.ReplaceAll(v, ph, s.value)
			}
		}
		if s.inURL {
			u := req.URL
			if strings.Contains(u.Path, ph) {
				// The value stays one segment: a "/" in it goes as %2F.
				u.RawPath = strings.ReplaceAll(u.EscapedPath(), ph, url.PathEscape(s.value))
				u.Path = strings.ReplaceAll(u.Path, ph, s.value)
			}
			u.RawQuery = strings.ReplaceAll(u.RawQuery, ph, url.QueryEscape(s.value))
		}
	}
	return ""
}

// checkPlain decides a plain http:// request to host:port, which never
// gets a real value: moat puts secrets only into TLS, where the path to
// the host is not readable on the way. A placeholder of a secret whose
// Hosts match host:port makes it refused (saying so); a placeholder of
// another secret, as rewrite refuses it. The refusal names the secret and
// host:port, never a value. req is not changed.
func (r *runSecrets) checkPlain(req *http.Request, host string, port int) (refusal string) {
	for i, ph := range r.placeholders {
		if r.set.secrets[i].matches(host, port) && sent(req, ph) {
			return fmt.Sprintf("moat puts secrets only into TLS connections: the placeholder of secret %s was sent to %s over plain http",
				r.set.secrets[i].name, hostPort(host, port))
		}
	}
	return r.misplaced(req, host, port)
}

// hide replaces every secret's real value in s with its placeholder, as
// it is and in the escaped forms a URL carries it in (a redirect's
// Location that keeps the key of the query): for text that came from an
// upstream (a response's header, an error quoting what the upstream sent)
// on its way to the sandbox or to moat's logs.
func (r *runSecrets) hide(s string) string {
	for i := range r.set.secrets {
		v := r.set.secrets[i].value
		for _, form := range []string{v, url.QueryEscape(v), url.PathEscape(v)} {
			s = strings.ReplaceAll(s, form, r.placeholders[i])
		}
	}
	return s
}

// scrub hides the secrets' real values in h, a response's header on its
// way back to the sandbox: a host that echoes a request header does not
// hand the code the value. (A body gets hideBody, which knows more forms.)
func (r *runSecrets) scrub(h http.Header) {
	for _, vs := range h {
		for j, v := range vs {
			vs[j] = r.hide(v)
		}
	}
}

// hideResponse hides the secrets' real values in what resp, an upstream's
// response (a 1xx too) on its way to the sandbox, carries outside its
// body: the status line, the header and, once the body has been read to
// its end, the trailer. Every path that writes an upstream's response to
// the sandbox calls it before the write.
func (r *runSecrets) hideResponse(resp *http.Response) {
	resp.Status = r.hide(resp.Status)
	r.scrub(resp.Header)
	if resp.Trailer != nil && resp.Body != nil {
		resp.Body = &trailerHider{ReadCloser: resp.Body, r: r, trailer: resp.Trailer}
	}
}

// trailerHider is a response's body that hides the secrets' values in the
// response's trailer when the body ends (net/http fills the trailer then,
// and Response.Write writes it after the body).
type trailerHider struct {
	io.ReadCloser
	r       *runSecrets
	trailer http.Header
}

func (b *trailerHider) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.r.scrub(b.trailer)
	}
	return n, err
}

// hiddenError is an error whose text has the secrets' values hidden; it
// unwraps to the error it hides (whose own text may hold them: print the
// hiddenError, not what it wraps).
type hiddenError struct {
	msg string
	err error
}

func (e *hiddenError) Error() string { return e.msg }
func (e *hiddenError) Unwrap() error { return e.err }

// hideErr returns err with the secrets' values hidden in its text; nil
// stays nil.
func (r *runSecrets) hideErr(err error) error {
	if err == nil {
		return nil
	}
	if msg := err.Error(); r.hide(msg) != msg {
		return &hiddenError{msg: r.hide(msg), err: err}
	}
	return err
}
