package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// lockedBuffer is a bytes.Buffer safe for the server's logger and the test.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func writeTokens(t *testing.T, content string, mode os.FileMode) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(p, []byte(content), mode); err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, mode)
	return p
}

func TestServeBadInput(t *testing.T) {
	good := writeTokens(t, "alice s3cret-token-0123456789\n", 0o600)
	for _, c := range []struct {
		name string
		args []string
	}{
		{"no tokens file", []string{"--addr", "127.0.0.1:0"}},
		{"missing tokens file", []string{"--tokens-file", "/nonexistent/tokens"}},
		{"world-readable tokens", []string{"--tokens-file", writeTokens(t, "alice s3cret-token-0123456789\n", 0o644)}},
		{"short token", []string{"--tokens-file", writeTokens(t, "alice short\n", 0o600)}},
		{"malformed line", []string{"--tokens-file", writeTokens(t, "alice\n", 0o600)}},
		{"bad address", []string{"--tokens-file", good, "--addr", "127.0.0.1:notaport"}},
		{"unknown level", []string{"--tokens-file", good, "--levels", "vm9000"}},
		{"bad duration", []string{"--tokens-file", good, "--session-ttl", "soon"}},
		{"ttl over max", []string{"--tokens-file", good, "--session-ttl", "9h"}},
		{"stray argument", []string{"--tokens-file", good, "extra"}},
		{"negative connection cap", []string{"--tokens-file", good, "--max-connections", "-1"}},
		{"bad write timeout", []string{"--tokens-file", good, "--write-timeout", "soon"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			// Bounded: a case that wrongly starts serving stops here.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			code := cmdServe(ctx, c.args, Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
			if code != exitUsage {
				t.Errorf("exit %d, want %d; stderr %q", code, exitUsage, errb.String())
			}
		})
	}
}

func TestServe(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("CI must run as root: the subprocess level needs it")
		}
		t.Skip("the subprocess level needs root (CI runs this as root)")
	}
	tokens := writeTokens(t, `[{"name": "alice", "token": "s3cret-token-0123456789"}]`, 0o600)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var errb lockedBuffer
	done := make(chan int, 1)
	go func() {
		done <- cmdServe(ctx, []string{"--addr", "127.0.0.1:0", "--tokens-file", tokens, "--state-dir", t.TempDir(), "--wall-time", "5s",
			"--max-runs-per-token", "2", "--queue-per-token", "4", "--stream-buffer", "4MiB", "--read-header-timeout", "5s",
			"--read-timeout", "30s", "--write-timeout", "10s", "--conn-idle-timeout", "30s", "--max-connections", "64"},
			Stdio{In: strings.NewReader(""), Out: io.Discard, Err: &errb})
	}()
	var url string
	deadline := time.Now().Add(20 * time.Second)
	for url == "" {
		if m := regexp.MustCompile(`url=(http://127\.0\.0\.1:\d+)`).FindStringSubmatch(errb.String()); m != nil {
			url = m[1]
		}
		select {
		case code := <-done:
			t.Fatalf("serve exited %d: %s", code, errb.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("serve did not start: %s", errb.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	req, _ := http.NewRequest("POST", url+"/v1/runs", strings.NewReader(`{"code":"print(6*7)"}`))
	req.Header.Set("Authorization", "Bearer s3cret-token-0123456789")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var res map[string]any
	json.NewDecoder(resp.Body).Decode(&res)
	resp.Body.Close()
	if resp.StatusCode != 200 || res["stdout"] != "42\n" {
		t.Errorf("run: %d %v", resp.StatusCode, res)
	}
	if !strings.Contains(errb.String(), "msg=run ") || !strings.Contains(errb.String(), "reason=none") {
		t.Errorf("no log line for the run: %s", errb.String())
	}
	cancel() // as SIGTERM does through main's context
	select {
	case code := <-done:
		if code != exitOK {
			t.Errorf("exit %d after shutdown: %s", code, errb.String())
		}
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not stop")
	}
}
