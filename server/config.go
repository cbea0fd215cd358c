// Config: what a Server serves, its caps and timeouts, their defaults and Validate.

package server

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/moatsandbox/moat"
)

// The values of Config.OnIdle.
const (
	OnIdleEnd     = "end"
	OnIdleSuspend = "suspend"
)

// Token is one bearer token the operator gives out. Name identifies its
// holder in logs, metrics and session ownership; it is never secret.
type Token struct {
	Name  string `json:"name"`
	Token string `json:"token"`
	// NetworkProfiles are the network profiles (keys of Config.Profiles)
	// its holder may ask for by name. Empty means none: the holder's runs
	// and sessions get the default sandboxes only.
	NetworkProfiles []string `json:"network_profiles,omitempty"`
	// E2BKey is the key ("e2b_" and at least 40 hex digits) its holder
	// gives E2B's SDKs as E2B_API_KEY when moat serve also serves the
	// E2B-compatible API (package e2b): the same owner as Token, with the
	// same sessions and grants. Empty means the holder has no E2B key.
	E2BKey string `json:"e2b_key,omitempty"`
}

// e2bKey is the form of Token.E2BKey: the Python SDK checks e2b_[0-9a-f]+.
var e2bKey = regexp.MustCompile(`^e2b_[0-9a-f]{40,}$`)

// Config configures a Server. Zero values are documented per field.
type Config struct {
	// Sandboxes are the levels served. At least one is required. The
	// server does not close them. A request that names no network
	// profile gets these, with whatever egress policy they were opened
	// with (the operator's top-level one).
	Sandboxes map[moat.Level]moat.Sandbox `json:"-"`
	// Profiles are the network profiles: per profile name, its sandboxes
	// per level, opened with the profile's egress policy. A run or
	// session that names a profile ("network": "NAME") its token may use
	// (Token.NetworkProfiles) gets that profile's sandbox of its level;
	// the request itself never carries a policy. Each profile's levels
	// must be served (keys of Sandboxes); a level a profile lacks is not
	// served with that profile. Nil means no profiles. The server does
	// not close them.
	Profiles map[string]map[moat.Level]moat.Sandbox `json:"-"`
	// ProfilePolicies are the egress policies of Profiles, by the same
	// names, as GET /v1/network_profiles shows them to the tokens that
	// may use them: allowed hosts, and the names and hosts of secrets,
	// never their values nor where they come from. The server does not
	// enforce them (the sandboxes do). A profile without an entry is
	// listed by name and levels only.
	ProfilePolicies map[string]moat.Egress `json:"-"`
	// DefaultLevel is used when a request names none. Zero means
	// subprocess when served, else the lightest level served.
	DefaultLevel moat.Level `json:"default_level,omitempty"`
	// Tokens are the accepted bearer tokens. At least one is required: a
	// server without tokens would serve no one.
	Tokens []Token `json:"tokens"`
	// Addr is where ListenAndServe listens. Zero means 127.0.0.1:8080.
	Addr string `json:"addr,omitempty"`
	// StateDir holds the session database and, in StateDir/suspended
	// (mode 0700), the suspended sessions' states. Zero means /var/lib/moat when
	// root, else $XDG_STATE_HOME/moat or ~/.local/state/moat.
	StateDir string `json:"state_dir,omitempty"`
	// Registry is the Prometheus registry the server's collectors join and
	// GET /metrics serves, so that the sandboxes' own (the egress proxy's
	// moat_egress_requests_total) appear beside them. Nil means one of the
	// server's own.
	Registry *prometheus.Registry `json:"-"`

	// MaxCodeBytes caps the code of one run. Zero means 1MiB.
	MaxCodeBytes moat.Bytes `json:"max_code_bytes,omitempty"`
	// MaxBodyBytes caps a JSON request body. Zero means MaxCodeBytes plus
	// 64KiB (JSON escaping can make code longer: send it as it is).
	MaxBodyBytes moat.Bytes `json:"max_body_bytes,omitempty"`
	// MaxFileBytes caps one uploaded file. Zero means 16MiB; the level's
	// own file size and disk limits apply as well.
	MaxFileBytes moat.Bytes `json:"max_file_bytes,omitempty"`
	// MaxSessionsPerToken caps the sessions one token holds at once. Zero
	// means 16.
	MaxSessionsPerToken int `json:"max_sessions_per_token,omitempty"`
	// MaxConcurrentRuns is how many runs execute at once, all levels and
	// tokens together. Zero means twice the number of CPUs.
	MaxConcurrentRuns int `json:"max_concurrent_runs,omitempty"`
	// QueueLength is how many runs may wait for a slot; one more gets 429
	// with Retry-After. Zero means 64.
	QueueLength int `json:"queue_length,omitempty"`
	// QueueWait is the longest a run waits for a slot before it gets 503
	// with Retry-After. Zero means 30s.
	QueueWait moat.Duration `json:"queue_wait,omitempty"`
	// MaxRunsPerToken is how many runs of one token execute at once, so
	// that one token cannot take every slot: its further runs wait in the
	// queue while other tokens' runs start. Zero means half of
	// MaxConcurrentRuns, rounded up, or all of them when there is one
	// token; more than MaxConcurrentRuns means MaxConcurrentRuns.
	MaxRunsPerToken int `json:"max_runs_per_token,omitempty"`
	// QueuePerToken is how many runs of one token may wait for a slot;
	// one more gets 429 token_busy with Retry-After. Zero means half of
	// QueueLength, rounded up, or all of it when there is one token.
	QueuePerToken int `json:"queue_per_token,omitempty"`
	// StreamBuffer is how far a streaming client may fall behind the
	// code's output, in bytes, before live output to it stops (it gets an
	// overflow event, then the result when the run ends). The run itself
	// never waits for a client. Zero means 2MiB, twice the default output
	// cap.
	StreamBuffer moat.Bytes `json:"stream_buffer,omitempty"`

	// ReadHeaderTimeout is the longest a connection may take to send a
	// request's headers; a connection that sends nothing is closed then.
	// Zero means 10s.
	ReadHeaderTimeout moat.Duration `json:"read_header_timeout,omitempty"`
	// ReadTimeout is the longest a connection may take to send a whole
	// request, headers and body. It does not bound the handling: a run
	// may last longer. Zero means 1m.
	ReadTimeout moat.Duration `json:"read_timeout,omitempty"`
	// WriteTimeout is the longest one write of a response may block on a
	// client that does not read; the client is then dropped as gone, and a
	// run still going for it is cancelled, as when a client disconnects
	// (a streaming run whose client stopped reading while output was
	// being sent to it). It is set anew before each write, so a long
	// stream is not bounded by it. Zero means 30s.
	WriteTimeout moat.Duration `json:"write_timeout,omitempty"`
	// ConnIdleTimeout closes a keep-alive connection that sends no new
	// request for that long. Zero means 1m.
	ConnIdleTimeout moat.Duration `json:"conn_idle_timeout,omitempty"`
	// MaxConnections caps the connections Serve holds open at once, with
	// or without a token; further ones wait in the listen backlog until
	// one closes. Zero means 512.
	MaxConnections int `json:"max_connections,omitempty"`

	// SessionTTL is a session's time to live when the request names none.
	// Zero means 30m.
	SessionTTL moat.Duration `json:"session_ttl,omitempty"`
	// MaxSessionTTL caps the time to live a request may ask for. Zero
	// means 8h.
	MaxSessionTTL moat.Duration `json:"max_session_ttl,omitempty"`
	// IdleTimeout ends (or, see OnIdle, suspends) a session with no run
	// and no file operation for that long, when the request names none.
	// Zero means 10m.
	IdleTimeout moat.Duration `json:"idle_timeout,omitempty"`
	// SweepInterval is how often expired and idle sessions are looked
	// for. Zero means 1s.
	SweepInterval moat.Duration `json:"sweep_interval,omitempty"`
	// OnIdle is what happens to a session idle past its idle timeout,
	// and to every running session at Shutdown: OnIdleEnd ends it (its
	// files are gone), OnIdleSuspend suspends it (its state kept on disk
	// under StateDir/suspended until its time to live ends; its next use
	// resumes it, after a restart too). Zero means OnIdleEnd.
	OnIdle string `json:"on_idle,omitempty"`
	// MaxSnapshotBytesPerToken caps the disk the snapshots of one token
	// hold (their SuspendInfo.Bytes): a snapshot that would pass it is
	// refused with 507. Zero means 1GiB.
	MaxSnapshotBytesPerToken moat.Bytes `json:"max_snapshot_bytes_per_token,omitempty"`

	// Logger gets one line per run and per session event. Nil means
	// discard.
	Logger *slog.Logger `json:"-"`
}

func (c Config) withDefaults() Config {
	if c.DefaultLevel == "" {
		if _, ok := c.Sandboxes[moat.LevelSubprocess]; ok {
			c.DefaultLevel = moat.LevelSubprocess
		} else {
			for _, l := range moat.Levels {
				if _, ok := c.Sandboxes[l]; ok {
					c.DefaultLevel = l
					break
				}
			}
		}
	}
	if c.Addr == "" {
		c.Addr = "127.0.0.1:8080"
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir()
	}
	if c.MaxCodeBytes == 0 {
		c.MaxCodeBytes = moat.MiB
	}
	if c.MaxBodyBytes == 0 {
		c.MaxBodyBytes = c.MaxCodeBytes + 64*moat.KiB
	}
	if c.MaxFileBytes == 0 {
		c.MaxFileBytes = 16 * moat.MiB
	}
	if c.MaxSessionsPerToken == 0 {
		c.MaxSessionsPerToken = 16
	}
	if c.MaxConcurrentRuns == 0 {
		c.MaxConcurrentRuns = 2 * numCPU()
	}
	if c.QueueLength == 0 {
		c.QueueLength = 64
	}
	if c.QueueWait == 0 {
		c.QueueWait = moat.Duration(30 * time.Second)
	}
	// With one token there is no one to be fair to.
	if c.MaxRunsPerToken == 0 {
		c.MaxRunsPerToken = (c.MaxConcurrentRuns + 1) / 2
		if len(c.Tokens) == 1 {
			c.MaxRunsPerToken = c.MaxConcurrentRuns
		}
	}
	c.MaxRunsPerToken = min(c.MaxRunsPerToken, c.MaxConcurrentRuns)
	if c.QueuePerToken == 0 {
		c.QueuePerToken = (c.QueueLength + 1) / 2
		if len(c.Tokens) == 1 {
			c.QueuePerToken = c.QueueLength
		}
	}
	if c.StreamBuffer == 0 {
		c.StreamBuffer = 2 * moat.MiB
	}
	if c.ReadHeaderTimeout == 0 {
		c.ReadHeaderTimeout = moat.Duration(10 * time.Second)
	}
	if c.ReadTimeout == 0 {
		c.ReadTimeout = moat.Duration(time.Minute)
	}
	if c.WriteTimeout == 0 {
		c.WriteTimeout = moat.Duration(30 * time.Second)
	}
	if c.ConnIdleTimeout == 0 {
		c.ConnIdleTimeout = moat.Duration(time.Minute)
	}
	if c.MaxConnections == 0 {
		c.MaxConnections = 512
	}
	if c.SessionTTL == 0 {
		c.SessionTTL = moat.Duration(30 * time.Minute)
	}
	if c.MaxSessionTTL == 0 {
		c.MaxSessionTTL = moat.Duration(8 * time.Hour)
	}
	if c.IdleTimeout == 0 {
		c.IdleTimeout = moat.Duration(10 * time.Minute)
	}
	if c.SweepInterval == 0 {
		c.SweepInterval = moat.Duration(time.Second)
	}
	if c.OnIdle == "" {
		c.OnIdle = OnIdleEnd
	}
	if c.MaxSnapshotBytesPerToken == 0 {
		c.MaxSnapshotBytesPerToken = moat.GiB
	}
	return c
}

// Validate reports whether c can serve; the error wraps moat.ErrInvalid.
func (c Config) Validate() error {
	var errs []error
	if len(c.Sandboxes) == 0 {
		errs = append(errs, errors.New("no level to serve"))
	}
	for l, sb := range c.Sandboxes {
		if sb == nil {
			errs = append(errs, fmt.Errorf("level %s has no sandbox", l))
		}
	}
	if c.DefaultLevel != "" {
		if _, ok := c.Sandboxes[c.DefaultLevel]; !ok {
			errs = append(errs, fmt.Errorf("default level %s is not served", c.DefaultLevel))
		}
	}
	if len(c.Tokens) == 0 {
		errs = append(errs, errors.New("no bearer token: give at least one"))
	}
	for _, name := range slices.Sorted(maps.Keys(c.Profiles)) {
		lv := c.Profiles[name]
		if !profileName.MatchString(name) {
			errs = append(errs, fmt.Errorf("network profile %q: a name is lower-case letters, digits, - and _", name))
		}
		if len(lv) == 0 {
			errs = append(errs, fmt.Errorf("network profile %q has no sandbox", name))
		}
		for l, sb := range lv {
			if _, ok := c.Sandboxes[l]; !ok {
				errs = append(errs, fmt.Errorf("network profile %q: level %s is not served", name, l))
			}
			if sb == nil {
				errs = append(errs, fmt.Errorf("network profile %q: level %s has no sandbox", name, l))
			}
		}
	}
	for name := range c.ProfilePolicies {
		if _, ok := c.Profiles[name]; !ok {
			errs = append(errs, fmt.Errorf("network profile %q has a policy but no sandboxes", name))
		}
	}
	names, secrets := map[string]bool{}, map[string]string{}
	for i, t := range c.Tokens {
		if t.Name == "" || len(t.Token) < 16 {
			errs = append(errs, fmt.Errorf("token %d needs a name and a secret of at least 16 characters", i))
		}
		if names[t.Name] {
			errs = append(errs, fmt.Errorf("token name %q given twice", t.Name))
		}
		names[t.Name] = true
		// One secret under two names would make its holders one owner,
		// each seeing the other's sessions.
		if other, ok := secrets[t.Token]; ok && t.Token != "" {
			errs = append(errs, fmt.Errorf("tokens %q and %q have the same secret", other, t.Name))
		}
		secrets[t.Token] = t.Name
		if t.E2BKey != "" {
			if !e2bKey.MatchString(t.E2BKey) {
				errs = append(errs, fmt.Errorf("token %q: its e2b key is not \"e2b_\" and at least 40 lower-case hex digits", t.Name))
			}
			if other, ok := secrets[t.E2BKey]; ok {
				errs = append(errs, fmt.Errorf("tokens %q and %q have the same secret or e2b key", other, t.Name))
			}
			secrets[t.E2BKey] = t.Name
		}
		for _, p := range t.NetworkProfiles {
			if _, ok := c.Profiles[p]; !ok {
				errs = append(errs, fmt.Errorf("token %q: network profile %q is not defined", t.Name, p))
			}
		}
	}
	if c.MaxCodeBytes < 0 || c.MaxBodyBytes < 0 || c.MaxFileBytes < 0 || c.MaxSessionsPerToken < 0 ||
		c.MaxConcurrentRuns < 0 || c.QueueLength < 0 || c.QueueWait < 0 || c.SessionTTL < 0 ||
		c.MaxSessionTTL < 0 || c.IdleTimeout < 0 || c.SweepInterval < 0 ||
		c.MaxRunsPerToken < 0 || c.QueuePerToken < 0 || c.StreamBuffer < 0 || c.ReadHeaderTimeout < 0 ||
		c.ReadTimeout < 0 || c.WriteTimeout < 0 || c.ConnIdleTimeout < 0 || c.MaxConnections < 0 || c.MaxSnapshotBytesPerToken < 0 {
		errs = append(errs, errors.New("caps and durations must not be negative"))
	}
	if c.OnIdle != "" && c.OnIdle != OnIdleEnd && c.OnIdle != OnIdleSuspend {
		errs = append(errs, fmt.Errorf("on_idle %q: want %q or %q", c.OnIdle, OnIdleEnd, OnIdleSuspend))
	}
	if d := c.withDefaults(); d.SessionTTL > d.MaxSessionTTL || d.IdleTimeout > d.MaxSessionTTL {
		errs = append(errs, fmt.Errorf("session ttl %v and idle timeout %v must be at most the maximum ttl %v", d.SessionTTL, d.IdleTimeout, d.MaxSessionTTL))
	}
	if len(errs) > 0 {
		return fmt.Errorf("server: config: %w", moat.Invalid(errors.Join(errs...)))
	}
	return nil
}

// DefaultStateDir is where the session database lives when Config.StateDir
// is empty.
func DefaultStateDir() string {
	if os.Geteuid() == 0 {
		return "/var/lib/moat"
	}
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "moat")
	}
	home, _ := os.UserHomeDir()
	return filepath.Join(home, ".local", "state", "moat")
}

// profileName is what a network profile may be called (as in moat's
// config file): it goes in logs, metric labels and the tokens file's
// comma-separated lists.
var profileName = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,62}$`)

func numCPU() int { return runtime.NumCPU() }
