package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/netutil"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/e2b"
	"github.com/moatsandbox/moat/server"
)

func init() {
	commandUsage["serve"] = "moat serve [--addr 127.0.0.1:8080] [--e2b-addr 127.0.0.1:3000] --tokens-file FILE [--levels L,...] [flags]"
}

// cmdServe serves the HTTP API (package server) over the chosen levels
// until SIGTERM or SIGINT, then shuts down gracefully.
func cmdServe(ctx context.Context, args []string, stdio Stdio) int {
	fs := newFlagSet("serve")
	sf := addSandboxFlags(fs)
	addServerFlags(fs, &sf.flags.Server)
	if code, ok := parseFlags(fs, args, stdio); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return exitFor(stdio, fmt.Errorf("serve: unexpected argument %q: %w", fs.Arg(0), moat.ErrInvalid))
	}
	fc, err := sf.resolve()
	if err != nil {
		return exitFor(stdio, err)
	}
	sc := fc.Server
	cfg := sc.Config
	if cfg.Addr == "" {
		cfg.Addr = defaultAddr
	}
	shutdownWait := sc.ShutdownTimeout
	if shutdownWait == 0 {
		shutdownWait = defaultShutdownTimeout
	}
	var handler slog.Handler = slog.NewTextHandler(stdio.Err, nil)
	if sc.LogJSON {
		handler = slog.NewJSONHandler(stdio.Err, nil)
	}
	log := slog.New(handler)
	cfg.Logger = log
	// One registry for the server's collectors and the egress proxies'
	// counters, which GET /metrics serves together.
	cfg.Registry = prometheus.NewRegistry()
	fc.logger, fc.registerer = log, cfg.Registry

	if sc.TokensFile == "" {
		return exitFor(stdio, fmt.Errorf("serve: --tokens-file (server.tokens_file) is required: the API serves only holders of a token: %w", moat.ErrInvalid))
	}
	tokens, err := readTokens(sc.TokensFile)
	if err != nil {
		return exitFor(stdio, err)
	}
	cfg.Tokens = tokens
	// The profiles some token may use: the only ones worth opening.
	granted := map[string]bool{}
	for _, t := range tokens {
		for _, p := range t.NetworkProfiles {
			if _, ok := fc.NetworkProfiles[p]; !ok {
				return exitFor(stdio, fmt.Errorf("serve: tokens file %s: token %q may use network profile %q, which the config file's network_profiles does not define: %w", sc.TokensFile, t.Name, p, moat.ErrInvalid))
			}
			granted[p] = true
		}
	}
	profiles := slices.Sorted(maps.Keys(granted))
	names := sc.Levels
	if names == "" {
		names = string(fc.Level)
	}
	served, err := parseLevels(ctx, names, fc)
	if err != nil {
		return exitFor(stdio, fmt.Errorf("serve: %w", moat.Invalid(err)))
	}
	// A template must name what is served: found at startup, not by the
	// first create.
	for _, name := range slices.Sorted(maps.Keys(sc.E2BTemplates)) {
		tpl := sc.E2BTemplates[name]
		if tpl.Level != "" && !slices.Contains(served, tpl.Level) {
			return exitFor(stdio, fmt.Errorf("serve: e2b template %q: level %s is not served (--levels): %w", name, tpl.Level, moat.ErrInvalid))
		}
		if _, ok := fc.NetworkProfiles[tpl.Network]; tpl.Network != "" && !ok {
			return exitFor(stdio, fmt.Errorf("serve: e2b template %q: network profile %q is not defined in network_profiles: %w", name, tpl.Network, moat.ErrInvalid))
		}
	}
	// Validate everything but the sandboxes before opening any.
	probe := cfg
	probe.Sandboxes = map[moat.Level]moat.Sandbox{fc.Level: noSandbox{}}
	probe.Profiles = map[string]map[moat.Level]moat.Sandbox{}
	for _, p := range profiles {
		probe.Profiles[p] = map[moat.Level]moat.Sandbox{fc.Level: noSandbox{}}
	}
	if err := probe.Validate(); err != nil {
		return exitFor(stdio, err)
	}
	// Listen first: a refused address needs no sandbox.
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return exitFor(stdio, fmt.Errorf("serve: %w", listenError(err)))
	}
	defer ln.Close()
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !tcp.IP.IsLoopback() {
		log.Warn("serve: listening beyond loopback: anyone who can reach this address and holds a token can run code", "addr", ln.Addr().String())
	}
	var e2bLn net.Listener
	if sc.E2BAddr != "" {
		if !slices.ContainsFunc(tokens, func(t server.Token) bool { return t.E2BKey != "" }) {
			return exitFor(stdio, fmt.Errorf("serve: --e2b-addr (server.e2b_addr) needs a token with an e2b key in %s (a last field e2b_<40 hex>, or \"e2b_key\"): %w", sc.TokensFile, moat.ErrInvalid))
		}
		if e2bLn, err = net.Listen("tcp", sc.E2BAddr); err != nil {
			return exitFor(stdio, fmt.Errorf("serve: e2b: %w", listenError(err)))
		}
		defer e2bLn.Close()
		if tcp, ok := e2bLn.Addr().(*net.TCPAddr); ok && !tcp.IP.IsLoopback() {
			log.Warn("serve: the E2B API listens beyond loopback: anyone who can reach this address and holds an e2b key can run code", "addr", e2bLn.Addr().String())
		}
	}

	// Opening a level reaps what a dead moat left of it: after a crash,
	// this is what removes the directories and processes of the sessions
	// the server's database still lists.
	cfg.Sandboxes = map[moat.Level]moat.Sandbox{}
	cfg.Profiles = map[string]map[moat.Level]moat.Sandbox{}
	cfg.ProfilePolicies = map[string]moat.Egress{}
	defer func() {
		for _, sb := range cfg.Sandboxes {
			sb.Close()
		}
		for _, lv := range cfg.Profiles {
			for _, sb := range lv {
				sb.Close()
			}
		}
	}()
	for _, l := range served {
		warnHardening(stdio, fc, l)
		sb, err := openLevel(ctx, fc, l)
		if err != nil {
			return exitFor(stdio, err)
		}
		cfg.Sandboxes[l] = sb
	}
	// Each profile a token may use gets a sandbox per served level, with
	// the profile's policy in place of the top-level one.
	for _, name := range slices.Sorted(maps.Keys(fc.NetworkProfiles)) {
		if !granted[name] {
			log.Warn("serve: no token may use this network profile: not opened", "network", name)
		}
	}
	for _, name := range profiles {
		e := fc.NetworkProfiles[name]
		cfg.Profiles[name] = map[moat.Level]moat.Sandbox{}
		cfg.ProfilePolicies[name] = e
		for _, l := range served {
			sb, err := openLevelEgress(ctx, fc, l, e)
			if err != nil {
				return exitFor(stdio, fmt.Errorf("serve: network profile %s, level %s: %w", name, l, err))
			}
			cfg.Profiles[name][l] = sb
		}
	}
	if _, ok := cfg.Sandboxes[fc.Level]; ok {
		cfg.DefaultLevel = fc.Level
	}
	srv, err := server.New(cfg)
	if err != nil {
		return exitFor(stdio, err)
	}
	served2 := make(chan error, 1)
	go func() { served2 <- srv.Serve(ln) }()
	var e2bSrv *http.Server
	e2bDone := make(chan error, 1)
	if e2bLn != nil {
		// A template without a profile runs in cfg.Sandboxes, opened with
		// the top-level policy: the E2B API holds creates against it.
		api, err := e2b.New(e2b.Config{Sessions: srv, Tokens: tokens, Templates: sc.E2BTemplates, Policy: fc.egress(), MaxFileBytes: cfg.MaxFileBytes, WriteTimeout: cfg.WriteTimeout, Logger: log})
		if err != nil {
			srv.Close()
			<-served2
			return exitFor(stdio, err)
		}
		// The server's connection cap, read timeouts and write timeout
		// (per write, in e2b) hold here too.
		e2bSrv = &http.Server{
			Handler:           api.Handler(),
			ReadHeaderTimeout: time.Duration(orDefault(cfg.ReadHeaderTimeout, moat.Duration(10*time.Second))),
			ReadTimeout:       time.Duration(orDefault(cfg.ReadTimeout, moat.Duration(time.Minute))),
			IdleTimeout:       time.Duration(orDefault(cfg.ConnIdleTimeout, moat.Duration(time.Minute))),
		}
		maxConns := cfg.MaxConnections
		if maxConns == 0 {
			maxConns = 512
		}
		// Watches end at once at shutdown; commands get the wait.
		e2bSrv.RegisterOnShutdown(api.EndWatches)
		go func() { e2bDone <- e2bSrv.Serve(netutil.LimitListener(e2bLn, maxConns)) }()
		log.Info("serve: the E2B API is listening", "url", "http://"+e2bLn.Addr().String())
	}
	levelNames := make([]string, 0, len(served))
	for _, l := range served {
		levelNames = append(levelNames, string(l))
	}
	log.Info("serve: listening", "url", "http://"+ln.Addr().String(), "levels", strings.Join(levelNames, ","), "network_profiles", strings.Join(profiles, ","), "tokens", len(tokens), "state_dir", srv.StateDir())

	select {
	case <-ctx.Done():
		log.Info("serve: shutting down", "wait", shutdownWait)
	case err := <-served2:
		srv.Close()
		return exitFor(stdio, fmt.Errorf("serve: %w", err))
	}
	sctx, cancel := context.WithTimeout(context.Background(), time.Duration(shutdownWait))
	defer cancel()
	e2bStopped := make(chan struct{})
	if e2bSrv != nil {
		// The E2B API's commands are runs of the server's sessions: they
		// get the same wait, then their connections are closed, which
		// cancels them, so that srv.Shutdown can end or suspend their
		// sessions.
		go func() {
			e2bSrv.Shutdown(sctx)
			e2bSrv.Close()
			<-e2bDone
			close(e2bStopped)
		}()
	} else {
		close(e2bStopped)
	}
	err = srv.Shutdown(sctx)
	<-e2bStopped
	<-served2
	if err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return exitFor(stdio, fmt.Errorf("serve: shutdown: %w", err))
	}
	log.Info("serve: stopped")
	return exitOK
}

// addServerFlags registers moat serve's own flags, each named for its key
// in the config file's server section (server.max_code_bytes is
// --max-code-bytes), and the old spellings as deprecated ones.
func addServerFlags(fs *flag.FlagSet, sc *serverSection) {
	cfg := &sc.Config
	fs.StringVar(&cfg.Addr, "addr", "", "listen address; a non-loopback address exposes the API beyond this machine (default "+defaultAddr+")")
	fs.StringVar(&sc.TokensFile, "tokens-file", "", `bearer tokens, one "NAME TOKEN [PROFILE,...]" per line (# comments), or a JSON list of {"name","token","network_profiles"}; required`)
	fs.StringVar(&sc.Levels, "levels", "", "levels to serve: comma-separated, or all (every level available here); default: the --level")
	fs.StringVar(&cfg.StateDir, "state-dir", "", "directory of the session database and of suspended sessions and snapshots (default /var/lib/moat as root)")
	fs.Var(&cfg.MaxCodeBytes, "max-code-bytes", "largest code of one run (default 1MiB)")
	deprecate(fs, "max-code", "max-code-bytes")
	fs.Var(&cfg.MaxBodyBytes, "max-body-bytes", "largest JSON request body (default max-code-bytes + 64KiB)")
	deprecate(fs, "max-body", "max-body-bytes")
	fs.Var(&cfg.MaxFileBytes, "max-file-bytes", "largest uploaded file (default 16MiB)")
	deprecate(fs, "max-file", "max-file-bytes")
	fs.IntVar(&cfg.MaxSessionsPerToken, "max-sessions-per-token", 0, "sessions per token (default 16)")
	deprecate(fs, "max-sessions", "max-sessions-per-token")
	fs.IntVar(&cfg.MaxConcurrentRuns, "max-concurrent-runs", 0, "runs executing at once (default 2 x CPUs)")
	deprecate(fs, "max-runs", "max-concurrent-runs")
	fs.IntVar(&cfg.QueueLength, "queue-length", 0, "runs waiting for a slot before 429 (default 64)")
	deprecate(fs, "queue", "queue-length")
	fs.Var(&cfg.QueueWait, "queue-wait", "longest wait for a slot before 503 (default 30s)")
	fs.IntVar(&cfg.MaxRunsPerToken, "max-runs-per-token", 0, "runs of one token executing at once (default half of max-concurrent-runs, rounded up; all with one token)")
	fs.IntVar(&cfg.QueuePerToken, "queue-per-token", 0, "runs of one token waiting for a slot before 429 token_busy (default half of queue-length, rounded up; all with one token)")
	fs.Var(&cfg.StreamBuffer, "stream-buffer", "how far a streaming client may fall behind the output before its live output stops (default 2MiB)")
	fs.Var(&cfg.ReadHeaderTimeout, "read-header-timeout", "longest a connection may take to send a request's headers (default 10s)")
	fs.Var(&cfg.ReadTimeout, "read-timeout", "longest a connection may take to send a whole request, body included (default 1m)")
	fs.Var(&cfg.WriteTimeout, "write-timeout", "longest one write of an answer may wait for a client that does not read; it is then dropped (default 30s)")
	fs.Var(&cfg.ConnIdleTimeout, "conn-idle-timeout", "longest a keep-alive connection may wait for its next request (default 1m)")
	fs.IntVar(&cfg.MaxConnections, "max-connections", 0, "connections open at once; more wait in the listen backlog (default 512)")
	fs.Var(&cfg.SessionTTL, "session-ttl", "default session time to live (default 30m)")
	fs.Var(&cfg.MaxSessionTTL, "max-session-ttl", "longest session time to live (default 8h)")
	fs.Var(&cfg.IdleTimeout, "idle-timeout", "default session idle timeout (default 10m)")
	fs.Var(&cfg.SweepInterval, "sweep-interval", "how often expired and idle sessions are looked for (default 1s)")
	fs.StringVar(&cfg.OnIdle, "on-idle", "", "what happens to a session idle past its idle timeout, and to running sessions at shutdown: end, or suspend (kept on disk, resumed by its next use, after a restart too) (default end)")
	fs.Var(&cfg.MaxSnapshotBytesPerToken, "max-snapshot-bytes-per-token", "disk the snapshots of one token may hold (default 1GiB)")
	fs.Var(&sc.ShutdownTimeout, "shutdown-timeout", "how long SIGTERM waits for runs in progress before cancelling them (default 30s)")
	fs.BoolVar(&sc.LogJSON, "log-json", false, "log JSON lines instead of text")
	fs.StringVar(&sc.E2BAddr, "e2b-addr", "", "also serve the E2B-compatible API here (both sides on one listener; keys: an e2b_ field per token in the tokens file); default: not served")
}

func orDefault(d, def moat.Duration) moat.Duration {
	if d == 0 {
		return def
	}
	return d
}

// readTokens reads the operator's tokens: a JSON list of {"name", "token",
// "network_profiles": ["pypi", ...]}, or lines "NAME TOKEN" (or
// "NAME:TOKEN") with # comments, each optionally followed by the network
// profiles its holder may use, comma-separated without spaces:
// "alice s3cret pypi,github". A line without them grants none. A last
// field that starts with "e2b_" is the holder's key for the E2B-compatible
// API (server.Token.E2BKey; "e2b_key" in the JSON form). Whether the
// profiles exist is checked by the caller, against the config file.
func readTokens(path string) ([]server.Token, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("serve: tokens: %w", moat.Invalid(err))
	}
	if st, err := os.Stat(path); err == nil && st.Mode().Perm()&0o004 != 0 {
		return nil, fmt.Errorf("serve: tokens file %s is readable by every user (mode %v): chmod 600 it: %w", path, st.Mode().Perm(), moat.ErrInvalid)
	}
	if t := strings.TrimSpace(string(data)); strings.HasPrefix(t, "[") {
		var tokens []server.Token
		dec := json.NewDecoder(strings.NewReader(t))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&tokens); err != nil {
			return nil, fmt.Errorf("serve: tokens file %s: %w", path, moat.Invalid(err))
		}
		return tokens, nil
	}
	var tokens []server.Token
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(strings.Replace(line, ":", " ", 1))
		key := ""
		if len(f) >= 3 && strings.HasPrefix(f[len(f)-1], "e2b_") {
			key, f = f[len(f)-1], f[:len(f)-1]
		}
		if len(f) != 2 && len(f) != 3 {
			return nil, fmt.Errorf("serve: tokens file %s, line %d: want \"NAME TOKEN [PROFILE,...] [e2b_KEY]\": %w", path, n, moat.ErrInvalid)
		}
		t := server.Token{Name: f[0], Token: f[1], E2BKey: key}
		if len(f) == 3 {
			t.NetworkProfiles = strings.Split(f[2], ",")
			if slices.Contains(t.NetworkProfiles, "") {
				return nil, fmt.Errorf("serve: tokens file %s, line %d: an empty name in the network profiles %q: %w", path, n, f[2], moat.ErrInvalid)
			}
		}
		tokens = append(tokens, t)
	}
	return tokens, nil
}

// noSandbox stands for a level not opened yet, so that the rest of the
// server's config can be checked before any level is.
type noSandbox struct{ moat.Sandbox }
