package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	bolt "go.etcd.io/bbolt"

	"github.com/moatsandbox/moat"
	"github.com/moatsandbox/moat/server"
)

// Each row of the exit-status table, with an error as the commands make
// it, gets its status; and docs/exit-status.md lists every status moat
// uses.
func TestExitStatusTable(t *testing.T) {
	_, listenErr := net.Listen("tcp", "256.0.0.1:0")
	inUse := func() error {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		_, err = net.Listen("tcp", ln.Addr().String())
		if err == nil {
			t.Fatal("a second listen on the same address succeeded")
		}
		return err
	}()
	for _, tt := range []struct {
		name string
		err  error
		want int
	}{
		{"nil", nil, exitOK},
		{"bad input", fmt.Errorf("run: the code is empty: %w", moat.ErrInvalid), exitUsage},
		{"bad input classed twice", fmt.Errorf("config: %w", moat.Invalid(moat.Invalid(errors.New("x")))), exitUsage},
		{"an address that does not parse", fmt.Errorf("serve: %w", listenError(listenErr)), exitUsage},
		{"address in use", fmt.Errorf("serve: %w", listenError(inUse)), exitEnvironment},
		{"address in use, classed as input by a caller", moat.Invalid(inUse), exitEnvironment},
		{"state dir locked", fmt.Errorf("server: x: %w", server.ErrStateLocked), exitEnvironment},
		{"server not running", fmt.Errorf("session: cannot reach: %w", &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}), exitEnvironment},
		{"level unavailable", fmt.Errorf("gvisor: new: %w", &moat.UnavailableError{Level: moat.LevelGVisor, Reason: "runsc not found"}), exitInternal},
		{"interrupted", fmt.Errorf("run: %w", context.Canceled), exitInterrupted},
		{"interrupted while a level checked", &moat.UnavailableError{Level: moat.LevelMicroVM, Reason: "probe", Err: context.Canceled}, exitInterrupted},
		{"anything else", errors.New("subprocess: something broke"), exitInternal},
	} {
		if got := exitStatus(tt.err); got != tt.want {
			t.Errorf("%s: exitStatus(%v) = %d, want %d", tt.name, tt.err, got, tt.want)
		}
	}

	// The server's answers, as moat session maps them.
	for _, tt := range []struct {
		status int
		code   string
		want   int
	}{
		{400, "bad_request", exitUsage},
		{404, "not_found", exitUsage},
		{429, "busy", exitEnvironment},
		{429, "too_many_sessions", exitEnvironment},
		{409, "session_busy", exitEnvironment},
		{503, "shutting_down", exitEnvironment},
		{503, "unavailable", exitInternal},
		{500, "internal", exitInternal},
	} {
		if got := (&apiError{status: tt.status, code: tt.code}).exit(); got != tt.want {
			t.Errorf("server answered %d %s: exit %d, want %d", tt.status, tt.code, got, tt.want)
		}
	}

	doc, err := os.ReadFile(filepath.Join("..", "..", "docs", "exit-status.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, status := range []int{exitOK, exitFailure, exitUsage, exitEnvironment, exitInternal, exitInterrupted} {
		if !regexp.MustCompile(`(?m)^\| ` + strconv.Itoa(status) + ` +\|`).Match(doc) {
			t.Errorf("docs/exit-status.md has no row for status %d", status)
		}
	}
	help, _, _ := runMoat(t, "", "help")
	if !strings.Contains(help, "docs/exit-status.md") {
		t.Errorf("moat help does not point at docs/exit-status.md:\n%s", help)
	}
}

// An address in use is the environment's (3), not bad usage (2), and the
// message does not call it invalid input. It needs no root: serve listens
// before it opens a level.
func TestServeAddressInUseIsEnvironment(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	tokens := writeTokens(t, "alice s3cret-token-0123456789\n", 0o600)
	_, stderr, code := runMoat(t, "", "serve", "--addr", ln.Addr().String(), "--tokens-file", tokens, "--state-dir", t.TempDir())
	if code != exitEnvironment {
		t.Errorf("exit %d, want %d: %s", code, exitEnvironment, stderr)
	}
	if !strings.Contains(stderr, "address already in use") || strings.Contains(stderr, moat.ErrInvalid.Error()) {
		t.Errorf("stderr %q: want the errno, not %q", stderr, moat.ErrInvalid)
	}
}

// A state dir another moat serve holds is the environment's (3), not an
// unavailable protection (125).
func TestServeStateDirLockedIsEnvironment(t *testing.T) {
	requireRoot(t)
	dir := t.TempDir()
	db, err := bolt.Open(filepath.Join(dir, "server.db"), 0o600, &bolt.Options{Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	tokens := writeTokens(t, "alice s3cret-token-0123456789\n", 0o600)
	cfg := filepath.Join(t.TempDir(), "moat.json")
	if err := os.WriteFile(cfg, []byte(`{"subprocess": {"warm": -1}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	_, stderr, code := runMoat(t, "", "serve", "--config", cfg, "--addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", dir, "--level", "subprocess")
	if code != exitEnvironment {
		t.Errorf("exit %d, want %d: %s", code, exitEnvironment, stderr)
	}
	if !strings.Contains(stderr, "another moat serve uses this state dir") {
		t.Errorf("stderr %q does not say why", stderr)
	}
}

// A server that does not answer is the environment's (3).
func TestSessionServerNotRunningIsEnvironment(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // nothing listens there now
	t.Setenv("MOAT_TOKEN", "s3cret-token-0123456789")
	_, stderr, code := runMoat(t, "", "session", "--url", "http://"+addr, "list")
	if code != exitEnvironment {
		t.Errorf("exit %d, want %d: %s", code, exitEnvironment, stderr)
	}
}

// No message says its class twice: the errors commands make of bad input
// end in "invalid input" once, and no ": "-separated part of a message
// repeats the one before it.
func TestMessagesSayTheirClassOnce(t *testing.T) {
	dir := t.TempDir()
	badLimit := filepath.Join(dir, "bad-limit.json")
	os.WriteFile(badLimit, []byte(`{"limits": {"memory": "12x"}}`), 0o600)
	badKey := filepath.Join(dir, "bad-key.json")
	os.WriteFile(badKey, []byte(`{"levell": "x"}`), 0o600)
	for _, args := range [][]string{
		{"attack", "--attacks", "teleport"},
		{"attack", "--attacks", "loop,teleport"},
		{"run", filepath.Join(dir, "missing.py")},
		{"run", "--config", badLimit, "-c", "print(1)"},
		{"run", "--config", badKey, "-c", "print(1)"},
		{"run", "--config", filepath.Join(dir, "missing.json"), "-c", "print(1)"},
		{"run", "--memory", "12x", "-c", "print(1)"},
		{"run", "--level", "nope", "-c", "print(1)"},
		{"bench", "--levels", "subprocess", "--html", filepath.Join(dir, "no", "such", "dir", "x.html")},
		{"serve", "--tokens-file", filepath.Join(dir, "missing-tokens")},
		{"session", "--token-file", filepath.Join(dir, "missing-token"), "list"},
	} {
		_, stderr, code := runMoat(t, "", args...)
		if code != exitUsage {
			t.Errorf("%v: exit %d, want %d: %s", args, code, exitUsage, stderr)
		}
		if n := strings.Count(stderr, moat.ErrInvalid.Error()); n != 1 {
			t.Errorf("%v: %q says %q %d times, want once", args, stderr, moat.ErrInvalid, n)
		}
		if part, ok := repeatedPart(stderr); ok {
			t.Errorf("%v: %q repeats %q", args, stderr, part)
		}
	}
}

// repeatedPart returns a ": "-separated part of msg that repeats the part
// before it.
func repeatedPart(msg string) (string, bool) {
	parts := strings.Split(strings.TrimSpace(msg), ": ")
	for i := 1; i < len(parts); i++ {
		if parts[i] == parts[i-1] {
			return parts[i], true
		}
	}
	return "", false
}
